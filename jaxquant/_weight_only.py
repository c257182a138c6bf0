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
time instead of 1.2-1.5x). Other backends get the plain dot. (Under ``vmap``
over the weights themselves the predicate is batched and both branches run;
``lax.scan`` over stacked layers keeps one.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant._granularity import Layout, apply_grouped
from jaxquant._qtensor import QTensor, is_qtensor
from jaxquant._quantize import dequantize_values

__all__ = ["weight_only_dot"]

_is_q = is_qtensor


def _split_layout(op, contract: tuple, batch: tuple) -> Layout | None:
    """The per-phase layout of packed integer codes that can be multiplied phase by phase."""
    if not (_is_q(op) and op.packed and op.format.is_integer) or op.qvalue.axis in batch \
            or _is_q(op.scale) or op.layout.kind == "tile":
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


def weight_only_dot(lhs, rhs, dims: tuple, precision, preferred_element_type, out_sharding):
    """``lax.dot_general(lhs, rhs, dims, ...)`` with `QTensor` operands dequantized (traceable).

    ``dims`` is normalized (tuples of non-negative ints); no argument checks.
    A QTensor is dequantized to the other operand's dtype (its own ``dtype``
    when both are QTensors).
    """
    contract, batch = dims

    def float_dot(a, b):
        return lax.dot_general(a, b, dims, precision=precision,
                               preferred_element_type=preferred_element_type,
                               out_sharding=out_sharding)

    def dot(*ops):
        ops = list(ops)
        split = [i for i in (0, 1) if _split_layout(ops[i], contract[i], batch[i])][:1]
        for i in (0, 1):
            if _is_q(ops[i]) and i not in split:
                dtype = ops[i].dtype if _is_q(ops[1 - i]) else ops[1 - i].dtype
                ops[i] = dequantize_values(ops[i]).astype(dtype)
        if not split:
            return float_dot(*ops)
        (i,), qt, other = split, ops[split[0]], ops[1 - split[0]]
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
            w = _phase(qt, j, layout).astype(other.dtype)
            o = lax.slice_in_dim(other, j, None, per, c) if p in contract[i] else other
            ys.append(float_dot(o, w) if i else float_dot(w, o))
        if p in contract[i]:
            return functools.reduce(jnp.add, ys)
        free = [d for d in range(qt.ndim) if d not in contract[i] and d not in batch[i]]
        nfree0 = lhs.ndim - len(contract[0]) - len(batch[0])
        k = len(batch[i]) + (nfree0 if i else 0) + free.index(p)  # p's axis in the output
        y = jnp.stack(ys, axis=k + 1)  # interleave the phases' outputs
        y = y.reshape(y.shape[:k] + (m * per,) + y.shape[k + 2:])
        return lax.slice_in_dim(y, 0, qt.shape[p], axis=k)

    def cpu(lhs, rhs):  # see the module docstring: schedules the dequantize next to its dot
        s = (lhs if _is_q(lhs) else rhs).scale
        while _is_q(s):  # a two-level scale: its float32 tensor scale
            s = s.scale
        s = jnp.max(s.astype(jnp.float32))  # a scalar on any sharding
        return lax.cond(s == s, dot, dot, lhs, rhs)  # same branches: the predicate is moot

    return lax.platform_dependent(lhs, rhs, cpu=cpu, default=dot)
