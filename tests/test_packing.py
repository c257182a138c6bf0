"""Sub-byte packing: the ONNX byte layout, round trips on every axis, packed QTensors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

PACKABLE = ["int2", "uint2", "int4", "uint4", "float4_e2m1fn"]


def _random_codes(fmt, shape, seed=0):
    """Every bit pattern of the format, uniformly (numpy + ml_dtypes, not the library)."""
    bits = jq.get_format(fmt).bits
    raw = np.random.default_rng(seed).integers(0, 1 << bits, shape, dtype=np.uint8)
    unsigned = {2: ml_dtypes.uint2, 4: ml_dtypes.uint4}[bits]
    return raw.astype(unsigned).view(np.dtype(getattr(ml_dtypes, fmt)))


@pytest.mark.parametrize("fmt", PACKABLE)
# 4-bit: a full last byte (2, 8) or half of one (3, 33); 2-bit: the last byte holding
# 2 (2), 3 (3), 4 (8) or 1 (33, after full bytes) codes
@pytest.mark.parametrize("n", [2, 3, 8, 33])
def test_flat_layout_matches_onnx_serialization(fmt, n):
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    codes = _random_codes(fmt, (n,), seed=n)
    expected = np.frombuffer(numpy_helper.from_array(codes).raw_data, np.uint8)
    packed = np.asarray(jq.pack_bits(jnp.asarray(codes)))
    np.testing.assert_array_equal(packed, expected)
    back = numpy_helper.to_array(numpy_helper.from_array(codes))
    unpacked = np.asarray(jq.unpack_bits(jnp.asarray(expected), codes.dtype, n))
    np.testing.assert_array_equal(unpacked.view(np.uint8), back.view(np.uint8))
    del onnx


def test_first_element_in_low_bits():
    p = jq.pack_bits(jnp.array([1, 2], jnp.uint4))
    assert int(p[0]) == 1 | 2 << 4
    p = jq.pack_bits(jnp.array([1, 2, 3, 0], jnp.uint2))
    assert int(p[0]) == 1 | 2 << 2 | 3 << 4


# Every format on a rank-3 array (every axis: even, odd, first, interior, last); the 2-
# and 4-bit layouts also on a size-1 axis, a vector and a matrix.
ROUND_TRIPS = [(fmt, (2, 5, 3)) for fmt in PACKABLE] + [
    ("int4", (4, 1, 9)), ("int2", (4, 1, 9)), ("uint2", (5,)), ("float4_e2m1fn", (3, 7)),
]


@pytest.mark.parametrize("fmt,shape", ROUND_TRIPS)
def test_round_trip_every_axis_bit_exact(fmt, shape):
    codes = jnp.asarray(_random_codes(fmt, shape, seed=sum(shape)))
    per = 8 // jq.get_format(fmt).bits
    for axis in range(-len(shape), len(shape)):
        p = jq.pack(codes, axis=axis)
        assert p.data.dtype == jnp.uint8 and p.shape == codes.shape and p.dtype == codes.dtype
        assert p.data.shape[axis] == -(-shape[axis] // per)
        back = jq.unpack(p)
        assert back.dtype == codes.dtype
        np.testing.assert_array_equal(np.asarray(back).view(np.uint8),
                                      np.asarray(codes).view(np.uint8))


@pytest.mark.parametrize("fmt", ["int4", "uint4", "float4_e2m1fn", "int2", "uint2"])
def test_packed_qtensor_dequantizes_identically(fmt):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 11)).astype(np.float32))
    sym = not jq.get_format(fmt).is_integer or jq.get_format(fmt).signed
    qt = jq.quantize(x, dtype=fmt, axis=1, block_size=4, symmetric=sym)
    pq = jq.pack(qt)
    assert pq.packed and not qt.packed and pq.shape == qt.shape
    assert pq.qvalue.dtype == qt.qvalue.dtype
    np.testing.assert_array_equal(jq.dequantize(pq), jq.dequantize(qt))
    np.testing.assert_array_equal(jax.jit(jq.dequantize)(pq), jq.dequantize(qt))
    up = jq.unpack(pq)
    np.testing.assert_array_equal(np.asarray(up.qvalue).view(np.uint8),
                                  np.asarray(qt.qvalue).view(np.uint8))
    per = 8 // jq.get_format(fmt).bits
    assert pq.qvalue.nbytes == 5 * -(-11 // per)


def test_nbytes_counts_codes_at_bit_width():
    x = jnp.ones((64, 64), jnp.float32)
    assert jq.quantize(x, dtype=jnp.int8).nbytes == 64 * 64 + 4
    assert jq.quantize(x, dtype=jnp.int4, axis=1).nbytes == 64 * 32 + 64 * 4
    assert jq.pack(jq.quantize(x, dtype=jnp.int4, axis=1)).nbytes == 64 * 32 + 64 * 4
    assert jq.quantize(x, dtype=jnp.uint2, symmetric=False).nbytes == 64 * 16 + 4 + 1
    assert jq.quantize(x, dtype=jnp.int16, axis=0, block_size=32).nbytes == 64 * 64 * 2 + 64 * 2 * 4


def test_pack_errors():
    with pytest.raises(TypeError, match=r"only 2- and 4-bit formats are packed, got int8 \(8 bits\)"):
        jq.pack_bits(jnp.zeros(4, jnp.int8))
    with pytest.raises(TypeError, match="packed must be a uint8 array, got dtype int8"):
        jq.unpack_bits(jnp.zeros(4, jnp.int8), jnp.int4, 8)
    with pytest.raises(ValueError, match=r"length 9 does not fit 4 packed bytes.*\(6, 8\]"):
        jq.unpack_bits(jnp.zeros(4, jnp.uint8), jnp.int4, 9)
    with pytest.raises(ValueError, match="axis must be in"):
        jq.pack(jnp.zeros((2, 2), jnp.int4), axis=2)
    with pytest.raises(ValueError, match="at least one dimension"):
        jq.pack_bits(jnp.zeros((), jnp.int4))


def test_packed_array_is_a_pytree_through_jit():
    p = jq.pack(jnp.asarray(_random_codes("int4", (3, 5))))
    out = jax.jit(lambda p: p)(p)
    assert isinstance(out, jq.PackedArray) and out.shape == (3, 5) and out.axis == 1
    np.testing.assert_array_equal(out.data, p.data)


@pytest.mark.parametrize("fmt", ["int4", "uint2", "float6_e3m2fn"])
def test_pack_of_packed_codes_repacks_along_another_axis(fmt):
    # regression: pack(x, axis=0) of codes packed along axis 1 returned them as they were
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32))
    qt = jq.quantize(x, dtype=fmt, axis=0)
    bits = 6 if fmt.startswith("float6") else int(fmt[-1])
    along_1 = jq.pack(qt, axis=1)
    assert jq.pack(along_1, axis=-1).qvalue is along_1.qvalue  # already packed along it
    for packed in (jq.pack(along_1, axis=0), jax.jit(jq.pack, static_argnums=1)(along_1, 0)):
        assert packed.qvalue.axis == 0
        assert packed.qvalue.data.shape == (3 * -(-5 // 4) if bits == 6 else -(-5 * bits // 8), 7)
        np.testing.assert_array_equal(np.asarray(jq.unpack(packed).qvalue).view(np.uint8),
                                      np.asarray(qt.qvalue).view(np.uint8))
        np.testing.assert_array_equal(jq.dequantize(packed), jq.dequantize(qt))
    repacked = jq.pack(along_1.qvalue, axis=0)
    assert isinstance(repacked, jq.PackedArray) and repacked.axis == 0


# Every format and every granularity, the signed 2- and 4-bit formats in every granularity
# (the fast path's arithmetic does not depend on the granularity).
FAST_PATHS = [(fmt, gran) for fmt in ("int4", "int2")
              for gran in (dict(), dict(axis=0), dict(axis=1, block_size=4))] + [
    ("uint4", dict(axis=0)), ("uint2", dict(axis=1, block_size=4)), ("float4_e2m1fn", dict()),
    ("float4_e2m1fn", dict(axis=1, block_size=4)),
]


@pytest.mark.parametrize("fmt,gran", FAST_PATHS)
def test_quantize_packed_fast_path_equals_pack_of_quantize(fmt, gran):
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, 9)).astype(np.float32))
    sym = not jq.get_format(fmt).is_integer or jq.get_format(fmt).signed
    slow = jq.pack(jq.quantize(x, dtype=fmt, symmetric=sym, **gran))
    fast = jq.quantize(x, dtype=fmt, symmetric=sym, packed=True, **gran)
    assert fast.packed and fast.qvalue.axis == 1
    np.testing.assert_array_equal(fast.qvalue.data, slow.qvalue.data)
    np.testing.assert_array_equal(jq.dequantize(fast), jq.dequantize(jq.unpack(slow)))
    jitted = jax.jit(lambda x: jq.quantize(x, dtype=fmt, symmetric=sym, packed=True, **gran))(x)
    np.testing.assert_array_equal(jitted.qvalue.data, slow.qvalue.data)


def test_quantize_packed_rejects_wide_formats():
    with pytest.raises(ValueError, match="packed=True needs a 2-, 4- or 6-bit format and an input of rank >= 1, got int8"):
        jq.quantize(jnp.ones(4), dtype=jnp.int8, packed=True)


@pytest.mark.parametrize("dtype", ["float6_e3m2fn", "float6_e2m3fn", "int4", "int2"])
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0,)])
def test_packing_empty_arrays(dtype, shape):
    # NumPy: an empty array packs to an empty array; ceil(5 * bits / 8) bytes per row
    qt = jq.quantize(jnp.ones(shape), dtype=dtype, axis=None, packed=True)
    bits = 6 if dtype.startswith("float6") else int(dtype[-1])
    row = -(-shape[-1] // (24 // bits if bits == 6 else 8 // bits)) * (3 if bits == 6 else 1)
    assert qt.qvalue.data.shape == shape[:-1] + (row,)
    assert qt.dequantize().shape == shape
