"""The ``jaxquant`` command line: ``quantize``, ``report`` and ``demo``.

``jaxquant quantize IN.safetensors OUT.safetensors --rules 'REGEX=SPEC' ...``
reads a safetensors file (a plain one, such as a Hugging Face checkpoint, or
one jaxquant wrote), quantizes its tensors by rules, writes a jaxquant
safetensors file and prints the per-tensor report. ``jaxquant report IN [OUT]``
prints the report of a file alone (formats, bytes) or of IN against its
quantized OUT (SQNR, largest error). ``jaxquant demo`` trains, quantizes and
runs a small model. ``quantize`` and ``demo`` show progress bars on stderr (when
tqdm is installed); ``--quiet`` turns them off.

Rules, one ``--rules`` argument each, tried in order (the first whose REGEX
`re.search` finds in a tensor's name wins; unmatched tensors are kept)::

    RULE   := REGEX "=" SPEC            (split at the first "=")
    SPEC   := "none" | FORMAT (":" OPTION)*
    FORMAT := int2 | uint2 | int4 | uint4 | int8 | uint8 | int16 | uint16 | int32
              | float8_e4m3fn | float8_e5m2 | float4_e2m1fn
              | nf4 | fp4 | float6_e2m3fn | float6_e3m2fn           (codebooks)
              | mxfp8_e4m3 | mxfp8_e5m2 | mxfp6_e2m3 | mxfp6_e3m2
              | mxfp4 | mxint8 | nvfp4                              (composites)
    OPTION := "axis=" INT | "axis=none"  (default -1: one scale per last-axis entry)
              | "block=" INT             (blocks of INT along axis)
              | "tile=" INT "x" INT ...  (scales over tiles, one length per axis;
                                          integer, float and codebook formats, not
                                          the mx* and nvfp4 composites)
              | "packed"                 (2- and 4-bit codes two or four per byte)
              | "asym"                   (asymmetric: min/max with a zero point;
                                          integer formats only)
              | "nosaturate"             (float formats: no clipping to the largest value)
              | "dq"                     (double quantization of the scales)
              | "scale=" DTYPE           (float32, bfloat16, float16, float8_e8m0fnu, ...)
              | "round=" MODE            (e8m0 scales: floor, ceil or up_on_overflow)

Examples: ``int8``, ``int8:axis=0``, ``int4:block=32:packed``, ``float8_e4m3fn``,
``nf4:packed:dq``, ``mxfp4:packed:round=ceil``, ``int8:tile=128x128``, ``none``.
Without ``--rules``, every floating tensor of rank >= 2 becomes int8 with one
scale per last-axis entry (`jaxquant.quantize_tree`'s default).
PyTorch checkpoints store ``Linear`` weights as ``(out, in)``: ``axis=0`` gives
one scale per output channel.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from jaxquant._formats import CODEBOOKS, FORMATS
from jaxquant._schemes import SCHEMES
from jaxquant._tree import QuantSpec

__all__ = ["main", "parse_spec", "parse_rule"]

_USAGE_ERROR, _RUN_ERROR = 2, 1
_HELP = __doc__.replace("``", "").replace("`", "")  # the docstring, without markup


def parse_spec(text: str) -> QuantSpec | None:
    """A `QuantSpec` from its command-line form (``int4:block=32:packed``; ``none``).

    Args:
      text: ``none``, or a format name followed by ``:``-separated options
        ``axis=INT``, ``axis=none``, ``block=INT``, ``packed``, ``asym``,
        ``nosaturate`` (see the module docstring).

    Returns:
      The spec, or ``None`` for ``none`` (the tensor is kept).

    Raises:
      ValueError: an unknown format or option, a malformed number, or options
        that `QuantSpec` rejects (``packed`` for an 8-bit format...).

    Example:
      >>> parse_spec("int4:axis=0:block=32:packed")
      QuantSpec(dtype=dtype(int4), axis=0, block_size=32, symmetric=True, saturate=True,
                packed=True, scale_dtype=None, scale_rounding='floor', double_quant=False)
      >>> parse_spec("nf4:packed:dq").double_quant
      True
      >>> parse_spec("int8:sym")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: unknown option 'sym' in 'int8:sym'; expected axis=INT, axis=none, ...
    """
    name, *options = text.strip().split(":")
    if name == "none" and not options:
        return None
    names = [*FORMATS, *CODEBOOKS, *SCHEMES]
    if name not in names:
        raise ValueError(f"unknown format {name!r} in {text!r}; expected none or one of "
                         f"{', '.join(dict.fromkeys(names))}.")
    kw: dict[str, Any] = {"dtype": name}
    for opt in options:
        key, _, value = opt.partition("=")
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
        elif opt == "dq":
            kw["double_quant"] = True
        elif opt in ("packed", "asym", "nosaturate"):
            kw[{"packed": "packed", "asym": "symmetric", "nosaturate": "saturate"}[opt]] = \
                opt == "packed"
        else:
            raise ValueError(f"unknown option {opt!r} in {text!r}; expected axis=INT, axis=none, "
                             f"block=INT, tile=INTxINT, packed, asym, nosaturate, dq, "
                             f"scale=DTYPE or round=MODE.")
    try:
        return QuantSpec(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{text!r}: {e}") from e


def _int(value: str, opt: str, text: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{opt!r} in {text!r} needs an integer, got {value!r}.") from None
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
    except re.error as e:
        raise ValueError(f"rule {text!r}: invalid regular expression {pattern!r}: {e}.") from None
    try:
        return pattern, parse_spec(spec)
    except ValueError as e:
        raise ValueError(f"rule {text!r}: {e}") from None


class _Fail(Exception):
    """A one-line error for the user, with the exit status."""

    def __init__(self, message: str, status: int = _RUN_ERROR):
        super().__init__(message)
        self.status = status


def _load(path: str):
    from jaxquant._checkpoint import load_safetensors

    if not os.path.isfile(path):
        raise _Fail(f"{path}: no such file")
    try:
        return load_safetensors(path, allow_plain=True)
    except (ImportError, TypeError, ValueError) as e:
        raise _Fail(str(e).splitlines()[0]) from None


def _same_file(a: str, b: str) -> bool:
    """Whether the paths ``a`` and ``b`` name one existing file (links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist
        return False


def _apply(spec: QuantSpec, name: str, leaf):
    """``spec(leaf)``; a rule that does not fit the tensor is a usage error naming it."""
    import jax

    try:
        return jax.block_until_ready(spec(leaf))
    except (TypeError, ValueError) as e:
        shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", "?")
        raise _Fail(f"cannot quantize tensor {name!r} ({dtype}{list(shape)}) as its rule "
                    f"says: {str(e).splitlines()[0]}", _USAGE_ERROR) from None


def _quantize(args) -> int:
    import jax

    from jaxquant._checkpoint import save_safetensors
    from jaxquant._progress import progress_bar
    from jaxquant._report import format_report, quantization_report
    from jaxquant._tree import is_record, match_rules, path_str, unused_rules

    try:
        rules = None if not args.rules else [parse_rule(r) for r in args.rules]
    except ValueError as e:
        raise _Fail(f"--rules: {e}", _USAGE_ERROR) from None
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise _Fail(f"{args.output}: cannot write: no such directory {folder}")
    if _same_file(args.input, args.output):
        raise _Fail(f"OUT {args.output!r} is the input file IN {args.input!r}: quantize would "
                    f"overwrite it; give OUT another path.", _USAGE_ERROR)
    tree = _load(args.input)
    unused = unused_rules(tree, rules) if rules else []
    for rule in unused:
        print(f"jaxquant: warning: rule {rule[0]!r} matches no tensor", file=sys.stderr)
    specs = match_rules(tree, rules)
    taken = {id(spec) for spec in specs.values()}
    for rule in rules or []:
        if rule[1] is not None and rule not in unused and id(rule[1]) not in taken:
            print(f"jaxquant: warning: rule {rule[0]!r} matches only tensors that are not "
                  f"float (kept as they are)", file=sys.stderr)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_record)
    out = []
    with progress_bar(total=sum(s is not None for s in specs.values()), enabled=not args.quiet,
                      desc="quantize", unit="tensor") as bar:
        for path, leaf in leaves:
            name = path_str(path)
            if specs[name] is not None:
                bar.set_postfix_str(name[-40:])
                leaf = _apply(specs[name], name, leaf)
                bar.update()
            out.append(leaf)
    qtree = jax.tree_util.tree_unflatten(treedef, out)
    try:
        save_safetensors(args.output, qtree, progress=not args.quiet)
    except Exception as e:  # OSError, or safetensors' own error type
        raise _Fail(f"{args.output}: cannot write: {str(e).splitlines()[0]}") from None
    print(format_report(quantization_report(tree, qtree)))
    print(f"wrote {args.output}")
    return 0


def _report(args) -> int:
    from jaxquant._report import format_report, quantization_report

    tree = _load(args.input)
    if args.output is None:
        rows = quantization_report(tree)
    else:
        try:
            rows = quantization_report(tree, _load(args.output))
        except (TypeError, ValueError) as e:
            raise _Fail(f"{args.input} vs {args.output}: {e}") from None
    print(format_report(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxquant`` console script and ``python -m jaxquant``.

    Args:
      argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
      The process exit status: 0, 1 (a file that cannot be read or written),
      2 (bad arguments; argparse's own usage errors exit with 2 as well).

    Example:
      >>> main(["quantize", "missing.safetensors", "out.safetensors"])
      1
    """
    parser = argparse.ArgumentParser(prog="jaxquant", description=_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a safetensors file by rules",
                       description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("input", metavar="IN", help="a safetensors file (plain or jaxquant)")
    q.add_argument("output", metavar="OUT", help="the jaxquant safetensors file to write")
    q.add_argument("--rules", nargs="+", metavar="REGEX=SPEC", action="extend",
                   help="rules, first match wins (SPEC: none, int8, int8:axis=0, "
                        "int4:block=32:packed, float8_e4m3fn, ...; see above)")
    q.add_argument("--quiet", action="store_true", help="no progress bars")
    r = sub.add_parser("report", help="per-tensor table of a file, or of IN against OUT")
    r.add_argument("input", metavar="IN", help="a safetensors file (the float one, with OUT)")
    r.add_argument("output", metavar="OUT", nargs="?", help="its quantized version")
    demo = sub.add_parser("demo", help="train a small model on real text, quantize it to "
                                       "every format, run it quantized, print a table")
    demo.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.steps < 1:
            parser.error(f"--steps must be a positive integer, got {args.steps}")
        from jaxquant._demo import run

        run(steps=args.steps, progress=not args.quiet)
        return 0
    try:
        return (_quantize if args.command == "quantize" else _report)(args)
    except _Fail as e:
        print(f"jaxquant {args.command}: error: {e}", file=sys.stderr)
        return e.status


if __name__ == "__main__":
    sys.exit(main())
