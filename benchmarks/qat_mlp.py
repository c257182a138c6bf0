"""QAT benchmark: the jitted optax.adam train step of a 4-layer MLP (width 1024, batch 256).

Run from the repository root::

    python -m benchmarks.qat_mlp                  # 15 rounds of 3 steps per case
    python -m benchmarks.qat_mlp --rounds 5 --steps 2

Every case trains the same ``flax.linen`` model (four ``Dense(1024)`` layers with
biases and ReLU between them, mean squared error against a fixed random target)
with ``optax.adam(1e-3)``, one jitted step ``(params, opt_state, x, y) -> (params,
opt_state, loss)`` with the parameters and optimizer state donated:

* ``float32``: plain ``nn.Dense``;
* ``fake-quant QAT``: ``dot_general=QATDotGeneral(fake=True)``: `jaxquant.fake_quant`
  on the kernel (per output channel) and the activation (per token), float dots;
* ``int8-dot QAT``: ``dot_general=QATDotGeneral()``: the same values, the forward dot
  as int8 x int8 -> int32 (`jaxquant._qat_dot`), float backward dots;
* ``int8-dot QAT, backward='int8'``: the gradient wrt the activation also as an int8
  dot (the incoming gradient quantized per row); the weight gradient stays float;
* ``plain jnp fake-quant``: the hand-written STE ``x + stop_gradient(q - x)`` with
  ``q = clip(round(x / s), -127, 127) * s``, absmax scales per output channel and per
  token (the baseline a user would write; XLA may turn ``x / s`` into ``x * (1 / s)``);
* ``qwix QAT``: ``qwix.quantize_model`` with ``qwix.QtProvider`` and one
  ``qwix.QtRule(weight_qtype=int8, act_qtype=int8)`` (int8 forward, float backward).

Cases are timed round-robin with `benchmarks._harness.run_rounds` (each round runs
every case in turn, so a noisy neighbour slows all alike); the table gives the median
and minimum time per step, and the ratio to float32 as the median of the per-round
ratios. Two single dots of one layer's shape (float32, and int8 x int8 -> int32) run in
the same rounds: their ratio is the most an int8 forward can save on this machine. Also
reported: the loss of the first step (quantized cases must stay close to
float32, and the fake-quant and int8-dot cases must agree) and the relative L2
difference of each case's first-step kernel gradients from the fake-quant case's.

Results go to ``benchmarks/results/qat_mlp.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._qat_dot import QATDotGeneral

try:  # python -m benchmarks.qat_mlp
    from benchmarks import _harness
    from benchmarks._harness import (
        call_repeatedly,
        machine_info,
        ratio_record,
        run_rounds,
        write_report,
    )
except ImportError:  # python benchmarks/qat_mlp.py
    import _harness
    from _harness import call_repeatedly, machine_info, ratio_record, run_rounds, write_report

WIDTH, BATCH, LAYERS = 1024, 256, 4


def make_model(dot_general=None):
    import flax.linen as nn

    class MLP(nn.Module):
        dot: Callable | None = None

        @nn.compact
        def __call__(self, x):
            kw = {} if self.dot is None else {"dot_general": self.dot}
            for i in range(LAYERS):
                x = nn.Dense(WIDTH, **kw)(x)
                x = nn.relu(x) if i < LAYERS - 1 else x
            return x

    return MLP(dot_general)


def plain_fake_quant_dot(lhs, rhs, dimension_numbers, precision=None,
                         preferred_element_type=None, **kwargs):
    """A ``dot_general`` on hand-written STE fake-quant operands (per token / per channel)."""
    from jax import lax

    def ste(x, keep):
        axes = tuple(d for d in range(x.ndim) if d not in keep)
        s = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / 127
        s = jnp.where(s == 0, 1.0, s)
        return x + lax.stop_gradient(jnp.clip(jnp.round(x / s), -127, 127) * s - x)

    return lax.dot_general(ste(lhs, tuple(range(lhs.ndim - 1))), ste(rhs, (rhs.ndim - 1,)),
                           dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)


def make_step(apply: Callable, optimizer) -> Callable:
    """The jitted train step; ``params`` and ``opt_state`` are donated."""
    import optax

    def loss_fn(params, x, y):
        return jnp.mean(jnp.square(apply(params, x) - y))

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), jax.jit(jax.grad(loss_fn))


def cases() -> dict:
    """name -> flax model (or a string saying why the case cannot run)."""
    out = {
        "float32": make_model(),
        "fake-quant QAT (jq.fake_quant W per-channel + A per-token, float dots)":
            make_model(QATDotGeneral(fake=True)),
        "int8-dot QAT (jaxquant QATDotGeneral, float backward)": make_model(QATDotGeneral()),
        "int8-dot QAT, backward='int8' (activation gradient as an int8 dot)":
            make_model(QATDotGeneral(backward="int8")),
        "plain jnp fake-quant (x + stop_gradient(q - x), W per-channel + A per-token)":
            make_model(plain_fake_quant_dot),
    }
    try:
        import qwix
    except ImportError:
        out["qwix QAT"] = "not installed"
        return out
    try:
        rule = qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8)
        out["qwix QAT (QtProvider, int8 W+A, float backward)"] = qwix.quantize_model(
            make_model(), qwix.QtProvider([rule]))
    except Exception as e:  # an API change in qwix must not stop the run
        out["qwix QAT"] = f"error: {type(e).__name__}: {e}"[:200]
    return out


def _rel(a, b) -> float:
    a, b = (np.concatenate([np.ravel(v) for v in jax.tree.leaves(t)]) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def single_dots(rng, calls: int) -> dict:
    """One layer's forward dot, float32 and int8 x int8 -> int32: the speed-up int8 can give."""
    from jax import lax

    x = jax.device_put(rng.standard_normal((BATCH, WIDTH), np.float32))
    w = jax.device_put(rng.standard_normal((WIDTH, WIDTH), np.float32))
    xi, wi = (jax.device_put(rng.integers(-127, 128, a.shape).astype(np.int8)) for a in (x, w))
    dn = (((1,), (0,)), ((), ()))
    f32 = jax.jit(lambda a, b: lax.dot_general(a, b, dn))
    i8 = jax.jit(lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=jnp.int32))
    out = {}
    for name, fn, args in [(f"float32 dot ({BATCH}, {WIDTH}) . ({WIDTH}, {WIDTH})", f32, (x, w)),
                           ("int8 x int8 -> int32 dot, same shapes", i8, (xi, wi))]:
        fn(*args).block_until_ready()
        out[name] = lambda fn=fn, args=args: call_repeatedly(lambda: fn(*args), calls)
    return out


def run(rounds: int, steps: int) -> dict:
    import optax

    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((BATCH, WIDTH), np.float32))
    y = jax.device_put(rng.standard_normal((BATCH, WIDTH), np.float32))
    optimizer = optax.adam(1e-3)
    models = cases()
    init = models["float32"].init(jax.random.key(0), x)
    ready, info, grads = {}, {}, {}
    for name, model in models.items():
        if isinstance(model, str):
            continue
        try:
            params = model.init(jax.random.key(0), x)
            # the same starting point for every case (qwix adds no parameters in QT)
            params = jax.tree.map(lambda a, b: b, params, init)
            step, grad = make_step(model.apply, optimizer)
            # compared in full float32 (a GPU's default TF32 dots alone move them by ~2%)
            with jax.default_matmul_precision("highest"):
                grads[name] = grad(params, x, y)["params"]
            state = {"params": jax.tree.map(jnp.copy, params)}
            state["opt"] = optimizer.init(state["params"])
            state["params"], state["opt"], loss = step(state["params"], state["opt"], x, y)
            info[name] = {"first_loss": float(loss)}

            def fn(step=step, state=state):
                for _ in range(steps):
                    state["params"], state["opt"], loss = step(state["params"], state["opt"],
                                                               x, y)
                return jax.block_until_ready((state["params"], state["opt"], loss))

            fn()  # warm up after the donation changed the buffers
            ready[name] = fn
        except Exception as e:  # a peer's failure must not stop the run
            traceback.print_exc()
            models[name] = f"error: {type(e).__name__}: {e}"[:200]
    ref = next(k for k in grads if k.startswith("fake-quant"))
    for name in ready:
        info[name]["grad_rel_diff_vs_fake_quant"] = _rel(grads[name], grads[ref])
    dots = single_dots(rng, steps)
    load_before = os.getloadavg()[0]
    times = {k: [t / steps for t, _ in v]
             for k, v in run_rounds(ready | dots, rounds).items()}
    base = times["float32"]
    f32_dot = times[next(iter(dots))]
    dot_records = [{"dot": name, "median_ms": statistics.median(times[name]) * 1e3,
                    "min_ms": min(times[name]) * 1e3,
                    "vs_float32_dot": statistics.median(
                        a / b for a, b in zip(times[name], f32_dot, strict=True))}
                   for name in dots]
    records = []
    for name, model in models.items():
        if isinstance(model, str):
            records.append({"case": name, "status": model})
            continue
        records.append(ratio_record(name, times[name], base) | info[name])
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine_info(["jax", "jaxlib", "flax", "optax", "qwix", "numpy"]),
            "model": f"{LAYERS} x Dense({WIDTH}) + ReLU, batch {BATCH}, MSE, optax.adam, "
                     f"jitted train step (params and optimizer state donated)",
            "command": "python -m benchmarks.qat_mlp" + (
                "" if (rounds, steps) == (15, 3) else f" --rounds {rounds} --steps {steps}"),
            "rounds": rounds, "steps_per_round": steps,
            "load_average_1min": [load_before, os.getloadavg()[0]], "cases": records,
            "single_dots": dot_records}


def markdown(result: dict) -> str:
    m = result["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    lines = [f"{result['date']} · {m['cpu']}, {m['cpu_count']} CPUs ({m['platform']}) · "
             f"{versions} · `{result['command']}` · {result['model']} · median of "
             f"{result['rounds']} round-robin rounds of {result['steps_per_round']} steps · "
             f"1-min load average {result['load_average_1min'][0]:.2f} before, "
             f"{result['load_average_1min'][1]:.2f} after (a shared machine: compare rows "
             f"within one run)", "",
             "| case | median ms / step | min ms | vs float32 (median of per-round ratios) | "
             "min vs float32 min | first-step loss | kernel-grad rel. diff vs fake-quant |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["cases"]:
        if "status" in r:
            lines.append(f"| {r['case']} | {r['status']} | | | | | |")
            continue
        lines.append(f"| {r['case']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
                     f"{r['vs_float32']:.2f} | {r['min_vs_float32_min']:.2f} | "
                     f"{r['first_loss']:.6f} | {r['grad_rel_diff_vs_fake_quant']:.1e} |")
    lines += ["", "One layer's forward dot alone (the ceiling on what an int8 forward can save):", "",
              "| dot | median ms | min ms | vs float32 dot (median of per-round ratios) |",
              "|---|---:|---:|---:|"]
    lines += [f"| {r['dot']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
              f"{r['vs_float32_dot']:.2f} |" for r in result["single_dots"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args(argv)
    _harness.check_at_least_one(parser, args, "rounds", "steps")
    result = run(args.rounds, args.steps)
    write_report(args.out, "qat_mlp", result, markdown(result))


if __name__ == "__main__":
    main()
