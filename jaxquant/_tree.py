"""Whole parameter trees: rules of `QuantSpec`s, `quantize_tree`, `dequantize_tree`.

A rule is a plain ``(pattern, spec)`` pair. Each leaf's path is its keys
joined by ``/`` (``params/Dense_0/kernel``), matched with `re.search`; the
first matching rule wins, ``spec=None`` keeps the leaf, unmatched leaves are
kept. Only floating-point leaves are ever quantized (not ``float8_e8m0fnu`` scale
arrays or NumPy's float6, which `quantize` refuses).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._leaves import (
    eval_shape_sharded,
    is_abstract,
    is_record,
    leaf_dtype,
    leaf_nbytes,
    stacked_axes,
)
from jaxquant._progress import progress_bar
from jaxquant._qtensor import is_qtensor
from jaxquant._quantize import dequantize
from jaxquant._spec import QuantSpec

__all__ = ["quantize_tree", "dequantize_tree", "path_str", "match_rules",
           "unused_rules", "is_record", "tree_nbytes"]


Rules = QuantSpec | Sequence[tuple[str, QuantSpec | None]] | None


def path_str(path) -> str:
    """A key path as ``/``-joined key names (``params/Dense_0/kernel``).

    Args:
      path: a key path from `jax.tree_util.tree_flatten_with_path`.

    Returns:
      Dict keys, attribute names and sequence indices joined by ``/``.

    Example:
      >>> [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path({"a": [1, 2]})]
      ['a/0', 'a/1']
    """
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _check_rules(rules: Rules):
    """``rules`` validated: ``None``, a `QuantSpec`, or a list of (compiled pattern, spec)."""
    if rules is None or isinstance(rules, QuantSpec):
        return rules
    if isinstance(rules, jax.Array):  # jax.jit(quantize_tree)(tree, spec) traced the spec
        raise TypeError("rules is a traced value: rules are static; close over them or pass "
                        "them with jax.jit(quantize_tree, static_argnames='rules'), as a tuple "
                        "of pairs (a static argument must be hashable).")
    if isinstance(rules, tuple | list) and len(rules) == 2 and isinstance(rules[0], str) \
            and (rules[1] is None or isinstance(rules[1], QuantSpec)):
        raise TypeError(f"rules must be a sequence of (pattern, QuantSpec | None) pairs, got "
                        f"one pair {rules!r}; wrap it in a list: [{rules!r}].")
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Iterable):
        raise TypeError(f"rules must be None, a QuantSpec or a sequence of (pattern, QuantSpec "
                        f"| None) pairs, got {type(rules).__name__}: {rules!r}.")
    if isinstance(rules, set | frozenset):  # iterated in hash order: varies between runs
        raise TypeError(f"rules must be ordered (the first match wins); got a "
                        f"{type(rules).__name__}: {rules!r}. Pass a list of pairs.")
    if inspect.isgenerator(rules) and inspect.getgeneratorstate(rules) == inspect.GEN_CLOSED:
        raise ValueError("rules is a generator that an earlier call consumed (it yields no "
                         "rules now); pass a list of (pattern, QuantSpec | None) pairs instead.")
    # zip(...), map(...), iter([...]): consumed once, and (unlike a generator) with no
    # state that tells a consumed one from a fresh empty one
    single_pass = iter(rules) is rules and not inspect.isgenerator(rules)
    checked = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)
                and (rule[1] is None or isinstance(rule[1], QuantSpec))):
            raise TypeError(f"rules[{i}] must be a (pattern: str, QuantSpec | None) pair, "
                            f"got {rule!r}.")
        try:
            checked.append((re.compile(rule[0]), rule[1]))
        except (re.error, OverflowError, RecursionError) as e:  # a{99999999999}: Overflow
            raise ValueError(f"rules[{i}]: pattern {rule[0]!r} is not a valid regular "
                             f"expression: {e}.") from None
    if single_pass and not checked:  # an empty one is almost surely one used before
        raise ValueError(f"rules is an iterator ({type(rules).__name__}) that yields no rules, "
                         f"likely consumed by an earlier call; pass a list of (pattern, "
                         f"QuantSpec | None) pairs instead.")
    return checked


_NOT_QUANTIZABLE = ("float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn")  # `quantize` refuses


def _is_float(leaf) -> bool:
    """Whether ``leaf`` is a float array (or a Python float, a float32 tracer under jit)
    that `quantize` takes: not a scale format (``float8_e8m0fnu``) or NumPy's float6."""
    try:
        dtype = leaf_dtype(leaf)
    except TypeError:  # a dtype of another library's own (torch.quint8): kept as it is
        return False
    return jnp.issubdtype(dtype, jnp.floating) and dtype.name not in _NOT_QUANTIZABLE


def _ndim(leaf) -> int:
    return len(leaf.shape) if hasattr(leaf, "shape") else np.ndim(leaf)


def _select(path: str, leaf, rules) -> tuple[QuantSpec | None, int | None]:
    """(spec or None, index of the rule that matched or None)."""
    if rules is None or isinstance(rules, QuantSpec):
        spec = rules or QuantSpec()  # matrices: ndim >= 2 within one layer of a stacked spec
        ok = _is_float(leaf) and _ndim(leaf) - spec.stacked >= 2
        return (spec if ok else None), None
    for i, (pattern, spec) in enumerate(rules):
        if pattern.search(path):
            return (spec if _is_float(leaf) else None), i
    return None, None


def match_rules(tree: Any, rules: Rules = None) -> dict[str, QuantSpec | None]:
    """The spec each leaf gets (``None``: kept as it is), by path.

    Args:
      tree: a pytree of arrays (existing `QTensor` and `PackedArray` leaves are
        kept: ``None``).
      rules: as for `quantize_tree`.

    Returns:
      ``{path: QuantSpec | None}`` for every leaf, in the tree's leaf order.

    Raises:
      TypeError: a malformed rule, or rules in a set (unordered).
      ValueError: a pattern that is not a regular expression; a generator of rules that
        an earlier call consumed.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> tree = {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}}
      >>> jq.match_rules(tree, [("kernel", jq.QuantSpec(dtype=jnp.int4))])["dense/bias"] is None
      True
    """
    checked = _check_rules(rules)
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_record)
    return {path_str(p): (None if is_record(leaf) else _select(path_str(p), leaf, checked)[0])
            for p, leaf in leaves}


def unused_rules(tree: Any, rules: Rules) -> list[tuple[str, QuantSpec | None]]:
    """The rules of ``rules`` that match no leaf path of ``tree`` (likely typos).

    A rule that matches only paths an earlier rule already took counts as unused.

    Args:
      tree: a pytree of arrays.
      rules: as for `quantize_tree` (``None`` or a single `QuantSpec`: ``[]``).

    Returns:
      The unused ``(pattern, spec)`` pairs, in their order in ``rules``.

    Raises:
      TypeError: a malformed rule, or rules in a set (unordered).
      ValueError: a pattern that is not a regular expression; a generator of rules that
        an earlier call consumed.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> jq.unused_rules({"w": jnp.ones((2, 2))}, [("w", jq.QuantSpec()), ("kernal", None)])
      [('kernal', None)]
    """
    checked = _check_rules(rules)
    if checked is None or isinstance(checked, QuantSpec):
        return []
    used = set()
    for p, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_record):
        used.add(_select(path_str(p), leaf, checked)[1])
    # from ``checked``: ``rules`` may be an iterator, consumed by the check
    return [(pattern.pattern, spec) for i, (pattern, spec) in enumerate(checked) if i not in used]


def quantize_tree(tree: Any, rules: Rules = None, *, progress: bool = False) -> Any:
    """Quantizes the leaves of a pytree that a rule selects.

    Args:
      tree: any pytree of arrays (a Flax ``params`` dict, a checkpoint...); leaves
        may be `jax.ShapeDtypeStruct` placeholders, which give abstract `QTensor`
        leaves (as under `jax.eval_shape`, shardings included).
      rules: ``None``: every floating leaf with ``ndim >= 2`` gets
        ``QuantSpec()``; a `QuantSpec`: the same selection with that spec (with
        ``stacked=n``, ``ndim >= 2`` within one layer: stacked biases are kept); or a
        sequence of ``(pattern, QuantSpec | None)``: the first pattern that
        `re.search` finds in the leaf's ``/``-joined path wins, ``None`` keeps
        the leaf, unmatched leaves are kept. Non-float leaves (and
        ``float8_e8m0fnu`` scale arrays and NumPy's float6 arrays, which
        `quantize` refuses) and existing `QTensor` and `PackedArray` leaves are
        always kept (each under its own path, not its children's). A Python
        float is a float leaf (as it is under `jax.jit`, a float32 tracer).
      progress: show a tqdm bar over the leaves that are quantized (on stderr,
        when tqdm is installed; eager calls only, a traced call has nothing to
        show).

    Returns:
      The same structure with `QTensor` leaves where a rule applied. A sharded
      leaf (``NamedSharding``) gives codes with the same sharding and scales
      sharded along the mesh axes of the dimensions they index (per-axis: the
      channel's mesh axis; blocked: both); XLA's sharding propagation places
      them, eagerly or under ``jit``.

    Raises:
      TypeError: a malformed rule, or rules in a set (unordered).
      ValueError: a pattern that is not a regular expression; a generator of rules that
        an earlier call consumed; or, naming the leaf, a spec that does not fit it (as
        `jaxquant.quantize`).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> params = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
      >>> jq.quantize_tree(params)["dense"]["kernel"]
      QTensor(int8[4, 8], axis=1, scale[8], dtype=float32)
    """
    checked = _check_rules(rules)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_record)
    specs = [None if is_record(leaf) else _select(path_str(path), leaf, checked)[0]
             for path, leaf in flat]
    traced = any(isinstance(leaf, jax.core.Tracer) for _, leaf in flat)
    bar = progress_bar(enabled=progress if not traced else False, desc="quantize",
                       total=sum(s is not None for s in specs), unit="tensor")
    out = []
    with bar:
        for (path, leaf), spec in zip(flat, specs, strict=True):
            if spec is not None:
                if not hasattr(leaf, "shape"):  # a Python float: float32, as under jit
                    leaf = jnp.asarray(leaf)
                try:  # placeholders (ShapeDtypeStruct): an abstract QTensor, shardings kept
                    leaf = eval_shape_sharded(spec, leaf) if is_abstract(leaf) else spec(leaf)
                except (TypeError, ValueError) as e:  # name the leaf the rule failed on
                    raise type(e)(f"leaf {path_str(path)!r} ({leaf_dtype(leaf).name}"
                                  f"{list(leaf.shape)}): {e}") from e
                bar.update(1)
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def dequantize_tree(tree: Any) -> Any:
    """Turns every `QTensor` leaf back into an array of its ``dtype``.

    Under ``jit`` on sharded leaves, each array comes back with its codes'
    sharding.

    Args:
      tree: a pytree with `QTensor` leaves (abstract ones, of `jax.ShapeDtypeStruct`
        placeholders, give `jax.ShapeDtypeStruct` leaves).

    Returns:
      The same structure, `QTensor` leaves replaced by `jaxquant.dequantize`.

    A `QTensor` stacked by ``jax.vmap`` / ``lax.scan`` (the layers of a scanned
    model, one scale set each) is dequantized layer by layer, under as many
    ``jax.vmap`` as it has stacked axes.

    Raises:
      ValueError: a `QTensor` whose leaves fit its metadata after no number of leading
        axes is removed (edited by hand).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> t = jq.dequantize_tree(jq.quantize_tree({"w": jnp.eye(2)}))
      >>> t["w"]
      Array([[1., 0.],
             [0., 1.]], dtype=float32)
    """
    def restore(path, leaf):
        if not is_qtensor(leaf):
            return leaf
        f = dequantize
        for _ in range(stacked_axes(leaf, f"tree leaf {path_str(path)!r}")):
            f = jax.vmap(f)
        return eval_shape_sharded(f, leaf) if is_abstract(leaf) else f(leaf)

    return jax.tree_util.tree_map_with_path(restore, tree, is_leaf=is_qtensor)


def tree_nbytes(tree: Any) -> int:
    """Storage bytes of a tree, counting `QTensor` leaves at their real cost.

    Args:
      tree: a pytree of arrays (jax or NumPy), `QTensor` leaves, and other leaves
        that `quantize_tree` keeps (Python numbers: the bytes of their NumPy array).

    Returns:
      The sum of ``size * itemsize`` of the arrays and `QTensor.nbytes` (codes
      at their bit width, plus scales and zero points).

    Raises:
      TypeError: a leaf that is no array (an ``object()``), naming its path.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> jq.tree_nbytes({"w": jnp.ones((4, 8)), "q": jq.quantize(jnp.ones((4, 8)), axis=1)})
      192
    """
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_record)[0]:
        try:
            total += leaf_nbytes(leaf)
        except TypeError as e:
            raise TypeError(f"leaf {path_str(path)!r}: {e}") from None
    return total
