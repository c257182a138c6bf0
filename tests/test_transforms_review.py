"""The functional core under JAX transformations: vmap, grad, jit caching, x64.

API.md: "Everything here is pure and traceable: it works under jax.jit, jax.vmap
and jax.grad, and two calls with equal shapes and metadata do not retrace."
References: Python loops over slices (vmap, bit for bit), PyTorch's learnable
per-channel fake quantization (gradients), ``onnx.reference`` (x64 codes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _quantize


def _rand(shape, seed=0, scale=3.0):
    return jnp.asarray((np.random.default_rng(seed).standard_normal(shape) * scale)
                       .astype(np.float32))


def _bits(a):
    a = np.atleast_1d(np.asarray(a))
    return a.dtype, a.shape, a.view(np.uint8).tobytes()


def _stack_loop(f, xs, in_axis, out_axis, *rest):
    """``f`` applied to each slice of ``xs`` along ``in_axis``, stacked along ``out_axis``."""
    outs = [np.asarray(f(jnp.take(xs, i, axis=in_axis), *rest)) for i in range(xs.shape[in_axis])]
    return np.stack(outs, axis=out_axis)


# --- vmap -------------------------------------------------------------------------------------

_VMAP_CASES = [
    (dict(axis=0, block_size=2, symmetric=False, dtype=jnp.uint8), 2, 0),
    (dict(block_size=(2, 3), dtype=jnp.int4), 0, -1),
    (dict(dtype=jnp.int4, packed=True, axis=-1, block_size=4), 1, 2),
]


@pytest.mark.parametrize("kw, ia, oa", _VMAP_CASES, ids=["blocks-asym", "tiles", "packed"])
def test_vmap_of_computed_mode_matches_a_loop_over_slices(kw, ia, oa):
    x = _rand((3, 5, 8))
    fq_kw = {k: v for k, v in kw.items() if k != "packed"}
    ref = _stack_loop(jax.jit(lambda r: jq.dequantize(jq.quantize(r, **kw))), x, ia, oa)
    qt = jax.vmap(lambda r: jq.quantize(r, **kw), in_axes=ia, out_axes=oa)(x)
    # the stacked QTensor's static metadata describes one unbatched slice
    one = jax.eval_shape(lambda r: jq.quantize(r, **kw), jnp.take(x, 0, axis=ia))
    assert (qt.axis, qt.block_size) == (one.axis, one.block_size)
    got = jax.vmap(jq.dequantize, in_axes=oa, out_axes=oa)(qt)
    assert _bits(got) == _bits(ref)
    fq = jax.jit(jax.vmap(lambda r: jq.fake_quant(r, **fq_kw), in_axes=ia, out_axes=oa))(x)
    assert _bits(fq) == _bits(ref)


def test_nested_vmap_matches_a_loop():
    x = _rand((3, 5, 8), seed=1)
    f = lambda r: jq.quantize(r, axis=0).qvalue  # noqa: E731
    got = jax.vmap(jax.vmap(f, in_axes=1, out_axes=1))(x)
    ref = np.stack([_stack_loop(f, x[i], 1, 1) for i in range(3)])
    assert _bits(got) == _bits(ref)


def test_vmap_of_explicit_scales_batched_or_shared_matches_a_loop():
    rng = np.random.default_rng(2)
    x = _rand((3, 5, 8), seed=2)
    s_axis = jnp.asarray(rng.uniform(0.01, 0.05, (3, 8)).astype(np.float32))
    s_blk = jnp.asarray(rng.uniform(0.01, 0.05, (3, 5, 3)).astype(np.float32))
    z_blk = jnp.asarray(rng.integers(-5, 5, (3, 5, 3)).astype(np.int8))
    per_axis = lambda r, s: jq.quantize(r, s, axis=-1).qvalue  # noqa: E731
    blocked = lambda r, s, z: jq.quantize(r, s, z, axis=-1, block_size=3).qvalue  # noqa: E731
    loop = lambda f, *args: np.stack([np.asarray(f(*(a[i] for a in args))) for i in range(3)])  # noqa: E731,E501
    assert _bits(jax.vmap(per_axis)(x, s_axis)) == _bits(loop(per_axis, x, s_axis))
    assert _bits(jax.vmap(per_axis, in_axes=(0, 1))(x, s_axis.T)) == \
        _bits(loop(per_axis, x, s_axis))
    shared = np.broadcast_to(s_axis[0], (3, 8))
    assert _bits(jax.vmap(per_axis, in_axes=(0, None))(x, s_axis[0])) == \
        _bits(loop(per_axis, x, shared))
    assert _bits(jax.vmap(blocked)(x, s_blk, z_blk)) == _bits(loop(blocked, x, s_blk, z_blk))
    z_shared = np.broadcast_to(z_blk[0], z_blk.shape)
    assert _bits(jax.vmap(blocked, in_axes=(0, 0, None))(x, s_blk, z_blk[0])) == \
        _bits(loop(blocked, x, s_blk, z_shared))
    # x shared, scales batched: per-channel scale candidates for one tensor
    one = jax.jit(lambda s: jq.fake_quant(x[0], s, axis=1))
    fq = jax.jit(jax.vmap(one))(s_axis)
    ref = np.stack([np.asarray(one(s_axis[i])) for i in range(3)])
    assert _bits(fq) == _bits(ref)


def _jit_vjp(f, g, *args):
    """(f(*args), the vjp of g), in one jitted function."""
    def run(g, *args):
        y, vjp = jax.vjp(f, *args)
        return y, vjp(g)

    return jax.jit(run)(jnp.asarray(g), *(jnp.asarray(a) for a in args))


# --- grad -------------------------------------------------------------------------------------

def _torch_learnable_per_channel(x, s, z, axis, qmin, qmax, g):
    torch = pytest.importorskip("torch")
    xt, st, zt = (torch.tensor(a, requires_grad=True) for a in (x, s, z))
    y = torch._fake_quantize_learnable_per_channel_affine(xt, st, zt, axis, qmin, qmax, 1.0)
    y.backward(torch.tensor(g))
    return [a.numpy() for a in (y.detach(), xt.grad, st.grad, zt.grad)]


@pytest.mark.parametrize("dtype, qmin, qmax", [(jnp.int4, -8, 7), (jnp.int16, -32768, 32767)],
                         ids=["int4", "int16"])
def test_blocked_lsq_gradients_match_torch_per_channel(dtype, qmin, qmax):
    # blocks of 2 rows of a (4, 6) array along axis 0 are torch's channels of a (12, 2) view
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 6)) * 3).astype(np.float32)
    g = rng.standard_normal((4, 6)).astype(np.float32)
    s = rng.uniform(0.01, 0.3, (2, 6)).astype(np.float32) / (100 if qmax > 127 else 1)
    z = np.round(rng.uniform(qmin, qmax, (2, 6))).astype(np.float32)
    view = lambda a: a.reshape(2, 2, 6).transpose(0, 2, 1).reshape(12, 2)  # noqa: E731
    back = lambda a: a.reshape(2, 6, 2).transpose(0, 2, 1).reshape(4, 6)  # noqa: E731
    y, dx, ds, dz = _torch_learnable_per_channel(view(x), s.ravel(), z.ravel(), 0, qmin, qmax,
                                                 view(g))
    out, (jdx, jds, jdz) = _jit_vjp(lambda x, s, z: jq.fake_quant(x, s, z, dtype=dtype, axis=-2,
                                                                  block_size=2), g, x, s, z)
    np.testing.assert_array_equal(np.asarray(out), back(y))
    np.testing.assert_array_equal(np.asarray(jdx), back(dx))
    # per element, (fq - x) / s carries the rounding of x / s (jaxquant) or of fq (torch), up
    # to an ulp of the largest quotient: int16's quotients reach the thousands
    tol = 4 * np.abs(g).max() * np.spacing(np.float32(np.abs(x).max() / s.min()))
    np.testing.assert_allclose(np.asarray(jds), ds.reshape(2, 6), rtol=1e-5, atol=max(tol, 1e-6))
    np.testing.assert_allclose(np.asarray(jdz), dz.reshape(2, 6), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_ste_and_lsq_gradients_match_a_numpy_reference(dtype):
    # x / s on both sides of the largest value and of the midpoint past it (e4m3fn: 448 and
    # 464, a tie that rounds down to 448; e5m2: 57344 and 61440, a tie that rounds up)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    f8 = getattr(ml_dtypes, dtype)
    top = float(ml_dtypes.finfo(f8).max)
    mid = {"float8_e4m3fn": 464.0, "float8_e5m2": 61440.0}[dtype]
    t = np.array([0.1, 1.0, 400.0, top, (top + mid) / 2, mid, mid + 8, -mid - 8, 1e6, -0.3],
                 np.float32)
    s = np.float32(0.5)
    x = t * s  # exact: t / s gives t back
    g = np.linspace(0.5, 1.5, t.size).astype(np.float32)
    _, (dx, ds) = _jit_vjp(lambda x, s: jq.fake_quant(x, s, dtype=dtype), g, x, s)
    # in range: x / s rounds (without a largest value) to at most the largest finite value
    inside = np.abs(t) <= mid if dtype == "float8_e4m3fn" else np.abs(t) < mid
    q = np.clip(t, -top, top).astype(f8).astype(np.float64)
    ref_ds = np.sum(g * np.where(inside, q - t, np.sign(t) * top))
    np.testing.assert_array_equal(np.asarray(dx), np.where(inside, g, 0))
    np.testing.assert_allclose(float(ds), ref_ds, rtol=1e-6)


def test_gradients_agree_through_jit_vmap_checkpointed_scan():
    rng = np.random.default_rng(4)
    x = _rand((4, 6), seed=4)
    s = jnp.asarray(rng.uniform(0.01, 0.3, (6,)).astype(np.float32))
    z = jnp.asarray(rng.uniform(-3, 3, (6,)).astype(np.float32))

    def row_loss(r, s, z):
        return jnp.sum(jnp.sin(jq.fake_quant(r, s, z, axis=-1)))

    def loss(x, s, z):
        return row_loss(x, s, z)

    def scan_loss(x, s, z):
        return jax.lax.scan(lambda c, r: (c + row_loss(r, s, z), None), 0.0, x)[0]

    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))  # noqa: E731
    ref = grad(loss)(x, s, z)
    for a, b in zip(grad(jax.checkpoint(scan_loss))(x, s, z), ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    per_example = jax.jit(jax.vmap(jax.grad(row_loss, argnums=(0, 1, 2)),
                                   in_axes=(0, None, None)))(x, s, z)
    np.testing.assert_array_equal(np.asarray(per_example[0]), np.asarray(ref[0]))
    for a, b in zip(per_example[1:], ref[1:], strict=True):
        np.testing.assert_allclose(np.asarray(a.sum(0)), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_reverse_over_reverse_gives_the_ste_second_derivative():
    # f = sum(fq(x)**3): df/dx = 3 fq**2 * mask, d2f/dx2 = diag(6 fq * mask) (mask' = 0)
    x = jnp.linspace(-1.2, 1.2, 9)
    s = jnp.float32(0.125)
    h = jax.jit(jax.jacrev(jax.grad(lambda x: jnp.sum(jq.fake_quant(x, s, dtype=jnp.int4) ** 3))))(x)
    t = np.round(np.asarray(x, np.float64) / 0.125)
    mask = (t >= -8) & (t <= 7)
    fq = np.clip(t, -8, 7) * 0.125
    np.testing.assert_allclose(np.asarray(h), np.diag(6 * fq * mask), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float4_e2m1fn", "int8"])
def test_codes_of_quantize_are_constants_of_differentiation(dtype):
    # dequantize(quantize(x, s)) = codes * s: d/ds is the sum of the codes and d/dx is 0, as
    # for integer codes. A float8 / float4 cast passed gradients instead (its cotangent cast
    # to the code format: 128 became float4's 6), a third rule next to fake_quant's STE.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([0.3, 1.1, -2.6, 5.0, 1000.0, -0.01], np.float32)
    s = np.float32(0.5)
    gx, gs = jax.grad(lambda x, s: jnp.sum(jq.dequantize(jq.quantize(x, s, dtype=dtype))),
                      argnums=(0, 1))(jnp.asarray(x), jnp.asarray(s))
    info = ml_dtypes.finfo(getattr(ml_dtypes, dtype)) if "float" in dtype else np.iinfo(dtype)
    t = np.clip(x / s, float(info.min), float(info.max))
    codes = t.astype(getattr(ml_dtypes, dtype)) if "float" in dtype else np.rint(t)
    np.testing.assert_array_equal(np.asarray(gx), np.zeros_like(x))
    assert float(gs) == float(np.sum(codes.astype(np.float64)))
    if dtype != "float4_e2m1fn":
        return
    gx = jax.grad(lambda x: jnp.sum(jq.dequantize(jq.quantize(x, dtype="mxfp4"))))(
        jnp.asarray(np.resize(x, 32)))
    np.testing.assert_array_equal(np.asarray(gx), np.zeros(32, np.float32))


@pytest.mark.parametrize("x", [jnp.arange(4), jnp.array([True, False]), [1, 2, 3]],
                         ids=["int32", "bool", "int-list"])
def test_non_float_inputs_are_a_clear_type_error(x):
    for f in (jq.fake_quant, jq.quantize):
        with pytest.raises(TypeError, match=r"x must be a floating-point array, got dtype"):
            f(x, jnp.float32(0.1))


# --- jit caching ------------------------------------------------------------------------------

def test_python_float_scales_do_not_retrace_jitted_consumers():
    # A Python float (jnp.array(0.5)) is weakly typed: stored as such in a QTensor it gave a
    # leaf of another type than a float32 scale's, and every jit the QTensor reached traced
    # again, for equal shapes and metadata.
    traces = []

    @jax.jit
    def f(qt):
        traces.append(1)
        return jq.dequantize(qt)

    x = _rand((8,), seed=5)
    qts = [jq.quantize(x, jnp.float32(0.1)), jq.quantize(x, 0.2), jq.quantize(x, np.float32(0.3)),
           jq.QTensor(jnp.ones(8, jnp.int8), jnp.array(0.5))]
    for qt in qts:
        f(qt)
    assert len(traces) == 1
    assert all(not qt.scale.weak_type and qt.scale.dtype == jnp.float32 for qt in qts)
    with jax.enable_x64():  # a Python float is float64 there: still the float32 the maths uses
        qt = jq.quantize(x, 0.2)
        assert qt.scale.dtype == jnp.float32 and qt.nbytes == 8 + 4
    np.testing.assert_array_equal(np.asarray(qt.qvalue), np.asarray(qts[1].qvalue))


def test_equal_dtype_spellings_and_array_kinds_share_one_kernel():
    x = _rand((4, 8), seed=6)
    jq.quantize(x, jnp.float32(0.1), dtype=jnp.int8)
    before = _quantize._quantize_explicit._cache_size()
    for d in (np.dtype("int8"), "int8", np.int8, jnp.dtype("int8")):
        jq.quantize(x, jnp.float32(0.2), dtype=d)
    assert _quantize._quantize_explicit._cache_size() == before
    traces = []

    @jax.jit
    def g(qt):
        traces.append(1)
        return qt.dequantize()

    qt = jq.quantize(x, axis=-1)
    for other in (qt, jq.quantize(2 * x, axis=1), jq.QTensor(np.asarray(qt.qvalue),
                                                              np.asarray(qt.scale), axis=1,
                                                              dtype="float32")):
        g(other)
    assert len(traces) == 1


# --- dtypes: x64, half precision, weak types --------------------------------------------------

def test_x64_float64_inputs_follow_the_float32_contract():
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    rng = np.random.default_rng(7)
    # a float64 value just above a tie k + 0.5 rounds to the tie in float32: the float32
    # contract gives the even code, a float64 quotient would round up
    s = 0.25
    ties = (np.arange(-20, 20) + 0.5) * s + 2.0**-30
    x64 = np.concatenate([rng.standard_normal(200) * 10, ties])
    x32 = x64.astype(np.float32)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
    graph = helper.make_graph([node], "g", [
        helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x32.shape),
        helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, ()),
        helper.make_tensor_value_info("z", onnx.TensorProto.INT8, ())],
        [helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    ref = ReferenceEvaluator(model).run(None, {"x": x32, "s": np.float32(s), "z": np.int8(0)})[0]
    assert not np.array_equal(ref, np.clip(np.rint(x64 / s), -128, 127))  # the ties matter
    with jax.enable_x64():
        qt = jq.quantize(x64, np.float64(s))
        assert qt.qvalue.dtype == jnp.int8 and qt.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(qt.qvalue), ref)
        d = jq.dequantize(qt)
        assert d.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(d), (ref.astype(np.float32) * np.float32(s))
                                      .astype(np.float64))
        fq = jax.jit(jq.fake_quant)(x64, np.float64(s))
        assert fq.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(fq), np.asarray(d))
        gx, gs = jax.jit(jax.grad(lambda x, s: jnp.sum(jq.fake_quant(x, s)), argnums=(0, 1)))(
            jnp.asarray(x64), jnp.float64(s))
        assert gx.dtype == gs.dtype == jnp.float64


def test_half_precision_results_keep_the_input_dtype():
    dt = jnp.bfloat16
    x = _rand((4, 8), seed=8).astype(dt)
    s = jnp.asarray(0.05, dt)
    qt = jq.quantize(x, s)
    assert qt.dtype == dt and jq.dequantize(qt).dtype == dt
    assert jq.dequantize(qt, jnp.float32).dtype == jnp.float32
    fq = jax.jit(jq.fake_quant)(x, s)
    assert fq.dtype == dt and jax.jit(lambda x: jq.fake_quant(x, axis=0))(x).dtype == dt
    gx, gs = jax.jit(jax.grad(lambda x, s: jnp.sum(jq.fake_quant(x, s).astype(jnp.float32)),
                              argnums=(0, 1)))(x, s)
    assert gx.dtype == dt and gs.dtype == dt
    # the value is computed in float32 and rounded once to the input dtype
    ref = jq.dequantize(jq.quantize(x.astype(jnp.float32), s.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(fq), np.asarray(ref.astype(dt)))
