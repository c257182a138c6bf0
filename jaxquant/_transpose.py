"""`transpose`: a `QTensor`'s axes permuted, its granularity and packing with them.

PyTorch stores a ``Linear`` weight as ``(out, in)``, Flax a kernel as ``(in, out)``:
a quantized PyTorch checkpoint becomes Flax kernels by a transpose. Transposing the
codes alone (``jax.tree.map(jnp.transpose, qt)``) keeps the quantized ``axis`` where
it was: on a square weight that dequantizes silently wrong. `transpose` moves the
axis, the block scales (two-level ones too) and the tile lengths with the codes, and
packs the codes again along the last axis, so that ``transpose(quantize(w, ...))``
is ``quantize(w.T, ...)`` with the axes renamed, bit for bit; with ``double_quant``
over more than one group of 256 block scales, the second-level groups keep the tiles
they were made with (``quantize(w.T)`` would tile the transposed scale grid anew), so
there the values are ``dequantize(q).T`` exactly but not always the codes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxquant._args import as_array
from jaxquant._granularity import normalize_axis
from jaxquant._leaves import layer_by_layer
from jaxquant._packing import PackedArray, pack
from jaxquant._qtensor import QTensor

__all__ = ["transpose"]


def _permutation(axes, ndim: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(reversed(range(ndim)))
    if isinstance(axes, np.ndarray):  # as jnp.transpose takes them
        axes = axes.tolist()
    if not isinstance(axes, Sequence) or isinstance(axes, str):
        raise TypeError(f"axes must be None or a sequence of ints, got {axes!r}.")
    perm = tuple(normalize_axis(a, ndim, "axes") for a in axes)
    if sorted(perm) != list(range(ndim)):
        raise ValueError(f"axes must be a permutation of the {ndim} axes of x, got "
                         f"{tuple(axes)!r}.")
    return perm


def transpose(x, axes: Sequence[int] | None = None):
    """``x`` with its axes permuted: for a `QTensor`, the codes, scales and zero points.

    Args:
      x: a `QTensor` (of layers stacked by ``jax.vmap`` / ``lax.scan`` too: each layer
        is transposed, ``axes`` counted within a layer), or an array.
      axes: a permutation of ``x``'s axes (negative allowed), as `jnp.transpose`;
        ``None`` reverses them (``qt.T``).

    Returns:
      The transposed `QTensor`: a per-axis or blocked ``axis`` moves with its axis,
      block scales (and a two-level scale's tiles) are transposed, tile lengths are
      permuted, and packed codes are packed again along the last axis (along their old
      axis where the last one is split across devices so that a byte would straddle
      two). An array gives ``jnp.transpose(x, axes)``.

    Raises:
      TypeError: ``axes`` not a sequence of ints.
      ValueError: ``axes`` not a permutation of ``x``'s axes.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> w = jnp.arange(12.0).reshape(3, 4)  # (out, in), as PyTorch stores it
      >>> qt = jq.quantize(w, axis=0)  # one scale per output channel
      >>> jq.transpose(qt)  # a Flax kernel: (in, out), the scales still per output
      QTensor(int8[4, 3], axis=1, scale[3], dtype=float32)
      >>> bool(jnp.array_equal(jq.dequantize(jq.transpose(qt)), jq.dequantize(qt).T))
      True
    """
    if not isinstance(x, QTensor):
        return jnp.transpose(as_array(x, "x"), axes)
    return layer_by_layer(lambda q: _transpose_layer(q, axes), x)


def _transpose_layer(x: QTensor, axes) -> QTensor:
    perm = _permutation(axes, x.ndim)
    packed = isinstance(x.qvalue, PackedArray)
    codes = jnp.transpose(x.qvalue.unpack() if packed else x.qvalue, perm)
    layout, scale, zero_point = x.layout, x.scale, x.zero_point
    axis, block_size = None, layout.block_size
    if layout.kind in ("axis", "block"):
        axis = perm.index(layout.axis)
    if layout.kind in ("block", "tile"):
        scale = transpose(scale, perm)  # a two-level scale is a QTensor
        zero_point = None if zero_point is None else jnp.transpose(zero_point, perm)
    if layout.kind == "tile":
        block_size = tuple(block_size[p] for p in perm)
    out = QTensor(codes, scale, zero_point, axis=axis, block_size=block_size, dtype=x.dtype,
                  codebook=x.codebook)
    if not packed:
        return out
    try:
        return pack(out)
    except ValueError:  # the last axis is split across devices: bytes along the old axis
        return pack(out, perm.index(x.qvalue.axis))
