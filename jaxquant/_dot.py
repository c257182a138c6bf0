"""Quantized dot products: `qdot_general` and the `QDotGeneral` callable (`qeinsum`: `_einsum`).

A `QTensor` operand (the weight) is multiplied in one of two ways:

* **int8 x int8 -> int32** (``act_quant=ActQuant()``, "W8A8", this module): the
  float operand is quantized on the fly to symmetric int8, ``lax.dot_general``
  multiplies the codes with ``preferred_element_type=jnp.int32`` and both scales
  multiply the int32 result. The weight's scale must be constant along the
  contraction: per-tensor, per-axis on a non-contracting axis, or blocked along
  the single contracting axis, which is then split into ``(n_blocks, block)``:
  one batched int dot, each block's int32 partial sum scaled, then the blocks
  summed. Zero points (and unsigned codes, shifted to int8) are exact in int32:
  ``sum_k a_k (w_k - z) = sum_k a_k w_k - z sum_k a_k``. The int32 sums are
  exact while ``K * 127 * max|w - z| < 2**31`` (``K`` up to 66,000 for any
  8-bit codes, 132,000 for symmetric int8).
* **weight-only** (``act_quant=None``, `jaxquant._weight_only`): the weight is
  dequantized inside the jitted dot and multiplied in float.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jaxquant._barriers import gemm_operand
from jaxquant._formats import get_format
from jaxquant._granularity import expand, normalize_axis
from jaxquant._packing import PackedArray, sign_extend, split_groups, unpack_fields
from jaxquant._qtensor import QTensor, is_qtensor, scale_values
from jaxquant._rounding import divide, round_to_codes
from jaxquant._scales import scale_from_range
from jaxquant._weight_only import weight_only_dot

__all__ = ["ActQuant", "QDotGeneral", "qdot_general", "promote_dtype"]

_INT8 = get_format(jnp.int8)
_SIDES = ("lhs", "rhs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActQuant:
    """Dynamic symmetric int8 quantization of the float operand of a quantized dot.

    Scale ``absmax / 127`` (all zeros: 1) computed on every call, codes
    ``clip(round_half_even(x / scale), -127, 127)``.

    Attributes:
      granularity: ``"token"``: one scale per row, that is per index of the
        non-contracting dimensions; ``"tensor"``: one scale for the operand.

    Raises:
      ValueError: an unknown granularity.

    Example:
      >>> ActQuant()
      ActQuant(granularity='token')
    """

    granularity: Literal["token", "tensor"] = "token"

    def __post_init__(self):
        if self.granularity not in ("token", "tensor"):
            raise ValueError(f"granularity must be 'token' or 'tensor', got "
                             f"{self.granularity!r}.")


_is_q = is_qtensor


def _check_dims(dimension_numbers, ndims) -> tuple:
    """``((lc, rc), (lb, rb))`` as tuples of non-negative ints, or a ValueError."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(f"dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                         f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}.") from None
    out = []
    for name, pair in (("contracting", (lc, rc)), ("batch", (lb, rb))):
        pair = tuple(tuple(normalize_axis(int(d), ndims[i], f"{_SIDES[i]} {name} dimension")
                           for d in pair[i]) for i in (0, 1))
        if len(pair[0]) != len(pair[1]):
            raise ValueError(f"lhs and rhs must have as many {name} dimensions, got "
                             f"{pair[0]} and {pair[1]}.")
        out.append(pair)
    return tuple(out)


def promote_dtype(*args, dtype: DTypeLike | None = None, inexact: bool = True):
    """Flax's ``promote_dtype``, letting `QTensor` operands through unchanged.

    Arrays are cast to ``dtype``, or to the promoted dtype of the arrays and the
    QTensors' ``dtype``. Pass as ``promote_dtype=`` to ``flax.linen.Dense``
    (called with the arrays) or ``flax.nnx.Linear`` (called with one tuple).

    Args:
      *args: arrays, QTensors or ``None``; or a single tuple of them (nnx).
      dtype: the dtype to cast to, or ``None`` to infer it.
      inexact: accepted for Flax compatibility.

    Returns:
      A list (a tuple for a tuple argument) of the arguments.

    Example:
      >>> import jaxquant as jq
      >>> x, w = promote_dtype(jnp.ones(2, jnp.bfloat16), jq.quantize(jnp.ones((2, 2))))
      >>> x.dtype, type(w).__name__
      (dtype('float32'), 'QTensor')
    """
    del inexact
    as_tuple = len(args) == 1 and isinstance(args[0], tuple)
    items = args[0] if as_tuple else args
    if dtype is None:
        dts = [x.dtype if _is_q(x) else jnp.asarray(x).dtype for x in items if x is not None]
        with jax.numpy_dtype_promotion("standard"):
            dtype = functools.reduce(jnp.promote_types, dts, np.dtype(dts[0] if dts else "f4"))
    out = [x if x is None or _is_q(x) else jnp.asarray(x, dtype) for x in items]
    return tuple(out) if as_tuple else out


# ----------------------------------------------------------------------------- int8 path


def _check_int_operand(qt: QTensor, contract: tuple, name: str) -> None:
    fmt, layout = qt.format, qt.layout
    alt = "or pass act_quant=None for a weight-only dot."
    if not fmt.is_integer or fmt.bits > 8:
        raise ValueError(f"the int8 x int8 path needs {name} codes of an integer format of at "
                         f"most 8 bits, got {fmt.name}; {alt}")
    if layout.kind == "tile":
        raise ValueError(f"the int8 x int8 path does not take tiled scales ({name} has tiles "
                         f"{layout.block_size}); {alt}")
    if layout.kind == "axis" and layout.axis in contract:
        raise ValueError(
            f"the int8 x int8 path needs {name}'s scale to be constant along the contracting "
            f"dimensions {contract}, but {name} is quantized per-axis along axis {layout.axis}, "
            f"which is contracted; quantize along a non-contracting axis (axis=-1 for an "
            f"(in, out) kernel), {alt}")
    if layout.kind == "block" and contract != (layout.axis,):
        raise ValueError(
            f"the int8 x int8 path supports a blocked {name} only when its blocked axis is the "
            f"single contracting dimension; {name} is blocked along axis {layout.axis} "
            f"(block_size={layout.block_size}) and the contracting dimensions are {contract}; "
            f"{alt}")


def _int_operand(op, contract: tuple, act_quant: ActQuant):
    """``(int8 codes, float32 scale, int32 zero point or None)``, each of ``op``'s rank.

    Scales and zero points have size 1 along ``contract``, except a blocked
    QTensor's, which keep their ``n_blocks`` entries along the contracting axis.
    """
    n = op.ndim
    if not _is_q(op):
        x = op.astype(jnp.float32)
        axes = contract if act_quant.granularity == "token" else tuple(range(n))
        # One reduction of |x| (activations are small: two reductions cost more dispatch).
        amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
        scale, _ = scale_from_range(amax, amax, _INT8, True)
        return round_to_codes(divide(x, scale), None, _INT8), scale, None
    fmt, layout, codes = op.format, op.layout, op.qvalue
    offset = 0 if fmt.signed else 1 << (fmt.bits - 1)  # unsigned u -> int8 u - offset
    if isinstance(codes, PackedArray):
        u = unpack_fields(codes.data, fmt.bits, codes.shape[codes.axis], codes.axis)
        q = sign_extend(u, fmt.bits) if fmt.signed else u.astype(jnp.int8) - jnp.int8(offset)
    elif fmt.bits == 8 and offset:  # u - 128 is u ^ 0x80 read as int8
        q = lax.bitcast_convert_type(codes ^ jnp.uint8(128), jnp.int8)
    else:
        q = codes.astype(jnp.int8) - jnp.int8(offset)

    def like_scale(v):
        if layout.kind == "tensor":
            return v.reshape((1,) * n)
        return expand(v, op.shape, layout) if layout.kind == "axis" else v

    zp = op.zero_point
    if zp is not None:
        zp = like_scale(zp.astype(jnp.int32) - jnp.int32(offset))
    elif offset:
        zp = jnp.full((1,) * n, -offset, jnp.int32)
    return q, like_scale(scale_values(op)), zp


def _to_output(v: jax.Array, contract: tuple, batch: tuple, side: int, n_other_free: int):
    """An operand-rank array of size 1 along ``contract``, laid out as the dot's output."""
    free = tuple(d for d in range(v.ndim) if d not in contract and d not in batch)
    v = jnp.transpose(v, batch + free + contract)
    v = v.reshape(v.shape[:len(batch) + len(free)])
    nb, ones = len(batch), (1,) * n_other_free
    return v.reshape(v.shape + ones if side == 0 else v.shape[:nb] + ones + v.shape[nb:])


def _int_dot(ops, dims, act_quant, out_dtype, out_sharding):
    block = {op.block_size for op in ops if _is_q(op) and op.block_size}
    parts = [_int_operand(op, dims[0][i], act_quant) for i, op in enumerate(ops)]
    return int_dot_parts(parts, dims, block.pop() if block else None, out_dtype, out_sharding)


def int_dot_parts(parts, dims, block, out_dtype, out_sharding):
    """The int8 x int8 -> int32 dot of two ``(codes, scale, zero point)`` from `_int_operand`.

    ``block``: the block size of a blocked operand (its contracting axis), or ``None``.
    """
    contract, batch = dims
    if block:  # the contracting axis k becomes (k: a batch axis of blocks, k + 1: contracted)
        b, ks = block, [c[0] for c in contract]
        parts = [(split_groups(q, k, b), jnp.expand_dims(s, k + 1),
                  None if z is None else jnp.expand_dims(z, k + 1))
                 for (q, s, z), k in zip(parts, ks, strict=True)]
        batch = tuple(tuple(d + (d > k) for d in bt) + (k,) for bt, k in zip(batch, ks,
                                                                           strict=True))
        contract = tuple((k + 1,) for k in ks)
    nfree = [p[0].ndim - len(c) - len(bt) for p, c, bt in zip(parts, contract, batch,
                                                              strict=True)]
    acc = lax.dot_general(gemm_operand(parts[0][0]), gemm_operand(parts[1][0]), (contract, batch),
                          preferred_element_type=jnp.int32,
                          out_sharding=None if block else out_sharding)

    def out(v, i):
        return _to_output(v, contract[i], batch[i], i, nfree[1 - i])

    for i in (0, 1):
        if parts[i][2] is not None:  # sum_k a_k (w_k - z) = a.w - z sum_k a_k
            rowsum = jnp.sum(parts[1 - i][0], axis=contract[1 - i], keepdims=True,
                             dtype=jnp.int32)
            acc = acc - out(parts[i][2], i) * out(rowsum, 1 - i)
    y = acc.astype(jnp.float32) * out(parts[0][1], 0) * out(parts[1][1], 1)
    if block:
        y = jnp.sum(y, axis=len(batch[0]) - 1)
    return y.astype(out_dtype)


# ----------------------------------------------------------------------------- public API


@functools.partial(jax.jit, static_argnames=("dims", "precision", "preferred_element_type",
                                             "out_sharding", "act_quant"))
def _qdot(lhs, rhs, dims, precision, preferred_element_type, out_sharding, act_quant):
    if act_quant is None:
        return weight_only_dot(lhs, rhs, dims, precision, preferred_element_type, out_sharding)
    floats = [op.dtype for op in (lhs, rhs) if not _is_q(op)]
    with jax.numpy_dtype_promotion("standard"):
        out_dtype = preferred_element_type or (floats[0] if floats else
                                               jnp.promote_types(lhs.dtype, rhs.dtype))
    return _int_dot((lhs, rhs), dims, act_quant, out_dtype, out_sharding)


def qdot_general(
    lhs: ArrayLike | QTensor,
    rhs: ArrayLike | QTensor,
    dimension_numbers,
    precision=None,
    preferred_element_type: DTypeLike | None = None,
    *,
    out_sharding=None,
    act_quant: ActQuant | None = None,
) -> jax.Array:
    """``jax.lax.dot_general`` where either operand (or both) may be a `QTensor`.

    ``act_quant=None``: weight-only, the QTensor is dequantized inside the jitted
    dot (any format and layout, packed or not, zero points). An `ActQuant`: the
    float operand is quantized to int8 on the fly and the dot runs as
    int8 x int8 -> int32 (layouts: see the module docstring). Two arrays: a
    plain ``lax.dot_general``.

    Args:
      lhs: a float array or a `QTensor`.
      rhs: a float array or a `QTensor`.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch))``, as for ``lax.dot_general``.
      precision: for the float dot (the int8 dot is exact).
      preferred_element_type: the result dtype; int8 path default: the float
        operand's dtype.
      out_sharding: passed to ``lax.dot_general`` (except on the blocked int8
        path, whose dot has an extra axis of blocks).
      act_quant: ``None`` (weight-only) or an `ActQuant` (int8 x int8 -> int32).

    Returns:
      ``lax.dot_general``'s result: batch, then lhs free, then rhs free dims.

    Raises:
      TypeError: a non-float array operand; ``act_quant`` not an `ActQuant`.
      ValueError: bad ``dimension_numbers``; int8 path: a float or wider than
        8-bit QTensor, a scale varying along the contraction (per-axis on a
        contracting axis, blocked along another axis than the single
        contracting one), zero points on both operands, an integer
        ``preferred_element_type``.

    Example:
      >>> import jaxquant as jq
      >>> w = jq.quantize(jnp.array([[1.0, -2.0], [0.5, 4.0]]), jnp.float32(0.5))
      >>> x, dims = jnp.array([[1.0, 3.0]]), (((1,), (0,)), ((), ()))
      >>> qdot_general(x, w, dims)  # x @ dequantize(w)
      Array([[ 2.5, 10. ]], dtype=float32)
      >>> qdot_general(x, w, dims, act_quant=ActQuant())  # int8 x int8 -> int32
      Array([[ 2.492126, 10.015748]], dtype=float32)
    """
    if not (_is_q(lhs) or _is_q(rhs)):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                               out_sharding=out_sharding)
    ops = [op if _is_q(op) else jnp.asarray(op) for op in (lhs, rhs)]
    for name, op in zip(_SIDES, ops, strict=True):
        if not (_is_q(op) or jnp.issubdtype(op.dtype, jnp.floating)):
            raise TypeError(f"{name} must be a float array or a jaxquant.QTensor, got dtype "
                            f"{op.dtype}.")
    dims = _check_dims(dimension_numbers, (ops[0].ndim, ops[1].ndim))
    if preferred_element_type is not None:
        preferred_element_type = np.dtype(preferred_element_type)
    if act_quant is not None:
        if not isinstance(act_quant, ActQuant):
            raise TypeError(f"act_quant must be None or a jaxquant.ActQuant, got "
                            f"{type(act_quant).__name__}.")
        for i, name in enumerate(_SIDES):
            if _is_q(ops[i]):
                _check_int_operand(ops[i], dims[0][i], name)
        if all(_is_q(op) and (op.zero_point is not None or not op.format.signed) for op in ops):
            raise ValueError("the int8 x int8 path supports a zero point (or unsigned codes) on "
                             "one operand only; pass act_quant=None for a weight-only dot.")
        block = {op.block_size for op in ops if _is_q(op) and op.block_size}
        if len(block) > 1:
            raise ValueError(f"lhs and rhs are blocked with different block sizes "
                             f"{sorted(block)}; the int8 x int8 path needs one block size.")
        if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type,
                                                                     jnp.floating):
            raise ValueError(f"preferred_element_type must be a float dtype on the int8 x int8 "
                             f"path (the int32 sums are scaled), got {preferred_element_type}.")
    return _qdot(*ops, dims, precision, preferred_element_type, out_sharding, act_quant)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QDotGeneral:
    """`qdot_general` as a ``lax.dot_general`` drop-in for Flax's ``dot_general=``.

    A frozen (hashable) dataclass, so it can be a Flax module field. Layers whose
    kernel is a `QTensor` run quantized, the others in float: the rules that
    quantized the tree decide. Give Flax `promote_dtype` too, or it turns the
    QTensor into an array: ``nn.Dense(1024, dot_general=jq.QDotGeneral(),
    promote_dtype=jq.promote_dtype)`` (``flax.nnx.Linear`` takes the same two).

    Attributes:
      act_quant: ``None`` (weight-only) or an `ActQuant` (int8 x int8 -> int32).

    Example:
      >>> import jaxquant as jq
      >>> dot = QDotGeneral(act_quant=ActQuant())
      >>> x, w = jnp.array([[64.0, -127.0]]), jq.quantize(jnp.eye(2), axis=1)
      >>> dot(x, w, (((1,), (0,)), ((), ())))  # the scales are 1: exact
      Array([[  64., -127.]], dtype=float32)
    """

    act_quant: ActQuant | None = None

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None) -> jax.Array:
        return qdot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                            out_sharding=out_sharding, act_quant=self.act_quant)
