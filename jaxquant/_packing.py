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

`PackedArray` is the storage record. It stands in for a code array inside a
`QTensor`: its ``dtype`` is the format and its ``shape`` the logical shape, so
the QTensor invariants hold whether the codes are packed or not.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jaxquant._args import as_array
from jaxquant._formats import get_format
from jaxquant._granularity import Layout, normalize_axis
from jaxquant._shard_fit import check_shards_fit

__all__ = ["PackedArray", "pack", "unpack", "pack_bits", "unpack_bits", "pack_fields",
           "unpack_fields", "sign_extend", "packed_length", "split_groups", "check_packed"]

_UNSIGNED = {2: jnp.uint2, 4: jnp.uint4}


def _check_packable(dtype, argname: str) -> int:
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
    return lax.slice_in_dim(out, 0, length, axis=axis)


def pack_fields(u: jax.Array, bits: int, axis: int) -> jax.Array:
    """Packs uint8 bit fields ``u`` (each ``< 2**bits``) along a non-negative ``axis``.

    The fast path: codes computed as 8-bit integers are packed without ever
    materializing a sub-byte array (``astype(jnp.int4)`` is several times
    slower on XLA:CPU than the same maths in bytes).
    """
    if bits == 6:
        return _pack6(u, axis)
    u = split_groups(u, axis, 8 // bits)
    # Disjoint bit fields: the sum is the bitwise or.
    return jnp.sum(u << _shifts(bits, u.ndim, axis + 1), axis=axis + 1, dtype=jnp.uint8)


def unpack_fields(packed: jax.Array, bits: int, length: int, axis: int) -> jax.Array:
    """Inverse of `pack_fields`: uint8 bit fields, ``length`` of them along ``axis``."""
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
    return lax.slice_in_dim(u, 0, length, axis=axis)


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
      ValueError: if ``axis`` is out of range.

    Example:
      >>> pack_bits(jnp.array([1, -1, 7], jnp.int4))
      Array([241,   7], dtype=uint8)
    """
    codes = as_array(codes, "codes")
    bits = _check_packable(codes.dtype, "codes")
    if codes.ndim == 0:
        raise ValueError("codes must have at least one dimension to be packed, got a scalar.")
    axis = normalize_axis(axis, codes.ndim)
    u = lax.bitcast_convert_type(codes, _UNSIGNED[bits]).astype(jnp.uint8)
    return pack_fields(u, bits, axis)


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
      >>> unpack_bits(jnp.array([241, 7], jnp.uint8), jnp.int4, 3)
      Array([1, -1, 7], dtype=int4)
    """
    bits = _check_packable(dtype, "dtype")
    packed = as_array(packed, "packed")
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype}.")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension, got a scalar.")
    if isinstance(length, bool | np.bool_) or not isinstance(length, int | np.integer):
        raise TypeError(f"length must be an int, got {length!r}.")
    axis = normalize_axis(axis, packed.ndim)
    u = unpack_fields(packed, bits, length, axis)
    return lax.bitcast_convert_type(u.astype(_UNSIGNED[bits]), dtype)


@dataclasses.dataclass(frozen=True, eq=False)  # holds an array: identity eq/hash
class PackedArray:
    """Sub-byte codes stored packed in uint8, standing in for the code array.

    Invariants: ``data.dtype == uint8``; ``data.shape`` equals ``shape`` except
    ``packed_length(shape[axis], bits)`` along ``axis``; ``unpack()`` returns
    codes of ``dtype`` and ``shape`` bit for bit.

    Attributes:
      data: the packed bytes (the only array child).
      dtype: the code format (static).
      shape: the logical, unpacked shape (static); rebuilt from the bytes a transform
        hands over (a layer's in ``vmap``, a shard's in ``jax.shard_map``).
      axis: the packed axis, non-negative (static).
      bits: the code width when ``dtype`` does not say it (6-bit codes held
        as uint8: float6); ``None`` otherwise (static).

    Example:
      >>> p = pack(jnp.array([[1, -2, 3]], jnp.int4))
      >>> p.shape, p.dtype, p.data.shape, p.nbytes
      ((1, 3), dtype(int4), (1, 2), 2)
    """

    data: jax.Array
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    bits: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):  # `jnp.int4`, `[1, 6]`, `-1` in the forms the records hold
        n, a = len(self.shape), self.axis
        for k, v in (("dtype", np.dtype(self.dtype)), ("shape", tuple(self.shape)),
                     ("axis", a + n if isinstance(a, int | np.integer) and -n <= a < 0 else a)):
            object.__setattr__(self, k, v)

    @property
    def ndim(self) -> int:
        """The logical rank."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The logical number of codes."""
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        """Bytes of storage actually held."""
        return int(np.prod(self.data.shape))

    def unpack(self) -> jax.Array:
        """The codes as an array of ``dtype`` and ``shape``."""
        if self.bits:
            return unpack_fields(self.data, self.bits, self.shape[self.axis], self.axis)
        return unpack_bits(self.data, self.dtype, self.shape[self.axis], self.axis)

    def unpack_float32(self) -> jax.Array:
        """The codes' values as float32, without a sub-byte intermediate for integer formats."""
        fmt = get_format(self.dtype)
        if not fmt.is_integer or self.bits:
            return self.unpack().astype(jnp.float32)
        u = unpack_fields(self.data, fmt.bits, self.shape[self.axis], self.axis)
        return (sign_extend(u, fmt.bits) if fmt.signed else u).astype(jnp.float32)


def _codes_in(nbytes: int, bits: int) -> int:
    """How many codes ``nbytes`` bytes along the packed axis hold, padding included."""
    return nbytes // 3 * 4 if bits == 6 else nbytes * (8 // bits)


def _flatten(p: PackedArray):
    """The bytes, and metadata without the shape (the packed axis counted from the end, the
    last byte's padding codes): the shape follows from the bytes a transform hands over."""
    if p.shape is None:  # a tree map's leaves (specs, None) in place of the bytes
        return (p.data,), p._aux
    bits = p.bits or get_format(p.dtype).bits
    n, m = len(p.shape), p.shape[p.axis] if 0 <= p.axis < len(p.shape) else 0
    pad = _codes_in(packed_length(m, bits), bits) - m
    fits = getattr(p.data, "shape", None) == p.shape[:p.axis] + (packed_length(m, bits),) \
        + p.shape[p.axis + 1:]
    # bytes that do not fit the shape keep it, so that `check_packed` still sees the mismatch
    return (p.data,), (p.dtype, p.axis - n, p.bits, pad, None if fits else (p.shape, p.axis))


def _unflatten(aux, children) -> PackedArray:
    (dtype, back, bits, pad, stated), (data,) = aux, children
    p = object.__new__(PackedArray)
    shape, axis = stated or (None, None)
    dims = getattr(data, "shape", None)
    if stated is None and isinstance(dims, tuple) and len(dims) >= -back:
        axis = len(dims) + back
        count = _codes_in(dims[axis], bits or get_format(dtype).bits) - pad
        shape = dims[:axis] + (count,) + dims[axis + 1:]
    for k, v in zip(("data", "dtype", "shape", "axis", "bits", "_aux"),
                    (data, dtype, shape, axis, bits, aux), strict=True):
        object.__setattr__(p, k, v)
    return p


_with_keys = lambda p: (((jax.tree_util.GetAttrKey("data"), p.data),), _flatten(p)[1])  # noqa: E731
jax.tree_util.register_pytree_with_keys(PackedArray, _with_keys, _unflatten, _flatten)


def check_packed(p: PackedArray, argname: str = "qvalue", hint: str = "") -> None:
    """A ValueError (naming ``argname``, the expected and the received shapes) when the
    bytes of ``p`` do not hold codes of ``p.shape`` packed along ``p.axis``.

    Args:
      p: the `PackedArray` (its ``data`` may be abstract: only shapes are read).
      argname: the argument to name.
      hint: appended to the message.

    Raises:
      ValueError: ``p.axis`` out of range, or ``data`` of another shape.
    """
    shape, axis = tuple(p.shape), p.axis
    if not 0 <= axis < len(shape):
        raise ValueError(f"{argname}: packed axis {axis} is out of range for codes of shape "
                         f"{shape}.{hint}")
    bits = p.bits or get_format(p.dtype).bits
    want = shape[:axis] + (packed_length(shape[axis], bits),) + shape[axis + 1:]
    if tuple(p.data.shape) != want:
        raise ValueError(f"{argname}: packed bytes of shape {tuple(p.data.shape)} do not hold "
                         f"codes of shape {shape} packed along axis {axis}; expected bytes of "
                         f"shape {want}.{hint}")


def _six_bit_fields(codes: jax.Array, name: str) -> jax.Array:
    """uint8 codebook ``codes`` checked (when concrete: a ValueError for codes of 64 or
    more, whose high bits would land in the neighbouring field) or masked (traced) to 6 bits."""
    if not isinstance(codes, jax.core.Tracer) and codes.size and (top := int(codes.max())) >= 64:
        raise ValueError(f"x: {name} codes are 6-bit indices (0 to 63), got a largest code "
                         f"{top}; packed four in three bytes it would change its neighbour.")
    return codes & jnp.uint8(63)  # traced: a code never spills into its neighbour's bits


def _pack_six(codes: jax.Array, axis: int, name: str) -> PackedArray:
    """uint8 codebook ``codes`` packed four per three bytes along ``axis``."""
    if codes.ndim == 0:  # the message of pack_bits
        raise ValueError("codes must have at least one dimension to be packed, got a scalar.")
    a = normalize_axis(axis, codes.ndim)
    check_shards_fit(codes, Layout("tensor"), 4, pack_axis=a, name="codes",
                     unpacked="another axis of pack")
    data = pack_fields(_six_bit_fields(codes, name), 6, a)
    return PackedArray(data, np.dtype(codes.dtype), tuple(codes.shape), a, 6)


def pack(x, axis: int = -1):
    """Packs codes, or the codes of a `QTensor`, into sub-byte storage.

    Args:
      x: a code array (2- or 4-bit format) or a `QTensor` of such a format.
      axis: the axis along which codes share bytes.

    Returns:
      A `PackedArray`, or for a `QTensor` the same record with a `PackedArray`
      as ``qvalue`` (``dequantize`` unpacks it). Codes already packed along ``axis`` are
      returned as they are; packed along another axis, they are repacked along ``axis``.

    Raises:
      TypeError: ``x`` not an array, or of a format wider than 4 bits (6-bit float6
        QTensors are packed four codes per three bytes).
      ValueError: for a scalar, ``axis`` out of range, codes explicitly sharded
        along ``axis`` so that a byte would straddle two devices, or (concrete) 6-bit
        codebook codes of 64 or more (traced ones are cut to their low 6 bits).

    Example:
      >>> import jaxquant as jq
      >>> qt = jq.quantize(jnp.linspace(-1, 1, 5), dtype=jnp.int4)
      >>> jq.pack(qt).nbytes, qt.nbytes
      (7, 7)
    """
    if hasattr(x, "qvalue"):  # a QTensor
        if x.format.bits == 6 and not isinstance(x.qvalue, PackedArray):  # float6 codebooks
            return dataclasses.replace(x, qvalue=_pack_six(x.qvalue, axis, x.format.name))
        return dataclasses.replace(x, qvalue=pack(x.qvalue, axis))
    if isinstance(x, PackedArray):  # repacked only along another axis
        if normalize_axis(axis, x.ndim) == x.axis:
            return x
        return _pack_six(x.unpack(), axis, x.dtype.name) if x.bits else pack(x.unpack(), axis)
    x = as_array(x, "x")
    if x.ndim:
        check_shards_fit(x, Layout("tensor"), 8 // math.gcd(8, _check_packable(x.dtype, "codes")),
                         pack_axis=normalize_axis(axis, x.ndim), name="codes",
                         unpacked="another axis of pack")
    data = pack_bits(x, axis)  # checks the format and the rank first
    return PackedArray(data, np.dtype(x.dtype), tuple(x.shape), normalize_axis(axis, x.ndim))


def unpack(x):
    """Inverse of `pack`: a `PackedArray` to codes, a packed `QTensor` to an unpacked one.

    Arrays and unpacked QTensors are returned as they are.

    Args:
      x: a `PackedArray`, a `QTensor`, or an array.

    Returns:
      The codes of a `PackedArray` (its ``dtype`` and ``shape``, bit for bit those that
      were packed); for a packed `QTensor`, the same record with those codes as
      ``qvalue``; anything else unchanged.

    Example:
      >>> c = jnp.array([1, -2, 3], jnp.int4)
      >>> bool((unpack(pack(c)) == c).all())
      True
    """
    if isinstance(x, PackedArray):
        return x.unpack()
    if hasattr(x, "qvalue") and isinstance(x.qvalue, PackedArray):
        return dataclasses.replace(x, qvalue=x.qvalue.unpack())
    return x
