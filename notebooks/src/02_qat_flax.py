# %% [markdown]
# # Quantization-aware training of Flax models (linen and nnx)
#
# A byte-level language model trained on the Python standard library's own sources (no
# download), three ways: in float32; in float32 and then quantized after training (PTQ); and
# with quantization in the loop (QAT), where the forward pass sees int4 kernels (blocks of 32)
# and the gradient passes straight through. The models are plain Flax; `jaxquant.flax` reaches
# them by rules on module paths. After training, the same model runs on a tree of `QTensor`
# kernels.

# %%
import os
import pathlib
import sysconfig
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

import jaxquant as jq
from jaxquant.flax import QuantConfig, nnx_qat, nnx_quantize, nnx_unused_rules, quantize_linen


def load_corpus(max_bytes):
    """The bytes of the standard library's .py files: (train, validation), every tenth file
    to validation."""
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    parts, total = ([], []), 0
    for i, path in enumerate(files):
        parts[i % 10 == 0].append(path.read_bytes())
        total += len(parts[i % 10 == 0][-1])
        if total >= max_bytes:
            break
    return tuple(np.frombuffer(b"\n".join(p), dtype=np.uint8) for p in parts)


train_bytes, val_bytes = load_corpus(max_bytes=1_000_000)
CONTEXT, STEPS, BATCH = 16, 600, 128
if os.environ.get("JAXQUANT_SMOKE_TEST"):  # the test suite only checks that the notebook runs
    STEPS = 20
print(f"{len(train_bytes):,} train / {len(val_bytes):,} validation bytes")


def batches(data, seed):
    rng = np.random.default_rng(seed)
    while True:
        start = rng.integers(0, len(data) - CONTEXT - 1, BATCH)
        win = data[start[:, None] + np.arange(CONTEXT + 1)]
        yield jnp.asarray(win[:, :-1], jnp.int32), jnp.asarray(win[:, -1], jnp.int32)


val_stream = batches(val_bytes, seed=99)
VAL = [next(val_stream) for _ in range(8)]


def bits(logits, targets):
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[:, None], axis=1).mean() / jnp.log(2.0)


# %% [markdown]
# ## linen
#
# The rules: every layer int4 with blocks of 32 along the input axis, except the embedding,
# which stays float (`None`). `quantize_linen` returns a module-like object whose `init` and
# `apply` run the model with the selected kernels fake-quantized.

# %%
class ByteMLP(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(256, 32)(tokens).reshape(tokens.shape[0], -1)
        h = nn.gelu(nn.Dense(512)(h))
        h = nn.gelu(nn.Dense(512)(h))
        return nn.Dense(256, name="head")(h)


INT4 = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32))
RULES = [("Embed", None), ("", INT4)]
model = ByteMLP()
qm = quantize_linen(model, RULES)
x0 = VAL[0][0]
for path, cfg in qm.layers(model.init(jax.random.key(0), x0), x0).items():
    w = None if cfg is None else cfg.weight
    print(f"{path:<8}", "float" if w is None else f"{w.dtype.name}, block {w.block_size}")


def train_linen(apply):
    params = model.init(jax.random.key(0), x0)
    opt = optax.adam(optax.cosine_decay_schedule(3e-3, STEPS))
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, g = jax.value_and_grad(lambda p: bits(apply(p, batch[0]), batch[1]))(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses, stream = [], batches(train_bytes, seed=0)
    for _ in range(STEPS):
        params, state, loss = step(params, state, next(stream))
        losses.append(float(loss))
    return params, losses


def evaluate(apply, params):
    f = jax.jit(lambda p, t, y: bits(apply(p, t), y))
    return float(np.mean([f(params, t, y) for t, y in VAL]))


t = time.perf_counter()
float_params, float_curve = train_linen(model.apply)
qat_params, qat_curve = train_linen(qm.apply)
print(f"trained twice in {time.perf_counter() - t:.1f} s")

# %% [markdown]
# Conversion: `quantize_params` replaces the selected kernels by `QTensor`s, and the
# same `qm.apply` then runs the model on them (weight-only: each kernel is dequantized inside the
# jitted dot). PTQ is the same conversion applied to the float model.

# %%
ptq_tree = qm.quantize_params(float_params, x0)
qat_tree = qm.quantize_params(qat_params, x0)
print(ptq_tree["params"]["head"]["kernel"])
linen_rows = {
    "float32": (evaluate(model.apply, float_params), jq.tree_nbytes(float_params)),
    "PTQ int4 block 32": (evaluate(qm.apply, ptq_tree), jq.tree_nbytes(ptq_tree)),
    "QAT int4 block 32": (evaluate(qm.apply, qat_tree), jq.tree_nbytes(qat_tree)),
}
for name, (loss, nbytes) in linen_rows.items():
    print(f"linen {name:<18} validation {loss:.4f} bits/byte   {nbytes:>9,} bytes")

# %% [markdown]
# ## nnx
#
# The same model in nnx. `nnx_qat` edits the model in place (each selected layer gets a
# fake-quantizing hook); training is ordinary nnx code; `nnx_quantize` then stores `QTensor`
# kernels in the layers' `Param`s.

# %%
class NnxByteMLP(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(256, 32, rngs=rngs)
        self.fc1 = nnx.Linear(CONTEXT * 32, 512, rngs=rngs)
        self.fc2 = nnx.Linear(512, 512, rngs=rngs)
        self.head = nnx.Linear(512, 256, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens).reshape(tokens.shape[0], -1)
        h = nnx.gelu(self.fc2(nnx.gelu(self.fc1(h))))
        return self.head(h)


NNX_RULES = [("embed", None), ("", INT4)]


def train_nnx(qat):
    m = NnxByteMLP(nnx.Rngs(0))
    if qat:
        nnx_qat(m, NNX_RULES)
    opt = nnx.Optimizer(m, optax.adam(optax.cosine_decay_schedule(3e-3, STEPS)), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, tokens, targets):
        loss, g = nnx.value_and_grad(lambda m: bits(m(tokens), targets))(m)
        opt.update(m, g)
        return loss

    losses, stream = [], batches(train_bytes, seed=0)
    for _ in range(STEPS):
        losses.append(float(step(m, opt, *next(stream))))
    return m, losses


def evaluate_nnx(m):
    f = nnx.jit(lambda m, t, y: bits(m(t), y))
    return float(np.mean([f(m, t, y) for t, y in VAL]))


nnx_float, nnx_float_curve = train_nnx(qat=False)
nnx_q, nnx_qat_curve = train_nnx(qat=True)
print("unused rules:", nnx_unused_rules(nnx_float, NNX_RULES))
nnx_rows = {"float32": evaluate_nnx(nnx_float)}
nnx_quantize(nnx_float, NNX_RULES)  # PTQ, in place
nnx_rows["PTQ int4 block 32"] = evaluate_nnx(nnx_float)
nnx_quantize(nnx_q, NNX_RULES)
nnx_rows["QAT int4 block 32"] = evaluate_nnx(nnx_q)
print(type(nnx_q.head.kernel[...]).__name__, nnx_q.head.kernel[...])
for name, loss in nnx_rows.items():
    print(f"nnx   {name:<18} validation {loss:.4f} bits/byte")

# %% [markdown]
# ## Curves and results
#
# Training loss of float and QAT runs (smoothed), and validation loss after conversion. With
# this short training, one seed, the differences are thousandths of a bit per byte: read them
# as "int4 costs this small model little, with or without QAT", not as a ranking of the two. `benchmarks/char_transformer.py` trains a transformer longer:
# there PTQ int4 costs 2% perplexity and QAT int4 none.

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
k = 20
for name, curve in [("linen float32", float_curve), ("linen QAT int4", qat_curve),
                    ("nnx float32", nnx_float_curve), ("nnx QAT int4", nnx_qat_curve)]:
    a.plot(np.convolve(curve, np.ones(k) / k, mode="valid"), label=name)
a.set(xlabel="step", ylabel="train loss (bits/byte)", title="training")
a.legend()
names = list(nnx_rows)
w = 0.38
pos = np.arange(len(names))
b.bar(pos - w / 2, [linen_rows[n][0] for n in names], w, label="linen")
b.bar(pos + w / 2, [nnx_rows[n] for n in names], w, label="nnx")
lo = min(min(v[0] for v in linen_rows.values()), min(nnx_rows.values()))
b.set(xticks=pos, xticklabels=names, ylabel="validation bits/byte", ylim=(lo * 0.97, None),
      title="after conversion")
b.legend()
fig.tight_layout()
plt.show()
for fw, rows in (("linen", {k: v[0] for k, v in linen_rows.items()}), ("nnx", nnx_rows)):
    print(fw, {k: f"{v - rows['float32']:+.4f}" for k, v in rows.items()})
