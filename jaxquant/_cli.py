"""The ``jaxquant`` command line: ``jaxquant demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxquant`` console script and ``python -m jaxquant``.

    Args:
      argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
      The process exit status.
    """
    parser = argparse.ArgumentParser(prog="jaxquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on real text, quantize it to "
                                       "every format, run it quantized, print a table")
    demo.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.steps < 1:
            parser.error(f"--steps must be a positive integer, got {args.steps}")
        from jaxquant._demo import run

        run(steps=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
