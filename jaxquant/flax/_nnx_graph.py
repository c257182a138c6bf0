"""The covered layers of an ``nnx`` model's graph, by path, with the rule each gets.

``nnx.iter_graph`` visits a module once, at its first path. A layer reachable
at several paths (one module held by two attributes: tied weights) is one
layer, listed at that first path; rules that would give its paths different
configs are refused, rather than silently following the first path. So are
rules that give different configs to two layers sharing one kernel ``Variable``
(``b.kernel = a.kernel``): it holds one float or one QTensor kernel.

Also the kernel of a layer: its attribute name, its shape, its stacked axes.
"""

from __future__ import annotations

from collections.abc import Iterator

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.nnx import graph

from jaxquant._packing import unpack
from jaxquant._qtensor import is_qtensor
from jaxquant.flax._rules import QuantConfig, Rules, check_rules, select

__all__ = ["LAYERS", "covered_layers", "kernel_name", "kernel_shape", "layer_paths",
           "spec_layout", "stack", "stacked_axes"]

LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose, nnx.Einsum, nnx.Embed)


def layer_paths(model: nnx.Module) -> dict[int, list[str]]:
    """Every ``/``-joined path of every covered layer, keyed by the layer's ``id``.

    Example:
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
      >>> list(layer_paths(model).values())
      [['layers/0']]
    """
    found: dict[int, list[str]] = {}

    def visit(node, path: tuple, ancestors: frozenset) -> None:
        if isinstance(node, LAYERS):
            found.setdefault(id(node), []).append("/".join(str(k) for k in path))
        if id(node) in ancestors or isinstance(node, nnx.Variable) or not graph.is_node(node):
            return
        impl = graph.get_node_impl(node)
        if impl is not None:
            for key, child in impl.node_dict(node).items():
                visit(child, (*path, key), ancestors | {id(node)})

    visit(model, (), frozenset())
    return found


def covered_layers(model: nnx.Module, rules: Rules
                   ) -> Iterator[tuple[str, nnx.Module, QuantConfig | None]]:
    """``(path, layer, config or None)`` for each covered layer, in graph order.

    Args:
      model: an ``nnx.Module``.
      rules: one `QuantConfig` or ``(pattern, QuantConfig | None)`` pairs.

    Returns:
      An iterator; a shared layer comes once, at its first path.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``; malformed rules.
      ValueError: an invalid pattern; a shared layer whose paths the rules give
        different configs, or layers sharing a kernel Variable that they give
        different configs.

    Example:
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
      >>> [(p, cfg) for p, _, cfg in covered_layers(model, [("layers/0", None)])]
      [('layers/0', None)]
    """
    if not isinstance(model, nnx.Module):
        hint = "; a linen Module takes quantize_linen" if isinstance(model, nn.Module) else ""
        raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}{hint}.")
    compiled = check_rules(rules)
    shared = {k: v for k, v in layer_paths(model).items() if len(v) > 1}
    kernels: dict[int, tuple[str, QuantConfig | None]] = {}  # by the kernel Variable's id
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, LAYERS):
            continue
        p = "/".join(str(k) for k in path)
        cfg = select(p, compiled)[0]
        var = getattr(node, kernel_name(node))
        first, first_cfg = kernels.setdefault(id(var), (p, cfg))
        if first_cfg != cfg:
            raise ValueError(
                f"the {type(node).__name__} at {p!r} shares its kernel Variable with the "
                f"layer at {first!r}, but the rules give {p!r} {cfg} and {first!r} "
                f"{first_cfg}; make the rules of both layers agree.")
        for q in shared.get(id(node), ()):
            if (other := select(q, compiled)[0]) != cfg:
                raise ValueError(
                    f"the {type(node).__name__} at {p!r} is also reachable at {q!r} (one "
                    f"layer, shared), but the rules give {p!r} {cfg} and {q!r} {other}; "
                    f"make the rules of both paths agree.")
        yield p, node, cfg


def kernel_name(layer) -> str:
    """``"embedding"`` for an ``Embed``, else ``"kernel"``: the layer's kernel attribute."""
    return "embedding" if isinstance(layer, nnx.Embed) else "kernel"


def kernel_shape(layer) -> tuple[int, ...]:
    """The shape of one layer's kernel (table), from the layer's attributes."""
    if isinstance(layer, nnx.Embed):
        return (layer.num_embeddings, layer.features)
    if isinstance(layer, nnx.Conv | nnx.ConvTranspose | nnx.Einsum):
        return tuple(layer.kernel_shape)
    if isinstance(layer, nnx.LinearGeneral):
        return (*layer.batch_axis.values(), *layer.in_features, *layer.out_features)
    return (layer.in_features, layer.out_features)


def stacked_axes(path: str, layer, kernel) -> int:
    """How many leading axes stack copies of the layer's kernel (``nnx.vmap``-made
    layers), or a ValueError naming the layer when ``kernel`` does not end in its shape."""
    want = kernel_shape(layer)
    shape = tuple(kernel.shape)
    if shape[len(shape) - len(want):] != want:
        raise ValueError(f"the {type(layer).__name__} at {path!r} expects a "
                         f"{kernel_name(layer)} of shape {want} (or stacked layers of it), got "
                         f"{'a QTensor' if is_qtensor(kernel) else 'an array'} of shape {shape}.")
    return len(shape) - len(want)


def stack(fn, extra: int):
    """``fn`` vmapped over ``extra`` leading axes: one layer's kernel at a time."""
    for _ in range(extra):
        fn = jax.vmap(fn)
    return fn


def spec_layout(qt) -> tuple:
    """What a QTensor's spec decides, storage aside: its leaves' shapes and dtypes (unpacked),
    its axis (non-negative), block and codebook."""
    qt = jax.eval_shape(unpack, qt)
    axis = None if qt.axis is None else qt.axis % max(qt.ndim, 1)
    return ([(tuple(a.shape), np.dtype(a.dtype)) for a in jax.tree.leaves(qt)], axis,
            qt.block_size, qt.codebook)
