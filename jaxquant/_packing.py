"""`PackedArray`, the record of sub-byte codes stored packed in uint8, and `pack` /
`unpack`, which move a code array or a `QTensor`'s codes in and out of it.

A `PackedArray` stands in for a code array inside a `QTensor`: its ``dtype`` is the
format and its ``shape`` the logical shape, so the QTensor invariants hold whether
the codes are packed or not. The bit layout is `jaxquant._bits`' (ONNX's).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._args import as_array
from jaxquant._bits import (
    check_packable,
    pack_bits,
    pack_fields,
    packed_length,
    sign_extend,
    unpack_bits,
    unpack_fields,
)
from jaxquant._formats import get_format
from jaxquant._granularity import Layout, normalize_axis
from jaxquant._shard_fit import check_shards_fit

__all__ = ["PackedArray", "pack", "unpack", "check_packed", "layers_of_packed"]


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
        hands over (a layer's in ``vmap``, a shard's in ``jax.shard_map``), so transforms
        may add or remove axes in front of the packed one only (``vmap`` ``in_axes`` /
        ``out_axes`` there), and split it into shards only where the bytes hold no padding
        (a ValueError otherwise).
      axis: the packed axis, non-negative (static).
      bits: the code width when ``dtype`` does not say it (6-bit codes held
        as uint8: float6); ``None`` otherwise (static).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> p = jq.pack(jnp.array([[1, -2, 3]], jnp.int4))
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
        if self.bits is None:  # names the field for an unknown or codebook format ("nf4")
            check_packable(self.dtype, "PackedArray dtype")
        ints = lambda v: int(v) if isinstance(v, np.integer) else v  # noqa: E731  (JSON, hash)
        a = ints(a)
        for k, v in (("dtype", jnp.dtype(self.dtype)), ("shape", tuple(map(ints, self.shape))),
                     ("axis", a + n if isinstance(a, int) and -n <= a < 0 else a)):
            object.__setattr__(self, k, v)
        check_record(self)

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
    last byte's padding codes and, with padding, the bytes along that axis): the shape
    follows from the bytes a transform hands over (layers stacked in front, shards of whole
    padding-free bytes)."""
    if p.shape is None:  # a tree map's leaves (specs, None) in place of the bytes
        return (p.data,), p._aux
    bits = p.bits or get_format(p.dtype).bits
    n, m = len(p.shape), p.shape[p.axis] if 0 <= p.axis < len(p.shape) else 0
    nbytes = packed_length(m, bits)
    pad = _codes_in(nbytes, bits) - m
    fits = getattr(p.data, "shape", None) == p.shape[:p.axis] + (nbytes,) + p.shape[p.axis + 1:]
    # bytes that do not fit the shape keep it, so that `check_packed` still sees the mismatch
    # the byte length only with padding: shards of padding-free bytes have the same metadata
    return (p.data,), (p.dtype, p.axis - n, p.bits, (pad, nbytes if pad else None),
                       None if fits else (p.shape, p.axis))


def _unflatten(aux, children) -> PackedArray:
    (dtype, back, bits, (pad, nbytes), stated), (data,) = aux, children
    p = object.__new__(PackedArray)
    shape, axis = stated or (None, None)
    dims = getattr(data, "shape", None)
    if stated is None and isinstance(dims, tuple) and dims:
        if len(dims) < -back:
            raise ValueError(f"packed codes: bytes of shape {dims} have no axis {back} (the "
                             f"packed axis, counted from the end); jax.vmap / jax.lax.scan "
                             f"may map over the axes in front of the packed one only.")
        axis = len(dims) + back
        if pad and nbytes is not None and dims[axis] != nbytes:
            raise ValueError(
                f"packed codes: {nbytes} bytes along the packed axis hold {pad} padding "
                f"code(s) in their last byte, and came back as {dims[axis]} (bytes of shape "
                f"{dims}): split across shards (jax.shard_map) every shard would end in "
                f"padding, mapped over (jax.vmap out_axes) the axes would be mixed up. Pack "
                f"along an axis whose length fills whole bytes, or do not split that axis.")
        count = _codes_in(dims[axis], bits or get_format(dtype).bits) - pad
        shape = dims[:axis] + (count,) + dims[axis + 1:]
    for k, v in zip(("data", "dtype", "shape", "axis", "bits", "_aux"),
                    (data, dtype, shape, axis, bits, aux), strict=True):
        object.__setattr__(p, k, v)
    return p


def layers_of_packed(data, dtype: np.dtype, shape: tuple[int, ...], axis: int,
                     bits: int | None) -> PackedArray:
    """A `PackedArray` of one layer's ``shape`` and ``axis`` over ``data`` that holds layers
    stacked along leading axes (as `jax.vmap` returns them), for a `QTensor` of such layers."""
    return _unflatten((np.dtype(dtype), axis - len(shape), bits, (0, None), (shape, axis)),
                      (data,))


_with_keys = lambda p: (((jax.tree_util.GetAttrKey("data"), p.data),), _flatten(p)[1])  # noqa: E731
jax.tree_util.register_pytree_with_keys(PackedArray, _with_keys, _unflatten, _flatten)


def check_record(p: PackedArray) -> None:
    """The invariants of a `PackedArray` built by hand: uint8 bytes of a 2- or 4-bit format
    (or uint8 codes with ``bits=6``) that fit its shape; a TypeError or ValueError naming the
    field, the expected and the received value."""
    if p.bits is not None and (p.bits != 6 or p.dtype != np.uint8):
        raise TypeError(f"PackedArray: bits is for 6-bit codes held as uint8 (bits=6, "
                        f"dtype=uint8); got bits={p.bits!r} with dtype {p.dtype}.")
    data_dtype = getattr(p.data, "dtype", None)
    if data_dtype is None or np.dtype(data_dtype) != np.uint8:
        raise TypeError(f"PackedArray: data must be a uint8 array of packed bytes, got "
                        f"{data_dtype or type(p.data).__name__}.")
    def concrete(d):
        return isinstance(d, int | np.integer) and d >= 0

    # `jax.export`'s symbolic dimensions (a batch of any size) may stand for unpacked axes
    if isinstance(p.axis, bool) or not isinstance(p.axis, int | np.integer) \
            or not all(concrete(d) or jax.export.is_symbolic_dim(d) for d in p.shape) \
            or (0 <= p.axis < len(p.shape) and not concrete(p.shape[p.axis])):
        raise TypeError(f"PackedArray: shape must be non-negative ints (symbolic dimensions "
                        f"allowed but along the packed axis) and axis an int; got "
                        f"shape={p.shape!r}, axis={p.axis!r}.")
    check_packed(p, "PackedArray data")


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
      A `QTensor` of layers stacked by ``jax.vmap`` / ``lax.scan`` (a scanned model's) is
      packed layer by layer, ``axis`` counted within a layer.

    Raises:
      TypeError: ``x`` not an array, or of a format wider than 4 bits (6-bit float6
        QTensors are packed four codes per three bytes).
      ValueError: for a scalar, ``axis`` out of range, codes explicitly sharded
        along ``axis`` so that a byte would straddle two devices, or (concrete) 6-bit
        codebook codes of 64 or more (traced ones are cut to their low 6 bits).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> qt = jq.quantize(jnp.linspace(-1, 1, 5), dtype=jnp.int4)
      >>> jq.pack(qt).nbytes, qt.nbytes
      (7, 7)
    """
    if hasattr(x, "qvalue"):  # a QTensor, of stacked layers too: one layer at a time
        return _layer_by_layer(lambda q: _pack_codes_of(q, axis), x)
    if isinstance(x, PackedArray):  # repacked only along another axis
        if normalize_axis(axis, x.ndim) == x.axis:
            return x
        return _pack_six(x.unpack(), axis, x.dtype.name) if x.bits else pack(x.unpack(), axis)
    x = as_array(x, "x")
    if x.ndim:
        check_shards_fit(x, Layout("tensor"), 8 // math.gcd(8, check_packable(x.dtype, "codes")),
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
      were packed); for a packed `QTensor` (of stacked layers too, as `pack` takes them),
      the same record with those codes as ``qvalue``; anything else unchanged.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> c = jnp.array([1, -2, 3], jnp.int4)
      >>> bool((jq.unpack(jq.pack(c)) == c).all())
      True
    """
    if isinstance(x, PackedArray):
        return x.unpack()
    if hasattr(x, "qvalue") and isinstance(x.qvalue, PackedArray):
        return _layer_by_layer(lambda q: dataclasses.replace(q, qvalue=q.qvalue.unpack()), x)
    return x


def _pack_codes_of(qt, axis: int):
    """One layer's QTensor with its codes packed along ``axis`` (see `pack`)."""
    if qt.format.bits == 6 and not isinstance(qt.qvalue, PackedArray):  # float6 codebooks
        return dataclasses.replace(qt, qvalue=_pack_six(qt.qvalue, axis, qt.format.name))
    return dataclasses.replace(qt, qvalue=pack(qt.qvalue, axis))


def _layer_by_layer(fn, qt):
    """`jaxquant._leaves.layer_by_layer` (that module imports this one)."""
    from jaxquant._leaves import layer_by_layer

    return layer_by_layer(fn, qt)
