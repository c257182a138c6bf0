"""Weight-only dots with and without streaming the weight (XLA:CPU), across widths and rows.

Run from the repository root::

    python -m benchmarks.weight_streaming             # 9 round-robin rounds of 5 calls
    python -m benchmarks.weight_streaming --rounds 5
    python -m benchmarks.weight_streaming --shapes 4096x1 4096x32

A jitted 4-layer MLP (Dense(width) + ReLU, float32 input of ``rows`` rows) runs
with float32 kernels and with int8 per-channel and packed int4 block-128
`QTensor` kernels through `jaxquant.qdot_general`, each quantized tree compiled
twice: as the library decides (large weights meeting 16-256 rows are dequantized
in chunks of 2 MiB, see `jaxquant._weight_only`) and with streaming turned off
(the whole float weight of a layer at once). Times are medians of round-robin
rounds, as ratios to float32 in the same rounds; "temp MiB" is XLA's temporary
buffer size. Results go to ``benchmarks/results/weight_streaming.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant import _weight_only

try:  # python -m benchmarks.weight_streaming
    from benchmarks._harness import check_at_least_one, machine_info, run_rounds, write_report
except ImportError:  # python benchmarks/weight_streaming.py
    from _harness import check_at_least_one, machine_info, run_rounds, write_report

SHAPES = ((1024, 1), (1024, 32), (1024, 128), (1024, 512), (4096, 1), (4096, 32), (4096, 256))
"""``(width, rows)`` pairs."""
DN = (((1,), (0,)), ((), ()))


def mlp(ws, x):
    """Four Dense + ReLU layers; QTensor kernels go through ``jq.qdot_general``."""
    for w in ws:
        x = jax.nn.relu(jq.qdot_general(x, w, DN) if jq.is_qtensor(w) else x @ w)
    return x


def compiled(ws, x, streaming: bool):
    """``mlp`` lowered and compiled, with streaming as the library decides or off."""
    limit = _weight_only.STREAM_BYTES if streaming else 2**62
    jax.clear_caches()  # qdot_general's own jit would reuse the other decision's trace
    with mock.patch.object(_weight_only, "STREAM_BYTES", limit):
        return jax.jit(mlp).lower(ws, x).compile()


def measure(width: int, rows: int, rounds: int, calls: int) -> list[dict]:
    """One shape's rows of the table."""
    rng = np.random.default_rng(0)
    floats = [jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), jnp.float32)
              for _ in range(4)]
    trees = {
        "int8 per-channel": [jq.quantize(w, axis=-1) for w in floats],
        "int4 block 128 packed": [jq.quantize(w, dtype=jnp.int4, axis=0, block_size=128,
                                              packed=True) for w in floats],
    }
    x = jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)
    cases = {"float32": (compiled(floats, x, True), floats)}
    for name, tree in trees.items():
        cases[f"{name}, streamed"] = (compiled(tree, x, True), tree)
        cases[f"{name}, whole weight"] = (compiled(tree, x, False), tree)

    def call(fn, tree):
        def run():
            for _ in range(calls):
                jax.block_until_ready(fn(tree, x))
        return run

    for fn, tree in cases.values():
        jax.block_until_ready(fn(tree, x))
    times = run_rounds({k: call(*v) for k, v in cases.items()}, rounds)
    base = [t / calls for t, _ in times["float32"]]
    out = []
    for name, (fn, _) in cases.items():
        seconds = [t / calls for t, _ in times[name]]
        out.append({
            "width": width, "rows": rows, "case": name,
            "median_ms": 1e3 * statistics.median(seconds),
            "vs_float32": statistics.median(a / b for a, b in zip(seconds, base, strict=True)),
            "temp_mib": fn.memory_analysis().temp_size_in_bytes / 2**20,
        })
    return out


def markdown(result: dict) -> str:
    """The results as a Markdown table with a one-line header."""
    m = result["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    lines = [
        f"{result['date']} · {m['cpu']}, {m['cpu_count']} CPUs · {versions} · "
        f"`{result['command']}` · 4 x Dense(width) + ReLU · median of round-robin rounds · "
        f"1-min load average {result['load_average'][0]:.2f} before, "
        f"{result['load_average'][1]:.2f} after (compare rows of one shape only)",
        "",
        "| width | rows | case | median ms | vs float32 (median of per-round ratios) "
        "| XLA temp MiB |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['width']} | {r['rows']} | {r['case']} | {r['median_ms']:.3f} "
                     f"| {r['vs_float32']:.2f} | {r['temp_mib']:.2f} |")
    return "\n".join(lines) + "\n"


def _shape(text: str) -> tuple[int, int]:
    """``"4096x1"`` -> ``(4096, 1)``."""
    try:
        width, rows = map(int, text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected WIDTHxROWS such as 4096x1, got {text!r}") from None
    if width < 1 or rows < 1:
        raise argparse.ArgumentTypeError(f"width and rows must be positive, got {text!r}")
    return width, rows


def main(argv=None) -> None:
    """Parses ``--rounds``, ``--calls`` and ``--out``, runs every shape, writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", type=_shape, default=SHAPES, metavar="WIDTHxROWS",
                        help="(width, rows) pairs to run, e.g. 4096x1 (default: all seven)")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    check_at_least_one(parser, args, "rounds", "calls")
    load_before, start = os.getloadavg()[0], time.perf_counter()
    rows = [r for width, n in args.shapes for r in measure(width, n, args.rounds, args.calls)]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m benchmarks.weight_streaming --rounds {args.rounds} "
                   f"--calls {args.calls}"
                   + ("" if args.shapes == SHAPES else
                      " --shapes " + " ".join(f"{w}x{n}" for w, n in args.shapes)),
        "machine": machine_info(["jax", "jaxlib", "numpy"]),
        "load_average": [load_before, os.getloadavg()[0]],
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    write_report(args.out, "weight_streaming", result, markdown(result))


if __name__ == "__main__":
    main()
