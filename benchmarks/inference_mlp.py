"""Inference benchmark: a jitted 4-layer MLP (width 1024, batch 32) on quantized weights.

Run from the repository root::

    python -m benchmarks.inference_mlp                 # 40 rounds of 10 calls per case
    python -m benchmarks.inference_mlp --rounds 5 --calls 10

Every case runs the same model on the same input in this one process: four
``Dense(1024)`` layers with biases and ReLU between them, jitted, parameters
already on the device. Cases are timed round-robin (each round runs every case
``--calls`` times, in a shuffled order, so a noisy neighbour slows all alike);
the table gives the median and minimum over rounds of the time per call, and
the ratio to float32 as the median of the per-round ratios.
jaxquant cases call `jaxquant.qdot_general` on a tree quantized with
`jaxquant.quantize_tree`; the Flax rows inject `QDotGeneral` into
``flax.linen.Dense``; qwix rows (if qwix is installed) use its PTQ on the same
Flax model. Also reported: parameter bytes over float32, XLA's temporary
buffer bytes (``compile().memory_analysis()``) and the relative L2 error of the
output against float32.

Results go to ``benchmarks/results/inference_mlp.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant._dot import ActQuant, QDotGeneral, promote_dtype, qdot_general
from jaxquant._einsum import qeinsum

try:  # python -m benchmarks.inference_mlp
    from benchmarks import _harness
    from benchmarks._harness import (
        call_repeatedly,
        command,
        machine_info,
        ratio_record,
        write_report,
    )
except ImportError:  # python benchmarks/inference_mlp.py
    import _harness
    from _harness import call_repeatedly, command, machine_info, ratio_record, write_report

WIDTH, BATCH, LAYERS = 1024, 32, 4
DN = (((1,), (0,)), ((), ()))


def make_params(seed: int = 0) -> dict:
    """Float32 parameters in Flax linen's layout: ``params/Dense_i/{kernel (in, out), bias}``."""
    rng = np.random.default_rng(seed)
    layers = {}
    for i in range(LAYERS):
        kernel = rng.standard_normal((WIDTH, WIDTH), np.float32) / np.sqrt(WIDTH)
        layers[f"Dense_{i}"] = {"kernel": jnp.asarray(kernel),
                                "bias": jnp.asarray(rng.standard_normal(WIDTH, np.float32) * 0.1)}
    return {"params": layers}


def mlp(dot: Callable) -> Callable:
    """The jitted forward pass with ``dot(x, kernel)`` for each layer."""
    def forward(params, x):
        for i in range(LAYERS):
            layer = params["params"][f"Dense_{i}"]
            x = dot(x, layer["kernel"]) + layer["bias"]
            if i < LAYERS - 1:
                x = jax.nn.relu(x)
        return x
    return jax.jit(forward)


def plain_weight_only(x, qt):
    """The one-liner a user would write: dequantize, then dot (per-channel int8)."""
    return x @ (qt.qvalue.astype(jnp.float32) * qt.scale)


def jaxquant_cases(params) -> dict:
    """name -> (jitted forward, params tree)."""
    rules = lambda spec: [("kernel", spec)]  # noqa: E731
    tree = lambda spec: jq.quantize_tree(params, rules(spec))  # noqa: E731
    int8 = tree(jq.QuantSpec(axis=-1))
    int4 = tree(jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=128, packed=True))
    w8a8 = lambda x, w: qdot_general(x, w, DN, act_quant=ActQuant())  # noqa: E731
    weight_only = lambda x, w: qdot_general(x, w, DN)  # noqa: E731
    # (out, in) kernels: the layout XLA:CPU's int8 dot reads fastest
    t = {"params": {k: {"kernel": v["kernel"].T, "bias": v["bias"]}
                    for k, v in params["params"].items()}}
    int8_t = jq.quantize_tree(t, [("kernel", jq.QuantSpec(axis=0))])
    return {
        "float32": (mlp(lambda x, w: x @ w), params),
        "jaxquant int8 W+A (per-token act, per-channel weight)": (mlp(w8a8), int8),
        "jaxquant int8 W+A (per-tensor act)": (
            mlp(lambda x, w: qdot_general(x, w, DN, act_quant=ActQuant(granularity="tensor"))),
            int8),
        "jaxquant int8 W+A, kernels stored (out, in)": (
            mlp(lambda x, w: qeinsum("bk,nk->bn", x, w, act_quant=ActQuant())), int8_t),
        "jaxquant int8 W+A, weight block 128": (
            mlp(w8a8), tree(jq.QuantSpec(axis=0, block_size=128))),
        "jaxquant weight-only int8 (per-channel)": (mlp(weight_only), int8),
        "plain jnp weight-only int8 (q * s, then dot)": (mlp(plain_weight_only), int8),
        "jaxquant weight-only int4 packed (block 128)": (mlp(weight_only), int4),
        "jq.dequantize then dot, int4 packed (block 128)": (
            mlp(lambda x, w: x @ jq.dequantize(w)), int4),
        "jaxquant weight-only int4 packed (per-channel)": (
            mlp(weight_only), tree(jq.QuantSpec(dtype=jnp.int4, axis=-1, packed=True))),
        "jaxquant weight-only int4 unpacked (block 128)": (
            mlp(weight_only), tree(jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=128))),
        "jaxquant weight-only float8_e4m3fn (per-channel)": (
            mlp(weight_only), tree(jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=-1))),
    }


def flax_cases(params) -> dict:
    """The same model as ``flax.linen.Dense`` layers: float, jaxquant injection, qwix PTQ."""
    import flax.linen as nn

    class MLP(nn.Module):
        dot: QDotGeneral | None = None

        @nn.compact
        def __call__(self, x):
            kw = {} if self.dot is None else {"dot_general": self.dot,
                                              "promote_dtype": promote_dtype}
            for i in range(LAYERS):
                x = nn.Dense(WIDTH, **kw)(x)
                x = nn.relu(x) if i < LAYERS - 1 else x
            return x

    int8 = jq.quantize_tree(params, [("kernel", jq.QuantSpec(axis=-1))])
    cases = {
        "flax linen float32": (jax.jit(MLP().apply), params),
        "flax linen + jaxquant int8 W+A": (jax.jit(MLP(QDotGeneral(act_quant=ActQuant())).apply),
                                           int8),
        "flax linen + jaxquant weight-only int8": (jax.jit(MLP(QDotGeneral()).apply), int8),
    }
    try:
        import qwix
    except ImportError:
        cases["qwix PTQ"] = "not installed"
        return cases
    x = jnp.zeros((BATCH, WIDTH))
    for name, rule in [
        ("qwix PTQ int8 W+A", dict(weight_qtype=jnp.int8, act_qtype=jnp.int8)),
        ("qwix PTQ weight-only int8", dict(weight_qtype=jnp.int8)),
        ("qwix PTQ weight-only int4 (tile 128)", dict(weight_qtype=jnp.int4, tile_size=128)),
    ]:
        try:
            model = qwix.quantize_model(MLP(), qwix.PtqProvider([qwix.QtRule(module_path=".*",
                                                                             **rule)]))
            abstract = jax.eval_shape(model.init, jax.random.key(0), x)
            qparams = {"params": qwix.quantize_params(params["params"], abstract["params"])}
            cases[name] = (jax.jit(model.apply), qparams)
        except Exception as e:  # an API change in qwix must not stop the run
            cases[name] = f"error: {type(e).__name__}: {e}"[:200]
    return cases


def param_bytes(tree) -> int:
    """Storage bytes: QTensors at their real cost, qwix QArrays by their leaves' arrays."""
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=jq.is_qtensor):
        if jq.is_qtensor(leaf):
            total += leaf.nbytes
        else:
            bits = jnp.iinfo(leaf.dtype).bits if jnp.issubdtype(leaf.dtype, jnp.integer) \
                else jnp.finfo(leaf.dtype).bits
            total += -(-leaf.size * bits // 8)
    return total


def run(rounds: int, calls: int) -> dict:
    params = make_params()
    x = jax.device_put(np.random.default_rng(1).standard_normal((BATCH, WIDTH), np.float32))
    cases = jaxquant_cases(params)
    try:
        cases |= flax_cases(params)
    except ImportError:
        cases["flax linen"] = "not installed"
    ready = {k: v for k, v in cases.items() if not isinstance(v, str)}
    ref = np.asarray(ready["float32"][0](params, x), np.float64)
    info = {}
    for name, (fn, tree) in ready.items():
        y = np.asarray(fn(tree, x).block_until_ready(), np.float64)  # compiles
        mem = fn.lower(tree, x).compile().memory_analysis()
        info[name] = {"rel_l2_error": float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
                      "param_bytes": param_bytes(tree),
                      "temp_bytes": int(mem.temp_size_in_bytes) if mem else None}
    load_before = os.getloadavg()[0]
    times = {name: [] for name in ready}
    order = list(ready)
    shuffle = np.random.default_rng(2)
    for r in range(rounds):
        start = time.perf_counter()
        shuffle.shuffle(order)  # no case always runs right after another
        for name in order:
            fn, tree = ready[name]
            t0 = time.perf_counter()
            call_repeatedly(lambda fn=fn, tree=tree: fn(tree, x), calls)
            times[name].append((time.perf_counter() - t0) / calls)
        print(f"  round {r + 1}/{rounds}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    base = times["float32"]
    fbytes = info["float32"]["param_bytes"]
    records = []
    for name, value in cases.items():
        if isinstance(value, str):
            records.append({"case": name, "status": value})
            continue
        records.append(ratio_record(name, times[name], base)
                       | {"bytes_vs_float32": info[name]["param_bytes"] / fbytes, **info[name]})
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine_info(["jax", "jaxlib", "flax", "qwix", "numpy"]),
            "model": f"{LAYERS} x Dense({WIDTH}) + ReLU, batch {BATCH}, float32 input",
            "rounds": rounds, "calls_per_round": calls,
            "load_average_1min": [load_before, os.getloadavg()[0]], "cases": records}


def markdown(result: dict) -> str:
    m = result["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    lines = [f"{result['date']} · {m['cpu']}, {m['cpu_count']} CPUs · {versions} · "
             f"`{result['command']}` · {result['model']} · median of {result['rounds']} "
             f"round-robin rounds of {result['calls_per_round']} calls · 1-min load average "
             f"{result['load_average_1min'][0]:.2f} before, {result['load_average_1min'][1]:.2f} "
             f"after (a shared machine: compare rows within one run)", "",
             "| case | median ms | min ms | vs float32 (median of per-round ratios) | "
             "min vs float32 min | param bytes vs float32 | XLA temp MiB | rel. L2 error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["cases"]:
        if "status" in r:
            lines.append(f"| {r['case']} | {r['status']} | | | | | | |")
            continue
        temp = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.2f}"
        lines.append(f"| {r['case']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | "
                     f"{r['vs_float32']:.2f} | {r['min_vs_float32_min']:.2f} | "
                     f"{r['bytes_vs_float32']:.4f} | {temp} | "
                     f"{r['rel_l2_error']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args(argv)
    _harness.check_at_least_one(parser, args, "rounds", "calls")
    try:
        result = run(args.rounds, args.calls)
    except Exception:
        traceback.print_exc()
        raise
    result["command"] = command("inference_mlp", argv)
    write_report(args.out, "inference_mlp", result, markdown(result))


if __name__ == "__main__":
    main()
