"""jaxquant.flax: bfloat16 kernels at inference, learned scales of tiled specs, specs whose
scales learn_scale cannot keep, ActSpec formats and calibrated scales, nnx_qat applied
twice. References are written out in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

from reference_tables import NF4  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import ActSpec, QuantConfig, nnx_qat, nnx_quantize, quantize_linen  # noqa: E402

_run = nnx.jit(lambda m, x: m(x))


def _x(*shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32) * 0.37).reshape(shape)


def _np_int_fq(w, bits=8, axis=-1, keep=None):
    """Symmetric absmax fake quantization in NumPy: one scale per index of ``axis`` (``keep``:
    the axes that keep their own scale, for tiles), codes rounded half to even, then
    dequantized in float32 and cast back to ``w``'s dtype."""
    w32 = np.asarray(w, np.float32)
    red = tuple(d for d in range(w32.ndim) if d != axis % w32.ndim) if keep is None else keep
    qmax = 2.0 ** (bits - 1) - 1
    scale = (np.max(np.abs(w32), axis=red, keepdims=True) / np.float32(qmax)).astype(np.float32)
    q = np.clip(np.rint(w32 / scale), -qmax - 1, qmax)
    return (q * scale).astype(np.asarray(w).dtype), scale


# ----------------------------------------------------------------------------- bfloat16 kernels


class _Layers(nn.Module):
    """Dense, Conv, Einsum and Embed (lookup and attend) with bfloat16 params, float32 compute."""

    dtype: object = None

    @nn.compact
    def __call__(self, t):
        kw = dict(param_dtype=jnp.bfloat16, dtype=self.dtype)
        emb = nn.Embed(11, 8, **kw)
        x = nn.Dense(8, **kw)(emb(t).astype(jnp.float32))
        x = nn.Conv(8, (3,), padding="SAME", **kw)(x)
        x = nn.Einsum((8, 8), "btc,cd->btd", **kw)(x)
        return emb.attend(x)


@pytest.mark.parametrize("dtype", [None, jnp.float32], ids=["dtype=None", "dtype=float32"])
def test_linen_bfloat16_kernels_infer_as_the_fake_quantized_model(dtype):
    # regression: the QTensor was dequantized straight to float32, not to its bfloat16
    # (the fake-quantized bfloat16 kernel of training), so inference drifted by ~1e-3
    with jax.numpy_dtype_promotion("standard"):  # dtype=None: Flax promotes bf16 and f32
        _check_linen_bfloat16_kernels(dtype)


def _check_linen_bfloat16_kernels(dtype):
    tokens = jnp.arange(10).reshape(2, 5) % 11
    model = _Layers(dtype)
    qm = quantize_linen(model, QuantConfig())
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    ref_params = jax.tree.map(lambda w: _np_int_fq(w)[0] if w.ndim >= 2 else w, params)
    ref = np.asarray(jax.jit(model.apply)(ref_params, tokens))
    q = jax.jit(qm.quantize_params)(params, tokens)
    for leaf in jax.tree.leaves(q, is_leaf=jq.is_qtensor):
        if jq.is_qtensor(leaf):
            assert leaf.dtype == jnp.bfloat16
    y_qat = np.asarray(jax.jit(qm.apply)(params, tokens))
    y_inf = np.asarray(jax.jit(qm.apply)(q, tokens))
    assert y_inf.dtype == y_qat.dtype == ref.dtype == np.float32
    np.testing.assert_allclose(y_qat, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y_inf, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layer", ["linear", "linear_general", "conv", "einsum"])
def test_nnx_bfloat16_kernels_infer_as_the_fake_quantized_model(layer):
    rngs, x = nnx.Rngs(0), _x(2, 5, 8)
    kw = dict(param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=rngs)
    model = {"linear": lambda: nnx.Linear(8, 6, **kw),
             "linear_general": lambda: nnx.LinearGeneral(8, (2, 3), **kw),
             "conv": lambda: nnx.Conv(8, 6, (3,), **kw),
             "einsum": lambda: nnx.Einsum("btc,cd->btd", (8, 6), (6,), **kw)}[layer]()
    ref = nnx.clone(model)
    ref.kernel.set_value(jnp.asarray(_np_int_fq(ref.kernel[...])[0]))
    want = np.asarray(_run(ref, x))
    nnx_qat(model, QuantConfig())
    np.testing.assert_allclose(np.asarray(_run(model, x)), want, rtol=1e-6, atol=1e-6)
    nnx_quantize(model, QuantConfig())
    assert model.kernel[...].dtype == jnp.bfloat16
    y = np.asarray(_run(model, x))
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layer", ["nnx-linear", "nnx-linear-general", "linen-dense"])
def test_int8_dot_bfloat16_kernels_train_the_deployed_model(layer):
    # regression: int8_dot=True (no activation spec: weight-only at inference) trained on the
    # kernel fake-quantized in float32, but inference dequantizes to the bfloat16 param
    # dtype: outputs of about 1.7 differed by 1.6e-3
    x, cfg = _x(4, 8), QuantConfig(int8_dot=True)
    kw = dict(param_dtype=jnp.bfloat16, dtype=jnp.float32)
    if layer == "linen-dense":
        model = nn.Dense(16, **kw)
        params = model.init(jax.random.key(0), x)
        w = params["params"]["kernel"]
        qm = quantize_linen(model, cfg)
        y_qat = qm.apply(params, x)
        grads = jax.grad(lambda p: jnp.sum(qm.apply(p, x) ** 2))(params)["params"]["kernel"]
        assert grads.dtype == jnp.bfloat16 and bool(jnp.any(grads != 0))
        y_inf = qm.apply(qm.quantize_params(params, x), x)
        b = params["params"]["bias"]
    else:
        model = (nnx.Linear(8, 16, rngs=nnx.Rngs(0), **kw) if layer == "nnx-linear" else
                 nnx.LinearGeneral(8, 16, rngs=nnx.Rngs(0), **kw))
        w, b = model.kernel[...], model.bias[...]
        nnx_qat(model, cfg)
        y_qat = model(x)
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        assert grads.kernel[...].dtype == jnp.bfloat16 and bool(jnp.any(grads.kernel[...] != 0))
        nnx_quantize(model, cfg)
        y_inf = model(x)
    fq = np.asarray(_np_int_fq(w)[0], np.float32)  # the bfloat16 fake-quantized kernel
    want = np.asarray(x) @ fq.reshape(8, 16) + np.asarray(b, np.float32)
    np.testing.assert_allclose(np.asarray(y_qat), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_inf), want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- learn_scale


def test_learned_tile_scales_train_and_convert():
    # regression: a tiled spec (block_size=(4, 4)) with learn_scale=True raised
    # "axis must be None; got axis=-1" though the spec names no axis
    spec = jq.QuantSpec(block_size=(4, 4))
    x = _x(3, 8)
    qm = quantize_linen(nn.Dense(6), QuantConfig(weight=spec, learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(0), x)
    kernel = np.asarray(v["params"]["kernel"])
    want_scale = np.array([[np.abs(kernel[4 * i:4 * i + 4, 4 * j:4 * j + 4]).max()
                            for j in range(2)] for i in range(2)], np.float32) / np.float32(127)
    np.testing.assert_array_equal(np.asarray(v["quant"]["kernel_scale"]), want_scale)
    scale = np.repeat(np.repeat(want_scale, 4, axis=0), 4, axis=1)[:, :6]
    fq = (np.clip(np.rint(kernel / scale), -128, 127) * scale).astype(np.float32)
    want = np.asarray(x) @ fq + np.asarray(v["params"]["bias"])
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(v, x)), want, rtol=1e-6,
                               atol=1e-6)
    q = jax.jit(qm.quantize_params)(v, x)
    np.testing.assert_array_equal(np.asarray(jax.jit(jq.dequantize)(q["params"]["kernel"])), fq)
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, x)), want, rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("spec, stored", [
    (jq.QuantSpec(dtype="mxfp4"), "float8_e8m0fnu"),
    (jq.QuantSpec(dtype="nvfp4"), "float8_e4m3fn"),
    (jq.QuantSpec(scale_dtype=jnp.bfloat16), "bfloat16"),
    (jq.QuantSpec(dtype=jnp.int4, block_size=4, double_quant=True), "float32, double_quant"),
], ids=["mxfp4", "nvfp4", "scale-bf16", "double-quant"])
def test_learn_scale_refuses_specs_that_store_scales_in_another_format(spec, stored):
    # regression: the scale format was dropped silently (float32 learned scales, a
    # QTensor that is not MXFP4 / bfloat16-scaled), or nvfp4 crashed with AttributeError
    with pytest.raises(ValueError, match=rf"learn_scale=True learns float32 scales.*"
                                         rf"scales stored as {stored}"):
        QuantConfig(weight=spec, learn_scale=True)


# ----------------------------------------------------------------------------- ActSpec


def test_act_spec_codebook_is_kept_and_applied():
    # regression: ActSpec(dtype="nf4") became uint4 (the codebook's storage dtype), so the
    # activations were fake-quantized as 4-bit integers instead of NF4
    act = ActSpec(dtype="nf4")
    assert act.dtype == "nf4"
    model, x = nn.Dense(4, use_bias=False), _x(3, 8)
    params = jax.jit(model.init)(jax.random.key(0), x)
    y = jax.jit(quantize_linen(model, QuantConfig(weight=None, act=act)).apply)(params, x)
    xs = np.asarray(x)
    absmax = np.abs(xs).max(axis=1, keepdims=True)
    codes = np.abs(xs[..., None] / absmax[..., None] - NF4).argmin(-1)  # no ties in this x
    xq = NF4[codes] * absmax
    np.testing.assert_allclose(np.asarray(y), xq @ np.asarray(params["params"]["kernel"]),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"needs ActSpec\(dtype=jnp.int8\), got dtype=nf4"):
        act.act_quant()


@pytest.mark.parametrize("scale", [np.float32(0.05), jnp.float32(0.05), jnp.array([0.05]),
                                   np.float64(0.05)], ids=["np32", "jnp0d", "jnp1", "np64"])
def test_act_spec_takes_a_calibrated_scale(scale):
    # regression: a calibration result (a NumPy / JAX scalar) was refused as "not a float"
    act = ActSpec(scale=scale)
    assert isinstance(act.scale, float)
    assert act.scale == float(np.asarray(scale).reshape(()))
    hash(act)


@pytest.mark.parametrize("scale, exc", [("0.1", TypeError), (jnp.array([0.1, 0.2]), TypeError),
                                        (jnp.array(1, jnp.int32), TypeError),
                                        (np.float32(-1.0), ValueError), (True, TypeError)])
def test_act_spec_bad_scales(scale, exc):
    with pytest.raises(exc, match="ActSpec.scale must be None"):
        ActSpec(scale=scale)


# ----------------------------------------------------------------------------- nnx_qat twice


def test_nnx_qat_again_starts_from_the_float_layer():
    # regression: a second nnx_qat kept the int8 training dot of the first, and a None
    # rule left a layer fake-quantized (with its learned scale)
    x = _x(4, 8)
    layer = nnx.Linear(8, 5, rngs=nnx.Rngs(0))
    kernel, bias = np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])
    nnx_qat(layer, QuantConfig(int8_dot=True))
    nnx_qat(layer, QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4)))
    fq4 = _np_int_fq(kernel, bits=4)[0]
    np.testing.assert_allclose(np.asarray(_run(layer, x)), np.asarray(x) @ fq4 + bias,
                               rtol=1e-6, atol=1e-6)
    nnx_qat(layer, QuantConfig(learn_scale=True))
    nnx_qat(layer, [("", None)])
    np.testing.assert_allclose(np.asarray(_run(layer, x)), np.asarray(x) @ kernel + bias,
                               rtol=1e-6, atol=1e-6)
    assert not any("scale" in str(p) for p, _ in nnx.to_flat_state(nnx.state(layer)))
    nnx_quantize(layer, QuantConfig())
    with pytest.raises(ValueError, match="the Linear at '' has a QTensor kernel"):
        nnx_qat(layer, QuantConfig())
