"""What each backend's exact division costs, measured on the CPU: `jq.quantize_tree` of the
GPT-2-small tree (int8 per channel) with each of the three lowerings of
`jaxquant._rounding.divide` swapped in.

Run from the repository root (either form)::

    python -m benchmarks.division_routes              # 5 rounds
    python benchmarks/division_routes.py --rounds 9

`divide` picks its lowering per backend when the program is lowered: the CPU's
IEEE division (``x / where(x == x, s, 1)``); on GPUs, a float64 division
rounded to float32 (`jaxquant._wide_division`); on TPUs, the float32 quotient
corrected with an exact residual (`jaxquant._corrected_division.correct_quotient`, ~40
more operations per element). Here each one runs on the CPU, in place of the
CPU's, so their compile times, program sizes and run times can be compared in
one process on one machine. Compile time is what the choice of route was about:
with the float32 correction, XLA:GPU compiled this tree in 13.5-14 s against
0.7 s for a plain jit (H100, 2026-11-24). Every route must give the same codes
(checked here, and a route that differs is reported as such).

Results go to ``<out>/division_routes.json`` and ``<out>/division_routes.md``.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import jaxquant as jq
import jaxquant._rounding as rounding

try:  # python -m benchmarks.division_routes
    from benchmarks._harness import machine_info, parse_rounds, run_rounds, write_report
    from benchmarks.quantize_tree import LAYERS, compile_times, random_tree
except ImportError:  # python benchmarks/division_routes.py
    from _harness import machine_info, parse_rounds, run_rounds, write_report
    from quantize_tree import LAYERS, compile_times, random_tree

PACKAGES = ("jax", "jaxlib", "numpy")
CPU_DIVISIONS = dict(rounding.CPU_DIVISIONS)  # by the scales' kind: any or normal
CPU_DIVISION = rounding._plain_division
ROUTES = {  # name -> the function that takes the CPU divisions' place (None: the CPU's own)
    "CPU: IEEE float32 division (the CPU's own route)": None,
    "GPU: float64 division rounded to float32": rounding._wide_division,
    "TPU: float32 quotient + exact-residual correction": lambda x, s: rounding.nan_propagated(
        x, s, rounding.correct_quotient(x, s, CPU_DIVISION(x, s))),
}


def measure_route(division, tree: dict, rounds: int) -> dict:
    """Compile times, program size, one run's codes and a jitted function, with ``division``."""
    jax.clear_caches()  # traces made with another route's division
    if division is not None:
        rounding.CPU_DIVISIONS.update(dict.fromkeys(CPU_DIVISIONS, division))
    try:
        times = compile_times(jq.quantize_tree, tree, rounds)
        compiled = jax.jit(jq.quantize_tree).lower(tree).compile()  # kept by clear_caches
        text = compiled.as_text()
        codes = [q.qvalue for q in jax.tree.leaves(jax.block_until_ready(compiled(tree)),
                                                    is_leaf=jq.is_qtensor) if jq.is_qtensor(q)]
        return {**times, "hlo_instructions": sum(" = " in line for line in text.splitlines()),
                "fn": compiled, "codes": codes}
    finally:
        rounding.CPU_DIVISIONS.update(CPU_DIVISIONS)


def main(argv: Sequence[str] | None = None) -> int:
    """Measures each route (compile, program size, run time, codes), writes the results."""
    args = parse_rounds(__doc__, argv, layers=LAYERS)
    wall = time.perf_counter()
    tree = jax.block_until_ready(random_tree(layers=args.layers))
    routes = {name: measure_route(division, tree, args.rounds)
              for name, division in ROUTES.items()}
    # Run times round-robin, each route's compiled program as it was compiled.
    times = run_rounds({name: (lambda fn=r["fn"]: jax.block_until_ready(fn(tree)))
                        for name, r in routes.items()}, args.rounds)
    reference = routes[next(iter(ROUTES))]["codes"]
    base = statistics.median(s for s, _ in times[next(iter(ROUTES))])
    cases = []
    for name, r in routes.items():
        secs = [s for s, _ in times[name]]
        differing = sum(int(jnp.sum(a != b)) for a, b in zip(r["codes"], reference, strict=True))
        cases.append({"name": name, "codes_differing_from_cpu_route": differing,
                      "hlo_instructions": r["hlo_instructions"],
                      "median_ms": 1e3 * statistics.median(secs), "min_ms": 1e3 * min(secs),
                      "ratio_to_cpu_route": statistics.median(secs) / base,
                      **{k: round(r[k], 4) for k in ("first_trace_lower_s", "first_compile_s",
                                                     "trace_lower_s", "compile_s")}})
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.division_routes " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(PACKAGES),
        "rounds": args.rounds,
        "parameters": sum(x.size for x in jax.tree.leaves(tree)),
        "cases": cases,
        "wall_s": round(time.perf_counter() - wall, 1),
    }
    write_report(args.out, "division_routes", report, markdown(report))
    return 0


def markdown(report: dict) -> str:
    """The results as a markdown table, with a header naming date, machine and command."""
    m, v = report["machine"], report["machine"]["versions"]
    lines = [
        f"{report['date']} · {m['cpu']}, {m['cpu_count']} CPUs · jax {v['jax']}, jaxlib "
        f"{v['jaxlib']} · `{report['command'].strip()}` · medians of {report['rounds']} rounds",
        "",
        f"`jq.quantize_tree` of the GPT-2-small tree ({report['parameters']:,} float32 "
        "parameters) to int8 per channel, on the CPU, with each backend's lowering of the exact "
        "division in place of the CPU's.",
        "",
        "| division route | codes differing from the CPU route | HLO instructions | compile s "
        "| first compile s | trace+lower s | median ms | vs CPU route |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["cases"]:
        lines.append(f"| {c['name']} | {c['codes_differing_from_cpu_route']:,} | "
                     f"{c['hlo_instructions']:,} | {c['compile_s']:.2f} | "
                     f"{c['first_compile_s']:.2f} | {c['trace_lower_s']:.2f} | "
                     f"{c['median_ms']:.1f} | {c['ratio_to_cpu_route']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
