"""Core benchmark: jaxquant quantize / dequantize / fake_quant against its peers.

Formats: int8 (per tensor, per channel, computed scales), int4 in blocks of 128,
and the low-bit formats NF4 (blocks of 64), MXFP8 (E4M3), MXFP4 and NVFP4, each
quantized (scales computed from the data) and dequantized, next to a plain
``jnp`` spelling of the same format.

Run from the repository root (either form)::

    python -m benchmarks.run                  # 8192 x 8192 float32, 7 rounds
    python benchmarks/run.py --size 2048 --repeats 3 --only int4

Every case runs in this one process on the same random-normal array. Cases are
timed round-robin: each round runs every case once, in turn, so that a noisy
neighbour slows all cases alike; the table reports the median over rounds and
the minimum. JAX functions are jitted and compiled (warmed up) before timing,
their inputs are already on the device, and each call is timed up to
``block_until_ready()``. Peers (ONNX Runtime, PyTorch, qwix) are optional: a
missing package gives a "not installed" row.

Results go to ``<out>/core.json`` and ``<out>/core.md``; see
``benchmarks/README.md`` for what each row means.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import pathlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence

try:  # python -m benchmarks.run
    from benchmarks._harness import machine_info, run_rounds, write_report
    from benchmarks.core_cases import LIMIT_CASE, Case, Inputs, cases
except ImportError:  # python benchmarks/run.py
    from _harness import machine_info, run_rounds, write_report
    from core_cases import LIMIT_CASE, Case, Inputs, cases

PEER_PACKAGES = ("jax", "jaxlib", "numpy", "onnxruntime", "onnx", "torch", "qwix")


# --------------------------------------------------------------------------- timing


def prepare(case: Case, inp: Inputs, warmup: int = 2) -> tuple[Callable[[], object] | None, str]:
    """The case's callable, built and warmed up (compiled), or ``None`` and why not."""
    if case.requires and importlib.util.find_spec(case.requires) is None:
        return None, "not installed"
    try:
        fn = case.build(inp)
        for _ in range(warmup):
            fn()
    except Exception as e:  # a peer's API drift must not sink the whole run
        return None, f"error: {type(e).__name__}: {e}".splitlines()[0][:160]
    return fn, ""


# --------------------------------------------------------------------------- report


def summarize(selected: Sequence[Case], notes: dict[str, str],
              times: dict[str, list[tuple[float, int]]], size: int) -> list[dict]:
    """One result record per case: medians, minima, ratios, bandwidth and page faults."""
    elements = size * size
    median = {name: statistics.median(t for t, _ in ts) for name, ts in times.items()}
    limit_bps = 8 * elements / median[LIMIT_CASE] if LIMIT_CASE in median else None
    rows = []
    for case in selected:
        row = {"name": case.name, "group": case.group, "status": notes.get(case.name) or "ok",
               "bytes_moved": int(case.bytes_per_element * elements),
               "median_ms": None, "min_ms": None, "ratio_to_plain_jnp": None,
               "ratio_to_copy_limit": None, "gb_per_s": None, "page_faults": None,
               "plain_jnp_case": case.baseline}
        if case.name in times:
            sec = median[case.name]
            row.update(median_ms=1e3 * sec, min_ms=1e3 * min(t for t, _ in times[case.name]),
                       gb_per_s=row["bytes_moved"] / sec / 1e9,
                       page_faults=int(statistics.median(f for _, f in times[case.name])))
            if case.baseline in median:
                row["ratio_to_plain_jnp"] = sec / median[case.baseline]
            if limit_bps:
                row["ratio_to_copy_limit"] = sec / (row["bytes_moved"] / limit_bps)
        rows.append(row)
    return rows


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def markdown(report: dict) -> str:
    """The results as a markdown table with a header line naming the date and machine."""
    m = report["machine"]
    v = m["versions"]
    lines = [
        f"{report['date']} · {m['cpu']}, {m['cpu_count']} CPUs ({m['platform']}) · "
        f"jax {v['jax']}, numpy {v['numpy']}, onnxruntime {v['onnxruntime']}, "
        f"torch {v['torch']}, qwix {v['qwix']} · {report['size']}x{report['size']} float32, "
        f"median of {report['repeats']} round-robin rounds",
        "",
        "| case | group | median ms | min ms | vs plain jnp | vs copy limit | GB/s "
        "| page faults |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["cases"]:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['group']} | {r['status']} | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['group']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
            f"{_fmt(r['ratio_to_plain_jnp'], '.2f')} | {_fmt(r['ratio_to_copy_limit'], '.2f')} | "
            f"{r['gb_per_s']:.1f} | {r['page_faults']} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=8192,
                   help="the array is SIZE x SIZE float32 (default 8192; a multiple of 128)")
    p.add_argument("--repeats", type=int, default=7, help="round-robin rounds (default 7)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"),
                   help="output folder for core.json and core.md (default benchmarks/results)")
    p.add_argument("--only", default="",
                   help="run only cases whose name or group contains this substring "
                        "(the copy limit always runs)")
    args = p.parse_args(argv)
    if args.size < 128 or args.size % 128:
        p.error(f"--size must be a positive multiple of 128 (the int4 block), got {args.size}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Builds, warms up and times the selected cases, then writes core.json and core.md."""
    args = parse_args(argv)
    wall = time.perf_counter()
    # PyTorch's quantized tensors are deprecated; they are still the reference to beat.
    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
    selected = [c for c in cases()
                if c.name == LIMIT_CASE or args.only in c.name or args.only in c.group]
    inp = Inputs(args.size)
    fns, notes = {}, {}
    for case in selected:
        print(f"preparing {case.name}", file=sys.stderr)
        fn, notes[case.name] = prepare(case, inp)
        if fn is not None:
            fns[case.name] = fn
    print(f"timing {len(fns)} cases, {args.repeats} rounds", file=sys.stderr)
    times = run_rounds(fns, args.repeats)
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(PEER_PACKAGES),
        "size": args.size,
        "repeats": args.repeats,
        "limit_case": LIMIT_CASE,
        "cases": summarize(selected, notes, times, args.size),
    }
    report["wall_s"] = round(time.perf_counter() - wall, 1)
    write_report(args.out, "core", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
