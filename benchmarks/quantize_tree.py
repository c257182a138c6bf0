"""Whole-tree quantization: `jq.quantize_tree` on a GPT-2-small parameter tree.

Run from the repository root (either form)::

    python -m benchmarks.quantize_tree                 # 5 round-robin rounds
    python benchmarks/quantize_tree.py --repeats 9

The tree has GPT-2 small's real shapes (124,439,808 parameters: wte 50257x768,
wpe 1024x768, 12 blocks of attention c_attn 768x2304 and c_proj 768x768, MLP
c_fc 768x3072 and c_proj 3072x768, layer norms and biases) filled with
random-normal float32 values. `jq.quantize_tree` with its default rules (int8,
one absmax scale per last-axis entry, every float leaf of rank >= 2) runs
under one `jax.jit`. Measured:

* trace + lower and XLA compile time of that jit: the first in the process, and
  medians over fresh wrappers;
* run time, round-robin against (a) a hand-written single jit of the same maths
  (absmax per channel, divide, round, clip, cast), once with the correctly
  rounded quotient the contract defines (the divisor hidden from XLA's
  reciprocal rewrite, as jaxquant does on CPU) and once as the one-liner a
  user would write, whose ``x / s`` XLA turns into ``x * (1 / s)``, and (b) qwix's `quantize_params` given an abstract tree that says
  "int8, channelwise on the last axis" for the same leaves (qwix's defaults:
  ``absmax / 127.5`` scales and a multiply by the reciprocal);
* storage after / before (`jq.tree_nbytes`);
* `jq.quantization_report` of the quantized tree against the float one: the
  first call (compiling one program per leaf signature) and the median of the
  next ones, relative to the quantize_tree run.

Results go to ``<out>/quantize_tree.json`` and ``<out>/quantize_tree.md``.
"""

from __future__ import annotations

import datetime
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

import jaxquant as jq

try:  # python -m benchmarks.quantize_tree
    from benchmarks._harness import machine_info, parse_rounds, run_rounds, write_report
except ImportError:  # python benchmarks/quantize_tree.py
    from _harness import machine_info, parse_rounds, run_rounds, write_report

PACKAGES = ("jax", "jaxlib", "numpy", "qwix", "flax")
D, LAYERS, VOCAB, CONTEXT = 768, 12, 50257, 1024


def gpt2_shapes(layers: int = LAYERS) -> dict:
    """GPT-2 small's parameter shapes as a nested dict (Flax-like names), ``layers`` blocks."""
    dense = lambda n_in, n_out: {"kernel": (n_in, n_out), "bias": (n_out,)}
    norm = {"scale": (D,), "bias": (D,)}
    block = {"ln_1": norm, "attn": {"c_attn": dense(D, 3 * D), "c_proj": dense(D, D)},
             "ln_2": norm, "mlp": {"c_fc": dense(D, 4 * D), "c_proj": dense(4 * D, D)}}
    return {"wte": {"embedding": (VOCAB, D)}, "wpe": {"embedding": (CONTEXT, D)},
            "h": {str(i): block for i in range(layers)}, "ln_f": norm}


def random_tree(seed: int = 0, layers: int = LAYERS) -> dict:
    """The GPT-2-small tree (``layers`` blocks) with random-normal float32 leaves, on the
    device."""
    shapes = gpt2_shapes(layers)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    normal = jax.jit(jax.random.normal, static_argnums=(1,))
    return jax.tree.unflatten(treedef, [normal(k, s) for k, s in zip(keys, leaves, strict=True)])


def plain_quantize_tree(tree: dict, exact: bool = False) -> dict:
    """The hand-written reference: int8 absmax per last-axis entry, for rank >= 2 leaves.

    ``exact``: the correctly rounded quotients that the contract (and ONNX) defines. The
    divisors ``where(x == x, s, 1)`` and ``where(a == a, 127, 1)`` (the same values) are
    not broadcasts or constants XLA can see, so ``x / s`` and ``absmax / 127`` stay
    divisions instead of becoming products with reciprocals.
    """
    hide = (lambda v, d: jnp.where(v == v, d, 1.0)) if exact else (lambda v, d: d)

    def one(x):
        if x.ndim < 2:
            return x
        a = jnp.max(jnp.abs(x), axis=tuple(range(x.ndim - 1)))
        s = a / hide(a, 127.0)
        s = jnp.where(s == 0, 1.0, s)
        return jnp.clip(jnp.round(x / hide(x, s)), -127, 127).astype(jnp.int8), s

    return jax.tree.map(one, tree)


def differing(quantized: dict, plain: dict) -> tuple[int, int]:
    """Codes and scales of jaxquant's tree that differ from a plain tree's, bit for bit.

    Args:
      quantized: `jq.quantize_tree`'s output.
      plain: `plain_quantize_tree`'s output for the same tree (``(codes, scales)`` pairs).

    Returns:
      The number of differing codes and of differing scales (compared as bit patterns,
      so ``-0.0`` and ``0.0`` differ and equal NaNs do not).
    """
    codes = scales = 0
    pairs = zip(jax.tree.leaves(quantized, is_leaf=jq.is_qtensor),
                jax.tree.leaves(plain, is_leaf=lambda v: isinstance(v, tuple)), strict=True)
    for a, b in pairs:
        if jq.is_qtensor(a):
            bits = lambda s: lax.bitcast_convert_type(jnp.ravel(s), jnp.uint32)  # noqa: E731
            codes += int(jnp.sum(a.qvalue != b[0]))
            scales += int(jnp.sum(bits(a.scale) != bits(b[1])))
    return codes, scales


def qwix_quantizer(tree: dict) -> Callable[[dict], object]:
    """qwix's `quantize_params` on the bare tree: an abstract tree of `WithAux` leaves."""
    import qwix
    from qwix._src.core.qarray import HowToQuantize
    from qwix._src.providers.ptq import WithAux

    def abstract(x):
        if x.ndim < 2:
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        how = HowToQuantize(qtype=jnp.int8, channelwise_axes=(x.ndim - 1,))
        return WithAux(jax.ShapeDtypeStruct(x.shape, x.dtype), how)

    abstract_tree = jax.tree.map(abstract, tree)
    return lambda params: qwix.quantize_params(params, abstract_tree)


def compile_times(fn: Callable, tree: dict, repeats: int) -> dict:
    """Seconds of trace + lower and of XLA compilation of ``jax.jit(fn)`` on ``tree``.

    ``first_*``: the first time in the process (what a user waits for). The
    medians come from fresh wrappers of ``fn`` (a new function object each
    time, so the outer trace and the compilation are not served from JAX's
    caches; jitted functions that ``fn`` calls keep their traces).
    """
    lower, comp = [], []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        lowered = jax.jit(lambda t: fn(t)).lower(tree)
        lower.append(time.perf_counter() - t)
        t = time.perf_counter()
        lowered.compile()
        comp.append(time.perf_counter() - t)
    return {"first_trace_lower_s": lower[0], "first_compile_s": comp[0],
            "trace_lower_s": statistics.median(lower[1:]),
            "compile_s": statistics.median(comp[1:])}


def main(argv: Sequence[str] | None = None) -> int:
    """Builds the tree, measures compile and run times and memory, writes the results."""
    args = parse_rounds(__doc__, argv, flag="--repeats", layers=LAYERS)
    wall = time.perf_counter()
    tree = jax.block_until_ready(random_tree(layers=args.layers))
    n_params = sum(x.size for x in jax.tree.leaves(tree))
    print(f"tree: {n_params:,} parameters, {jq.tree_nbytes(tree) / 2**20:.1f} MiB",
          file=sys.stderr)

    exact_plain = functools.partial(plain_quantize_tree, exact=True)
    compiled = {"jaxquant quantize_tree": compile_times(jq.quantize_tree, tree, args.rounds),
                "plain jnp, correctly rounded x / s (one jit)": compile_times(exact_plain, tree,
                                                  args.rounds),
                "plain jnp (one jit)": compile_times(plain_quantize_tree, tree, args.rounds)}
    fns = {"jaxquant quantize_tree": jax.jit(jq.quantize_tree),
           "plain jnp, correctly rounded x / s (one jit)": jax.jit(exact_plain),
           "plain jnp (one jit)": jax.jit(plain_quantize_tree)}
    notes = {}
    try:
        fns["qwix quantize_params"] = jax.jit(qwix_quantizer(tree))
        compiled["qwix quantize_params"] = compile_times(qwix_quantizer(tree), tree,
                                                          args.rounds)
    except Exception as e:  # an optional peer whose API changed: a row saying so
        notes["qwix quantize_params"] = f"error: {type(e).__name__}: {e}"[:200]
    outputs = {}
    for name, fn in fns.items():
        outputs[name] = jax.block_until_ready(fn(tree))  # compile and warm up
        jax.block_until_ready(fn(tree))
    times = run_rounds({name: (lambda fn=fn: jax.block_until_ready(fn(tree)))
                        for name, fn in fns.items()}, args.rounds)

    q = outputs["jaxquant quantize_tree"]
    vs_plain = differing(q, outputs["plain jnp (one jit)"])
    vs_same = differing(q, outputs["plain jnp, correctly rounded x / s (one jit)"])
    before, after = jq.tree_nbytes(tree), jq.tree_nbytes(q)
    t = time.perf_counter()
    rows = jq.quantization_report(tree, q)
    report_first = time.perf_counter() - t
    report_times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        jq.quantization_report(tree, q)
        report_times.append(time.perf_counter() - t)
    base = statistics.median(s for s, _ in times["plain jnp (one jit)"])
    same = statistics.median(s for s, _ in times["plain jnp, correctly rounded x / s (one jit)"])
    cases = []
    for name in [*fns, *notes]:
        if name in notes:
            cases.append({"name": name, "status": notes[name]})
            continue
        secs = [s for s, _ in times[name]]
        cases.append({"name": name, "status": "ok", "median_ms": 1e3 * statistics.median(secs),
                      "min_ms": 1e3 * min(secs), "ratio_to_plain": statistics.median(secs) / base,
                      "ratio_to_same_maths": statistics.median(secs) / same,
                      "page_faults": int(statistics.median(f for _, f in times[name])),
                      **{k: round(v, 4) for k, v in compiled[name].items()}})
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.quantize_tree " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(PACKAGES),
        "repeats": args.rounds,
        "parameters": n_params,
        "bytes_before": before,
        "bytes_after": after,
        "memory_ratio": after / before,
        "codes_differing_from_plain": vs_plain[0],
        "codes_differing_from_same_maths": vs_same[0],
        "scales_differing_from_same_maths": vs_same[1],
        "cases": cases,
        "report": {"rows": len(rows), "compared": sum(r.compared for r in rows),
                   "first_s": round(report_first, 3),
                   "median_s": round(statistics.median(report_times), 3),
                   "ratio_to_quantize_tree": statistics.median(report_times) / (
                       1e-3 * cases[0]["median_ms"])},
    }
    report["wall_s"] = round(time.perf_counter() - wall, 1)
    write_report(args.out, "quantize_tree", report, markdown(report))
    return 0


def markdown(report: dict) -> str:
    """The results as a markdown table, with a header naming date, machine and command."""
    m, v = report["machine"], report["machine"]["versions"]
    lines = [
        f"{report['date']} · {m['cpu']}, {m['cpu_count']} CPUs ({m['platform']}) · jax "
        f"{v['jax']}, qwix {v['qwix']} · `{report['command'].strip()}` · median of "
        f"{report['repeats']} round-robin rounds",
        "",
        f"GPT-2-small tree, {report['parameters']:,} float32 parameters, int8 per channel: "
        f"{report['bytes_before']:,} -> {report['bytes_after']:,} bytes "
        f"(**{report['memory_ratio']:.4f}x**); codes differing from the plain jnp jit: "
        f"{report['codes_differing_from_plain']:,} (XLA turns the plain `x / s` into "
        f"`x * (1 / s)`, which puts a few quotients on the wrong side of a rounding tie; "
        f"jaxquant's codes use the correctly rounded quotient, as ONNX); from the plain jit "
        f"with the correctly rounded quotient (the same maths): "
        f"{report['codes_differing_from_same_maths']:,} codes, "
        f"{report['scales_differing_from_same_maths']:,} scales. qwix, with its "
        f"defaults, scales by `absmax / 127.5` and multiplies by the reciprocal, so its codes "
        f"differ (a different, not an equivalent, computation).",
        "",
        "| case | median ms | min ms | vs plain jnp, same maths | vs plain jnp `x / s` "
        "| first trace+lower s | first compile s | trace+lower s | compile s | page faults |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    r = report["report"]
    lines[2:2] = [f"`jq.quantization_report` (float tree against quantized, {r['rows']} rows, "
                  f"{r['compared']} compared): first call {r['first_s']:.2f} s (compiling one "
                  f"program per leaf signature), then {r['median_s']:.2f} s "
                  f"({r['ratio_to_quantize_tree']:.1f}x the quantize_tree run).", ""]
    for r in report["cases"]:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']} | | | | | | | | |")
            continue
        lines.append(f"| {r['name']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
                     f"{r['ratio_to_same_maths']:.2f} | {r['ratio_to_plain']:.2f} | "
                     f"{r['first_trace_lower_s']:.2f} | "
                     f"{r['first_compile_s']:.2f} | {r['trace_lower_s']:.2f} | "
                     f"{r['compile_s']:.2f} | {r['page_faults']:,} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
