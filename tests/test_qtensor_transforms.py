"""QTensor as a pytree under JAX transformations and ordinary user operations.

jit / vmap / scan / grad / eval_shape, tree utilities, copies, pickling, equality,
conversion to arrays, and stacked QTensors used outside the transformation that
stacked them. Expected values come from NumPy (codes times scales), never from
the code under test.
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant._packing import PackedArray

_RNG = np.random.default_rng(11)
DN = (((1,), (0,)), ((), ()))


def _f32(*shape):
    return jnp.asarray(_RNG.standard_normal(shape).astype(np.float32))


def _numpy_values(codes, scale, block):
    """float32 values (one IEEE product each, as ONNX) of int8 codes blocked along the
    last axis (NumPy only)."""
    s = np.repeat(np.asarray(scale, np.float32), block, axis=-1)[..., :codes.shape[-1]]
    return np.asarray(codes, np.float32) * s


# --- stacked QTensors (vmap / scan outputs) ---------------------------------------------------

STACKED_SPECS = [
    dict(axis=-1, block_size=32),  # one block per row: used to broadcast into wrong values
    dict(dtype="mxfp8_e4m3"),  # the same, e8m0 scales
    dict(axis=0),
    dict(),
    dict(axis=1, block_size=4),
    dict(dtype=jnp.int4, axis=-1, packed=True),
    dict(dtype="nvfp4"),
]


@pytest.mark.parametrize("kw", STACKED_SPECS, ids=str)
def test_stacked_qtensor_outside_vmap_is_a_clear_error(kw):
    """vmap(quantize) stacks per-layer QTensors whose metadata describe one layer;
    dequantize / qdot_general outside vmap must say so, not broadcast the scales wrong
    (silently wrong values for one block per row) or fail inside the kernel."""
    w = _f32(3, 4, 32)
    q = jax.vmap(lambda a: jq.quantize(a, **kw))(w)
    with pytest.raises(ValueError, match=r"qt\..*stacked by jax\.vmap"):
        jq.dequantize(q)
    with pytest.raises(ValueError, match=r"rhs\..*stacked by jax\.vmap"):
        jq.qdot_general(jnp.ones((2, 4)), q, (((1,), (1,)), ((), ())))
    # inside vmap, the same stack is fine
    assert jax.vmap(jq.dequantize)(q).shape == (3, 4, 32)


def test_stacked_blocked_qtensor_inside_vmap_and_scan_matches_numpy():
    w = _f32(3, 4, 32)
    q = jax.vmap(lambda a: jq.quantize(a, axis=-1, block_size=8))(w)
    assert q.qvalue.shape == (3, 4, 32) and q.scale.shape == (3, 4, 4)
    expected = _numpy_values(q.qvalue, q.scale, 8)
    np.testing.assert_array_equal(np.asarray(jax.vmap(jq.dequantize)(q)), expected)
    _, ys = jax.lax.scan(lambda c, qi: (c, qi.dequantize()), 0, q)
    np.testing.assert_array_equal(np.asarray(ys), expected)


def test_scan_over_a_stack_quantized_whole_is_a_clear_error():
    """Quantizing the (layers, in, out) stack at once along its last axis stores axis=2;
    scanning slices the leaves but not the metadata: a ValueError, not an IndexError."""
    q = jq.quantize(_f32(3, 4, 32), axis=2, block_size=8)
    with pytest.raises(ValueError, match=r"axis=2, block_size=8 do not fit codes of shape"):
        jax.lax.scan(lambda c, qi: (c, qi.dequantize()), 0, q)


@pytest.mark.parametrize("kw", [dict(axis=1), dict(dtype=jnp.int4, axis=0, block_size=8,
                                                    packed=True),
                                dict(dtype=jnp.uint8, axis=1, symmetric=False)], ids=str)
def test_scan_over_a_layer_stack_of_qtensors_matches_numpy(kw):
    """The common inference pattern: lax.scan over stacked layers whose weights are
    QTensors (made by vmap(quantize)), under jit."""
    w, x = _f32(3, 16, 16), _f32(5, 16)
    q = jax.vmap(lambda a: jq.quantize(a, **kw))(w)
    deq = np.asarray(jax.vmap(lambda qi: jq.unpack(qi).qvalue.astype(jnp.float32))(q), np.float64)
    zp = 0.0 if q.zero_point is None else np.asarray(q.zero_point, np.float64)[:, None, :]
    scale = np.asarray(q.scale, np.float64)
    scale = np.repeat(scale, 8, axis=1) if q.block_size else scale[:, None, :]
    weights = (deq - zp) * scale
    h = jax.jit(lambda x, q: jax.lax.scan(
        lambda h, qi: (jnp.tanh(jq.qdot_general(h, qi, DN)), None), x, q)[0])(x, q)
    ref = np.asarray(x, np.float64)
    for i in range(3):
        ref = np.tanh(ref @ weights[i])
    np.testing.assert_allclose(np.asarray(h), ref, rtol=1e-5, atol=1e-5)


def test_packed_storage_that_does_not_fit_is_refused_on_construction():
    data = jnp.zeros((4, 2), jnp.uint8)  # 6 int4 codes per row need 3 bytes
    with pytest.raises(ValueError, match=r"PackedArray data: packed bytes of shape \(4, 2\).*"
                                         r"expected bytes of shape \(4, 3\)"):
        jq.QTensor(PackedArray(data, np.dtype(jnp.int4), (4, 6), 1), jnp.ones(6), axis=1)


# --- gradients and tree maps ------------------------------------------------------------------

def test_gradient_qtensor_prints_and_is_refused_by_dequantize():
    codes = jnp.array([[1, -2, 3], [4, 5, -6]], jnp.int8)
    qt = jq.QTensor(codes, jnp.array([0.5, 0.25]), axis=0)
    g = jax.grad(lambda q: q.dequantize().sum(), allow_int=True)(qt)
    np.testing.assert_array_equal(np.asarray(g.scale), [2.0, 3.0])  # row sums of the codes
    assert "scale=" in repr(g)  # float0 codes: printed as a plain record, no exception
    with pytest.raises(TypeError, match="must hold codes of a quantized format"):
        jq.dequantize(g)
    as_floats = jax.tree.map(lambda a: a.astype(jnp.float32), qt)
    assert "qvalue=" in repr(as_floats)
    with pytest.raises(TypeError, match="got float32 and float32"):
        jq.dequantize(as_floats)


@pytest.mark.parametrize("make", [
    lambda c, s: jq.QTensor(c, s, axis=0),
    lambda c, s: jq.pack(jq.QTensor(c.astype(jnp.int4), s, axis=0)),
    lambda c, s: jq.QTensor(c.astype(jnp.float8_e4m3fn), s, axis=0),
], ids=["int8", "packed-int4", "float8"])
def test_grad_through_dequantize_wrt_scale_is_the_code_sums(make):
    codes = jnp.array([[1, -2, 3, 0], [4, 5, -6, 2]], jnp.int8)
    g = jax.grad(lambda s: jq.dequantize(make(codes, s)).sum())(jnp.array([0.5, 0.25]))
    np.testing.assert_array_equal(np.asarray(g), [2.0, 5.0])


# --- jit, copies, conversion ------------------------------------------------------------------

def test_jit_retraces_only_on_different_metadata():
    traces = []

    @jax.jit
    def f(q):
        traces.append(1)
        return q.dequantize()

    x = _f32(4, 8)
    f(jq.quantize(x, axis=0))
    f(jq.quantize(2 * x, axis=0))
    assert len(traces) == 1
    f(jq.quantize(x, axis=1))
    f(jq.QTensor(jnp.zeros((4, 8), jnp.int8), jnp.ones(4), axis=0, dtype=jnp.bfloat16))
    assert len(traces) == 3


@pytest.mark.parametrize("kw", [dict(dtype=jnp.int4, axis=0, packed=True), dict(dtype="nvfp4"),
                                dict(dtype="nf4", double_quant=True)], ids=str)
def test_copies_pickles_and_device_round_trips_are_bit_exact(kw):
    qt = jq.quantize(_f32(4, 64), **kw)
    ref = np.asarray(qt.dequantize())
    for other in (copy.deepcopy(qt), pickle.loads(pickle.dumps(qt)), jax.device_get(qt),
                  jax.device_put(qt), jax.block_until_ready(qt)):
        assert jq.is_qtensor(other) and other.nbytes == qt.nbytes
        np.testing.assert_array_equal(np.asarray(jq.dequantize(other)), ref)


def test_equality_and_hash_are_by_identity():
    qt = jq.quantize(_f32(4, 8), axis=0)
    twin = copy.deepcopy(qt)
    assert qt == qt and qt != twin  # no "truth value of an array is ambiguous"
    assert {qt: 1, twin: 2}[twin] == 2 and twin in [qt, twin]
    packed = jq.pack(jq.quantize(_f32(4, 8), dtype=jnp.int4))
    assert hash(packed) == hash(packed) and packed.qvalue != copy.deepcopy(packed.qvalue)


def test_conversion_to_an_array_is_refused_clearly():
    qt = jq.quantize(_f32(4, 8), axis=0)
    for convert in (jnp.asarray, np.asarray, jnp.array):
        with pytest.raises(TypeError, match=r"QTensor is not an array.*dequantize\(\)"):
            convert(qt)
    with pytest.raises(TypeError, match=r"QTensor is not an array"):
        jq.quantize(qt)


@pytest.mark.parametrize("dtype, shown", [(None, "None"), ("foo", "'foo'"),
                                          (jnp.int32, "int32")])
def test_constructor_dtype_must_be_a_float_dtype(dtype, shown):
    """``dtype=None`` used to become float64 (NumPy's default dtype)."""
    with pytest.raises(TypeError, match=f"dtype must be a float dtype, got {shown}"):
        jq.QTensor(jnp.zeros((2, 2), jnp.int8), jnp.ones(()), dtype=dtype)


@pytest.mark.parametrize("dtype", ["float6_e2m3fn", "float6_e3m2fn"])
def test_float6_is_refused_as_a_value_dtype(dtype):
    # float6 is a code format only: XLA has no float6 arrays to dequantize into
    q = jq.quantize(jnp.ones(4), dtype=jnp.int8)
    with pytest.raises(TypeError, match=f"dtype must be a float dtype XLA computes in, got {dtype}"):
        jq.QTensor(q.qvalue, q.scale, dtype=dtype)
    with pytest.raises(TypeError, match="float6 is a code format only"):
        jq.dequantize(q, dtype)


def test_float64_is_a_value_dtype():
    # regression: "float64".startswith("float6") refused float64 as if it were float6
    q = jq.quantize(jnp.ones(4), dtype=jnp.int8)
    assert jq.QTensor(q.qvalue, q.scale, dtype=np.float64).dtype == np.float64
