"""A character-level transformer on the standard library's sources: float, PTQ and QAT.

Run from the repository root::

    python -m benchmarks.char_transformer              # the full run (minutes on a CPU)
    python -m benchmarks.char_transformer --steps 50 --eval-batches 2   # a quick check

The corpus is the bytes of the Python standard library's ``.py`` files, read
from the running interpreter (`jaxquant._demo.load_corpus`: every tenth file is
validation). The model is an unmodified Flax linen decoder (``nn.Embed``,
``nn.MultiHeadDotProductAttention``, ``nn.Dense``); quantization reaches it
from the outside:

* **PTQ**: the trained parameter tree goes through `jq.quantize_tree` (int8
  per-channel, int4 blocks of 32, packed) and the same model runs on it,
  dequantized (`jq.dequantize_tree`) inside the jitted evaluation; for W8A8 the
  input of every Dense layer is also fake-quantized to int8 per token through
  ``nn.intercept_methods`` (the values of an int8 x int8 dot, in float);
* **QAT**: the model trains from scratch with fake-quantized kernels
  (`jq.fake_quant`, straight-through gradients) and, for W8A8, fake-quantized
  per-token inputs of every Dense layer; then it is converted as in PTQ.

Every variant trains with the same data order, steps and optimizer. The table
reports validation bits per byte, perplexity (per byte), parameter bytes and
the median train-step time (the first 5 steps, compilation among them, left
out), in ``benchmarks/results/char_transformer.{json,md,png}``. The variants
train one after another, so their step times come from different minutes of
the machine, not interleaved rounds: on a shared machine compare them loosely.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxquant as jq
from jaxquant._demo import load_corpus

try:
    from benchmarks._harness import machine_info, write_atomic
except ImportError:  # python benchmarks/char_transformer.py
    from _harness import machine_info, write_atomic

VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training sizes."""

    context: int = 128
    width: int = 192
    heads: int = 6
    layers: int = 4
    batch: int = 32
    steps: int = 2000
    lr: float = 2e-3
    eval_batches: int = 16


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a GELU MLP."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(h.shape[:2], jnp.int32))
        h = h + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(h), mask=mask)
        m = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
        return h + nn.Dense(self.width)(nn.gelu(m))


class CharTransformer(nn.Module):
    """Next-byte logits for ``(batch, context)`` int32 tokens."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        pos = jnp.arange(tokens.shape[1])
        h = nn.Embed(VOCAB, c.width)(tokens) + nn.Embed(c.context, c.width)(pos)
        for _ in range(c.layers):
            h = Block(c.width, c.heads)(h)
        return nn.Dense(VOCAB)(nn.LayerNorm()(h))


# ------------------------------------------------------------------------- quantization

KERNELS = r"kernel$"
"""Which leaves are quantized: every Dense / DenseGeneral kernel (embeddings stay float)."""

INT8 = jq.QuantSpec(dtype=jnp.int8, axis=-1)
INT4_B32 = jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32, packed=True)


def fake_quant_kernels(params, spec: jq.QuantSpec):
    """Every kernel replaced by its fake-quantized value (straight-through gradient).

    DenseGeneral kernels of attention are ``(in, heads, head_dim)`` or
    ``(heads, head_dim, out)``: their scales follow the same spec on the flattened
    ``(in, out)`` view, as the inference path sees them.
    """
    chosen = jq.match_rules(params, [(KERNELS, spec)])

    def fq(path, leaf):
        if chosen["/".join(str(getattr(k, "key", k)) for k in path)] is None:
            return leaf
        return jq.fake_quant(leaf, dtype=spec.dtype, axis=spec.axis, block_size=spec.block_size)

    return jax.tree_util.tree_map_with_path(fq, params)


def act_quant_interceptor(next_fun, args, kwargs, context):
    """Fake-quantizes the input of every Dense layer to int8, one scale per token."""
    if isinstance(context.module, nn.Dense | nn.DenseGeneral) and context.method_name == "__call__":
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        x = jq.fake_quant(rows, dtype=jnp.int8, axis=0).reshape(x.shape)
        args = (x, *args[1:])
    return next_fun(*args, **kwargs)


# ------------------------------------------------------------------------- training


def batches(data: np.ndarray, cfg: Config, seed: int):
    """Endless random windows: (tokens, next tokens), both ``(batch, context)``."""
    rng = np.random.default_rng(seed)
    idx = np.arange(cfg.context + 1)
    while True:
        start = rng.integers(0, len(data) - cfg.context - 1, cfg.batch)
        win = data[start[:, None] + idx]
        yield jnp.asarray(win[:, :-1], jnp.int32), jnp.asarray(win[:, 1:], jnp.int32)


def bits_per_byte(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy in bits."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean() / jnp.log(2.0)


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a variant trains: ``weights`` and ``acts`` (int8 per token) fake-quantized, or not.

    Its converted tree is evaluated with the same ``acts``.
    """

    name: str
    weights: jq.QuantSpec | None = None
    acts: bool = False


def train(model: CharTransformer, params: dict, variant: Variant, data: np.ndarray, cfg: Config,
          log: Callable[[str], None]) -> tuple[dict, list[float], list[float]]:
    """Trains from the initial ``params``; returns params, the loss curve and the step times (s)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.steps // 20, cfg.steps)
    opt = optax.adamw(schedule, weight_decay=0.01)
    state = opt.init(params)

    def loss_fn(p, tokens, targets):
        if variant.weights is not None:
            p = fake_quant_kernels(p, variant.weights)
        if variant.acts:
            with nn.intercept_methods(act_quant_interceptor):
                logits = model.apply(p, tokens)
        else:
            logits = model.apply(p, tokens)
        return bits_per_byte(logits, targets)

    @jax.jit
    def step(p, s, tokens, targets):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens, targets)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses, times = [], []
    stream = batches(data, cfg, seed=1)
    for i in range(cfg.steps):
        tokens, targets = next(stream)
        t = time.perf_counter()
        params, state, loss = step(params, state, tokens, targets)
        loss = float(loss)
        times.append(time.perf_counter() - t)
        losses.append(loss)
        if i % max(1, cfg.steps // 10) == 0 or i == cfg.steps - 1:
            log(f"  {variant.name}: step {i:5d}  loss {loss:.3f} bits/byte")
    return params, losses, times[5:] or times[1:] or times  # the first step compiles


def evaluate(model: CharTransformer, params, val: list, acts: bool = False) -> float:
    """Mean validation bits per byte over fixed batches (params may hold QTensors)."""
    @jax.jit
    def loss(p, tokens, targets):
        p = jq.dequantize_tree(p)
        if acts:
            with nn.intercept_methods(act_quant_interceptor):
                return bits_per_byte(model.apply(p, tokens), targets)
        return bits_per_byte(model.apply(p, tokens), targets)

    return float(np.mean([float(loss(params, t, y)) for t, y in val]))


VARIANTS = (
    Variant("float32"),
    Variant("QAT int4 block 32", weights=INT4_B32),
    Variant("QAT int8 W8A8", weights=INT8, acts=True),
)
PTQ = (("PTQ int8 per-channel", INT8, False), ("PTQ int4 block 32", INT4_B32, False),
       ("PTQ int8 W8A8", INT8, True))


def run(cfg: Config, out: pathlib.Path, log: Callable[[str], None] = print) -> dict:
    """Trains every variant, converts, evaluates; writes json, md and png; returns the report."""
    train_data, val_data = load_corpus()
    stream = batches(val_data, dataclasses.replace(cfg, batch=64), seed=2)
    val = [next(stream) for _ in range(cfg.eval_batches)]
    model = CharTransformer(cfg)
    log(f"corpus: {len(train_data):,} train / {len(val_data):,} validation bytes; "
        f"{jax.devices()[0].platform}")
    init = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))
    rows, curves = [], {}
    for v in VARIANTS:
        params, losses, times = train(model, init, v, train_data, cfg, log)
        curves[v.name] = losses
        step_ms = 1e3 * statistics.median(times)
        if v.weights is None:
            float_params = params
            rows.append(dict(variant=v.name, bits_per_byte=evaluate(model, params, val),
                             bytes=jq.tree_nbytes(params), step_ms=step_ms))
            for name, spec, acts in PTQ:
                q = jq.quantize_tree(float_params, [(KERNELS, spec)])
                rows.append(dict(variant=name, bits_per_byte=evaluate(model, q, val, acts),
                                 bytes=jq.tree_nbytes(q), step_ms=math.nan))
        else:
            q = jq.quantize_tree(params, [(KERNELS, v.weights)])
            rows.append(dict(variant=v.name, bits_per_byte=evaluate(model, q, val, v.acts),
                             bytes=jq.tree_nbytes(q), step_ms=step_ms))
    base = rows[0]
    for r in rows:
        r["perplexity"] = 2.0 ** r["bits_per_byte"]
        r["ppl_vs_float"] = r["perplexity"] / (2.0 ** base["bits_per_byte"])
        r["bytes_vs_float"] = r["bytes"] / base["bytes"]
        r["step_vs_float"] = r["step_ms"] / base["step_ms"]
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": "python -m benchmarks.char_transformer " + " ".join(sys.argv[1:]),
              "config": dataclasses.asdict(cfg),
              "machine": machine_info(("jax", "jaxlib", "flax", "optax", "numpy")),
              "device": jax.devices()[0].device_kind,
              "rows": rows, "curves": curves}
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "char_transformer.json", json.dumps(report, indent=1))
    write_atomic(out / "char_transformer.md", markdown(report))
    plot(report, out / "char_transformer.png")
    log(markdown(report))
    return report


def markdown(report: dict) -> str:
    """The results table, with what was run where."""
    m, c = report["machine"], report["config"]
    lines = [
        f"{report['date']} · {report['device']} ({m['jax_backend']}) · {m['cpu']}, "
        f"{m['cpu_count']} CPUs · "
        f"`{report['command']}`",
        "",
        f"{c['layers']} layers, width {c['width']}, {c['heads']} heads, context {c['context']}, "
        f"batch {c['batch']}, {c['steps']} adamw steps per variant; validation: "
        f"{c['eval_batches']} x 64 windows of held-out stdlib files.",
        "",
        "| variant | val bits/byte | perplexity | vs float | param bytes | vs float | "
        "step ms (median) | vs float |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        step = "—" if math.isnan(r["step_ms"]) else f"{r['step_ms']:.1f}"
        ratio = "—" if math.isnan(r["step_vs_float"]) else f"{r['step_vs_float']:.2f}"
        lines.append(f"| {r['variant']} | {r['bits_per_byte']:.4f} | {r['perplexity']:.4f} | "
                     f"{r['ppl_vs_float']:.4f} | {r['bytes']:,} | {r['bytes_vs_float']:.3f} | "
                     f"{step} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    """Training curves (smoothed) and the validation perplexity of every variant."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, losses in report["curves"].items():
        k = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        a.plot(np.arange(len(smooth)) + k - 1, smooth, label=name)
    a.set(xlabel="step", ylabel="train loss (bits/byte)", title="training")
    a.legend()
    rows = report["rows"]
    b.barh([r["variant"] for r in rows], [r["perplexity"] for r in rows])
    ppl = [r["perplexity"] for r in rows]
    b.set(xlabel="validation perplexity (per byte)", xlim=(min(ppl) * 0.99, max(ppl) * 1.01),
          title="after conversion")
    b.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--layers", type=int, default=Config.layers)
    p.add_argument("--width", type=int, default=Config.width)
    p.add_argument("--eval-batches", type=int, default=Config.eval_batches,
                   help="held-out batches of 64 windows each variant is evaluated on")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    a = p.parse_args(argv)
    cfg = Config(steps=a.steps, layers=a.layers, width=a.width, eval_batches=a.eval_batches)
    run(cfg, a.out, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
