"""Edge cases of quantization-aware training on unmodified Flax models (linen and nnx):
learned scales of codebook and unsigned specs, errors that name the layer, intermediates,
gradients of grouped / strided convolutions and stacked layers. References come from
PyTorch's fake-quantization kernels, NumPy, or the float Flax model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

from nnx_training import train_nnx  # noqa: E402
from reference_tables import NF4  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import QuantConfig, nnx_qat, nnx_quantize, quantize_linen  # noqa: E402

_run = nnx.jit(lambda m, x: m(x))


def _normal(seed, *shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _np_nf4_rows(w):
    """NF4 with one absmax scale per row (a block of 64 along the last axis covers a row
    of 8): the nearest table entry of ``w / absmax``, times ``absmax``."""
    absmax = np.max(np.abs(w), axis=-1, keepdims=True)
    codes = np.argmin(np.abs((w / absmax)[..., None] - NF4), axis=-1)
    return (NF4[codes] * absmax).astype(np.float32), absmax


# ----------------------------------------------------------------------------- learned scales


def test_learned_scale_of_a_codebook_with_its_default_blocks():
    # regression: QuantSpec(dtype="nf4") quantizes in blocks of 64 along the last axis by
    # default, but the learned scale was passed back without those blocks: init raised
    # "scale must have one element (per-tensor) or be 1-D (per-axis) ... got shape (16, 1)"
    spec = jq.QuantSpec(dtype="nf4")
    x = jnp.asarray(_normal(0, 3, 16))
    model = nn.Dense(8)
    qm = quantize_linen(model, QuantConfig(weight=spec, learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(0), x)
    kernel = np.asarray(v["params"]["kernel"])
    ref_kernel, absmax = _np_nf4_rows(kernel)
    np.testing.assert_allclose(np.asarray(v["quant"]["kernel_scale"]), absmax, rtol=1e-6)
    want = jax.jit(model.apply)({"params": {**v["params"], "kernel": jnp.asarray(ref_kernel)}},
                                x)
    y = jax.jit(qm.apply)(v, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)
    q = jax.jit(qm.quantize_params)(v, x)
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, x)), np.asarray(y), atol=1e-6)

    layer = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    layer.kernel.set_value(jnp.asarray(kernel))
    nnx_qat(layer, QuantConfig(weight=spec, learn_scale=True))
    assert layer.promote_dtype.scale.shape == (16, 1)
    y_nnx = _run(layer, x)
    np.testing.assert_allclose(np.asarray(y_nnx), np.asarray(x) @ ref_kernel, rtol=1e-5,
                               atol=1e-6)
    nnx_quantize(layer, QuantConfig(weight=spec, learn_scale=True))
    np.testing.assert_allclose(np.asarray(_run(layer, x)), np.asarray(y_nnx), atol=1e-6)


@functools.partial(jax.jit, static_argnums=0)
def _forward_and_vjp(apply, v, *args_and_g):
    """``apply(v, *args)`` and the vjp of the cotangent (the last argument) to ``v`` and
    ``args``, in one program."""
    *args, g = args_and_g
    y, vjp = jax.vjp(apply, v, *args)
    return y, vjp(g)


def _torch_uint8_reference(kernel, scale, x, g):
    """PyTorch's learnable per-channel fake quantization of a ``(in, out)`` uint8 kernel
    with the symmetric zero point 128: ``(x @ fq(kernel), d/dkernel, d/dscale)``."""
    torch = pytest.importorskip("torch")
    kt = torch.tensor(kernel, requires_grad=True)
    st = torch.tensor(scale, requires_grad=True)
    zt = torch.full((kernel.shape[1],), 128.0)
    fq = torch._fake_quantize_learnable_per_channel_affine(kt, st, zt, 1, 0, 255, 1.0)
    yt = torch.from_numpy(x) @ fq
    yt.backward(torch.from_numpy(g))
    return yt.detach().numpy(), kt.grad.numpy(), st.grad.numpy()


def test_learned_scale_of_a_symmetric_unsigned_spec_keeps_the_mid_range_zero_point():
    # regression: symmetric uint8 quantizes with the zero point 128 (PyTorch's symmetric
    # quint8), but with learn_scale=True linen dropped it (negative weights clipped to 0,
    # a forward pass ~1.0 away from the quantized kernel's) and nnx made it a trainable
    # Param, although only asymmetric specs learn zero points
    spec = jq.QuantSpec(dtype=jnp.uint8)
    x, g = _normal(1, 5, 12), _normal(2, 5, 6)
    qm = quantize_linen(nn.Dense(6, use_bias=False), QuantConfig(weight=spec,
                                                                   learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(0), jnp.asarray(x))
    assert set(v["quant"]) == {"kernel_scale"}
    kernel = np.asarray(v["params"]["kernel"])
    np.testing.assert_allclose(np.asarray(v["quant"]["kernel_scale"]),
                               np.max(np.abs(kernel), axis=0) / 127, rtol=1e-6)
    scale = np.asarray(v["quant"]["kernel_scale"]) * 0.7  # a narrower range: some clip
    v = {"params": v["params"], "quant": {"kernel_scale": jnp.asarray(scale)}}
    y, (grads, _) = _forward_and_vjp(qm.apply, v, jnp.asarray(x), jnp.asarray(g))
    y_t, gk_t, gs_t = _torch_uint8_reference(kernel, scale, x, g)
    np.testing.assert_allclose(np.asarray(y), y_t, rtol=1e-5, atol=1e-5)
    # x^T g sums five products in another order than torch: float32 rounding of the sum
    np.testing.assert_allclose(np.asarray(grads["params"]["kernel"]), gk_t, rtol=1e-6,
                               atol=1e-6 * np.abs(gk_t).max())
    np.testing.assert_allclose(np.asarray(grads["quant"]["kernel_scale"]), gs_t, rtol=1e-4,
                               atol=1e-4)
    q = jax.jit(qm.quantize_params)(v, jnp.asarray(x))["params"]["kernel"]
    np.testing.assert_array_equal(np.asarray(q.zero_point), np.full(6, 128, np.uint8))
    np.testing.assert_allclose(
        np.asarray(jax.jit(qm.apply)({"params": {"kernel": q}}, jnp.asarray(x))),
        y_t, rtol=1e-5, atol=1e-5)

    layer = nnx.Linear(12, 6, use_bias=False, rngs=nnx.Rngs(0))
    layer.kernel.set_value(jnp.asarray(kernel))
    nnx_qat(layer, QuantConfig(weight=spec, learn_scale=True))
    assert layer.promote_dtype.zero_point is None
    assert set(nnx.to_pure_dict(nnx.state(layer, nnx.Param))["promote_dtype"]) == {"scale"}
    layer.promote_dtype.scale.set_value(jnp.asarray(scale))
    np.testing.assert_allclose(np.asarray(_run(layer, jnp.asarray(x))), y_t, rtol=1e-5,
                               atol=1e-5)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(jnp.asarray(x)) * g)))(layer)
    np.testing.assert_allclose(np.asarray(grads.promote_dtype.scale[...]), gs_t, rtol=1e-4,
                               atol=1e-4)


def test_learned_scales_of_a_grouped_strided_conv_match_torch():
    # a Conv with feature groups, strides and asymmetric padding: input, kernel and
    # learned-scale gradients against torch._fake_quantize_learnable_per_channel_affine
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = _normal(3, 2, 9, 9, 4)
    model = nn.Conv(6, (3, 3), strides=2, padding=((1, 0), (2, 1)), feature_group_count=2,
                    use_bias=False)
    qm = quantize_linen(model, QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4),
                                           learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(0), jnp.asarray(x))
    assert v["params"]["kernel"].shape == (3, 3, 2, 6)
    scale = np.asarray(v["quant"]["kernel_scale"]) * 0.6
    v = {"params": v["params"], "quant": {"kernel_scale": jnp.asarray(scale)}}
    g = _normal(4, *jax.eval_shape(qm.apply, v, jnp.asarray(x)).shape)
    y, (gv, gx) = _forward_and_vjp(qm.apply, v, jnp.asarray(x), jnp.asarray(g))

    kt = torch.tensor(np.asarray(v["params"]["kernel"]), requires_grad=True)
    st = torch.tensor(scale, requires_grad=True)
    xt = torch.tensor(x, requires_grad=True)
    fq = torch._fake_quantize_learnable_per_channel_affine(kt, st, torch.zeros(6), 3, -8, 7,
                                                           1.0)
    lhs = F.pad(xt.permute(0, 3, 1, 2), (2, 1, 1, 0))
    yt = F.conv2d(lhs, fq.permute(3, 2, 0, 1), stride=2, groups=2).permute(0, 2, 3, 1)
    yt.backward(torch.from_numpy(g))
    assert np.any(np.abs(kt.grad.numpy()) == 0)  # some weights clip
    np.testing.assert_allclose(np.asarray(y), yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), xt.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gv["params"]["kernel"]), kt.grad.numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gv["quant"]["kernel_scale"]), st.grad.numpy(),
                               rtol=1e-5, atol=1e-3)


def test_nnx_stacked_layers_train_with_learned_scales_under_nnx_jit():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return nnx.Linear(6, 6, rngs=rngs)

            self.layers = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, layer):
                return jnp.tanh(layer(x))

            return body(x, self.layers)

    x, y = jnp.asarray(_normal(5, 16, 6)), jnp.asarray(np.cos(_normal(6, 16, 6)))
    cfg = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, symmetric=False), learn_scale=True)
    model = nnx_qat(Stack(nnx.Rngs(0)), cfg)
    assert model.layers.promote_dtype.scale.shape == (3, 6)
    assert model.layers.promote_dtype.zero_point.shape == (3, 6)
    s0 = np.asarray(model.layers.promote_dtype.scale[...])
    losses = train_nnx(model, x, y, steps=30)
    assert losses[-1] < 0.7 * losses[0]
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(bool(jnp.isfinite(p).all()) for p in params)
    assert np.abs(np.asarray(model.layers.promote_dtype.scale[...]) - s0).max() > 1e-4
    y_qat = _run(model, x)
    nnx_quantize(model, cfg)
    np.testing.assert_allclose(np.asarray(_run(model, x)),
                               np.asarray(y_qat), atol=1e-6)


# ----------------------------------------------------------------------------- errors


class _Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(10, 6, name="emb")
        return emb.attend(emb(tokens))


@pytest.mark.parametrize("learn", [False, True])
def test_linen_embed_spec_that_does_not_fit_names_the_layer(learn):
    # regression: the table is fake-quantized in Embed.setup, outside the layer's error
    # context: "axis must be in [-2, 2) ..." without the layer it came from
    qm = quantize_linen(_Tied(), QuantConfig(weight=jq.QuantSpec(axis=2), learn_scale=learn))
    with pytest.raises(ValueError, match=r"layer 'emb' \(Embed\): axis must be in \[-2, 2\)"):
        jax.eval_shape(qm.init, jax.random.key(0), jnp.array([[1, 2, 3]]))  # while tracing


class _Block(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return nn.Dense(6)(c), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=2)
        return blocks()(x, None)[0]


def test_learn_scale_without_its_quant_variables_is_an_error_naming_the_layer():
    # regression: Flax's ModifyScopeVariableError ('collection "quant" is immutable'),
    # which names neither the rule nor the fix
    x, cfg = jnp.ones((2, 6)), QuantConfig(learn_scale=True)
    # shapes only (jax.eval_shape): the errors are raised while tracing
    qm = quantize_linen(nn.Sequential([nn.Dense(3)]), cfg)
    v = jax.eval_shape(qm.init, jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"layer 'layers_0' \(Dense\): learn_scale=True needs "
                                         r"the 'quant' variable kernel_scale"):
        jax.eval_shape(qm.apply, {"params": v["params"]}, x)
    qm = quantize_linen(_Scanned(), cfg)
    with pytest.raises(ValueError, match=r"layer 'Scan_Block_0/Dense_0' \(Dense\): .*"
                                         r"'quant' in variable_axes"):
        jax.eval_shape(qm.init, jax.random.key(0), x)


# ----------------------------------------------------------------------------- intermediates


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3,), name="conv")(x)
        x = nn.remat(nn.Dense)(4, name="mid")(nn.relu(x))
        return nn.Dense(2, name="head")(x)


def test_capture_intermediates_records_each_quantized_layer_once():
    # regression: the layer re-run as a clone was recorded too, so every quantized layer
    # had two outputs under "intermediates" (one for a float layer)
    model, x = _Net(), jnp.asarray(_normal(7, 2, 5, 3))
    v = jax.jit(model.init)(jax.random.key(0), x)
    spec = jq.QuantSpec(dtype=jnp.int4)
    qm = quantize_linen(model, QuantConfig(weight=spec))
    fq = jax.jit(lambda v: jax.tree.map(
        lambda w: jq.fake_quant(w, dtype=jnp.int4, axis=-1) if w.ndim > 1 else w,
        v))(v)  # the float model on fake-quantized kernels: the same layer outputs
    capture = lambda m: jax.jit(lambda v, x: m.apply(v, x, capture_intermediates=True,
                                                     mutable=["intermediates"]))
    _, want = capture(model)(fq, x)
    for variables in (v, jax.jit(qm.quantize_params)(v, x)):
        _, got = capture(qm)(variables, x)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for name in ("conv", "mid", "head"):
            (out,) = got["intermediates"][name]["__call__"]
            np.testing.assert_allclose(np.asarray(out),
                                       np.asarray(want["intermediates"][name]["__call__"][0]),
                                       rtol=1e-5, atol=1e-6)


def test_a_learned_scale_taken_below_zero_is_clamped_as_torch_does():
    """An optimizer step can take a learned scale to 0 or below: the layer then uses float32's
    eps (torch's _LearnableFakeQuantize clamps its parameter so), with the LSQ gradient at
    that value, and inference quantizes with the same scale."""
    torch = pytest.importorskip("torch")
    eps = float(np.finfo(np.float32).eps)
    x = _normal(0, 5, 8)
    model = nn.Dense(4, use_bias=False)
    qm = quantize_linen(model, QuantConfig(weight=jq.QuantSpec(), learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(0), jnp.asarray(x))
    scale = np.asarray(v["quant"]["kernel_scale"]).copy()
    scale[1], scale[3] = -0.16, 0.0
    v = {"params": v["params"], "quant": {"kernel_scale": jnp.asarray(scale)}}
    g = _normal(1, x.shape[0], 4)
    y, (gv, _) = _forward_and_vjp(qm.apply, v, jnp.asarray(x), jnp.asarray(g))

    kt = torch.tensor(np.asarray(v["params"]["kernel"]), requires_grad=True)
    st = torch.tensor(np.maximum(scale, eps), requires_grad=True)
    fq = torch._fake_quantize_learnable_per_channel_affine(kt, st, torch.zeros(4), 1, -128,
                                                           127, 1.0)
    yt = torch.from_numpy(x) @ fq
    yt.backward(torch.from_numpy(g))
    assert np.all(np.isfinite(np.asarray(y)))
    np.testing.assert_allclose(np.asarray(y), yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gv["quant"]["kernel_scale"]), st.grad.numpy(),
                               rtol=1e-5, atol=1e-3)
    q = jax.jit(qm.quantize_params)(v, jnp.asarray(x))
    assert np.all(np.asarray(q["params"]["kernel"].scale) >= eps)
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, jnp.asarray(x))), np.asarray(y),
                               rtol=1e-5, atol=1e-5)


def test_static_unsigned_activation_scale_keeps_the_symmetric_zero_point():
    """ActSpec is symmetric: a static uint8 scale uses the mid-range zero point 128, as the
    dynamic scales do (before, negative inputs were clipped to 0)."""
    torch = pytest.importorskip("torch")
    x = _normal(2, 4, 6)
    model = nn.Dense(3)
    qm = quantize_linen(model, QuantConfig(weight=None, act=jq.flax.ActSpec(dtype=jnp.uint8,
                                                                             scale=0.02)))
    v = jax.jit(qm.init)(jax.random.key(0), jnp.asarray(x))
    y = jax.jit(qm.apply)(v, jnp.asarray(x))
    xq = torch.fake_quantize_per_tensor_affine(torch.from_numpy(x), 0.02, 128, 0, 255).numpy()
    ref = jax.jit(model.apply)(v, jnp.asarray(xq))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)
