"""jaxquant.flax on an unmodified linen MLP: train step and inference, against float32.

Run from the repository root::

    python -m benchmarks.flax_integration                 # 11 rounds of 3 calls per case
    python -m benchmarks.flax_integration --rounds 5 --calls 2

The model is four ``nn.Dense(1024)`` layers with ReLU between them, batch 256,
never edited: every quantized case is `jaxquant.flax.quantize_linen` with one
`QuantConfig` for all layers.

* train (jitted ``optax.adam`` step, params and optimizer state donated): float32;
  fake-quant QAT (int8 kernel per output channel + int8 input per token, float
  dots); ``int8_dot=True`` (the same values through ``qat_dot_general``: int8 x
  int8 -> int32 forward, straight-through float backward); and the same int8 dot
  injected by hand as ``nn.Dense(dot_general=QATDotGeneral())``, which shows
  what the interception itself costs.
* inference (jitted forward on the tree of ``quantize_params``): float32;
  weight-only int8 and packed int4 (dequantized inside the jit); int8 x int8 ->
  int32 with per-token activations. The table also gives the relative L2 error
  against float32 and the parameter bytes.

Cases are timed round-robin (`benchmarks._harness.run_rounds`): each round runs
every case once, so a noisy neighbour slows all alike; the ratio to float32 is
the median of the per-round ratios. Results go to ``<out>/flax_integration.json``
and ``.md`` (``--out``, default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant.flax import ActSpec, QuantConfig, quantize_linen

try:  # python -m benchmarks.flax_integration
    from benchmarks._harness import (
        call_repeatedly,
        check_at_least_one,
        machine_info,
        run_rounds,
        write_atomic,
    )
except ImportError:  # python benchmarks/flax_integration.py
    from _harness import call_repeatedly, check_at_least_one, machine_info, run_rounds, write_atomic

WIDTH, BATCH, LAYERS = 1024, 256, 4
W8A8 = QuantConfig(act=ActSpec())


def make_model(dot_general=None):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            kw = {} if dot_general is None else {"dot_general": dot_general}
            for i in range(LAYERS):
                x = nn.Dense(WIDTH, **kw)(x)
                x = nn.relu(x) if i < LAYERS - 1 else x
            return x

    return MLP()


def train_cases(x, y, calls: int) -> dict:
    import optax

    from jaxquant._qat_dot import QATDotGeneral

    model = make_model()
    applies = {
        "float32 train step": model.apply,
        "fake-quant QAT: quantize_linen(W int8 per channel, A int8 per token)":
            quantize_linen(model, W8A8).apply,
        "int8-dot QAT: quantize_linen(..., int8_dot=True)":
            quantize_linen(model, QuantConfig(act=ActSpec(), int8_dot=True)).apply,
        "int8-dot QAT injected by hand: nn.Dense(dot_general=QATDotGeneral())":
            make_model(QATDotGeneral()).apply,
    }
    opt = optax.adam(1e-3)
    params = model.init(jax.random.key(0), x)
    out = {}
    for name, apply in applies.items():
        def step(p, s, apply=apply):
            loss, g = jax.value_and_grad(lambda p: jnp.mean((apply(p, x) - y) ** 2))(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        step = jax.jit(step, donate_argnums=(0, 1))
        state = [jax.tree.map(jnp.copy, params)]
        state.append(opt.init(state[0]))

        def fn(step=step, state=state):
            for _ in range(calls):
                state[0], state[1], loss = step(state[0], state[1])
            return jax.block_until_ready((state, loss))

        fn()
        out[name] = fn
    return out


def infer_cases(x, calls: int) -> tuple[dict, dict]:
    model = make_model()
    params = model.init(jax.random.key(0), x)
    ref = np.asarray(jax.jit(model.apply)(params, x))
    configs = {
        "float32 forward": None,
        "weight-only int8": QuantConfig(),
        "weight-only int4, packed": QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4,
                                                                    packed=True)),
        "int8 x int8 -> int32, per-token activations": W8A8,
    }
    fns, info = {}, {}
    for name, cfg in configs.items():
        if cfg is None:
            apply, tree = jax.jit(model.apply), params
        else:
            qm = quantize_linen(model, cfg)
            apply, tree = jax.jit(qm.apply), qm.quantize_params(params, x)
        y = np.asarray(apply(tree, x))
        info[name] = {"rel_l2_vs_float32": float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
                      "param_bytes": jq.tree_nbytes(tree)}
        fns[name] = lambda apply=apply, tree=tree: call_repeatedly(lambda: apply(tree, x), calls)
    return fns, info


def _table(times: dict, names, calls: int, info=None) -> list[str]:
    base = times[names[0]]
    rows = []
    for name in names:
        t = times[name]
        extra = "" if info is None else (f" | {info[name]['rel_l2_vs_float32']:.1e} | "
                                         f"{info[name]['param_bytes'] / 2**20:.2f}")
        rows.append(f"| {name} | {statistics.median(t) / calls * 1e3:.2f} | "
                    f"{min(t) / calls * 1e3:.2f} | "
                    f"{statistics.median(a / b for a, b in zip(t, base, strict=True)):.2f}"
                    f"{extra} |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "results",
                        help="output folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    check_at_least_one(parser, args, "rounds", "calls")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, WIDTH), np.float32))
    y = jnp.asarray(rng.standard_normal((BATCH, WIDTH), np.float32))
    train = train_cases(x, y, args.calls)
    infer, info = infer_cases(x, args.calls)
    load = [os.getloadavg()[0]]
    times = {k: [t for t, _ in v] for k, v in run_rounds(train | infer, args.rounds).items()}
    load.append(os.getloadavg()[0])
    command = "python -m benchmarks.flax_integration" + (
        "" if (args.rounds, args.calls) == (11, 3) else
        f" --rounds {args.rounds} --calls {args.calls}")
    m = machine_info(["jax", "jaxlib", "flax", "optax", "numpy"])
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    lines = [
        f"{date} · {m['cpu']}, "
        f"{m['cpu_count']} CPUs · " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()
                                                if v)
        + f" · `{command}` · {LAYERS} x Dense({WIDTH}) + ReLU, batch {BATCH} · median of "
        f"{args.rounds} round-robin rounds · 1-min load average {load[0]:.2f} before, "
        f"{load[1]:.2f} after (a shared machine: compare rows within one run)", "",
        "| train step (optax.adam, jitted) | median ms | min ms | vs float32 |",
        "|---|---:|---:|---:|", *_table(times, list(train), args.calls), "",
        "| inference (jitted forward) | median ms | min ms | vs float32 | rel. L2 error "
        "vs float32 | param MiB |", "|---|---:|---:|---:|---:|---:|",
        *_table(times, list(infer), args.calls, info)]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "flax_integration.md", text)
    write_atomic(args.out / "flax_integration.json", json.dumps(
        {"date": date, "command": command, "machine": m, "load_average_1min": load,
         "rounds": args.rounds, "calls_per_round": args.calls, "seconds_per_round": times,
         "inference": info},
        indent=1))


if __name__ == "__main__":
    main()
