"""The weight-only dot: `QTensor` operands dequantized inside the jitted dot.

The weight is dequantized in float32 (in the blocked view for blocked layouts),
cast to the other operand's dtype and multiplied with ``lax.dot_general``.
Packed int4/int2 codes are never unpacked to their interleaved order: each
phase of the bytes (low nibbles, high nibbles) is dequantized as a contiguous
array and multiplied on its own, and the partial results are interleaved
(packed along a free axis) or summed (packed along the contracted axis).
Unpacking to the interleaved order does not vectorize on XLA:CPU (1.2x slower
than the float model in the MLP benchmark, against 0.95x phase by phase).

What XLA:CPU does (jax 0.10): no elementwise producer is fused into its dot
kernels (YNNPACK), so each dot materializes its weight in float. Left alone it
also hoists every dequantization of a model to the start of the program (all
float weights live at once: 16 MiB of temporaries for four 1024 x 1024 layers)
and ignores ``optimization_barrier``. On CPU each weight-only dot therefore
runs inside a ``lax.cond`` whose two branches are the same: the dequantization
waits for the activation, one layer's float weight is live at a time (4 MiB)
and it is still in cache when the dot reads it (0.85-0.95x the float model's
time instead of 1.2-1.5x). The conditional's function is a ``jax.checkpoint``: a
gradient recomputes the dequantization in its own backward dot instead of saving
every layer's float weight for the backward pass (four 2048 x 2048 layers: 64 ->
16 MiB of temporaries). Other backends get the plain dot. The predicate
(`moot_predicate`) stays one scalar under ``vmap`` over stacked weights: a
batched one would turn the conditional into a ``select`` running both branches
(which JAX also rejects on meshes with explicit axes).

On CPU a large weight is also streamed when the other operand has few rows
(16 to 256 free elements: the dot is bound by reading the weight, not by
arithmetic): its rows along a contracted leading axis are dequantized and
multiplied in chunks of at most 2 MiB of float32 (`stream_rows`), each inside
its own ``lax.cond``, and the partial products summed in float32 (a two-level scale, NVFP4's or
``double_quant``'s, is dequantized to its float32 block scales first). The float
weight then never exists whole, and each chunk is still in cache when its dot
reads it. For four 1024 x 1024 layers at batch 32 this took weight-only int8
from 1.2-1.3x to 0.95-1.0x the float model's time (temporaries 16 -> 2.3 MiB),
four 4096 x 4096 layers from 1.3x to 0.65x; with many rows (compute-bound
dots) or one row and a small weight, chunks cost more than they save. A row count
unknown when the dot is traced (a symbolic batch under ``jax.export``) is not streamed, nor is
a weight under a mesh (``jax.set_mesh``, other than `shard_map`'s manual axes) or explicitly
sharded: slicing a sharded axis would gather the whole weight onto every device. (A weight
sharded with ``jax.device_put`` alone, no mesh set, cannot be seen when the dot is traced.)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap

from jaxquant._barriers import gemm_operand
from jaxquant._bits import without_padding
from jaxquant._explicit_sharding import explicit_sharding, explicit_spec, replicated_along
from jaxquant._granularity import Layout, apply_grouped
from jaxquant._packing import PackedArray
from jaxquant._qtensor import QTensor, is_qtensor
from jaxquant._quantize import dequantize_values

__all__ = ["weight_only_dot", "dequantized_in_turn", "moot_predicate"]

_is_q = is_qtensor

STREAM_BYTES = 2 * 2**20  # float32 bytes of weight dequantized per step when streaming
STREAM_MAX_ROWS = 256  # streams only for at most this many rows of the other operand,
STREAM_MIN_ROWS = 16  # and at least this many unless the float weight exceeds
STREAM_LARGE_BYTES = 16 * 2**20  # this many bytes
STREAM_UNROLL = 8  # chunks up to this many are unrolled, more run in a loop


@custom_vmap
def _scale_is_number(s: jax.Array) -> jax.Array:
    m = jnp.max(s.astype(jnp.float32), initial=0.0)  # a scalar on any sharding (or size)
    return m == m


@_scale_is_number.def_vmap
def _scale_is_number_vmap(axis_size, in_batched, s):
    del axis_size, in_batched
    return _scale_is_number(s), False  # one scalar for the whole batch


def moot_predicate(scale: jax.Array) -> jax.Array:
    """The predicate of a ``lax.cond`` whose two branches are the same (see the module
    docstring): a data-dependent scalar bool, so that XLA cannot fold the conditional
    away, and one that ``vmap`` leaves unbatched.

    Args:
      scale: a float array of any shape and sharding (gradients do not flow into it).

    Returns:
      A scalar bool: whether ``scale`` is free of NaN (the value does not matter).
    """
    return _scale_is_number(lax.stop_gradient(scale))


def stream_rows(qt, contract: tuple, batch: tuple, other_rows: int) -> int | None:
    """Rows of ``qt`` (along axis 0) to dequantize per step, or None for all at once.

    A weight is streamed when its leading axis is contracted, the other operand
    has `STREAM_MIN_ROWS` to `STREAM_MAX_ROWS` rows (its free elements; fewer
    when the weight's float32 values take more than `STREAM_LARGE_BYTES`) and
    the float32 values (of one phase, for packed codes) take more than
    `STREAM_BYTES`. Chunks hold at most `STREAM_BYTES`, whole scale blocks and
    whole packed bytes: equal chunks when the rows split evenly into at most
    twice the fewest chunks, else the fewest equal chunks and a shorter last one
    (a prime number of rows is not cut into single rows).
    """
    if not isinstance(other_rows, int):  # symbolic (jax.export): cannot be compared
        return None
    if not _is_q(qt) or 0 not in contract or batch or _is_q(qt.scale) \
            or qt.layout.kind == "tile" or other_rows > STREAM_MAX_ROWS:
        return None
    rows, row_bytes = qt.shape[0], 4 * math.prod(qt.shape[1:])
    step = qt.block_size if qt.layout.kind == "block" and qt.axis == 0 else 1
    if qt.packed and qt.qvalue.axis == 0:
        if 8 % qt.format.bits:
            return None
        step = math.lcm(step, 8 // qt.format.bits)
    if _split_layout(qt, contract, batch):  # dequantized phase by phase, 1 / per at a time
        row_bytes //= 8 // qt.format.bits
    if rows * row_bytes <= STREAM_BYTES or (
            other_rows < STREAM_MIN_ROWS and rows * row_bytes <= STREAM_LARGE_BYTES):
        return None
    fit = STREAM_BYTES // row_bytes // step * step  # the most rows a chunk may hold
    if not fit:
        return None
    fewest = -(-rows // fit)
    for n in range(fewest, 2 * fewest + 1):  # equal chunks
        if rows % n == 0 and (rows // n) % step == 0:
            return rows // n
    chunk = -(-rows // fewest)  # the fewest chunks, the last one shorter
    return -(-chunk // step) * step  # still at most `fit`: a multiple of step


def _sharded(qt) -> bool:
    """Whether ``qt`` may be split across devices: a mesh with axes other than `shard_map`'s
    manual ones is set, or its codes are explicitly sharded. Slices of a streamed weight along
    a sharded axis would gather the whole weight onto every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and (mesh.auto_axes or mesh.explicit_axes):
        return True
    codes = qt.qvalue.data if isinstance(qt.qvalue, PackedArray) else qt.qvalue
    return explicit_sharding(codes) is not None


def _one_level(qt):
    """``qt`` with a two-level scale (NVFP4, ``double_quant``) replaced by its float32 values.

    The values are those `dequantize_values` multiplies by, so the products are the same; the
    block scales are small (one per block), and plain ones can be cut into row chunks.
    """
    if not (_is_q(qt) and _is_q(qt.scale)) or qt.layout.kind == "tile":
        return qt
    return dataclasses.replace(qt, scale=dequantize_values(qt.scale))


def _rows(qt: QTensor, start, rows: int) -> QTensor:
    """Rows ``start : start + rows`` of ``qt`` along axis 0 (``start`` may be traced).

    ``start`` is a multiple of the rows of a scale block and of a packed byte;
    ``start + rows`` is too, or is the last row (a partial block or byte).
    """
    def cut(a, per):  # dim 0 of an array holding one entry per ``per`` rows
        return lax.dynamic_slice_in_dim(a, start // per, -(-rows // per), axis=0)

    layout = qt.layout
    if layout.kind == "tensor" or layout.kind == "axis" and layout.axis != 0:
        scale, zero_point = qt.scale, qt.zero_point
    else:
        per = layout.block_size if layout.kind == "block" and layout.axis == 0 else 1
        scale = cut(qt.scale, per)
        zero_point = None if qt.zero_point is None else cut(qt.zero_point, per)
    codes = qt.qvalue
    shape = (rows,) + tuple(qt.shape[1:])
    if isinstance(codes, PackedArray):
        per = 8 // qt.format.bits if codes.axis == 0 else 1
        codes = dataclasses.replace(codes, data=cut(codes.data, per), shape=shape)
    else:
        codes = cut(codes, 1)
    return QTensor(codes, scale, zero_point, axis=qt.axis, block_size=qt.block_size,
                   dtype=qt.dtype, codebook=qt.codebook)


def _split_layout(op, contract: tuple, batch: tuple) -> Layout | None:
    """The per-phase layout of packed integer codes that can be multiplied phase by phase."""
    if not (_is_q(op) and op.packed and op.format.is_integer) or op.qvalue.axis in batch \
            or _is_q(op.scale) or op.layout.kind == "tile" or op.shape[op.qvalue.axis] == 0:
        return None
    layout, per = op.layout, 8 // op.format.bits
    if layout.kind == "block" and layout.axis == op.qvalue.axis:
        if layout.block_size % per:
            return None
        return Layout("block", layout.axis, layout.block_size // per)
    return layout


def _phase(qt: QTensor, j: int, layout: Layout) -> jax.Array:
    """float32 values of codes ``j, j + per, j + 2 per, ...`` along the packed axis."""
    fmt, data, p = qt.format, qt.qvalue.data, qt.qvalue.axis
    bits, per, n = fmt.bits, 8 // fmt.bits, qt.shape[p]
    if fmt.signed:  # sign-extends field j: two arithmetic shifts of the byte as int8
        c = lax.bitcast_convert_type(data, jnp.int8) << jnp.int8(8 - bits * (j + 1))
        c = c >> jnp.int8(8 - bits)
    else:
        c = (data >> jnp.uint8(bits * j)) & jnp.uint8((1 << bits) - 1)

    def strided(v):  # a scale-shaped array that varies element by element along p
        varies = layout.kind != "tensor" and (layout.axis == p) != (layout.kind == "block")
        if v is None or not varies:
            return v
        k = 0 if layout.kind == "axis" else p
        v = lax.slice_in_dim(v, j, n, stride=per, axis=k)
        pad = [(0, 0)] * v.ndim
        pad[k] = (0, data.shape[p] - v.shape[k])
        return jnp.pad(v, pad)

    zp = None if qt.zero_point is None else strided(qt.zero_point.astype(jnp.float32))
    return apply_grouped(lambda q, s, z: (q if z is None else q - z) * s, c.astype(jnp.float32),
                         layout, strided(qt.scale.astype(jnp.float32)), zp)


def _gemm_ready(qt: QTensor) -> QTensor:
    """``qt`` with unpacked sub-byte integer codes widened to 8 bits (`gemm_operand`)."""
    codes = qt.qvalue
    if isinstance(codes, PackedArray) or not qt.format.is_integer or qt.format.bits >= 8:
        return qt
    wide = gemm_operand(codes)
    # the zero points too: int4 ones read straight from memory inside a GEMM fusion gave
    # wrong products on an H200 (as int4 codes did)
    zp = None if qt.zero_point is None else gemm_operand(qt.zero_point).astype(wide.dtype)
    return dataclasses.replace(qt, qvalue=wide, zero_point=zp)


def _scheduled(fn, *args):
    """``fn(*args)`` in a ``lax.cond`` of two equal branches (see the module docstring): the
    dequantization of the first `QTensor` of ``args`` inside ``fn`` waits for its dot."""
    qt = next(a for a in args if _is_q(a))
    s = qt.scale
    while _is_q(s):  # a two-level scale: its float32 tensor scale
        s = s.scale
    fn = jax.checkpoint(fn)  # gradients dequantize again rather than keep the weight
    return lax.cond(moot_predicate(s), fn, fn, *args)  # same branches


def dequantized_in_turn(fn, *args):
    """``fn(*args)`` (an op that dequantizes a `QTensor` of ``args``), scheduled on CPU as
    `weight_only_dot`'s dots are: one layer's float weight live at a time.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> qt = jq.quantize(jnp.eye(2))
      >>> dequantized_in_turn(lambda x, q: x @ q.dequantize(), jnp.ones((1, 2)), qt)
      Array([[1., 1.]], dtype=float32)
    """
    return lax.platform_dependent(*args, cpu=lambda *a: _scheduled(fn, *a), default=fn)


def weight_only_dot(lhs, rhs, dims: tuple, precision, preferred_element_type, out_sharding):
    """``lax.dot_general(lhs, rhs, dims, ...)`` with `QTensor` operands dequantized (traceable).

    ``dims`` is normalized (tuples of non-negative ints); no argument checks.
    A QTensor is dequantized to the other operand's dtype (to both QTensors'
    promoted ``dtype`` when both are). Phases of packed codes along the
    contraction are summed in float32 at least, then rounded once.
    """
    contract, batch = dims
    if _is_q(lhs) and _is_q(rhs):
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    else:
        dtype = (rhs if _is_q(lhs) else lhs).dtype

    def dot(*ops, preferred=preferred_element_type):
        def float_dot(a, b, preferred=preferred):
            return lax.dot_general(a, b, dims, precision=precision,
                                   preferred_element_type=preferred, out_sharding=out_sharding)

        ops = list(ops)
        split = [i for i in (0, 1) if _split_layout(ops[i], contract[i], batch[i])][:1]
        for i in (0, 1):
            if _is_q(ops[i]) and i not in split:
                ops[i] = dequantize_values(_gemm_ready(ops[i])).astype(dtype)
        if not split:
            return float_dot(*ops)
        (i,), qt, other = split, ops[split[0]], ops[1 - split[0]]
        out = np.dtype(preferred or dtype)
        acc = out if out.itemsize >= 4 else np.dtype(np.float32)  # one rounding of the sum
        p, per = qt.qvalue.axis, 8 // qt.format.bits
        m = qt.qvalue.data.shape[p]
        layout = _split_layout(qt, contract[i], batch[i])
        if p in contract[i]:  # phase j meets elements j, j + per, ... of the other operand
            c = contract[1 - i][contract[i].index(p)]
            pad = [(0, 0)] * other.ndim
            pad[c] = (0, m * per - other.shape[c])
            other = jnp.pad(other, pad)
        ys = []
        for j in range(per):
            w = _phase(qt, j, layout).astype(dtype)
            o = lax.slice_in_dim(other, j, None, per, c) if p in contract[i] else other
            pref = acc if p in contract[i] else preferred
            ys.append(float_dot(o, w, pref) if i else float_dot(w, o, pref))
        if p in contract[i]:
            return functools.reduce(jnp.add, ys).astype(out)
        free = [d for d in range(qt.ndim) if d not in contract[i] and d not in batch[i]]
        nfree0 = lhs.ndim - len(contract[0]) - len(batch[0])
        k = len(batch[i]) + (nfree0 if i else 0) + free.index(p)  # p's axis in the output
        y = jnp.stack(ys, axis=k + 1)  # interleave the phases' outputs
        y = y.reshape(y.shape[:k] + (m * per,) + y.shape[k + 2:])
        return without_padding(y, qt.shape[p], k)  # the phases' padding codes dropped

    def streamed(lhs, rhs, i: int, rows: int):  # see the module docstring
        c = contract[1 - i][contract[i].index(0)]

        def part(weight, other, start, rows=rows):
            o = lax.dynamic_slice_in_dim(other, start, rows, axis=c)
            w = _rows(weight, start, rows)
            return dot(w, o, preferred=acc) if i == 0 else dot(o, w, preferred=acc)

        weight, other = (lhs, rhs) if i == 0 else (rhs, lhs)
        out = np.dtype(preferred_element_type or other.dtype)  # the unstreamed dot's dtype
        acc = out if out.itemsize >= 4 else np.dtype(np.float32)  # sums in float32 at least
        first = _scheduled(part, weight, other, 0)

        def step(k, y):
            return y + _scheduled(part, weight, other, k * rows)

        n, y = weight.shape[0] // rows, first
        if n <= STREAM_UNROLL:  # a while loop costs more than a few calls
            y = functools.reduce(lambda y, k: step(k, y), range(1, n), y)
        else:
            y = lax.fori_loop(1, n, step, y)
        if weight.shape[0] % rows:  # a shorter last chunk
            tail = functools.partial(part, rows=weight.shape[0] % rows)
            y = y + _scheduled(tail, weight, other, n * rows)
        return y.astype(out)

    def cpu(lhs, rhs):
        for i in (0, 1):
            other = (lhs, rhs)[1 - i]
            if _is_q(other) or out_sharding is not None or _sharded((lhs, rhs)[i]):
                continue
            free = math.prod(n for d, n in enumerate(other.shape)
                             if d not in contract[1 - i] and d not in batch[1 - i])
            weight = _one_level((lhs, rhs)[i])
            rows = stream_rows(weight, contract[i], batch[i], free)
            if rows:
                return streamed(*((weight, other) if i == 0 else (other, weight)), i, rows)
        return _scheduled(dot, lhs, rhs)

    lhs, rhs = (_codes_gathered(op, contract[i], (lhs, rhs)[1 - i], contract[1 - i])
                for i, op in enumerate((lhs, rhs)))
    return lax.platform_dependent(lhs, rhs, cpu=cpu, default=dot)


def _codes_gathered(qt, contract: tuple, other, other_contract: tuple):
    """``qt`` with its contracted axes whole on every device where their mesh axes shard
    another axis of the other operand (a mesh with explicit axes: an FSDP weight): the codes are
    gathered, not the float weight dequantized from them (4x the bytes of int8 codes, 8x of
    packed int4)."""
    if not _is_q(qt) or _is_q(other):
        return qt
    codes = qt.qvalue
    spec = explicit_spec(codes.data if isinstance(codes, PackedArray) else codes)
    if spec is None:
        return qt
    other_spec = explicit_spec(other) or (None,) * other.ndim

    def names(entry):
        return set() if entry is None else set(entry if isinstance(entry, tuple) else (entry,))

    # gathered where the other operand uses the same mesh axes on another of its axes (its
    # rows: FSDP); where it is whole along them, each device multiplies its slice and the
    # partial products are summed across devices, with nothing gathered
    axes = [d for d, e in zip(contract, other_contract, strict=True)
            if names(spec[d]) & set().union(*(names(a) for j, a in enumerate(other_spec)
                                              if j != e))]
    if not axes:
        return qt

    def whole(a, dims):
        for d in dims:
            a = replicated_along(a, d)
        return a

    codes = dataclasses.replace(codes, data=whole(codes.data, axes)) \
        if isinstance(codes, PackedArray) else whole(codes, axes)
    layout = qt.layout
    if layout.kind in ("block", "tile"):
        scale_axes = axes  # scales of the codes' rank
    else:
        scale_axes = [0] if layout.kind == "axis" and layout.axis in axes else []

    def groupwise(v):
        return v if v is None or _is_q(v) or not scale_axes else whole(v, scale_axes)

    return QTensor(codes, groupwise(qt.scale), groupwise(qt.zero_point), axis=qt.axis,
                   block_size=qt.block_size, dtype=qt.dtype, codebook=qt.codebook)
