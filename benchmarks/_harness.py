"""Shared benchmark harness: round-robin timing with page-fault counts, machine info, output.

Every benchmark in this folder times its cases in one process, round-robin
(each round runs every case once, in turn, so a noisy neighbour slows all cases
alike), and reports medians. Page faults are counted because on this kind of
machine faulting in a fresh output buffer is most of the cost of a
memory-bound XLA call.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax

ENV_VARS = ("GLIBC_TUNABLES", "XLA_FLAGS", "OMP_NUM_THREADS")
"""Environment variables that change the timings, recorded with the results."""


def time_call(fn: Callable[[], object]) -> tuple[float, int]:
    """Seconds one call of ``fn`` takes, and the minor page faults it causes.

    ``fn`` must return when its work is done. Minor faults count the fresh
    4 KiB pages the call touches (a newly allocated output, typically).
    """
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def call_repeatedly(fn: Callable[[], object], calls: int) -> list:
    """``calls`` calls of ``fn``, returned once every leaf of every result is ready.

    Waiting on the last result only would trust the runtime to run independent
    calls in order; waiting on all of them leaves no work of one case running
    into the next case's timing.
    """
    return jax.block_until_ready([fn() for _ in range(calls)])


def run_rounds(fns: dict[str, Callable[[], object]],
               repeats: int) -> dict[str, list[tuple[float, int]]]:
    """Times every callable once per round, in turn: ``repeats`` (seconds, faults) each.

    Each round starts one callable later than the one before, so that none is always
    the one that runs after the same neighbour (or first, after the allocator has
    returned the last round's buffers to the system and their pages fault in again).
    """
    times: dict[str, list[tuple[float, int]]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        start = time.perf_counter()
        for name in names:
            times[name].append(time_call(fns[name]))
        names = names[1:] + names[:1]
        print(f"  round {r + 1}/{repeats}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return times


def parse_rounds(doc: str, argv: Sequence[str] | None, *, flag: str = "--rounds",
                 default: int = 5, layers: int | None = None) -> argparse.Namespace:
    """Parses ``flag`` (round-robin rounds, at least 1) and ``--out`` (the results folder).

    The parser's description is the first paragraph of ``doc``; ``argv`` None reads
    ``sys.argv``. With ``layers`` (a default), ``--layers`` too (at least 1).
    """
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument(flag, type=int, default=default, dest="rounds",
                   help=f"round-robin rounds (default {default})")
    if layers is not None:
        p.add_argument("--layers", type=int, default=layers,
                       help=f"transformer blocks in the tree (default {layers})")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"),
                   help="output folder (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"{flag} must be at least 1, got {args.rounds}")
    if layers is not None and args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    return args


def check_at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       *names: str) -> None:
    """``parser.error`` (exit status 2) for each of ``args.<name>`` (``--rounds``,
    ``--calls``...) below 1: no median of no rounds, no time per call of no calls."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, "
                         f"got {getattr(args, name)}")


def command(module: str, argv: Sequence[str] | None) -> str:
    """The command line that ran ``benchmarks.<module>`` with ``argv`` (``None``: ``sys.argv``)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m benchmarks." + module, *args])


def machine_info(packages: Sequence[str]) -> dict:
    """Platform, CPU, JAX device and the versions of every package involved (``None``: not
    installed)."""
    versions = {}
    for pkg in packages:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "jax_devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "env": {k: os.environ.get(k) for k in ENV_VARS},
        "versions": versions,
    }


def write_atomic(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a ``.tmp`` file, so readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_report(out: pathlib.Path, stem: str, report: dict, table: str) -> None:
    """Writes ``<out>/<stem>.json`` (the report) and ``<stem>.md`` (the table), prints the
    table on stdout and where they went on stderr."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    write_atomic(out / f"{stem}.md", table)
    print(table)
    wall = f" ({report['wall_s']} s)" if "wall_s" in report else ""
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')}{wall}", file=sys.stderr)


def ratio_record(name: str, seconds: Sequence[float], base: Sequence[float],
                 base_name: str = "float32") -> dict:
    """One case's timings as a record: median and minimum ms, and ratios to ``base``.

    ``seconds`` and ``base`` are per-round times of the same rounds; the ratio is
    the median of the per-round ratios, robust to the load drifting during a run.
    """
    return {"case": name, "median_ms": statistics.median(seconds) * 1e3,
            "min_ms": min(seconds) * 1e3,
            f"vs_{base_name}": statistics.median(
                a / b for a, b in zip(seconds, base, strict=True)),
            f"min_vs_{base_name}_min": min(seconds) / min(base)}
