"""The covered layers of an ``nnx`` model's graph, by path, with the rule each gets.

``nnx.iter_graph`` visits a module once, at its first path. A layer reachable
at several paths (one module held by two attributes: tied weights) is one
layer, listed at that first path; rules that would give its paths different
configs are refused, rather than silently following the first path. So are
rules that give different configs to two layers sharing one kernel ``Variable``
(``b.kernel = a.kernel``): it holds one float or one QTensor kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

from flax import nnx
from flax.nnx import graph

from jaxquant.flax._rules import QuantConfig, Rules, check_rules, select

__all__ = ["LAYERS", "covered_layers", "layer_paths"]

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
      TypeError, ValueError: malformed rules; a shared layer whose paths the rules
        give different configs, or layers sharing a kernel Variable that they give
        different configs.

    Example:
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
      >>> [(p, cfg) for p, _, cfg in covered_layers(model, [("layers/0", None)])]
      [('layers/0', None)]
    """
    compiled = check_rules(rules)
    shared = {k: v for k, v in layer_paths(model).items() if len(v) > 1}
    kernels: dict[int, tuple[str, QuantConfig | None]] = {}  # by the kernel Variable's id
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, LAYERS):
            continue
        p = "/".join(str(k) for k in path)
        cfg = select(p, compiled)[0]
        var = getattr(node, "embedding" if isinstance(node, nnx.Embed) else "kernel")
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
