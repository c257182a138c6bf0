"""Quantized dot products: `qdot_general` and the `QDotGeneral` callable (`qeinsum`: `_einsum`).

A `QTensor` operand (the weight) is multiplied in one of two ways:

* **int8 x int8 -> int32** (``act_quant=ActQuant()``, "W8A8", `jaxquant._int_dot`): the
  float operand is quantized on the fly to symmetric int8, ``lax.dot_general``
  multiplies the codes with ``preferred_element_type=jnp.int32`` and both scales
  multiply the int32 result. The weight's scale must be constant along the
  contraction: per-tensor, per-axis on a non-contracting axis, or blocked along
  the single contracting axis, which is then split into ``(n_blocks, block)``:
  one batched int dot, each block's int32 partial sum scaled, then the blocks
  summed. Zero points (and unsigned codes) are exact; a contraction too long for
  exact int32 sums is cut into pieces that are exact. A NaN in the float
  operand makes the results of its row (per token) or of the whole dot (per
  tensor) NaN. Gradients: straight through the activation's quantization, as
  `jaxquant.fake_quant` (see `jaxquant._int_dot.int_dot`).
* **weight-only** (``act_quant=None``, `jaxquant._weight_only`): the weight is
  dequantized inside the jitted dot and multiplied in float.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jaxquant._args import as_array, as_dtype, as_precision
from jaxquant._granularity import normalize_axis
from jaxquant._int_dot import ActQuant, check_act_quant, check_int_operand, int_dot
from jaxquant._qtensor import QTensor, check_consistent, is_qtensor
from jaxquant._weight_only import weight_only_dot

__all__ = ["ActQuant", "QDotGeneral", "qdot_general", "promote_dtype"]

_SIDES = ("lhs", "rhs")


_is_q = is_qtensor


def _dim(d, side: str, name: str, dimension_numbers) -> int:
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
        raise TypeError(f"{side} {name} dimensions must be ints, got {d!r} in "
                        f"dimension_numbers {dimension_numbers!r}.")
    return int(d)


def _check_dims(dimension_numbers, shapes) -> tuple:
    """``((lc, rc), (lb, rb))`` as tuples of non-negative ints, checked against ``shapes``.

    Args:
      dimension_numbers: as for ``lax.dot_general``.
      shapes: the lhs and rhs shapes.

    Returns:
      The normalized dimension numbers.

    Raises:
      ValueError: a malformed ``dimension_numbers``, a dimension out of range or
        repeated (among contracting and batch dimensions of one side), lhs and rhs
        with different numbers of contracting (batch) dimensions or different sizes
        along them.
      TypeError: a dimension that is not an int.
    """
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        pairs = (("contracting", (tuple(lc), tuple(rc))), ("batch", (tuple(lb), tuple(rb))))
    except (TypeError, ValueError):
        raise ValueError(f"dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                         f"(lhs_batch, rhs_batch)), sequences of ints, got "
                         f"{dimension_numbers!r}.") from None
    out = []
    for name, pair in pairs:
        pair = tuple(tuple(normalize_axis(_dim(d, _SIDES[i], name, dimension_numbers),
                                          len(shapes[i]), f"{_SIDES[i]} {name} dimension")
                           for d in pair[i]) for i in (0, 1))
        if len(pair[0]) != len(pair[1]):
            raise ValueError(f"lhs and rhs must have as many {name} dimensions, got "
                             f"{pair[0]} and {pair[1]}.")
        for i, dims in enumerate(pair):
            seen = dims + (out[0][i] if out else ())
            if len(set(seen)) != len(seen):
                raise ValueError(f"{_SIDES[i]}: a dimension may appear once among the "
                                 f"contracting and batch dimensions, got {name} dimensions "
                                 f"{dims}" + (f" and contracting {out[0][i]}" if out else "")
                                 + f" of an operand of shape {tuple(shapes[i])}.")
        sizes = [tuple(shapes[i][d] for d in pair[i]) for i in (0, 1)]
        if sizes[0] != sizes[1]:
            raise ValueError(f"the {name} dimensions of lhs {pair[0]} and rhs {pair[1]} must "
                             f"have equal sizes; got lhs sizes {sizes[0]} and rhs sizes "
                             f"{sizes[1]}.")
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
      inexact: as Flax's: an inferred integer dtype is promoted with float32, and a
        ``dtype`` given must be inexact (float or complex).

    Returns:
      A list (a tuple for a tuple argument) of the arguments.

    Raises:
      TypeError: ``dtype`` is not a dtype, or an argument is not an array, a
        `QTensor` or ``None`` (a string, say).
      ValueError: with ``inexact``, a ``dtype`` that is not inexact.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> x, w = jq.promote_dtype(jnp.ones(2, jnp.bfloat16), jq.quantize(jnp.ones((2, 2))))
      >>> x.dtype, type(w).__name__
      (dtype('float32'), 'QTensor')
    """
    as_tuple = len(args) == 1 and isinstance(args[0], tuple)
    items = [x if x is None or _is_q(x) else as_array(x, f"args[{i}]")
             for i, x in enumerate(args[0] if as_tuple else args)]
    if dtype is not None:
        dtype = as_dtype(dtype, "dtype")
        if inexact and not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(f"dtype must be inexact (a float or complex dtype) with "
                             f"inexact=True, got {dtype}.")
    else:
        # weakly typed arrays (Python scalars) give way, as in Flax's `jnp.result_type`
        operands = [x.dtype if _is_q(x) else x for x in items if x is not None]
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(*operands) if operands else np.dtype("f4")
            if inexact and not jnp.issubdtype(dtype, jnp.inexact):
                dtype = jnp.promote_types(jnp.float32, dtype)
    out = [x if x is None or _is_q(x) else jnp.asarray(x, dtype) for x in items]
    return tuple(out) if as_tuple else out


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
    return int_dot((lhs, rhs), dims, act_quant, out_dtype, out_sharding, precision)


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
    dot (any format and layout, packed or not, zero points), in float32 and then cast
    to the float operand's dtype (not rounded to the QTensor's ``dtype``). An `ActQuant`: the
    float operand is quantized to int8 on the fly and the dot runs as
    int8 x int8 -> int32 (layouts: see the module docstring). Two arrays: a
    plain ``lax.dot_general`` (``act_quant`` is still checked).

    Args:
      lhs: a float array or a `QTensor`.
      rhs: a float array or a `QTensor`.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch))``, as for ``lax.dot_general``.
      precision: for the float dot (the int8 dot is exact; its backward pass is a
        float dot).
      preferred_element_type: the result dtype; int8 path default: the float
        operand's dtype.
      out_sharding: passed to ``lax.dot_general`` (the blocked int8 path, whose
        dot has an extra axis of blocks, reshards its result to it).
      act_quant: ``None`` (weight-only) or an `ActQuant` (int8 x int8 -> int32).

    Returns:
      ``lax.dot_general``'s result: batch, then lhs free, then rhs free dims.

    Raises:
      TypeError: a non-float (or not array-like) operand; ``act_quant`` not an
        `ActQuant`; a dimension that is not an int; a QTensor holding no codes; a
        ``preferred_element_type`` that is not a dtype.
      ValueError: bad ``dimension_numbers`` (malformed, out of range, or
        contracting or batch dimensions of different sizes); a ``precision``
        ``lax.dot_general`` does not take; a QTensor whose
        leaves do not fit its metadata (stacked, outside ``vmap``); int8 path: a
        float or wider than 8-bit QTensor, a scale varying along the
        contraction (per-axis on a contracting axis, blocked along another
        axis than the single contracting one), zero points on both operands,
        an integer ``preferred_element_type``.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> w = jq.quantize(jnp.array([[1.0, -2.0], [0.5, 4.0]]), jnp.float32(0.5))
      >>> x, dims = jnp.array([[1.0, 3.0]]), (((1,), (0,)), ((), ()))
      >>> jq.qdot_general(x, w, dims)  # x @ dequantize(w)
      Array([[ 2.5, 10. ]], dtype=float32)
      >>> jq.qdot_general(x, w, dims, act_quant=jq.ActQuant())  # int8 x int8 -> int32
      Array([[ 2.492126, 10.015748]], dtype=float32)
    """
    check_act_quant(act_quant)
    if not (_is_q(lhs) or _is_q(rhs)):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                               out_sharding=out_sharding)
    ops = [op if _is_q(op) else as_array(op, name)
           for name, op in zip(_SIDES, (lhs, rhs), strict=True)]
    for name, op in zip(_SIDES, ops, strict=True):
        if _is_q(op):
            check_consistent(op, name)
        elif not jnp.issubdtype(op.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array or a jaxquant.QTensor, got dtype "
                            f"{op.dtype}.")
    dims = _check_dims(dimension_numbers, (ops[0].shape, ops[1].shape))
    precision = as_precision(precision)
    if preferred_element_type is not None:
        preferred_element_type = as_dtype(preferred_element_type, "preferred_element_type")
    if act_quant is not None:
        for i, name in enumerate(_SIDES):
            if _is_q(ops[i]):
                check_int_operand(ops[i], dims[0][i], name)
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

    Raises:
      TypeError: ``act_quant`` neither ``None`` nor an `ActQuant` (the class itself, say).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> dot = jq.QDotGeneral(act_quant=jq.ActQuant())
      >>> x, w = jnp.array([[64.0, -127.0]]), jq.quantize(jnp.eye(2), axis=1)
      >>> dot(x, w, (((1,), (0,)), ((), ())))  # the scales are 1: exact
      Array([[  64., -127.]], dtype=float32)
    """

    act_quant: ActQuant | None = None

    def __post_init__(self):
        check_act_quant(self.act_quant)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None) -> jax.Array:
        return qdot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                            out_sharding=out_sharding, act_quant=self.act_quant)
