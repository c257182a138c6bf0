"""Whole parameter trees: `QuantSpec` rules, `quantize_tree`, `dequantize_tree`.

A rule is a plain ``(pattern, spec)`` pair. Each leaf's path is its keys
joined by ``/`` (``params/Dense_0/kernel``), matched with `re.search`; the
first matching rule wins, ``spec=None`` keeps the leaf, unmatched leaves are
kept. Only floating-point leaves are ever quantized.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxquant._args import as_dtype
from jaxquant._formats import CODEBOOKS, get_format
from jaxquant._granularity import _is_int
from jaxquant._leaves import is_abstract, is_record, leaf_nbytes, stacked_axes
from jaxquant._progress import progress_bar
from jaxquant._qtensor import QTensor, is_qtensor
from jaxquant._quantize import check_flags, dequantize, quantize
from jaxquant._scale_formats import scale_options
from jaxquant._schemes import SCHEMES, resolve

__all__ = ["QuantSpec", "quantize_tree", "dequantize_tree", "path_str", "match_rules",
           "unused_rules", "is_record", "tree_nbytes"]


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How to quantize one array: a frozen, hashable record.

    Attributes:
      dtype: the format (see `jaxquant.FORMATS`), a codebook name (``"nf4"``,
        ``"fp4"``, ``"float6_e2m3fn"``, ...) or a named composite format
        (``"mxfp4"``, ``"nvfp4"``, ...: `jaxquant.SCHEMES`).
      axis: the axis with its own scales (``-1``: the output features of a
        ``(in, out)`` kernel); ``None`` for per-tensor.
      block_size: split ``axis`` into blocks of this length (``None``: no
        blocks), or a tuple of tile lengths, one per axis (``axis`` is then
        not used).
      symmetric: symmetric scales, or asymmetric with a zero point (integer
        formats only).
      saturate: float formats: clip to the largest finite value.
      packed: store 2-, 4- and 6-bit codes packed (two int4 per byte) along the last axis.
      scale_dtype: how scales are stored (``None``: float32; see `jaxquant.quantize`).
      scale_rounding: ``float8_e8m0fnu`` scales: ``"floor"``, ``"ceil"`` or
        ``"up_on_overflow"``.
      double_quant: quantize the scales themselves to float8 (groups of 256).

    Raises:
      TypeError: unknown format or scale dtype; ``axis`` not an int or ``None``.
      ValueError: ``block_size <= 0``, ``block_size`` without ``axis``, a block
        length that contradicts a named format, ``packed`` for a wide format,
        ``symmetric=False`` for a float or codebook format (only integer formats
        have zero points).

    Example:
      >>> QuantSpec(dtype=jnp.int4, block_size=32)
      QuantSpec(dtype=dtype(int4), axis=-1, block_size=32, symmetric=True,
                saturate=True, packed=False, scale_dtype=None, scale_rounding='floor',
                double_quant=False)
      >>> QuantSpec(dtype="nf4", packed=True, double_quant=True)(jnp.ones((4, 128))).scale
      QTensor(float8_e4m3fn[4, 2], tiles=(4, 2), scale[1, 1], dtype=float32)
    """

    dtype: DTypeLike | str = jnp.int8
    axis: int | None = -1
    block_size: int | tuple[int, ...] | None = None
    symmetric: bool = True
    saturate: bool = True
    packed: bool = False
    scale_dtype: DTypeLike | None = None
    scale_rounding: str = "floor"
    double_quant: bool = False

    def __post_init__(self):
        check_flags(symmetric=self.symmetric, saturate=self.saturate, packed=self.packed,
                    double_quant=self.double_quant)
        named = isinstance(self.dtype, str) and (self.dtype in SCHEMES or self.dtype in CODEBOOKS)
        if not named:
            object.__setattr__(self, "dtype", get_format(self.dtype).dtype)
        if self.axis is not None and not _is_int(self.axis):
            raise TypeError(f"axis must be an int or None, got {self.axis!r}.")
        # NumPy integers as Python ints: the fields are static metadata, checked below
        as_int = lambda v: int(v) if _is_int(v) else v  # noqa: E731
        object.__setattr__(self, "axis", as_int(self.axis))
        b = self.block_size
        object.__setattr__(self, "block_size", tuple(map(as_int, b))
                           if isinstance(b, list | tuple) else as_int(b))
        if self.scale_dtype is not None:
            object.__setattr__(self, "scale_dtype", as_dtype(self.scale_dtype, "scale_dtype"))
        r = resolve(self.dtype, self.axis, self.block_size, self.scale_dtype)
        if isinstance(r.block_size, tuple):
            for b in r.block_size:
                if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
                    raise ValueError(f"block_size must hold positive integers, got "
                                     f"{self.block_size!r}.")
        elif r.block_size is not None:
            if isinstance(r.block_size, bool) or not isinstance(r.block_size, int) \
                    or r.block_size <= 0:
                raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}.")
            if r.axis is None:
                raise ValueError("block_size requires axis: the axis that is split into blocks.")
        if self.packed and r.fmt.bits not in (2, 4, 6):
            raise ValueError(f"packed=True needs a 2-, 4- or 6-bit format, got {r.fmt.name}.")
        if not self.symmetric and not r.fmt.is_integer:
            raise ValueError(f"symmetric=False needs an integer format (a zero point); "
                             f"{r.fmt.name} is a {r.fmt.kind} format, which has none.")
        scale_options(r.scale_dtype, self.scale_rounding, self.double_quant, self.symmetric)

    def __call__(self, x: jax.Array) -> QTensor:
        """Quantizes one array with this spec (scales computed from ``x``).

        Args:
          x: a float array.

        Returns:
          ``jaxquant.quantize(x, dtype=..., axis=..., ...)`` with this spec's fields.

        Raises:
          TypeError, ValueError: as `jaxquant.quantize` (non-float ``x``, ``axis``
            out of range...).

        Example:
          >>> QuantSpec(axis=0)(jnp.array([[1.0, -2.0], [0.5, 0.25]])).scale
          Array([0.01574803, 0.00393701], dtype=float32)
        """
        return quantize(x, packed=self.packed, **self.computed_kwargs())

    def computed_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `jaxquant.quantize` / `jaxquant.fake_quant` (computed
        scales) that this spec stands for, ``packed`` apart.

        Example:
          >>> QuantSpec(dtype="nf4", double_quant=True).computed_kwargs()["double_quant"]
          True
        """
        tiles = isinstance(self.block_size, tuple)
        return dict(dtype=self.dtype, axis=None if tiles else self.axis,
                    block_size=self.block_size, symmetric=self.symmetric,
                    saturate=self.saturate, scale_dtype=self.scale_dtype,
                    scale_rounding=self.scale_rounding, double_quant=self.double_quant)


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
    checked = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)
                and (rule[1] is None or isinstance(rule[1], QuantSpec))):
            raise TypeError(f"rules[{i}] must be a (pattern: str, QuantSpec | None) pair, "
                            f"got {rule!r}.")
        try:
            checked.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise ValueError(f"rules[{i}]: pattern {rule[0]!r} is not a valid regular "
                             f"expression: {e}.") from e
    return checked


def _is_float(leaf) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)


def _select(path: str, leaf, rules) -> tuple[QuantSpec | None, int | None]:
    """(spec or None, index of the rule that matched or None)."""
    if rules is None or isinstance(rules, QuantSpec):
        ok = _is_float(leaf) and leaf.ndim >= 2
        return ((rules or QuantSpec()) if ok else None), None
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
      >>> tree = {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}}
      >>> match_rules(tree, [("kernel", QuantSpec(dtype=jnp.int4))])["dense/bias"] is None
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
      >>> unused_rules({"w": jnp.ones((2, 2))}, [("w", QuantSpec()), ("kernal", None)])
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
        ``QuantSpec()``; a `QuantSpec`: the same selection with that spec; or a
        sequence of ``(pattern, QuantSpec | None)``: the first pattern that
        `re.search` finds in the leaf's ``/``-joined path wins, ``None`` keeps
        the leaf, unmatched leaves are kept. Non-float leaves and existing
        `QTensor` and `PackedArray` leaves are always kept (each under its own
        path, not its children's).
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
      >>> import jaxquant as jq
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
                try:  # placeholders (ShapeDtypeStruct): an abstract QTensor, shardings kept
                    leaf = jax.eval_shape(spec, leaf) if is_abstract(leaf) else spec(leaf)
                except (TypeError, ValueError) as e:  # name the leaf the rule failed on
                    raise type(e)(f"leaf {path_str(path)!r} ({jnp.dtype(leaf.dtype).name}"
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
      >>> import jaxquant as jq
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
        return jax.eval_shape(f, leaf) if is_abstract(leaf) else f(leaf)

    return jax.tree_util.tree_map_with_path(restore, tree, is_leaf=is_qtensor)


def tree_nbytes(tree: Any) -> int:
    """Storage bytes of a tree, counting `QTensor` leaves at their real cost.

    Args:
      tree: a pytree of arrays (jax or NumPy), `QTensor` leaves, and other leaves
        that `quantize_tree` keeps (Python numbers: the bytes of their NumPy array).

    Returns:
      The sum of ``size * itemsize`` of the arrays and `QTensor.nbytes` (codes
      at their bit width, plus scales and zero points).

    Example:
      >>> tree_nbytes({"w": jnp.ones((4, 8)), "q": quantize(jnp.ones((4, 8)), axis=1)})
      192
    """
    return sum(leaf_nbytes(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_record))
