"""The ``jaxquant`` command line: ``quantize``, ``report`` and ``demo``.

``jaxquant quantize IN.safetensors OUT.safetensors --rules 'REGEX=SPEC' ...``
reads a safetensors file (a plain one, such as a Hugging Face checkpoint, or
one jaxquant wrote), quantizes its tensors by rules, writes a jaxquant
safetensors file and prints the per-tensor report. ``jaxquant report IN [OUT]``
prints the report of a file alone (formats, bytes) or of IN against its
quantized OUT (SQNR, largest error). ``jaxquant demo`` trains, quantizes and
runs a small model. ``quantize`` and ``demo`` show progress bars on stderr (when
tqdm is installed); ``--quiet`` turns them off.

Rules, one ``--rules`` argument each (before or after IN OUT), tried in order (the
first whose REGEX `re.search` finds in a tensor's name wins; unmatched tensors are
kept). A tensor's name is the file's own key, ``/`` and all (``a`` and ``a/b`` are
two tensors)::

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
              | "packed"                 (2-, 4- and 6-bit codes: four, two per byte,
                                          or four in three bytes)
              | "asym"                   (asymmetric: min/max with a zero point;
                                          integer formats only)
              | "nosaturate"             (float formats: no clipping to the largest value)
              | "dq"                     (double quantization of the scales)
              | "scale=" DTYPE           (float32, bfloat16, float16, float8_e8m0fnu, ...)
              | "round=" MODE            (e8m0 scales: floor, ceil or up_on_overflow)
              | "stacked=" INT           (INT leading axes stack layers: scales per
                                          layer, axis counted within one layer)

Examples: ``int8``, ``int8:axis=0``, ``int4:block=32:packed``, ``float8_e4m3fn``,
``nf4:packed:dq``, ``mxfp4:packed:round=ceil``, ``int8:tile=128x128``,
``int8:stacked=1`` (a ``(layers, in, out)`` stack of kernels), ``none``.
Without ``--rules``, every floating tensor of rank >= 2 becomes int8 with one
scale per last-axis entry (`jaxquant.quantize_tree`'s default).
PyTorch checkpoints store ``Linear`` weights as ``(out, in)``: ``axis=0`` gives
one scale per output channel.

An existing OUT is replaced (through a link, the file it points to): the file is
written under a temporary name next to it, then renamed, so a failed or
interrupted run leaves OUT as it was. OUT must not be IN, a directory, a device or
a pipe. Exit status: 0 done, 1 a file that cannot be read or written (or a failed
run), 2 bad arguments or a rule that does not fit its tensor, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxquant import __version__
from jaxquant._cli_rules import parse_rule, parse_spec, rule_warnings, torch_layout_warning
from jaxquant._spec import QuantSpec

__all__ = ["main", "parse_spec", "parse_rule"]

_USAGE_ERROR, _RUN_ERROR = 2, 1
_HELP = __doc__.replace("``", "").replace("`", "")  # the docstring, without markup


class _Fail(Exception):
    """A one-line error for the user, with the exit status."""

    def __init__(self, message: str, status: int = _RUN_ERROR):
        super().__init__(message)
        self.status = status


def _load(path: str):
    """The tensors of the safetensors file ``path`` by name (a `QTensor` under its path in a
    jaxquant file); `_Fail` if it cannot be read as one. Names are not nested into dicts: a
    plain file may hold both ``a`` and ``a/b``."""
    from jaxquant._checkpoint import read_safetensors

    if os.path.isdir(path):
        raise _Fail(f"{path}: is a directory, not a file")
    if not os.path.exists(path):
        raise _Fail(f"{path}: no such file")
    if not os.path.isfile(path):  # read twice: a pipe would come back empty
        raise _Fail(f"{path}: is not a regular file (a device, a pipe or a socket); give "
                    f"the path of a safetensors file")
    try:
        return read_safetensors(path, allow_plain=True, flat=True)
    except (ImportError, TypeError, ValueError) as e:
        raise _Fail(str(e).splitlines()[0]) from None
    except OSError as e:  # unreadable (permissions, I/O error, a device)
        raise _Fail(f"{path}: cannot read: {e.strerror or e}") from None
    except RuntimeError as e:  # XLA's errors: out of device memory...
        raise _Fail(f"{path}: cannot load: {_first_line(e)}") from None


def _check_output(path: str) -> str:
    """The file to write for OUT ``path``: itself, or the file it links to.

    `os.replace` would put a regular file in place of a link (the file it points
    to left stale) or of a device or pipe (``/dev/null``, for root).

    Raises:
      _Fail: before any work, if OUT is empty, a directory, not a regular file,
        or in a missing directory.
    """
    if not path or path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise _Fail(f"{path!r}: cannot write: it is a directory or not a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        raise _Fail(f"{path}: cannot write: it exists and is not a regular file (a device, a "
                    f"pipe or a socket); give OUT the path of a file")
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise _Fail(f"{path}: cannot write: no such directory {folder}")
    return target


def _same_file(a: str, b: str) -> bool:
    """Whether the paths ``a`` and ``b`` name one existing file (links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist
        return False


def _apply(spec: QuantSpec, name: str, leaf):
    """``spec(leaf)``; a rule that does not fit the tensor is a usage error naming it."""
    import jax

    shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", "?")
    try:
        return jax.block_until_ready(spec(leaf))
    except (TypeError, ValueError) as e:
        raise _Fail(f"cannot quantize tensor {name!r} ({dtype}{list(shape)}) as its rule "
                    f"says: {str(e).splitlines()[0]}", _USAGE_ERROR) from None
    except RuntimeError as e:  # XLA's errors: out of device memory...
        raise _Fail(f"cannot quantize tensor {name!r} ({dtype}{list(shape)}): "
                    f"{_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, or its type's name when it has none."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _user_metadata(path: str) -> dict[str, str]:
    """IN's own ``__metadata__`` entries (jaxquant's header aside), carried into OUT."""
    from safetensors import safe_open

    from jaxquant._serialization import HEADER_KEY

    with safe_open(path, "np") as f:  # read already by _load: a readable safetensors file
        return {k: v for k, v in (f.metadata() or {}).items() if not k.startswith(HEADER_KEY)}


def _quantize(args) -> int:
    import jax

    from jaxquant._checkpoint import save_safetensors
    from jaxquant._progress import progress_bar
    from jaxquant._report import format_report, quantization_report
    from jaxquant._tree import is_record, match_rules, path_str

    try:
        rules = None if not args.rules else [parse_rule(r) for r in args.rules]
    except ValueError as e:
        raise _Fail(f"--rules: {e}", _USAGE_ERROR) from None
    target = _check_output(args.output)
    if _same_file(args.input, args.output):
        raise _Fail(f"OUT {args.output!r} is the input file IN {args.input!r}: quantize would "
                    f"overwrite it; give OUT another path.", _USAGE_ERROR)
    tree = _load(args.input)
    for warning in rule_warnings(tree, rules or []):
        _err(f"jaxquant: warning: {warning}")
    specs = match_rules(tree, rules)
    if not rules and _user_metadata(args.input).get("format") == "pt" and \
            (warning := torch_layout_warning(specs, tree)):
        _err(f"jaxquant: warning: {warning}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_record)
    out = []
    with progress_bar(total=sum(s is not None for s in specs.values()), enabled=not args.quiet,
                      desc="quantize", unit="tensor") as bar:
        for path, leaf in leaves:
            name = path_str(path)
            if specs[name] is not None:
                bar.set_postfix_str(name[-40:], refresh=False)  # drawn by update()
                leaf = _apply(specs[name], name, leaf)
                bar.update()
            out.append(leaf)
    qtree = jax.tree_util.tree_unflatten(treedef, out)
    try:
        save_safetensors(target, qtree, metadata=_user_metadata(args.input),
                         progress=not args.quiet)
    except Exception as e:  # OSError, or safetensors' own error type
        raise _Fail(f"{args.output}: cannot write: {str(e).splitlines()[0]}") from None
    _out(format_report(quantization_report(tree, qtree)))
    _out(f"wrote {args.output}")
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
    _out(format_report(rows))
    return 0


def _demo(args) -> int:
    """`jaxquant._demo.run`; its RuntimeErrors (no corpus, XLA's) as a `_Fail`."""
    from jaxquant._demo import run

    try:
        run(steps=args.steps, print_fn=_out, progress=not args.quiet)
    except RuntimeError as e:  # no corpus; XLA's errors (out of memory...)
        raise _Fail(_first_line(e)) from None
    return 0


def _out(text: str) -> None:
    """Prints ``text`` on stdout, flushed, so that a failure to write shows here.

    Raises:
      BrokenPipeError: the reader of a pipe has gone (`main` then ends quietly).
      _Fail: stdout cannot be written (a full disk...).
    """
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:
        raise _Fail(f"cannot write to standard output: {e.strerror or e}") from None


def _err(text: str) -> None:
    """Prints ``text`` on stderr, unless it is closed (``print(file=None)`` would use stdout)."""
    if sys.stderr is not None:
        print(text, file=sys.stderr)


def _drop_stdout() -> None:
    """Points stdout's descriptor at /dev/null: the interpreter's last flush must not fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no descriptor (stdout replaced in-process)
        pass


def _rules_last(argv: list[str]) -> list[str]:
    """``argv`` with IN and OUT taken out of a ``--rules`` list that came before them.

    ``--rules`` takes every following word, so in ``quantize --rules w=int8 IN OUT`` argparse
    would read IN and OUT as rules. While IN or OUT is missing, the last words of ``--rules``
    lists that hold no ``=`` (a rule has one) are put back as positional arguments.
    ``--rules=RULE`` is read as ``--rules RULE``: the words after it are rules too.
    """
    if not argv or argv[0] != "quantize" or "--" in argv:  # after "--": positional already
        return argv
    split = []  # --rules=w=int8 b=none as --rules w=int8 b=none (argparse: b=none positional)
    for word in argv:
        option, eq, value = word.partition("=")
        is_rules = eq and option.startswith("--r") and "--rules".startswith(option)
        split += [option, value] if is_rules else [word]
    argv = split
    kinds, in_rules = [], False  # per word: "option", "rule" or "positional"
    for word in argv[1:]:
        if word.startswith("-"):  # argparse takes a prefix: --rule, --rul
            in_rules = word.startswith("--r") and "--rules".startswith(word)
            kinds.append("option")
        else:
            kinds.append("rule" if in_rules else "positional")
    missing = 2 - kinds.count("positional")
    stray = [i for i, k in enumerate(kinds) if k == "rule" and "=" not in argv[1 + i]]
    moved = set(stray[len(stray) - missing:]) if missing > 0 else set()
    first = [i in moved or k == "positional" for i, k in enumerate(kinds)]  # IN, OUT in order
    return ([argv[0]] + [w for w, f in zip(argv[1:], first, strict=True) if f]
            + [w for w, f in zip(argv[1:], first, strict=True) if not f])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxquant`` console script and ``python -m jaxquant``.

    Args:
      argv: arguments without the program name (default: ``sys.argv[1:]``, and then
        Ctrl-C ends the process at once, with ``os._exit(130)``).

    Returns:
      The process exit status: 0, 1 (a file that cannot be read or written),
      2 (bad arguments; argparse's own usage errors exit with 2 as well), 130 (Ctrl-C).

    Example:
      >>> main(["quantize", "missing.safetensors", "out.safetensors"])
      1
    """
    parser = argparse.ArgumentParser(prog="jaxquant", description=_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxquant {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a safetensors file by rules",
                       description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("input", metavar="IN", help="a safetensors file (plain or jaxquant)")
    q.add_argument("output", metavar="OUT", help="the jaxquant safetensors file to write")
    q.add_argument("--rules", nargs="+", metavar="REGEX=SPEC", action="extend",
                   help="rules, first match wins, before or after IN OUT (SPEC: none, int8, "
                        "int8:axis=0, int4:block=32:packed, float8_e4m3fn, ...; see above)")
    q.add_argument("--quiet", action="store_true", help="no progress bars")
    r = sub.add_parser("report", help="per-tensor table of a file, or of IN against OUT")
    r.add_argument("input", metavar="IN", help="a safetensors file (the float one, with OUT)")
    r.add_argument("output", metavar="OUT", nargs="?", help="its quantized version")
    demo = sub.add_parser("demo", help="train a small model on real text, quantize it to "
                                       "every format, run it quantized, print a table")
    demo.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(_rules_last(sys.argv[1:] if argv is None else list(argv)))
    if args.command == "demo" and args.steps < 1:
        parser.error(f"--steps must be a positive integer, got {args.steps}")
    try:
        return {"quantize": _quantize, "report": _report, "demo": _demo}[args.command](args)
    except _Fail as e:
        _err(f"jaxquant {args.command}: error: {e}")
        return e.status
    except BrokenPipeError:  # `jaxquant report ... | head`: the reader has gone
        _drop_stdout()
        return _RUN_ERROR
    except KeyboardInterrupt:
        _err(f"\njaxquant {args.command}: interrupted")
        if argv is None:  # the program: XLA, stopped mid-compile, can crash the shutdown
            try:
                sys.stdout.flush()
            finally:
                os._exit(130)
        return 130  # 128 + SIGINT, as shells report it


if __name__ == "__main__":
    sys.exit(main())
