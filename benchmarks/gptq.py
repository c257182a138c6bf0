"""GPTQ on kernels of growing width: first-call (compile) time, run time and output error,
against round to nearest (`jaxquant.quantize`) of the same kernel in the same process.

Run from the repository root (either form)::

    python -m benchmarks.gptq                          # widths 512, 2048, 4096; 5 rounds
    python benchmarks/gptq.py --widths 256 --rounds 1  # the tests' size

For each input width ``k`` (a kernel of ``k`` x ``--outputs`` float32, ``y = x @ w``),
calibration inputs ``x`` of ``k`` rows with correlated features (a random low-rank
mixture, one outlier feature) give the Gram matrix ``H = x^T x``. Two layouts, int4
per output channel and int4 in blocks of 128 input rows (GPTQ's usual group size), are
quantized by `jaxquant.gptq` and by `jaxquant.quantize`:

* **first call s**: the first `jaxquant.gptq` call after `jax.clear_caches()`, i.e. trace,
  compile and one run. GPTQ visits the rows in lazy batches of 128 by a loop, so this
  stays flat as ``k`` grows (the loop body is compiled once);
* **median ms / vs round to nearest**: later calls, round-robin with the jitted
  `quantize`, median of per-round ratios;
* **output error vs round to nearest**: ``||x w - x q||^2`` of GPTQ's kernel over that of
  round to nearest (below 1: GPTQ's codes reproduce the layer's outputs better; the
  reason to pay its run time).

Results go to ``<out>/gptq.json`` and ``<out>/gptq.md``.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq

try:  # python -m benchmarks.gptq
    from benchmarks._harness import command, machine_info, run_rounds, write_report
except ImportError:  # python benchmarks/gptq.py
    from _harness import command, machine_info, run_rounds, write_report

PACKAGES = ("jax", "jaxlib", "numpy", "jaxquant")
LAYOUTS = {"int4 per-channel": dict(dtype=jnp.int4, axis=-1),
           "int4 block 128": dict(dtype=jnp.int4, axis=0, block_size=128)}


def calibration(k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, w, H)``: ``k`` rows of correlated inputs, a ``(k, n)`` kernel, ``x^T x``."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((64, k)).astype(np.float32) / 4
    x = rng.standard_normal((k, k)).astype(np.float32) + \
        rng.standard_normal((k, 64)).astype(np.float32) @ mix
    x[:, 3] *= 20  # an outlier input feature
    w = rng.standard_normal((k, n)).astype(np.float32)
    h = np.asarray(jax.jit(lambda x: x.T @ x)(x))
    return x, w, h


def output_error(x: np.ndarray, w: np.ndarray, q: jax.Array) -> float:
    """``||x w - x q||^2`` in float64."""
    d = w.astype(np.float64) - np.asarray(q, np.float64)
    return float(np.sum((x.astype(np.float64) @ d) ** 2))


def run(widths: Sequence[int], outputs: int, rounds: int) -> list[dict]:
    """Measures every width and layout; returns one record each."""
    rows = []
    for k in widths:
        x, w_np, h_np = calibration(k, outputs)
        w, h = jnp.asarray(w_np), jnp.asarray(h_np)
        for layout, kw in LAYOUTS.items():
            rtn = jax.jit(lambda w, kw=kw: jq.quantize(w, **kw))
            jax.clear_caches()
            start = time.perf_counter()
            q = jax.block_until_ready(jq.gptq(w, h, **kw))
            first = time.perf_counter() - start
            jax.block_until_ready(rtn(w))
            cases = {"gptq": lambda w=w, h=h, kw=kw: jax.block_until_ready(jq.gptq(w, h, **kw)),
                     "rtn": lambda w=w, rtn=rtn: jax.block_until_ready(rtn(w))}
            times = {name: [s for s, _ in t] for name, t in run_rounds(cases, rounds).items()}
            rows.append({
                "width": k, "outputs": outputs, "layout": layout,
                "first_call_s": round(first, 3),
                "median_ms": 1e3 * statistics.median(times["gptq"]),
                "rtn_median_ms": 1e3 * statistics.median(times["rtn"]),
                "vs_round_to_nearest": statistics.median(
                    a / b for a, b in zip(times["gptq"], times["rtn"], strict=True)),
                "error_vs_round_to_nearest": output_error(x, w_np, q.dequantize())
                / output_error(x, w_np, rtn(w).dequantize()),
            })
            print(f"{k} {layout}: first call {first:.2f} s", file=sys.stderr, flush=True)
    return rows


def markdown(report: dict) -> str:
    """The results as a Markdown table under a header naming date, machine and command."""
    m = report["machine"]
    lines = [f"{report['date']} · {m['cpu']}, {m['cpu_count']} CPUs, {m['jax_devices']} · "
             f"`{report['command']}` · median of {report['rounds']} rounds", "",
             "| width x outputs | layout | first call s | median ms | round to nearest ms "
             "| vs round to nearest | output error vs round to nearest |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['width']} x {r['outputs']} | {r['layout']} | {r['first_call_s']:.2f} "
                     f"| {r['median_ms']:.1f} | {r['rtn_median_ms']:.2f} "
                     f"| {r['vs_round_to_nearest']:.0f}x | {r['error_vs_round_to_nearest']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the options, runs, writes JSON and Markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[512, 2048, 4096],
                   help="input widths k, multiples of 128 (default 512 2048 4096)")
    p.add_argument("--outputs", type=int, default=512, help="output channels (default 512)")
    p.add_argument("--rounds", type=int, default=5, help="round-robin rounds (default 5)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"),
                   help="output folder (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.outputs < 1:
        p.error(f"--rounds and --outputs must be at least 1, got {args.rounds}, {args.outputs}")
    if any(k < 128 or k % 128 for k in args.widths):
        p.error(f"--widths must be multiples of 128 (the block layout's group), got "
                f"{args.widths}")
    wall = time.perf_counter()
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine_info(PACKAGES), "command": command("gptq", argv),
              "rounds": args.rounds, "rows": run(args.widths, args.outputs, args.rounds)}
    report["wall_s"] = round(time.perf_counter() - wall, 1)
    write_report(args.out, "gptq", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
