"""Sharding annotations of a float kernel carried onto the arrays of its `QTensor`.

A kernel's mesh-axis names (linen ``nn.with_partitioning``, nnx
``out_sharding`` metadata) name the kernel's axes. Its QTensor holds arrays of
other ranks: the codes take the kernel's names, the scales (and zero points)
those of the axes they vary along: none per tensor, the channel axis's per
channel, all of them for blocks and tiles (same rank as the kernel).
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

from jaxquant._qtensor import QTensor, is_qtensor

__all__ = ["box_qtensor", "leaf_names", "qtensor_pspec"]


def _scale_names(qt: QTensor, names: tuple, extra: int) -> tuple:
    """The names of ``qt``'s scale axes; ``extra`` leading stacked axes (``nn.scan``)."""
    if qt.block_size is not None:  # blocks and tiles: the kernel's rank
        return names
    if qt.axis is None:
        return names[:extra]
    return names[:extra] + (names[extra + qt.axis],)


def leaf_names(qt: QTensor, names, extra: int = 0) -> list[tuple]:
    """Mesh-axis names of each array of ``qt``, in ``jax.tree.leaves`` order.

    Args:
      qt: a QTensor (possibly stacked: ``extra`` leading axes, as ``jax.vmap`` makes).
      names: the names of the float kernel's axes (``None`` for a replicated axis).
      extra: how many leading axes of ``names`` are stacked layers.
    """
    names = tuple(names)
    names += (None,) * (jax.tree.leaves(qt.qvalue)[0].ndim - len(names))
    out = [names] * len(jax.tree.leaves(qt.qvalue))  # a PackedArray's bytes: same rank
    scale = _scale_names(qt, names, extra)
    if is_qtensor(qt.scale):  # two-level: codes of the scale's shape, their own scale
        out += leaf_names(qt.scale, scale, extra)
    else:
        out.append(scale)
    if qt.zero_point is not None:
        out.append(scale)
    return out


def box_qtensor(qt: QTensor, box: nn.Partitioned, extra: int = 0) -> QTensor:
    """``qt`` with each array in a copy of ``box`` (the float kernel's ``nn.Partitioned``)
    named for its own axes, so that ``nn.get_partition_spec`` gives one spec per array."""
    leaves, treedef = jax.tree.flatten(qt)
    names = leaf_names(qt, box.names, extra)
    return jax.tree.unflatten(treedef, [box.replace(value=v, names=n)
                                        for v, n in zip(leaves, names, strict=True)])


def qtensor_pspec(qt: QTensor, spec: PartitionSpec, extra: int = 0) -> QTensor:
    """A QTensor-shaped tree of ``PartitionSpec`` s, one per array of ``qt``, from the
    float kernel's ``spec`` (a prefix of ``qt`` for ``jax.jit`` / sharding constraints)."""
    leaves, treedef = jax.tree.flatten(qt)
    return jax.tree.unflatten(treedef, [PartitionSpec(*n)
                                        for n in leaf_names(qt, tuple(spec), extra)])
