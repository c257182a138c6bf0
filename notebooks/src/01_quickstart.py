# %% [markdown]
# # jaxquant quick start
#
# This notebook quantizes a real weight matrix with every granularity (per-tensor,
# per-axis, blocked) and format (int8, int4, uint8 asymmetric, float8 e4m3/e5m2,
# float4 e2m1), plots the error of each, and shows fake quantization, packing and the
# storage each choice costs; then the low-bit formats (NF4, MX, NVFP4), bits per weight
# against error.
#
# The weights come from a tiny byte-level language model trained here for a few hundred
# steps on the Python standard library's own sources: no download, a few seconds on two
# CPU cores.

# %%
import pathlib
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import jaxquant as jq

print("jax", jax.__version__, "on", jax.devices()[0].platform)

# %% [markdown]
# ## A trained weight matrix
#
# The model reads 8 bytes of Python source and predicts the next one: a 16-wide byte
# embedding, a 128 -> 256 ReLU layer and a 256 -> 256 output layer.

# %%
src = pathlib.Path(pathlib.__file__).parent
text = b"".join(p.read_bytes() for p in sorted(src.glob("[a-j]*.py")))
data = np.frombuffer(text, np.uint8)
split = int(0.9 * len(data))
print(f"{len(data):,} bytes of stdlib source")

CONTEXT, EMBED, HIDDEN = 8, 16, 256


def init(key):
    k = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k[0], (256, EMBED)) * 0.5,
        "dense1": {"kernel": jax.random.normal(k[1], (CONTEXT * EMBED, HIDDEN))
                   / np.sqrt(CONTEXT * EMBED), "bias": jnp.zeros(HIDDEN)},
        "dense2": {"kernel": jax.random.normal(k[2], (HIDDEN, 256)) / np.sqrt(HIDDEN),
                   "bias": jnp.zeros(256)},
    }


def logits_fn(params, ctx):
    h = params["embed"][ctx].reshape(ctx.shape[0], -1)
    h = jax.nn.relu(h @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return h @ params["dense2"]["kernel"] + params["dense2"]["bias"]


def loss_fn(params, ctx, target):
    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, ctx), target).mean()


def batch(rng, lo, hi, n):
    i = rng.integers(lo, hi - CONTEXT - 1, n)[:, None] + np.arange(CONTEXT + 1)
    return jnp.asarray(data[i[:, :-1]], jnp.int32), jnp.asarray(data[i[:, -1]], jnp.int32)


opt = optax.adam(3e-3)


@jax.jit
def step(params, state, ctx, target):
    loss, grads = jax.value_and_grad(loss_fn)(params, ctx, target)
    updates, state = opt.update(grads, state)
    return optax.apply_updates(params, updates), state, loss


rng = np.random.default_rng(0)
params = init(jax.random.key(0))
state = opt.init(params)
start, losses = time.perf_counter(), []
for _ in range(400):
    params, state, loss = step(params, state, *batch(rng, 0, split, 256))
    losses.append(float(loss))
test_ctx, test_target = batch(np.random.default_rng(1), split, len(data), 4096)
eval_loss = jax.jit(loss_fn)
print(f"trained in {time.perf_counter() - start:.1f} s; train loss {np.mean(losses[:20]):.2f} "
      f"-> {np.mean(losses[-20:]):.2f} nats/byte; "
      f"test loss {float(eval_loss(params, test_ctx, test_target)):.3f}")

W = params["dense1"]["kernel"]  # (in=128, out=256)
print("W:", W.shape, W.dtype, f"absmax {float(jnp.abs(W).max()):.3f}, std {float(W.std()):.3f}")

# %% [markdown]
# ## Quantize and dequantize
#
# `jq.quantize` returns a `QTensor`: the codes (`qvalue`, of the format's dtype and of
# `W`'s shape), the scale and, for asymmetric formats, the zero point. Without a `scale`,
# the scale is computed from the data: symmetric `absmax / qmax`. `jq.dequantize`
# computes `(qvalue - zero_point) * scale` in float32.

# %%
qt = jq.quantize(W)  # int8, one scale for the whole tensor
print(qt)
print("codes", qt.qvalue.dtype, qt.qvalue.shape, "scale", qt.scale)
W_hat = jq.dequantize(qt)
print("max |error|", float(jnp.abs(W_hat - W).max()), "<= scale / 2 =", float(qt.scale) / 2)

# %% [markdown]
# With an explicit scale (and zero point) the codes are those of ONNX `QuantizeLinear`, bit
# for bit: `round_half_to_even(x / scale) + zero_point`, clipped to the format's range.

# %%
x = jnp.array([-1.0, -0.25, 0.0, 0.25, 0.75, 100.0])
print(jq.quantize(x, jnp.float32(0.5)).qvalue)  # -0.5 and 0.5 are ties: round to even
print(jq.quantize(x, jnp.float32(0.5), jnp.uint8(128), dtype=jnp.uint8).qvalue)  # clipped to 255

# %% [markdown]
# ## Granularity
#
# Which elements share a scale, in ONNX's scale layouts:
#
# * **per-tensor** (`axis=None`): one scale;
# * **per-axis** (`axis=1`): one scale per output feature, `scale.shape == (256,)`;
# * **blocked** (`axis=0, block_size=32`): the input axis cut into blocks of 32, one scale
#   per block and output feature, `scale.shape == (4, 256)`.

# %%
GRANULARITIES = {
    "per-tensor": dict(axis=None),
    "per-axis": dict(axis=1),
    "blocked (32)": dict(axis=0, block_size=32),
}
for name, kw in GRANULARITIES.items():
    q = jq.quantize(W, dtype=jnp.int4, **kw)
    print(f"{name:13s} {q}")

# %% [markdown]
# ## Formats
#
# Integer formats are symmetric by default; `symmetric=False` uses the range
# `[min(x, 0), max(x, 0)]` with a zero point (uint8 here). Float formats scale the
# absmax to the format's largest finite value and round to the nearest code.
# The signal-to-quantization-noise ratio `10 log10(sum x^2 / sum (x - x_hat)^2)`:


# %%
FORMATS = {
    "int8": dict(dtype=jnp.int8),
    "uint8 asym": dict(dtype=jnp.uint8, symmetric=False),
    "float8_e4m3fn": dict(dtype=jnp.float8_e4m3fn),
    "float8_e5m2": dict(dtype=jnp.float8_e5m2),
    "int4": dict(dtype=jnp.int4),
    "float4_e2m1fn": dict(dtype=jnp.float4_e2m1fn),
}


def sqnr(x, x_hat):
    return float(10 * jnp.log10(jnp.sum(x**2) / jnp.sum((x - x_hat) ** 2)))


results = {}  # (format, granularity) -> dequantized W
for f, fkw in FORMATS.items():
    for g, gkw in GRANULARITIES.items():
        results[f, g] = jq.quantize(W, **fkw, **gkw).dequantize()

print(f"{'SQNR (dB)':15s}" + "".join(f"{g:>15s}" for g in GRANULARITIES))
for f in FORMATS:
    print(f"{f:15s}" + "".join(f"{sqnr(W, results[f, g]):15.1f}" for g in GRANULARITIES))

# %%
fig, ax = plt.subplots(figsize=(9, 3.5))
width = 0.8 / len(GRANULARITIES)
for i, g in enumerate(GRANULARITIES):
    ax.bar(np.arange(len(FORMATS)) + (i - 1) * width, [sqnr(W, results[f, g]) for f in FORMATS],
           width, label=g)
ax.set_xticks(np.arange(len(FORMATS)), list(FORMATS))
ax.set_ylabel("SQNR (dB)")
ax.set_title("Quantization of a trained 128x256 weight matrix")
ax.legend()
ax.grid(axis="y", alpha=0.3)
plt.show()

# %% [markdown]
# The error distribution: uniform over `[-scale/2, scale/2]` for integer formats,
# proportional to the magnitude for float formats (their codes are denser near zero).

# %%
fig, axes = plt.subplots(2, 3, figsize=(10, 5.5), sharey=True)
for ax, f in zip(axes.flat, FORMATS, strict=True):
    err = np.asarray(results[f, "per-axis"] - W).ravel()
    ax.hist(err, bins=80, color="tab:blue")
    ax.set_yscale("log")
    ax.set_title(f"{f}: SQNR {sqnr(W, results[f, 'per-axis']):.1f} dB", fontsize=10)
    ax.set_xlabel("dequantized - original")
fig.suptitle("Error per element, per-axis scales")
fig.tight_layout()
plt.show()

# %% [markdown]
# What the error does to the model: the test loss with `dense1`'s kernel replaced by its
# dequantized version (full precision above).

# %%
print(f"float32        test loss {float(eval_loss(params, test_ctx, test_target)):.4f}")
for f in FORMATS:
    p = {**params, "dense1": {**params["dense1"], "kernel": results[f, "blocked (32)"]}}
    print(f"{f:15s}test loss {float(eval_loss(p, test_ctx, test_target)):.4f} (blocked)")

# %% [markdown]
# ## Fake quantization for training
#
# `jq.fake_quant` returns `dequantize(quantize(x))` with a straight-through gradient: 1
# where the code was not clipped, 0 where it was. With the scale passed as an array, the
# scale gets the LSQ gradient (as PyTorch's learnable fake-quantize).

# %%
xs = jnp.linspace(-1.5, 1.5, 601)
scale = jnp.float32(0.15)
fq = jq.fake_quant(xs, scale, dtype=jnp.int4)
dx = jax.grad(lambda v: jq.fake_quant(v, scale, dtype=jnp.int4).sum())(xs)
ds = jax.grad(lambda s: jq.fake_quant(xs, s, dtype=jnp.int4).sum())(scale)
print("d/dscale of the sum (LSQ):", float(ds))

fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(xs, fq, label="fake_quant(x), int4, scale 0.15")
ax.plot(xs, dx, label="d/dx (straight-through)")
ax.axvspan(-1.5, -8.5 * 0.15, color="grey", alpha=0.2)
ax.axvspan(7.5 * 0.15, 1.5, color="grey", alpha=0.2, label="clipped codes")
ax.set_xlabel("x")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## Packing and storage
#
# JAX stores an `int4` array one code per byte; `jq.pack` stores two codes per byte (four
# for 2-bit formats) in ONNX's byte layout, low nibble first. `QTensor.nbytes` is the real
# storage cost: codes at their bit width plus scales and zero points.

# %%
codes = jnp.array([1, -2, 3, 7], jnp.int4)
packed = jq.pack(codes)
print(packed.data, [hex(b) for b in np.asarray(packed.data)], "->", jq.unpack(packed))

q4 = jq.quantize(W, dtype=jnp.int4, axis=0, block_size=32)
q4p = jq.pack(q4)  # the same as jq.quantize(..., packed=True)
print(q4p)
print("codes in memory:", q4.qvalue.nbytes, "bytes unpacked,", q4p.qvalue.nbytes, "packed")
print("bit-exact:", bool((q4p.dequantize() == q4.dequantize()).all()))

# %%
rows = [("float32", W.nbytes), ("bfloat16", W.astype(jnp.bfloat16).nbytes)]
for f, g in [("int8", "per-tensor"), ("int8", "per-axis"), ("uint8 asym", "per-axis"),
             ("float8_e4m3fn", "blocked (32)"), ("int4", "blocked (32)"),
             ("float4_e2m1fn", "blocked (32)")]:
    q = jq.quantize(W, **FORMATS[f], **GRANULARITIES[g])
    rows.append((f"{f}, {g}", q.nbytes))
for label, n in rows:
    print(f"{label:30s}{n:8,d} bytes  {8 * n / W.size:5.2f} bits/weight")

# %% [markdown]
# ## Low-bit formats: NF4, MX, NVFP4
#
# Codebooks (`"nf4"`, `"fp4"`) and named composites (`jq.SCHEMES`: the OCP Microscaling
# formats with `float8_e8m0fnu` power-of-two block scales, and NVFP4 with float8 block scales
# under a float32 tensor scale) are `dtype=` values like any other. Blocks run along the input
# axis (`axis=0`) of the `(in, out)` kernel. Each point is one format: storage bits per weight
# (scales included) against SQNR.

# %%
LOW_BIT = {
    "int8 per-channel": dict(dtype=jnp.int8, axis=1),
    "mxint8": dict(dtype="mxint8", axis=0),
    "mxfp8_e4m3": dict(dtype="mxfp8_e4m3", axis=0),
    "mxfp6_e2m3": dict(dtype="mxfp6_e2m3", axis=0, packed=True),
    "int4 block 32": dict(dtype=jnp.int4, axis=0, block_size=32, packed=True),
    "nf4": dict(dtype="nf4", axis=0, packed=True),
    "nf4 + double quant": dict(dtype="nf4", axis=0, packed=True, double_quant=True),
    "nvfp4": dict(dtype="nvfp4", axis=0, packed=True),
    "mxfp4": dict(dtype="mxfp4", axis=0, packed=True),
    "mxfp4 (ceil scales)": dict(dtype="mxfp4", axis=0, packed=True, scale_rounding="ceil"),
}
points = {}
for name, kw in LOW_BIT.items():
    q = jq.quantize(W, **kw)
    points[name] = (q.bits_per_element, sqnr(W, q.dequantize()))
    print(f"{name:22s} {jq.format_name(q):12s} {q.bits_per_element:5.2f} bits  "
          f"{points[name][1]:5.1f} dB")
print(jq.quantize(W, **LOW_BIT["nvfp4"]))  # the block scales are a QTensor themselves

fig, ax = plt.subplots(figsize=(7, 4))
for name, (bits, db) in points.items():
    ax.scatter(bits, db)
    ax.annotate(name, (bits, db), fontsize=8, xytext=(4, -3), textcoords="offset points")
ax.set_xlabel("bits per weight (scales included)")
ax.set_ylabel("SQNR (dB)")
ax.set_title("Low-bit formats on a trained kernel")
plt.show()
