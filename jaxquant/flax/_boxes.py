"""Sharding annotations of a float kernel carried onto the arrays of its `QTensor`.

A kernel's mesh-axis names (linen ``nn.with_partitioning``, nnx
``out_sharding`` metadata) name the kernel's axes. Its QTensor holds arrays of
other ranks: the codes take the kernel's names, the scales (and zero points)
those of the axes they vary along: none per tensor, the channel axis's per
channel, all of them for blocks and tiles (same rank as the kernel). In nnx the
QTensor kernel is held by a `QuantizedParam`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from flax import nnx
from flax.typing import MISSING
from jax.sharding import NamedSharding, PartitionSpec

from jaxquant._qtensor import QTensor, is_qtensor

__all__ = ["QuantizedParam", "box_qtensor", "keep_sharding", "leaf_names", "qtensor_pspec"]


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
        codes = jax.tree.leaves(qt.scale.qvalue)  # its scales (tiles over whole axes, a
        rest = jax.tree.leaves(qt.scale)[len(codes):]  # few entries): replicated, as made
        out += [scale] * len(codes) + [names[:extra] + (None,) * (len(a.shape) - extra)
                                       for a in rest]
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


class QuantizedParam(nnx.Param):
    """The ``nnx.Param`` of a QTensor kernel (made by `jaxquant.flax.nnx_quantize`).

    ``nnx.get_partition_spec`` (and ``get_named_sharding``) give it one spec per
    array of the QTensor: the codes the kernel's ``out_sharding``, the scales
    those of their own axes (the channel axis's, per channel). Where Flax gives
    it an abstract value of the kernel's shape and dtype (``nnx.eval_shape`` under
    ``jax.set_mesh``, ``nnx.as_abstract``), it keeps an abstract QTensor, each array
    with its own spec on that mesh, so that a checkpoint loads into it. Metadata
    ``stacked``: the leading axes of ``nnx.vmap``-made layers. As a filter,
    ``nnx.state(model, QuantizedParam)`` selects the quantized kernels.

    Example:
      >>> from flax import nnx
      >>> from jaxquant.flax import QuantConfig, QuantizedParam, nnx_quantize
      >>> layer = nnx_quantize(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), QuantConfig())
      >>> isinstance(layer.kernel, QuantizedParam), type(layer.kernel.get_value()).__name__
      (True, 'QTensor')
    """

    def _qtensor_of(self, value):
        """``value``, or for a ShapeDtypeStruct of the held QTensor's shape and dtype, the
        QTensor of ShapeDtypeStructs, each array on its spec of ``value``'s mesh."""
        raw = self.get_raw_value()
        if not (is_qtensor(raw) and isinstance(value, jax.ShapeDtypeStruct)
                and (tuple(value.shape), value.dtype) == (tuple(raw.shape), raw.dtype)):
            return value
        leaves, treedef = jax.tree.flatten(raw)
        sharding = value.sharding
        if isinstance(sharding, NamedSharding):
            names = leaf_names(raw, tuple(sharding.spec), self.get_metadata().get("stacked", 0))
            shardings = [NamedSharding(sharding.mesh, PartitionSpec(*n)) for n in names]
        else:
            shardings = [None] * len(leaves)
        return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                            for a, s in zip(leaves, shardings, strict=True)])

    def set_value(self, value, **kwargs):
        return super().set_value(self._qtensor_of(value), **kwargs)

    def copy(self, value=MISSING, **updates):
        raw = self.get_raw_value()
        if isinstance(value, PartitionSpec) and is_qtensor(raw):
            value = qtensor_pspec(raw, value, self.get_metadata().get("stacked", 0))
        return super().copy(self._qtensor_of(value), **updates)

    replace = copy


def keep_sharding(layer, name: str, var, extra: int, boxed: dict) -> None:
    """Swaps ``var``, the ``nnx.Param`` ``name`` of ``layer`` (holding a QTensor now), for a
    `QuantizedParam` with its metadata; ``extra``: leading stacked-layer axes; ``boxed``:
    ``{id(var): (var, its QuantizedParam)}`` of the layers done, updated, so that layers
    sharing one kernel Variable go on sharing one."""
    if id(var) in boxed:
        setattr(layer, name, boxed[id(var)][1])
        return
    metadata = var.get_metadata(exclude_required=True)
    if type(var) is nnx.Param:
        metadata.update(stacked=extra)
        if metadata.get("out_sharding"):
            metadata.update(eager_sharding=False)  # placed as the float kernel
        boxed[id(var)] = (var, QuantizedParam(var.get_raw_value(), **metadata))
        setattr(layer, name, boxed[id(var)][1])
