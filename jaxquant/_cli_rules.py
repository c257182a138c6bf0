"""The rules of the ``jaxquant quantize`` command line: ``REGEX=SPEC`` parsed into
`jaxquant.quantize_tree` rules, and why a rule that quantizes nothing does nothing.

The grammar is in `jaxquant._cli`'s docstring (the ``--help`` text).
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from jaxquant._formats import CODEBOOKS, FORMATS
from jaxquant._schemes import SCHEMES
from jaxquant._spec import QuantSpec

__all__ = ["parse_spec", "parse_rule", "rule_warnings"]


def parse_spec(text: str) -> QuantSpec | None:
    """A `QuantSpec` from its command-line form (``int4:block=32:packed``; ``none``).

    Args:
      text: ``none``, or a format name followed by ``:``-separated options
        ``axis=INT``, ``axis=none``, ``block=INT``, ``packed``, ``asym``,
        ``nosaturate``, ``stacked=INT`` ... (see `jaxquant._cli`'s docstring).

    Returns:
      The spec, or ``None`` for ``none`` (the tensor is kept).

    Raises:
      ValueError: an unknown (with the closest known name, if any), repeated or
        conflicting option or format, an option without its value, a malformed
        number, or options that `QuantSpec` rejects (``packed`` for int8...).

    Example:
      >>> parse_spec("int4:axis=0:block=32:packed")
      QuantSpec(dtype=dtype(int4), axis=0, block_size=32, symmetric=True, saturate=True,
                packed=True, scale_dtype=None, scale_rounding='floor', double_quant=False,
                stacked=0)
      >>> parse_spec("nf4:packed:dq").double_quant
      True
      >>> parse_spec("int8:sym")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: unknown option 'sym' in 'int8:sym'; expected axis=INT, ... (did you mean 'asym'?).
    """
    name, *options = text.strip().split(":")
    if name == "none":
        if options:
            raise ValueError(f"{text!r}: 'none' (keep the tensor) takes no options, got "
                             f"{':'.join(options)!r}.")
        return None
    names = list(dict.fromkeys([*FORMATS, *CODEBOOKS, *SCHEMES]))
    if name not in names:
        raise ValueError(f"unknown format {name!r} in {text!r}; expected none or one of "
                         f"{', '.join(names)}{_did_you_mean(name, names)}.")
    kw: dict[str, Any] = {"dtype": name}
    seen: set[str] = set()
    for opt in options:
        key, eq, value = opt.partition("=")
        if not value and key in _VALUED:
            after = " after '='" if eq else ""
            raise ValueError(f"{opt!r} in {text!r} needs a value{after}, for example "
                             f"{_VALUED[key]!r}.")
        _check_option(key, seen, opt, text)
        if key == "axis" and value:
            kw["axis"] = None if value == "none" else _int(value, opt, text)
        elif key == "block" and value:
            kw["block_size"] = _int(value, opt, text)
        elif key == "tile" and value:
            kw["block_size"] = tuple(_int(v, opt, text) for v in value.split("x"))
            kw["axis"] = None
        elif key == "scale" and value:
            kw["scale_dtype"] = value
        elif key == "round" and value:
            kw["scale_rounding"] = value
        elif key == "stacked" and value:
            kw["stacked"] = _int(value, opt, text)
        elif opt == "dq":
            kw["double_quant"] = True
        elif opt in ("packed", "asym", "nosaturate"):
            kw[{"packed": "packed", "asym": "symmetric", "nosaturate": "saturate"}[opt]] = \
                opt == "packed"
        else:
            hint = _did_you_mean(key if eq else opt, [*_VALUED, *_FLAGS])
            raise ValueError(f"unknown option {opt!r} in {text!r}; expected axis=INT, axis=none, "
                             f"block=INT, tile=INTxINT, packed, asym, nosaturate, dq, "
                             f"scale=DTYPE, round=MODE or stacked=INT{hint}.")
    try:
        return QuantSpec(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{text!r}: {e}") from e


_VALUED = {"axis": "axis=0", "block": "block=32", "tile": "tile=128x128",  # NAME=VALUE options,
           "scale": "scale=bfloat16", "round": "round=ceil", "stacked": "stacked=1"}  # examples
_FLAGS = ("packed", "asym", "nosaturate", "dq")


def _did_you_mean(word: str, known: list[str]) -> str:
    """``" (did you mean 'int8'?)"``: the name of ``known`` closest to ``word``, case aside;
    ``""`` when none is close."""
    lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.7)
    return f" (did you mean {lower[close[0]]!r}?)" if close else ""


def _check_option(key: str, seen: set[str], opt: str, text: str) -> None:
    """Adds ``key`` (``axis``, ``packed``...) to ``seen``, the options before ``opt`` in ``text``.

    Raises:
      ValueError: a repeated option (the last would silently win), ``block=`` with
        ``tile=``, or ``axis=`` with ``tile=`` (which would silently drop one).
    """
    if key in seen:
        raise ValueError(f"{opt!r} in {text!r} repeats an option; give each option once.")
    seen.add(key)
    if "tile" in seen and "block" in seen:
        raise ValueError(f"{opt!r} in {text!r}: block= and tile= exclude each other.")
    if "tile" in seen and "axis" in seen:
        raise ValueError(f"{opt!r} in {text!r}: tile= takes no axis= (tiles span every axis).")


def _int(value: str, opt: str, text: str) -> int:
    if not re.fullmatch(r"[+-]?[0-9]+", value):  # int() also reads "1_0" and other scripts' digits
        raise ValueError(f"{opt!r} in {text!r} needs an integer, got {value!r}.")
    number = int(value)
    if abs(number) >= 2**31:
        raise ValueError(f"{opt!r} in {text!r}: {number} is out of range (|n| < 2**31).")
    return number


def parse_rule(text: str) -> tuple[str, QuantSpec | None]:
    """A ``(pattern, spec)`` rule from ``REGEX=SPEC`` (split at the first ``=``).

    Args:
      text: the rule, for example ``'attn/.*kernel=int4:block=32:packed'``.

    Returns:
      ``(pattern, QuantSpec | None)``, as `jaxquant.quantize_tree` takes.

    Raises:
      ValueError: no ``=``, an invalid regular expression, or a bad SPEC.

    Example:
      >>> parse_rule("bias$=none")
      ('bias$', None)
      >>> parse_rule("kernel=float8_e4m3fn:axis=none")[1].axis is None
      True
    """
    pattern, sep, spec = text.partition("=")
    if not sep:
        raise ValueError(f"rule {text!r} must be REGEX=SPEC, for example 'kernel=int8'.")
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as e:  # a{99999999999}: OverflowError
        raise ValueError(f"rule {text!r}: invalid regular expression {pattern!r}: {e}.") from None
    try:
        return pattern, parse_spec(spec)
    except ValueError as e:
        raise ValueError(f"rule {text!r}: {e}") from None


def rule_warnings(tree, rules: list[tuple[str, QuantSpec | None]]) -> list[str]:
    """Why each rule (``(pattern, spec)``, first match wins) that quantizes nothing does nothing.

    Returns:
      One line per rule that takes no tensor of ``tree`` (it matches none, or only
      tensors an earlier rule takes), then one per rule with a format whose tensors
      are all kept (not float, or already quantized), then one per per-axis rule that
      takes 1-D tensors (one scale per element: a LayerNorm's weight grows 1.25x as
      int8), in the order of the rules.
    """
    import jax

    from jaxquant._tree import _is_float, is_record, path_str

    leaves = [(path_str(p), leaf)
              for p, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_record)]
    patterns = [re.compile(pattern) for pattern, _ in rules]
    taken: list[list] = [[] for _ in rules]
    for name, leaf in leaves:
        first = next((i for i, p in enumerate(patterns) if p.search(name)), None)
        if first is not None:
            taken[first].append((name, leaf))
    idle, kept, grown = [], [], []
    for (pattern, spec), compiled, mine in zip(rules, patterns, taken, strict=True):
        if not mine:
            shadowed = any(compiled.search(name) for name, _ in leaves)
            idle.append(f"rule {pattern!r} matches " + ("only tensors that an earlier rule takes"
                                                        if shadowed else "no tensor"))
        elif spec is not None and not any(_is_float(x) and not is_record(x) for _, x in mine):
            records = sum(is_record(x) for _, x in mine)
            what = {0: "not float", len(mine): "already quantized"}.get(
                records, "not float or already quantized")
            kept.append(f"rule {pattern!r} matches only tensors that are {what} "
                        f"(kept as they are)")
        elif spec is not None and spec.axis is not None and _block(spec) is None:
            vectors = [name for name, x in mine if _is_float(x) and not is_record(x)
                       and getattr(x, "ndim", 0) - (spec.stacked or 0) == 1
                       and _grows(spec, x)]
            if vectors:
                grown.append(f"rule {pattern!r} gives {len(vectors)} 1-D tensor(s) "
                             f"({vectors[0]!r}...) one scale per element (axis={spec.axis}), "
                             f"larger than they were: exempt them with an earlier rule "
                             f"(e.g. 'ln_|norm=none') or use axis=none")
    return idle + kept + grown


def _grows(spec, x) -> bool:
    """Whether ``spec`` stores ``x`` in more bytes than ``x`` itself (codes plus scales)."""
    import jax

    from jaxquant._tree import leaf_nbytes, tree_nbytes

    try:
        return tree_nbytes(jax.eval_shape(spec, x)) > leaf_nbytes(x)
    except (TypeError, ValueError):
        return False  # a spec that cannot take x: the conversion itself says why


def _block(spec):
    """The block length ``spec`` quantizes with: its own, or its scheme's (NVFP4 16, MX 32,
    NF4 / FP4 64), ``None`` for one scale per entry of its axis."""
    from jaxquant._schemes import resolve

    return resolve(spec.dtype, spec.axis, spec.block_size, spec.scale_dtype,
                   double_quant=spec.double_quant).block_size


def torch_layout_warning(specs: dict, tree: dict) -> str | None:
    """For a file PyTorch wrote (``format: pt``) quantized without rules: a line when 2-D
    tensors get one scale per last-axis entry, per input channel of a ``Linear`` weight.

    Args:
      specs: tensor name -> the `QuantSpec` that applies, or ``None``.
      tree: tensor name -> tensor.
    """
    names = [n for n, s in specs.items() if s is not None and s.block_size is None
             and s.axis in (-1, 1) and not s.stacked and getattr(tree[n], "ndim", 0) == 2]
    if not names:
        return None
    return (f"IN was saved by PyTorch (format: pt): without --rules its {len(names)} 2-D "
            f"tensor(s) ({names[0]!r}...) get one scale per last-axis entry, which for a "
            f"Linear weight (out, in) is per input channel; axis=0 gives one per output "
            f"channel (e.g. --rules 'weight$=int8:axis=0'). Weights stored (in, out), as "
            f"GPT-2's Conv1D, are per output channel as they are.")
