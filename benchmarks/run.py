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
missing package gives a "not installed" row. NumPy, ONNX Runtime and PyTorch run
on the host CPU: on an accelerator their rows get no ratio to the (device) plain
jnp rows, and the copy limit becomes the device's own copy (``jit(x + 0)``).

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

import jax

try:  # python -m benchmarks.run
    from benchmarks._harness import command, machine_info, run_rounds, write_report
    from benchmarks._peers import THREADS
    from benchmarks.core_cases import DEVICE_LIMIT_CASE, LIMIT_CASE, Case, Inputs, cases, limit_case
except ImportError:  # python benchmarks/run.py
    from _harness import command, machine_info, run_rounds, write_report
    from _peers import THREADS
    from core_cases import DEVICE_LIMIT_CASE, LIMIT_CASE, Case, Inputs, cases, limit_case

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
              times: dict[str, list[tuple[float, int]]], size: int,
              backend: str = "cpu") -> list[dict]:
    """One result record per case: medians, minima, ratios, bandwidth and page faults.

    Ratios compare cases on the same device only (``Case.device(backend)``): a host
    peer gets no ratio to a plain jnp row that ran on an accelerator, and the copy
    limit is `limit_case(backend)`.
    """
    elements = size * size
    median = {name: statistics.median(t for t, _ in ts) for name, ts in times.items()}
    limit = limit_case(backend)
    limit_bps = 8 * elements / median[limit] if limit in median else None
    device = {c.name: c.device(backend) for c in selected}
    rows = []
    for case in selected:
        row = {"name": case.name, "group": case.group, "status": notes.get(case.name) or "ok",
               "device": device[case.name],
               "bytes_moved": round(case.bytes_per_element * elements),
               "median_ms": None, "min_ms": None, "ratio_to_plain_jnp": None,
               "ratio_to_copy_limit": None, "gb_per_s": None, "page_faults": None,
               "plain_jnp_case": case.baseline}
        if case.name in times:
            sec = median[case.name]
            row.update(median_ms=1e3 * sec, min_ms=1e3 * min(t for t, _ in times[case.name]),
                       gb_per_s=row["bytes_moved"] / sec / 1e9,
                       page_faults=int(statistics.median(f for _, f in times[case.name])))
            if case.baseline in median and device[case.baseline] == device[case.name]:
                row["ratio_to_plain_jnp"] = sec / median[case.baseline]
            if limit_bps and device[limit] == device[case.name]:
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
        f"median of {report['repeats']} round-robin rounds · "
        f"`{report['command']}` · JAX on {m['jax_devices']} · host peers with "
        f"{report['peer_threads']} threads · copy limit: {report['limit_case']}",
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
                        "(the copy limits always run)")
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
    selected = [c for c in cases() if c.name in (LIMIT_CASE, DEVICE_LIMIT_CASE)
                or args.only in c.name or args.only in c.group]
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
        "command": command("run", argv),
        "machine": machine_info(PEER_PACKAGES),
        "size": args.size,
        "repeats": args.repeats,
        "peer_threads": THREADS,
        "limit_case": limit_case(jax.default_backend()),
        "cases": summarize(selected, notes, times, args.size, jax.default_backend()),
    }
    report["wall_s"] = round(time.perf_counter() - wall, 1)
    write_report(args.out, "core", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
