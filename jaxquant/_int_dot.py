"""The int8 x int8 -> int32 dot of `qdot_general` and `qat_dot_general`.

`ActQuant` quantizes the float operand on the fly to symmetric int8; `int_operand`
turns either operand into ``(int8 codes, float32 scale, int32 zero point)``;
`int_dot_parts` multiplies the codes with ``preferred_element_type=jnp.int32`` and
scales the int32 sums. Unsigned codes are shifted to int8 and zero points folded
in exactly: ``sum_k a_k (w_k - z) = sum_k a_k w_k - z sum_k a_k``. A blocked
operand's contracting axis is split as ``(n_blocks, block)``: one batched dot,
each block's sum scaled, the blocks summed. The int32 sums are exact while
``K * 128 * max|w - z| < 2**31`` (`exact_length`: ``K`` up to 65,793 with a zero
point, 131,071 without); a longer contraction (or block) is cut into pieces that
are, each piece's sum scaled, the pieces summed in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant._barriers import int_dot_general
from jaxquant._bits import sign_extend, split_groups, unpack_fields
from jaxquant._explicit_sharding import (
    explicit_spec,
    replicated_along,
    reshard_like,
    sharding_with_spec,
)
from jaxquant._formats import get_format
from jaxquant._granularity import expand
from jaxquant._packing import PackedArray
from jaxquant._qtensor import QTensor, is_qtensor, scale_values
from jaxquant._quantize import dequantize_values
from jaxquant._rounding import divide, round_to_codes
from jaxquant._scales import scale_from_range

_INT8 = get_format(jnp.int8)
_is_q = is_qtensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActQuant:
    """Dynamic symmetric int8 quantization of the float operand of a quantized dot.

    Scale ``absmax / 127`` (all zeros: 1) computed on every call, codes
    ``clip(round_half_even(x / scale), -127, 127)``.

    Attributes:
      granularity: ``"token"``: one scale per row, that is per index of the
        non-contracting dimensions; ``"tensor"``: one scale for the operand.

    Raises:
      ValueError: a granularity other than the strings ``"token"`` and ``"tensor"``.

    Example:
      >>> import jaxquant as jq
      >>> jq.ActQuant()
      ActQuant(granularity='token')
    """

    granularity: Literal["token", "tensor"] = "token"

    def __post_init__(self):
        if not isinstance(self.granularity, str) or self.granularity not in ("token", "tensor"):
            raise ValueError(f"granularity must be 'token' or 'tensor', got "
                             f"{self.granularity!r}.")


def check_act_quant(act_quant, name: str = "act_quant") -> None:
    """Raises a `TypeError` naming the argument ``name`` unless ``act_quant`` is ``None`` or an
    `ActQuant` instance."""
    if act_quant is None or isinstance(act_quant, ActQuant):
        return
    got = ("the class ActQuant itself; pass an instance, ActQuant()" if act_quant is ActQuant
           else f"{type(act_quant).__name__} {act_quant!r}")
    raise TypeError(f"{name} must be None or a jaxquant.ActQuant, got {got}.")


def check_int_operand(qt: QTensor, contract: tuple, name: str) -> None:
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


def int_operand(op, contract: tuple, act_quant: ActQuant):
    """``(int8 codes, float32 scale, int32 zero point or None)``, each of ``op``'s rank.

    Scales and zero points have size 1 along ``contract``, except a blocked
    QTensor's, which keep their ``n_blocks`` entries along the contracting axis.
    """
    n = op.ndim
    if not _is_q(op):
        x = op.astype(jnp.float32)
        axes = contract if act_quant.granularity == "token" else tuple(range(n))
        # One reduction of |x| (activations are small: two reductions cost more dispatch).
        amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True, initial=0.0)
        scale, _ = scale_from_range(amax, amax, _INT8, True)  # NaN for a NaN amax
        return round_to_codes(divide(x, scale, "normal"), None, _INT8), scale, None
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


def to_output(v: jax.Array, contract: tuple, batch: tuple, side: int, n_other_free: int):
    """An operand-rank array of size 1 along ``contract``, laid out as the dot's output."""
    free = tuple(d for d in range(v.ndim) if d not in contract and d not in batch)
    v = jnp.transpose(v, batch + free + contract)
    v = v.reshape(v.shape[:len(batch) + len(free)])
    nb, ones = len(batch), (1,) * n_other_free
    return v.reshape(v.shape + ones if side == 0 else v.shape[:nb] + ones + v.shape[nb:])


def spec_of_axes(v: jax.Array, axes) -> jax.sharding.NamedSharding | None:
    """The sharding of ``v``'s ``axes`` in that order (a result laid out as them) on a
    mesh with explicit axes, else ``None``."""
    spec = explicit_spec(v)
    return None if spec is None else sharding_with_spec(v, [spec[d] for d in axes])


def _constrain(y: jax.Array, sharding) -> jax.Array:
    """``y`` on ``sharding``, as ``lax.dot_general``'s ``out_sharding`` puts its result:
    resharded on explicit mesh axes, constrained on auto ones. Outside ``jax.set_mesh``, a
    bare ``PartitionSpec`` leaves ``y`` as it is, and so does a ``NamedSharding`` on explicit
    axes for a ``y`` that is not explicitly sharded (operands on one device)."""
    if sharding is None:
        return y
    if jax.sharding.get_abstract_mesh().empty and (
            not isinstance(sharding, jax.sharding.NamedSharding)
            or (explicit_spec(y) is None and sharding.mesh.explicit_axes)):
        return y
    if explicit_spec(y) is not None:
        return jax.sharding.reshard(y, sharding)
    return lax.with_sharding_constraint(y, sharding)


def int_dot(ops, dims, act_quant, out_dtype, out_sharding, precision=None):
    """The int8 x int8 -> int32 dot of `qdot_general` (arguments checked there).

    Differentiable: the float operand's gradient is the straight-through
    estimate of `jaxquant.fake_quant` (an absmax scale clips nothing), that is
    the gradient of the float dot of the dequantized operands, whose
    activation is the fake-quantized float operand; a `QTensor`'s scale gets
    the gradient of that dot (the result is linear in it), its codes none.

    Args:
      ops: ``(lhs, rhs)``, arrays or `QTensor` operands (at least one QTensor).
      dims: normalized dimension numbers.
      act_quant: how the float operand is quantized.
      out_dtype: the result dtype.
      out_sharding: the result's sharding, or ``None``.
      precision: for the float dot of the backward pass.

    Returns:
      The dot, in ``out_dtype``.
    """
    return _int_dot(*ops, dims, act_quant, np.dtype(out_dtype), out_sharding, precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _int_dot(lhs, rhs, dims, act_quant, out_dtype, out_sharding, precision):
    del precision  # the int8 dot is exact
    block = {op.block_size for op in (lhs, rhs) if _is_q(op) and op.block_size}
    parts = [int_operand(op, dims[0][i], act_quant) for i, op in enumerate((lhs, rhs))]
    return int_dot_parts(parts, dims, block.pop() if block else None, out_dtype, out_sharding)


def _int_dot_fwd(lhs, rhs, dims, act_quant, out_dtype, out_sharding, precision):
    return _int_dot(lhs, rhs, dims, act_quant, out_dtype, out_sharding, precision), (lhs, rhs)


def _int_dot_bwd(dims, act_quant, out_dtype, out_sharding, precision, ops, g):
    def fake_quantized(x, contract):  # the value the int8 dot gives x, in x's dtype
        q, scale, _ = int_operand(x, contract, act_quant)
        return (q.astype(jnp.float32) * scale).astype(x.dtype)

    def values(v):
        return dequantize_values(v) if _is_q(v) else v.astype(jnp.float32)

    def float_dot(a, b):
        return lax.dot_general(values(a), values(b), dims, precision,
                               preferred_element_type=jnp.float32, out_sharding=out_sharding)

    ops = [op if _is_q(op) else fake_quantized(op, dims[0][i]) for i, op in enumerate(ops)]
    _, vjp = jax.vjp(float_dot, *ops)  # straight through: d x = d fake_quantized(x)
    return vjp(g.astype(jnp.float32))


_int_dot.defvjp(_int_dot_fwd, _int_dot_bwd)


def exact_length(zero_point: bool) -> int:
    """The longest contraction whose int32 sums are exact: ``K * max|a| * max|w - z| < 2**31``.

    Codes are int8 (``|a| <= 128``); a zero point (on one side at most) makes
    ``|w - z| <= 255``: 131,071 without a zero point, 65,793 with one.
    """
    return (2**31 - 1) // (128 * (255 if zero_point else 128))


def contraction_pieces(sizes: tuple, limit: int) -> list:
    """``(start, stop)`` ranges, one per contracting axis, tiling the contraction in pieces
    of at most ``limit`` products (the largest axis is cut first)."""
    total = math.prod(sizes)
    if total <= limit:
        return [tuple((0, n) for n in sizes)]
    j = max(range(len(sizes)), key=sizes.__getitem__)
    step = max(1, limit // (total // sizes[j]))
    out = []
    for s in range(0, sizes[j], step):
        e = min(s + step, sizes[j])
        for sub in contraction_pieces(sizes[:j] + (e - s,) + sizes[j + 1:], limit):
            out.append(sub[:j] + ((s + sub[j][0], s + sub[j][1]),) + sub[j + 1:])
    return out


def slice_axes(v: jax.Array, axes: tuple, piece: tuple) -> jax.Array:
    for d, (s, e) in zip(axes, piece, strict=True):
        v = lax.slice_in_dim(v, s, e, axis=d)
    return v


def _block_range(q: jax.Array, k: int, block: int, s: int, e: int) -> jax.Array:
    """Positions ``s:e`` of every ``block`` along axis ``k``: length ``n_blocks * (e - s)``."""
    g = lax.slice_in_dim(split_groups(q, k, block), s, e, axis=k + 1)
    return g.reshape(q.shape[:k] + (-1,) + q.shape[k + 1:])


def int_dot_parts(parts, dims, block, out_dtype, out_sharding):
    """The int8 x int8 -> int32 dot of two ``(codes, scale, zero point)`` from `int_operand`.

    ``block``: the block size of a blocked operand (its contracting axis), or ``None``.
    A contraction (a block) longer than `exact_length` is cut into pieces whose int32
    sums are exact; their scaled float32 results are summed.
    """
    contract, limit = dims[0], exact_length(any(z is not None for _, _, z in parts))
    if block and block > limit:
        ks = [c[0] for c in contract]
        ys = [_int_dot_exact([(_block_range(q, k, block, s, min(s + limit, block)), sc, z)
                              for (q, sc, z), k in zip(parts, ks, strict=True)],
                             dims, min(s + limit, block) - s, out_sharding)
              for s in range(0, block, limit)]
    elif block:
        ys = [_int_dot_exact(parts, dims, block, out_sharding)]
    else:
        sizes = tuple(parts[0][0].shape[d] for d in contract[0])
        ys = [_int_dot_exact([(slice_axes(q, c, piece), sc, z)
                              for (q, sc, z), c in zip(parts, contract, strict=True)],
                             dims, None, out_sharding)
              for piece in contraction_pieces(sizes, limit)]
    return functools.reduce(jnp.add, ys).astype(out_dtype)


def _scaled(acc: jax.Array, s0: jax.Array, s1: jax.Array) -> jax.Array:
    """``acc * s0 * s1`` in float32: ``(acc * s0) * s1``, or ``acc * (s0 * s1)`` (the order of
    ONNX Runtime's and PyTorch's dynamic quantization) where ``acc * s0`` overflowed, which
    it can where the product is finite (a large activation scale, a small weight scale)."""
    y = acc * s0
    return jnp.where(jnp.isinf(y), acc * (s0 * s1), y * s1)


def _int_dot_exact(parts, dims, block, out_sharding):
    """`int_dot_parts` for a contraction (a block) of at most `exact_length`, in float32."""
    contract, batch = dims
    if block:  # the contracting axis k becomes (k: a batch axis of blocks, k + 1: contracted)
        b, ks = block, [c[0] for c in contract]
        parts = [(split_groups(q, k, b), jnp.expand_dims(s, k + 1),
                  None if z is None else jnp.expand_dims(z, k + 1))
                 for (q, s, z), k in zip(parts, ks, strict=True)]
        batch = tuple(tuple(d + (d > k) for d in bt) + (k,) for bt, k in zip(batch, ks,
                                                                           strict=True))
        contract = tuple((k + 1,) for k in ks)
        specs = [explicit_spec(q) for q, _, _ in parts]
        if None not in specs and specs[0][ks[0]] != specs[1][ks[1]]:
            # the axes of blocks are batch axes now, which JAX wants sharded alike: an
            # FSDP weight's blocks (sharded as the activation's rows) are gathered
            parts = [tuple(None if a is None else replicated_along(a, k) for a in p)
                     for p, k in zip(parts, ks, strict=True)]
    nfree = [p[0].ndim - len(c) - len(bt) for p, c, bt in zip(parts, contract, batch,
                                                              strict=True)]
    acc = int_dot_general(parts[0][0], parts[1][0], (contract, batch),
                          out_sharding=None if block else out_sharding)

    def out(v, i):
        return reshard_like(to_output(v, contract[i], batch[i], i, nfree[1 - i]), acc)

    for i in (0, 1):
        if parts[i][2] is not None:  # sum_k a_k (w_k - z) = a.w - z sum_k a_k
            rowsum = jnp.sum(parts[1 - i][0], axis=contract[1 - i], keepdims=True,
                             dtype=jnp.int32)
            acc = acc - out(parts[i][2], i) * out(rowsum, 1 - i)
    y = _scaled(acc.astype(jnp.float32), out(parts[0][1], 0), out(parts[1][1], 1))
    if block:
        y = sum_blocks(y, len(batch[0]) - 1)
        y = _constrain(y, out_sharding)  # the dot's: it had an axis of blocks more
    return y


def sum_blocks(y: jax.Array, axis: int) -> jax.Array:
    """``jnp.sum(y, axis)`` as a pairwise tree of elementwise adds of halves along ``axis``.

    ``axis`` holds the blocks, a major axis of the dot's output: XLA:CPU reduces such an
    axis several times slower than the int8 dot that made it (a 4-layer width-1024 MLP
    with weight blocks of 128 ran at 1.95x float32's time, 2026-11-25), where the
    ``log2(n_blocks)`` adds fuse with the scaling. A sharded ``axis`` (explicit mesh axes)
    is summed by ``jnp.sum``, a cross-device reduction.
    """
    spec = explicit_spec(y)
    if y.shape[axis] == 0 or spec is not None and spec[axis] is not None:
        return jnp.sum(y, axis)
    while (n := y.shape[axis]) > 1:
        half = lax.slice_in_dim(y, 0, n // 2, axis=axis) + lax.slice_in_dim(
            y, n // 2, 2 * (n // 2), axis=axis)
        odd = [lax.slice_in_dim(y, n - 1, n, axis=axis)] if n % 2 else []
        y = jnp.concatenate([half, *odd], axis) if odd else half
    return jnp.squeeze(y, axis)
