"""Sub-byte packing: int4/uint4/float4_e2m1fn two per byte, int2/uint2 four per byte,
6-bit codes (float6) four per three bytes.

The layout is ONNX's: along the packed axis, consecutive codes share a byte,
the first in the lowest bits (``byte = c0 | c1 << 4`` for 4-bit codes,
``c0 | c1 << 2 | c2 << 4 | c3 << 6`` for 2-bit codes). A partial last byte is
padded with zero bits. 6-bit codes continue the same little-endian bit stream
across bytes: four codes fill three bytes (``c0 | c1 << 6 | c2 << 12 | c3 <<
18``), a partial last group is padded with zero codes. ONNX packs the
flattened tensor, which is this layout along the last axis of a 1-D view;
`pack` can pack along any axis so that a weight matrix keeps its rows (for
sharding and for unpacking inside a dot).

This module holds the bit-level functions on arrays; `jaxquant._packing` holds the
`PackedArray` record and `pack` / `unpack`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jaxquant._args import as_array
from jaxquant._explicit_sharding import replicated_along
from jaxquant._formats import get_format
from jaxquant._granularity import normalize_axis

__all__ = ["pack_bits", "unpack_bits", "pack_fields", "unpack_fields", "sign_extend",
           "without_padding", "packed_length", "split_groups", "check_packable"]

_UNSIGNED = {2: jnp.uint2, 4: jnp.uint4}


def check_packable(dtype, argname: str) -> int:
    fmt = get_format(dtype, argname=argname)
    if fmt.is_codebook:  # "nf4" names a table, not the uint4 storage dtype of its codes
        raise TypeError(f"{argname}: codebook {fmt.name} codes are {fmt.dtype.name} indices; "
                        f"pass {fmt.dtype.name}.")
    if fmt.bits not in (2, 4):
        raise TypeError(f"{argname}: only 2- and 4-bit formats are packed, got {fmt.name} "
                        f"({fmt.bits} bits).")
    return fmt.bits


def _shifts(bits: int, ndim: int, axis: int) -> jax.Array:
    """Bit offsets ``0, bits, 2 * bits, ...`` laid along ``axis`` of a rank-``ndim`` array."""
    shape = [1] * ndim
    return jnp.arange(0, 8, bits, dtype=jnp.uint8).reshape(shape[:axis] + [8 // bits]
                                                            + shape[axis + 1:])


def packed_length(n: int, bits: int) -> int:
    """Bytes along the packed axis for ``n`` codes of ``bits`` bits (2, 4 or 6)."""
    return 3 * -(-n // 4) if bits == 6 else -(-n * bits // 8)


def split_groups(u: jax.Array, axis: int, size: int) -> jax.Array:
    """``u`` zero-padded along ``axis`` to a multiple of ``size``, split as ``(m, size)``."""
    n = u.shape[axis]
    m = -(-n // size)
    if m * size != n:
        pad = [(0, 0)] * u.ndim
        pad[axis] = (0, m * size - n)
        u = jnp.pad(u, pad)
    return u.reshape(u.shape[:axis] + (m, size) + u.shape[axis + 1:])


def _pack6(u: jax.Array, axis: int) -> jax.Array:
    g = split_groups(u, axis, 4)
    c = [lax.index_in_dim(g, i, axis + 1, keepdims=False) for i in range(4)]
    b = [c[0] | (c[1] << 6), (c[1] >> 2) | (c[2] << 4), (c[2] >> 4) | (c[3] << 2)]
    out = jnp.stack(b, axis=axis + 1)  # explicit lengths: -1 is ambiguous for empty arrays
    return out.reshape(out.shape[:axis] + (3 * out.shape[axis],) + out.shape[axis + 2:])


def _unpack6(packed: jax.Array, length: int, axis: int) -> jax.Array:
    m = packed.shape[axis]
    if m % 3 or not (m // 3 - 1) * 4 < length <= m // 3 * 4:
        raise ValueError(f"length {length} does not fit {m} bytes of 6-bit codes along axis "
                         f"{axis} (three bytes per four codes).")
    b = [lax.index_in_dim(split_groups(packed, axis, 3), i, axis + 1, keepdims=False)
         for i in range(3)]
    c = [b[0] & 63, (b[0] >> 6) | ((b[1] & 15) << 2), (b[1] >> 4) | ((b[2] & 3) << 4), b[2] >> 2]
    out = jnp.stack(c, axis=axis + 1)
    out = out.reshape(out.shape[:axis] + (4 * out.shape[axis],) + out.shape[axis + 2:])
    return without_padding(out, length, axis)


@functools.partial(jax.jit, static_argnames=("bits", "axis"))
def pack_fields(u: jax.Array, bits: int, axis: int) -> jax.Array:
    """Packs uint8 bit fields ``u`` (each ``< 2**bits``) along a non-negative ``axis``.

    The fast path: codes computed as 8-bit integers are packed without ever
    materializing a sub-byte array (``astype(jnp.int4)`` is several times
    slower on XLA:CPU than the same maths in bytes). Jitted: an eager call (`jaxquant.pack`)
    runs one program, not one dispatch per operation.
    """
    if bits == 6:
        return _pack6(u, axis)
    u = split_groups(u, axis, 8 // bits)
    # Disjoint bit fields: the sum is the bitwise or.
    return jnp.sum(u << _shifts(bits, u.ndim, axis + 1), axis=axis + 1, dtype=jnp.uint8)


@functools.partial(jax.jit, static_argnames=("bits", "length", "axis"))
def unpack_fields(packed: jax.Array, bits: int, length: int, axis: int) -> jax.Array:
    """Inverse of `pack_fields`: uint8 bit fields, ``length`` of them along ``axis``.

    Jitted, as `pack_fields`: an eager call runs one program, not one dispatch per operation.
    """
    if bits == 6:
        return _unpack6(packed, length, axis)
    per = 8 // bits
    m = packed.shape[axis]
    if not (m - 1) * per < length <= m * per:
        raise ValueError(f"length {length} does not fit {m} packed bytes of {per} codes along axis "
                         f"{axis}; expected a length in ({(m - 1) * per}, {m * per}].")
    shifts = _shifts(bits, packed.ndim + 1, axis + 1)
    u = (jnp.expand_dims(packed, axis + 1) >> shifts) & jnp.uint8((1 << bits) - 1)
    u = u.reshape(packed.shape[:axis] + (m * per,) + packed.shape[axis + 1:])
    return without_padding(u, length, axis)


def without_padding(u: jax.Array, length: int, axis: int) -> jax.Array:
    """The first ``length`` codes of ``u`` along ``axis``: the padding codes of the last byte
    dropped, from ``axis`` whole on every device where explicit mesh axes split it (JAX
    slices sharded axes only into lengths the shards divide)."""
    if length == u.shape[axis]:
        return u
    return lax.slice_in_dim(replicated_along(u, axis), 0, length, axis=axis)


def sign_extend(u: jax.Array, bits: int) -> jax.Array:
    """Two's-complement ``bits``-bit fields (uint8) as int8 values."""
    sign = jnp.int8(1 << (bits - 1))
    return (u.astype(jnp.int8) ^ sign) - sign


def pack_bits(codes: jax.Array, axis: int = -1) -> jax.Array:
    """Packs 2- or 4-bit codes into uint8 bytes along ``axis``.

    Args:
      codes: an array of int2/uint2/int4/uint4/float4_e2m1fn codes.
      axis: the axis along which consecutive codes share a byte.

    Returns:
      A uint8 array of ``codes``'s shape except ``ceil(n * bits / 8)`` along ``axis``.

    Raises:
      TypeError: if ``codes`` is not an array of a 2- or 4-bit format.
      ValueError: if ``codes`` is a scalar or ``axis`` is out of range.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> jq.pack_bits(jnp.array([1, -1, 7], jnp.int4))
      Array([241,   7], dtype=uint8)
    """
    codes = as_array(codes, "codes")
    bits = check_packable(codes.dtype, "codes")
    if codes.ndim == 0:
        raise ValueError("codes must have at least one dimension to be packed, got a scalar.")
    return _pack_codes(codes, bits, normalize_axis(axis, codes.ndim))


@functools.partial(jax.jit, static_argnames=("bits", "axis"))
def _pack_codes(codes: jax.Array, bits: int, axis: int) -> jax.Array:
    return pack_fields(lax.bitcast_convert_type(codes, _UNSIGNED[bits]).astype(jnp.uint8),
                       bits, axis)


def unpack_bits(packed: jax.Array, dtype: DTypeLike, length: int, axis: int = -1) -> jax.Array:
    """Unpacks bytes made by `pack_bits` back into codes.

    Args:
      packed: the uint8 array.
      dtype: the code format (int2, uint2, int4, uint4 or float4_e2m1fn).
      length: the logical length along ``axis`` (the padding is dropped).
      axis: the packed axis.

    Returns:
      The codes, of ``dtype``, bit for bit those that were packed.

    Raises:
      TypeError: if ``packed`` is not a uint8 array, ``dtype`` is not a 2- or 4-bit
        format (a codebook name included) or ``length`` is not an int.
      ValueError: if ``packed`` is a scalar or ``length`` does not fit the packed size.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> jq.unpack_bits(jnp.array([241, 7], jnp.uint8), jnp.int4, 3)
      Array([1, -1, 7], dtype=int4)
    """
    bits = check_packable(dtype, "dtype")
    packed = as_array(packed, "packed")
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype}.")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension, got a scalar.")
    if isinstance(length, bool | np.bool_) or not isinstance(length, int | np.integer):
        raise TypeError(f"length must be an int, got {length!r}.")
    return _unpack_codes(packed, np.dtype(dtype), bits, int(length),
                         normalize_axis(axis, packed.ndim))


@functools.partial(jax.jit, static_argnames=("dtype", "bits", "length", "axis"))
def _unpack_codes(packed: jax.Array, dtype: np.dtype, bits: int, length: int,
                  axis: int) -> jax.Array:
    u = unpack_fields(packed, bits, length, axis)
    return lax.bitcast_convert_type(u.astype(_UNSIGNED[bits]), dtype)
