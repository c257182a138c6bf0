"""Packing on edge inputs: a NumPy bit-by-bit reference for every format and axis, scalars,
empty arrays, jit, and argument errors that name the argument."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

PACKABLE = {"int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "float4_e2m1fn": 4}


def _np_pack(fields, bits, axis):
    """ONNX's layout along ``axis``, one code at a time in int64: code i in byte i // per."""
    per, moved = 8 // bits, np.moveaxis(fields.astype(np.int64), axis, -1)
    out = np.zeros(moved.shape[:-1] + (-(-moved.shape[-1] // per),), np.int64)
    for i in range(moved.shape[-1]):
        out[..., i // per] |= moved[..., i] << (bits * (i % per))
    return np.moveaxis(out, -1, axis).astype(np.uint8)


@pytest.mark.parametrize("fmt", PACKABLE)
@pytest.mark.parametrize("shape", [(1,), (7,), (0,), (3, 0), (2, 0, 3), (4, 3, 5)])
def test_pack_matches_numpy_on_every_axis_under_jit(fmt, shape):
    bits = PACKABLE[fmt]
    fields = np.random.default_rng(len(shape)).integers(0, 1 << bits, shape).astype(np.uint8)
    unsigned = {2: ml_dtypes.uint2, 4: ml_dtypes.uint4}[bits]
    codes = jnp.asarray(fields.astype(unsigned).view(getattr(ml_dtypes, fmt)))
    for axis in range(-len(shape), len(shape)):
        expected = _np_pack(fields, bits, axis % len(shape))
        packed = jax.jit(lambda c, axis=axis: jq.pack(c, axis))(codes)
        np.testing.assert_array_equal(np.asarray(packed.data), expected)
        back = jax.jit(jq.unpack)(packed)
        assert back.dtype == codes.dtype and back.shape == shape
        np.testing.assert_array_equal(np.asarray(back).view(np.uint8) & ((1 << bits) - 1),
                                      fields)
        unpacked = jq.unpack_bits(jnp.asarray(expected), codes.dtype, shape[axis], axis)
        np.testing.assert_array_equal(np.asarray(unpacked).view(np.uint8) & ((1 << bits) - 1),
                                      fields)


def test_pack_scalar_names_the_problem():
    with pytest.raises(ValueError, match="codes must have at least one dimension"):
        jq.pack(jnp.zeros((), jnp.int4))
    with pytest.raises(ValueError, match="packed must have at least one dimension"):
        jq.unpack_bits(jnp.zeros((), jnp.uint8), jnp.int4, 1)


def test_pack_a_list_is_a_type_error_naming_the_format():
    with pytest.raises(TypeError, match=r"codes: only 2- and 4-bit formats are packed, got int32"):
        jq.pack([1, 2, 3])


def test_format_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"codes: only 2- and 4-bit formats .* got int8 \(8 bits\)"):
        jq.pack(jnp.zeros(4, jnp.int8))
    with pytest.raises(TypeError, match=r"dtype: only 2- and 4-bit formats .* got int8 \(8 bits\)"):
        jq.unpack_bits(jnp.zeros(4, jnp.uint8), jnp.int8, 4)


@pytest.mark.parametrize("length", [6.0, True, np.float32(6)])
def test_unpack_bits_length_must_be_an_int(length):
    with pytest.raises(TypeError, match=re.escape(f"length must be an int, got {length!r}")):
        jq.unpack_bits(jnp.zeros(3, jnp.uint8), jnp.int4, length)


def test_packed_array_by_hand_takes_the_dtype_shape_and_axis_forms_users_write():
    # `jnp.int4` (a scalar type), a list shape and a negative axis are the record's np.dtype,
    # tuple and non-negative axis: dequantize and qdot_general read them as jq.pack's own.
    codes = jnp.array([[1, -2, 3, 7, -8, 0], [0, 5, -1, 2, 4, -3]], jnp.int4)
    want = jq.pack(codes, axis=1)
    p = jq.PackedArray(jq.pack_bits(codes, axis=1), jnp.int4, [2, 6], -1)
    assert (p.dtype, p.shape, p.axis) == (np.dtype("int4"), (2, 6), 1)
    assert jax.tree.structure(p) == jax.tree.structure(want)
    scale = jnp.float32(0.5)
    np.testing.assert_array_equal(jq.dequantize(jq.QTensor(p, scale)),
                                  np.asarray(codes, np.float32) * 0.5)
    x = jnp.ones((3, 2), jnp.float32)
    np.testing.assert_array_equal(
        jq.qdot_general(x, jq.QTensor(p, scale), (((1,), (0,)), ((), ()))),
        x @ (np.asarray(codes, np.float32) * 0.5))


_BYTES = jnp.array([[0x21, 0x73, 0x08]], jnp.uint8)  # six int4 codes of one row


@pytest.mark.parametrize("args, error, message", [
    ((_BYTES, jnp.int8, (1, 6), 1), TypeError, r"PackedArray dtype: only 2- and 4-bit formats"),
    ((_BYTES, "nf4", (1, 6), 1), TypeError, r"PackedArray dtype: codebook nf4 codes are uint4"),
    ((_BYTES.astype(jnp.float32), jnp.int4, (1, 6), 1), TypeError,
     r"data must be a uint8 array of packed bytes, got float32"),
    ((np.asarray(_BYTES).tolist(), jnp.int4, (1, 6), 1), TypeError,
     r"data must be a uint8 array of packed bytes, got list"),
    ((_BYTES, jnp.int4, (1, 6), 5), ValueError, r"packed axis 5 is out of range .* \(1, 6\)"),
    ((_BYTES, jnp.int4, (6,), 0), ValueError,
     r"bytes of shape \(1, 3\) do not hold codes of shape \(6,\) .* expected bytes of shape "
     r"\(3,\)"),
    ((_BYTES, jnp.int4, (1, 100), 1), ValueError, r"expected bytes of shape \(1, 50\)"),
    ((_BYTES, jnp.int4, (1, 6.0), 1), TypeError, r"shape must be non-negative ints"),
    ((_BYTES, jnp.int4, (1, 6), 1, 4), TypeError, r"bits is for 6-bit codes held as uint8"),
])
def test_packed_array_by_hand_is_checked_on_construction(args, error, message):
    # Before: IndexError / OverflowError at first use, a wrongly shaped unpack, or a file
    # that save_safetensors wrote and load_safetensors then refused as corrupted.
    with pytest.raises(error, match=message):
        jq.PackedArray(*args)


def test_packed_array_six_bit_codes_by_hand():
    codes = jnp.array([[1, 63, 7, 0, 33]], jnp.uint8)
    from jaxquant._bits import pack_fields

    p = jq.PackedArray(pack_fields(codes, 6, 1), jnp.uint8, (1, 5), 1, 6)
    np.testing.assert_array_equal(p.unpack(), codes)


def test_vmap_out_axes_inside_packed_bytes_is_refused_where_padding_would_mix_axes():
    # before: vmap(pack, out_axes=1) over 4 rows of 5 int4 codes gave a PackedArray of
    # shape (3, 7) whose codes were garbage; the bytes came back with the batch axis where
    # the packed axis was counted
    codes = (jnp.arange(20, dtype=jnp.int8).reshape(4, 5) % 8).astype(jnp.int4)
    with pytest.raises(ValueError, match=r"3 bytes along the packed axis hold 1 padding"):
        jax.vmap(jq.pack, out_axes=1)(codes)
    got = jax.vmap(jq.pack)(codes)  # stacked in front: the supported way
    np.testing.assert_array_equal(np.asarray(got.unpack()), np.asarray(codes))


def test_vmap_over_an_axis_behind_the_packed_one_is_a_clear_error():
    # before: TypeError: 'NoneType' object is not iterable, from check_packed
    q = jq.pack(jq.quantize(jnp.linspace(-1, 1, 30).reshape(5, 6), dtype=jnp.int4), 0)
    in_axes = jax.tree.map(lambda a: 1 if a.ndim == 2 else None, q)
    with pytest.raises(ValueError, match=r"bytes of shape \(3,\) have no axis -2 .*in front "
                                         r"of the packed one only"):
        jax.vmap(jq.dequantize, in_axes=(in_axes,), out_axes=1)(q)
