"""Quantized inference checked against independent references: the int8 x int8 -> int32
dot against NumPy int64 arithmetic (its exact-length limits at their boundaries), the memory
of weight-only gradients, and static activation scales of the Flax inference ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

from jaxpr_utils import find_eqns  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import ActSpec, QuantConfig, nnx_qat, nnx_quantize, quantize_linen  # noqa: E402

DN = (((1,), (0,)), ((), ()))
W8A8 = jq.ActQuant()
TINY = np.float32(np.finfo(np.float32).tiny)


def _np_codes(x, axes):
    """Symmetric int8 codes (int64) and float32 scales, in float64: absmax / 127 rounded to
    float32 (at least the smallest normal; 1 for zeros), the quotient rounded to float32,
    then half to even and clipped to +-127."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=axes, keepdims=True, initial=0.0).astype(np.float64)
    s = np.where(amax > 0, np.maximum((amax / 127).astype(np.float32), TINY), np.float32(1))
    t = (x.astype(np.float64) / s.astype(np.float64)).astype(np.float32)
    return np.clip(np.rint(t), -127, 127).astype(np.int64), s.astype(np.float32)


def _codes(qt, zp_shape=(-1,)):
    """A QTensor's codes minus its zero point (reshaped to ``zp_shape``), as int64."""
    zp = 0 if qt.zero_point is None else np.asarray(qt.zero_point).astype(np.int64)
    return np.asarray(qt.qvalue).astype(np.int64) - np.reshape(zp, zp_shape)


# ----------------------------------------------------------------------------- int8 x int8


def test_w8a8_equals_int64_reference_on_extreme_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x *= (np.float32(10) ** rng.integers(-30, 30, (6, 1))).astype(np.float32)
    x[0], x[1, 3], x[2] = 0.0, 1e30, 1e-40  # zeros, an outlier, a row of subnormals
    w = rng.standard_normal((64, 8)).astype(np.float32)
    xq, sx = _np_codes(x, (1,))
    for spec in [dict(axis=1), dict(dtype=jnp.uint8, axis=1, symmetric=False), {}]:
        qt = jq.quantize(w, **spec)
        expected = (xq @ _codes(qt)).astype(np.float32) * sx * np.asarray(qt.scale)
        np.testing.assert_array_equal(np.asarray(jq.qdot_general(x, qt, DN, act_quant=W8A8)),
                                      expected)


def test_w8a8_batch_dims_and_half_precision_equal_int64_reference():
    rng = np.random.default_rng(1)
    # the batch axis in the middle of the activation, the weight's per-axis scale last
    a = rng.standard_normal((5, 3, 24)).astype(np.float32)
    qw = jq.quantize(rng.standard_normal((24, 3, 7)).astype(np.float32), axis=2)
    dims = (((2,), (0,)), ((1,), (1,)))
    for gran, axes in [("token", (2,)), ("tensor", (0, 1, 2))]:
        aq, sa = _np_codes(a, axes)
        acc = np.einsum("ibk,kbj->bij", aq, _codes(qw)).astype(np.float32)
        sa = np.transpose(sa, (1, 0, 2)) if gran == "token" else sa.reshape(())
        y = jq.qdot_general(a, qw, dims, act_quant=jq.ActQuant(granularity=gran))
        np.testing.assert_array_equal(np.asarray(y), acc * sa * np.asarray(qw.scale))
    # an unsigned QTensor with zero points on the left, batch dims leading
    qa = jq.quantize(rng.standard_normal((3, 5, 24)).astype(np.float32), dtype=jnp.uint8,
                     axis=1, symmetric=False)
    b = rng.standard_normal((3, 24, 7)).astype(np.float32)
    bq, sb = _np_codes(b, (1,))
    acc = np.einsum("bik,bkj->bij", _codes(qa, (1, -1, 1)), bq).astype(np.float32)
    y = jq.qdot_general(qa, b, (((2,), (1,)), ((0,), (0,))), act_quant=W8A8)
    np.testing.assert_array_equal(np.asarray(y), acc * np.asarray(qa.scale)[None, :, None] * sb)
    # bfloat16 / float16 activations: quantized from their float32 values, the float32
    # result rounded once to the requested dtype
    x, qt = rng.standard_normal((4, 32)), jq.quantize(rng.standard_normal((32, 6)), axis=1)
    for dtype in (jnp.bfloat16, jnp.float16):
        xh = jnp.asarray(x, dtype)
        xq, sx = _np_codes(np.asarray(xh.astype(jnp.float32)), (1,))
        y32 = (xq @ _codes(qt)).astype(np.float32) * sx * np.asarray(qt.scale)
        for out in (None, jnp.float32, jnp.float16 if dtype == jnp.bfloat16 else jnp.bfloat16):
            y = jq.qdot_general(xh, qt, DN, preferred_element_type=out, act_quant=W8A8)
            assert y.dtype == (out or dtype)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.asarray(y32, y.dtype)))


@pytest.mark.parametrize("zero_point", [False, True])
def test_w8a8_exact_at_and_beyond_the_int32_length(zero_point):
    # the worst products: |a| = 128 (a QTensor lhs), |w - z| = 128 (255 with a zero point);
    # exact_length: 131,071 = (2**31 - 1) // 128**2, 65,793 = (2**31 - 1) // (128 * 255)
    limit = 65_793 if zero_point else 131_071
    assert limit * 128 * (255 if zero_point else 128) < 2**31
    assert (limit + 1) * 128 * (255 if zero_point else 128) >= 2**31
    for k in (limit, limit + 1):
        a = jq.quantize(jnp.full((1, k), -128.0), jnp.float32(1))
        if zero_point:
            b = jq.quantize(jnp.full((k, 1), 255.0), jnp.float32(1), jnp.uint8(0), dtype=jnp.uint8)
        else:
            b = jq.quantize(jnp.full((k, 1), -128.0), jnp.float32(1))
        exact = int((_codes(a) @ _codes(b))[0, 0])
        assert abs(exact) >= 2**31 - 2**16  # at (or past) the int32 range
        y = float(np.asarray(jq.qdot_general(a, b, DN, act_quant=W8A8))[0, 0])
        assert y == float(np.float32(exact))  # no int32 wrap-around


# ----------------------------------------------------------------------------- weight-only


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU scheduling")
@pytest.mark.parametrize("rows", [8, 64])  # one dot per layer; streamed in chunks
def test_weight_only_gradient_does_not_keep_every_float_weight(rows):
    # regression: jax.grad through four weight-only layers saved each layer's float weight
    # for the backward pass (16 MiB of temporaries for four 4 MiB weights)
    # weights of std 1/32: unit-variance pre-activations, a well-conditioned gradient (with
    # std 1, float32's own error is 1e-3 of the largest entry, and which float32 summation
    # order XLA picks depends on the CPU's vector width)
    rng = np.random.default_rng(2)
    ws = [jq.quantize(rng.standard_normal((1024, 1024), np.float32) / 32, axis=1)
          for _ in range(4)]

    def loss(x, ws):
        for w in ws:
            x = jnp.tanh(jq.qdot_general(x, w, DN))
        return x.sum()

    x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.float32)
    grad = jax.jit(jax.grad(loss))
    mem = grad.lower(x, ws).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 2 * 1024 * 1024 * 4  # not four float weights
    ref = np.asarray(jax.grad(loss)(x, [w.dequantize() for w in ws]))
    np.testing.assert_allclose(np.asarray(grad(x, ws)), ref, atol=1e-5 * np.abs(ref).max())


# ----------------------------------------------------------------------------- Flax, static scales


def _float_ref(model, params, q, x):
    deq = jax.tree.map(lambda v: v.dequantize() if jq.is_qtensor(v) else v, q,
                       is_leaf=jq.is_qtensor)
    return model.apply(deq, x)


@pytest.mark.parametrize("kind", ["dense", "einsum", "conv"])
def test_static_act_scale_nan_input_is_not_dropped(kind):
    # regression: a static ActSpec scale quantized a NaN input to the code 0, so int8
    # inference returned finite numbers where the float model and QAT give NaN
    model, shape = {"dense": (nn.Dense(4), (2, 6)),
                    "einsum": (nn.Einsum((6, 4), "bd,dk->bk"), (2, 6)),
                    "conv": (nn.Conv(4, (3,)), (2, 5, 6))}[kind]
    x = jax.random.normal(jax.random.key(0), shape)
    params = model.init(jax.random.key(1), x)
    qm = quantize_linen(model, QuantConfig(act=ActSpec(scale=0.05)))
    q = qm.quantize_params(params, x)
    clean = np.asarray(jax.jit(qm.apply)(q, x))
    assert np.isfinite(clean).all()
    bad = x.at[(0, 1) if x.ndim == 2 else (0, 1, 2)].set(jnp.nan)
    assert np.isnan(np.asarray(_float_ref(model, params, q, bad))).any()
    assert np.isnan(np.asarray(qm.apply(q, bad))[0]).all()
    assert np.isnan(np.asarray(jax.jit(qm.apply)(q, bad))[0]).all()
    # training (fake quantization on the float params) turns the same elements NaN: before,
    # the NaN got the zero code there and the QAT output was finite
    np.testing.assert_array_equal(np.isnan(np.asarray(qm.apply(params, bad))),
                                  np.isnan(np.asarray(jax.jit(qm.apply)(q, bad))))


def test_static_act_scale_of_a_format_other_than_int8_is_refused():
    # regression: ActSpec(dtype=int4, scale=...) ran int8 codes of the scale at inference
    # (up to +-127 instead of int4's -8..7) where the dynamic int4 ActSpec is refused
    x = jax.random.normal(jax.random.key(0), (3, 6)) * 3
    model = nn.Dense(4)
    params = model.init(jax.random.key(1), x)
    qm = quantize_linen(model, QuantConfig(act=ActSpec(dtype=jnp.int4, scale=0.1)))
    q = qm.quantize_params(params, x)
    with pytest.raises(ValueError, match=r"Dense.*needs ActSpec\(dtype=jnp.int8\), got dtype=int4"):
        qm.apply(q, x)
    layer = nnx_quantize(nnx.Linear(6, 4, rngs=nnx.Rngs(0)),
                         QuantConfig(act=ActSpec(dtype=jnp.int4, scale=0.1)))
    with pytest.raises(ValueError, match=r"Linear.*needs ActSpec\(dtype=jnp.int8\)"):
        layer(x)
    # uint8 around its zero point 128 has int8's codes: it runs, as int8 does
    y8, yu = (quantize_linen(model, QuantConfig(act=ActSpec(dtype=d, scale=0.1))).apply(q, x)
              for d in (jnp.int8, jnp.uint8))
    np.testing.assert_array_equal(np.asarray(y8), np.asarray(yu))
    xq = jq.fake_quant(x, jnp.float32(0.1), jnp.uint8(128), dtype=jnp.uint8)
    np.testing.assert_allclose(np.asarray(yu), np.asarray(_float_ref(model, params, q, xq)),
                               rtol=1e-5, atol=1e-5)


def test_nnx_int8_layers_dot_int8_codes_only():
    # no float dot beside the int8 one, for packed int4 kernels blocked along the contraction
    spec = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=4, packed=True),
                       act=ActSpec())
    rngs = nnx.Rngs(0)
    for layer, x in [(nnx.Linear(8, 5, rngs=rngs), (3, 8)),
                     (nnx.Einsum("btd,dk->btk", (8, 5), rngs=rngs), (2, 3, 8)),
                     (nnx.LinearGeneral(8, (5, 2), rngs=rngs), (3, 8))]:
        model, x = nnx_quantize(layer, spec), jnp.ones(x)
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda s, g=graphdef, x=x: nnx.merge(g, s)(x))(state).jaxpr
        dots = [[v.aval.dtype for v in e.invars + e.outvars] for e in find_eqns(jaxpr)]
        assert dots == [[jnp.int8, jnp.int8, jnp.int32]]


def test_nnx_static_act_scale_turns_nan_alike_in_training_and_inference():
    x = np.ones((3, 4), np.float32)
    x[0, 0] = np.nan
    rules = QuantConfig(act=ActSpec(scale=0.05))
    trained = np.asarray(nnx_qat(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), rules)(x))
    served = np.asarray(nnx_quantize(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), rules)(x))
    assert np.isnan(served).all()
    np.testing.assert_array_equal(np.isnan(trained), np.isnan(served))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU scheduling")
@pytest.mark.parametrize("kind", ["Dense", "Einsum", "nnx.Linear"])
def test_bfloat16_params_computed_in_float32_dequantize_one_layer_at_a_time(kind):
    # before: such a kernel (rounded through bfloat16, as training saw it) was dequantized
    # outside the scheduled dot, and XLA hoisted every layer's: all float weights live at once
    n, layers, x = 512, 4, jnp.ones((4, 512))
    if kind == "nnx.Linear":
        model = nnx.Sequential(*[nnx.Linear(n, n, use_bias=False, param_dtype=jnp.bfloat16,
                                            dtype=jnp.float32, rngs=nnx.Rngs(i))
                                 for i in range(layers)])
        trained = nnx_qat(nnx.clone(model), QuantConfig())(x)
        graph, state = nnx.split(nnx_quantize(model, QuantConfig()))
        serve, args = jax.jit(lambda s, v: nnx.merge(graph, s)(v)), (state, x)
    else:
        make = (lambda: nn.Dense(n, use_bias=False, param_dtype=jnp.bfloat16, dtype=jnp.float32)
                ) if kind == "Dense" else (lambda: nn.Einsum(
                    (n, n), "bd,dk->bk", use_bias=False, param_dtype=jnp.bfloat16, dtype=jnp.float32))
        model = nn.Sequential([make() for _ in range(layers)])
        qm = quantize_linen(model, QuantConfig())
        v = qm.init(jax.random.key(0), x)
        trained = qm.apply(v, x)
        serve, args = jax.jit(qm.apply), (qm.quantize_params(v, x), x)
    mem = serve.lower(*args).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 2 * n * n * 4, kind  # not four float32 weights
    np.testing.assert_allclose(np.asarray(serve(*args)), np.asarray(trained), rtol=1e-6, atol=1e-6)
