# %% [markdown]
# # Converting a checkpoint
#
# A whole parameter tree, here a small Flax linen transformer's, quantized by rules on its
# paths: int8 attention projections, int4 MLP weights packed two per byte, a float8 output
# layer. Then: what each rule did and what it saved, a safetensors checkpoint reloaded bit
# for bit, the same on 8 (host CPU) devices with sharded weights, and the model run on the
# quantized tree through `jq.qdot_general`.
#
# The 8 devices must be requested before JAX is imported:

# %%
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import pathlib  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxquant as jq  # noqa: E402

print(len(jax.devices()), "devices:", jax.devices()[0].platform)

# %% [markdown]
# ## The model
#
# A byte-level causal transformer: embedding, two pre-norm blocks (attention with
# `query`/`key`/`value`/`out` projections, an `mlp_in`/`mlp_out` MLP), and a `head`.
# Every `nn.Dense` takes `dot_general=` and `promote_dtype=` so that, given
# `jq.QDotGeneral()` and `jq.promote_dtype`, it multiplies by `QTensor` kernels directly.
# It is trained for a hundred steps on the Python standard library's sources.

# %%
D, HEADS, LAYERS, SEQ, STEPS = 64, 4, 2, 64, 100


class Block(nn.Module):
    dense: dict

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        h = nn.LayerNorm()(x)
        q, k, v = (nn.Dense(D, name=n, **self.dense)(h).reshape(b, t, HEADS, D // HEADS)
                   for n in ("query", "key", "value"))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v).reshape(b, t, D)
        x = x + nn.Dense(D, name="out", **self.dense)(attn)
        h = nn.gelu(nn.Dense(4 * D, name="mlp_in", **self.dense)(nn.LayerNorm()(x)))
        return x + nn.Dense(D, name="mlp_out", **self.dense)(h)


class Transformer(nn.Module):
    dot: Any = None  # None: float layers; jq.QDotGeneral(): QTensor kernels

    @nn.compact
    def __call__(self, tokens):
        dense = {} if self.dot is None else dict(dot_general=self.dot,
                                                 promote_dtype=jq.promote_dtype)
        x = nn.Embed(256, D)(tokens)
        for _ in range(LAYERS):
            x = Block(dense)(x)
        return nn.Dense(256, name="head", **dense)(nn.LayerNorm()(x))


src = pathlib.Path(pathlib.__file__).parent
data = np.frombuffer(b"".join(p.read_bytes() for p in sorted(src.glob("[a-j]*.py"))), np.uint8)
split = int(0.9 * len(data))


def batch(rng, lo, hi, n):
    i = rng.integers(lo, hi - SEQ - 1, n)[:, None] + np.arange(SEQ + 1)
    return jnp.asarray(data[i], jnp.int32)


def loss_fn(params, tokens):
    logits = Transformer().apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


opt = optax.adam(3e-3)


@jax.jit
def step(params, state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, state = opt.update(grads, state)
    return optax.apply_updates(params, updates), state, loss


rng = np.random.default_rng(0)
params = jax.jit(Transformer().init)(jax.random.key(0), batch(rng, 0, split, 1)[:, :-1])["params"]
state = opt.init(params)
start = time.perf_counter()
for _ in range(STEPS):
    params, state, loss = step(params, state, batch(rng, 0, split, 16))
test = batch(np.random.default_rng(1), split, len(data), 64)
print(f"{STEPS} steps in {time.perf_counter() - start:.1f} s: train loss {float(loss):.3f}, "
      f"test loss {float(jax.jit(loss_fn)(params, test)):.3f} nats/byte")
for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    print(f"{'/'.join(k.key for k in path):32s}{str(leaf.shape):12s}{leaf.dtype}")

# %% [markdown]
# ## Rules
#
# A rule is a `(regex, QuantSpec | None)` pair; each leaf's `/`-joined path is matched with
# `re.search`, the first match wins, `None` keeps a leaf as it is, and unmatched leaves are
# kept. `mlp_out/kernel` also matches `out/kernel`: the MLP rule comes first. The last rule
# has a typo, which `jq.unused_rules` reports.

# %%
rules = [
    (r"embedding", None),  # a lookup table, not a dot: kept in float
    (r"head/kernel", jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=-1)),
    (r"mlp_(in|out)/kernel", jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32, packed=True)),
    (r"(query|key|value|out)/kernel", jq.QuantSpec(dtype=jnp.int8, axis=-1)),
    (r"Block_\d+/kernal", jq.QuantSpec()),  # typo
]
print("unused rules:", jq.unused_rules(params, rules))

qparams = jq.quantize_tree(params, rules)
print(qparams["Block_0"]["mlp_in"]["kernel"])
print(qparams["Block_0"]["query"]["kernel"])
print(qparams["head"]["kernel"])

# %% [markdown]
# ## What each leaf became
#
# Format, granularity, bytes before and after, the signal-to-quantization-noise ratio and
# the largest error of every leaf: `jq.quantization_report` returns the rows as data (one
# compiled program per leaf signature), `jq.format_report` prints them as a table.

# %%
report = jq.quantization_report(params, qparams)
print(jq.format_report(report))
rows = [(r.path, r.format, r.granularity, r.nbytes_before, r.nbytes_after, r.sqnr_db)
        for r in sorted(report, key=lambda r: (not r.quantized, r.path))]  # quantized first
before, after = jq.tree_nbytes(params), jq.tree_nbytes(qparams)
print(f"total: {before:,} -> {after:,} bytes ({before / after:.2f}x smaller)")

# %%
big = [r for r in rows if r[3] >= 4096]  # the small float leaves go into one bar
small = [r for r in rows if r[3] < 4096]
labels = [r[0].replace("Block_", "B") for r in big] + [f"{len(small)} small float leaves"]
sizes = [(r[3], r[4]) for r in big] + [(sum(r[3] for r in small), sum(r[4] for r in small))]
fig, ax = plt.subplots(figsize=(10, 3.5))
pos = np.arange(len(labels))
ax.bar(pos - 0.2, [b / 1024 for b, _ in sizes], 0.4, label="float32")
ax.bar(pos + 0.2, [a / 1024 for _, a in sizes], 0.4, label="quantized")
ax.set_xticks(pos, labels, rotation=60, ha="right", fontsize=8)
ax.set_ylabel("KiB")
ax.set_title(f"Storage per leaf: {before / 1024:.0f} KiB -> {after / 1024:.0f} KiB")
ax.legend(loc="upper center")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Save and load, bit for bit
#
# `jq.save_safetensors` stores every leaf under its path (a `QTensor` as
# `<path>/qvalue`, `/scale`, `/zero_point`, 4-bit codes packed in uint8) with a header of
# metadata and CRC-32 checksums; `jq.load_safetensors` rebuilds the same tree.


# %%
def bit_exact(a, b):
    """Same tree structure (QTensor metadata included), dtypes, shapes and bytes."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.dtype == y.dtype and x.shape == y.shape
               and np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


workdir = tempfile.TemporaryDirectory()
path = os.path.join(workdir.name, "model.safetensors")
jq.save_safetensors(path, qparams, metadata={"model": "byte transformer"})
loaded = jq.load_safetensors(path)
print(f"file: {os.path.getsize(path):,} bytes (tree_nbytes {jq.tree_nbytes(qparams):,})")
print("bit-exact:", bit_exact(loaded, qparams))
print(loaded["Block_1"]["mlp_out"]["kernel"])

# %% [markdown]
# ## On 8 devices
#
# The float parameters are sharded over a mesh of 8 devices: every 2-D leaf (the kernels
# and the embedding table) along its last axis, the rest replicated. Quantizing keeps the sharding: the codes follow the
# kernel and each scale is sharded along the same axis. The mesh uses JAX's automatic
# sharding propagation (`AxisType.Auto`), so that XLA chooses how the model's activations
# are laid out. Quantization and the weight-only dot also take `jax.make_mesh`'s default,
# `AxisType.Explicit`, where a block or packed byte that would straddle two devices is
# refused with a `ValueError` instead of being gathered.

# %%
mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))


def sharding_for(leaf):
    spec = P(*([None] * (leaf.ndim - 1)), "model") if leaf.ndim == 2 else P()
    return NamedSharding(mesh, spec)


sharded = jax.device_put(params, jax.tree.map(sharding_for, params))
qsharded = jq.quantize_tree(sharded, rules)
for name in ("Block_0/query/kernel", "Block_0/mlp_in/kernel", "head/kernel"):
    leaf = qsharded
    for key in name.split("/"):
        leaf = leaf[key]
    codes = leaf.qvalue.data if leaf.packed else leaf.qvalue
    print(f"{name}: {leaf}")
    print(f"  codes {codes.dtype}{list(codes.shape)}: {codes.sharding.spec}, "
          f"per device {codes.addressable_shards[0].data.shape}")
    print(f"  scale {list(leaf.scale.shape)}: {leaf.scale.sharding.spec}")
print("same codes as on one device:", bit_exact(jax.device_get(qsharded), jax.device_get(qparams)))

# %% [markdown]
# Loading onto shardings: the target is the abstract quantized tree
# (`jax.eval_shape`) with a `NamedSharding` on every array, and each loaded array is placed
# on its sharding.

# %%
sharded_path = os.path.join(workdir.name, "sharded.safetensors")
jq.save_safetensors(sharded_path, qsharded)
abstract = jax.eval_shape(lambda p: jq.quantize_tree(p, rules), params)
target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s.sharding),
                      abstract, qsharded)
reloaded = jq.load_safetensors(sharded_path, target)
k = reloaded["Block_0"]["mlp_in"]["kernel"]
print(k, k.qvalue.data.sharding.spec, k.scale.sharding.spec)
print("bit-exact:", bit_exact(jax.device_get(reloaded), jax.device_get(qparams)))

# %% [markdown]
# ## Running the quantized model
#
# The same module with `dot=jq.QDotGeneral()` multiplies by the `QTensor` kernels
# (weight-only: each kernel is dequantized inside the jitted dot), on one device or on the
# sharded tree. Flax linen checks that a parameter's first leaf has the shape its
# initializer would give, which packed codes do not: `jq.unpack` each QTensor inside the
# jitted function, so the tree in memory stays packed. On the sharded tree, XLA warns
# that it replicates a small intermediate of the packed int4 `mlp_in` dots: the packed
# weight-only path is not yet partitioned without that copy.
#
# With `jq.ActQuant()` the dots run as int8 x int8 -> int32 with the activations quantized
# on the fly; that path needs 8-bit integer weights, so it runs on an all-int8 tree.

# %%
qmodel = Transformer(dot=jq.QDotGeneral())


@jax.jit
def q_apply(qparams, tokens):
    unpacked = jax.tree.map(jq.unpack, qparams, is_leaf=jq.is_qtensor)
    return qmodel.apply({"params": unpacked}, tokens)


float_logits = jax.jit(Transformer().apply)({"params": params}, test[:, :-1])
q_logits = q_apply(qparams, test[:, :-1])
sharded_logits = q_apply(qsharded, test[:, :-1])
print("output sharding on 8 devices:", sharded_logits.sharding)

int8_rules = [(r"embedding", None), (r"kernel", jq.QuantSpec(dtype=jnp.int8, axis=-1))]
w8a8 = Transformer(dot=jq.QDotGeneral(act_quant=jq.ActQuant()))
int8_params = jq.quantize_tree(params, int8_rules)


def dot_types(jaxpr):
    """The operand and result dtypes of every dot_general, sub-jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.add(" x ".join(v.aval.dtype.name for v in eqn.invars)
                      + " -> " + eqn.outvars[0].aval.dtype.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found |= dot_types(sub)
    return found


print("dots:", sorted(dot_types(jax.make_jaxpr(w8a8.apply)({"params": int8_params},
                                                         test[:1, :-1]).jaxpr)))
w8a8_logits = jax.jit(w8a8.apply)({"params": int8_params}, test[:, :-1])


def test_loss(logits):
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, test[:, 1:]).mean())


print(f"{'float32':34s}test loss {test_loss(float_logits):.4f}")
print(f"{'mixed int8/int4/fp8, weight-only':34s}test loss {test_loss(q_logits):.4f}")
print(f"{'  the same, sharded on 8 devices':34s}test loss {test_loss(sharded_logits):.4f}")
print(f"{'int8 weights x int8 activations':34s}test loss {test_loss(w8a8_logits):.4f}")
print("sharded == one device:", bool(jnp.allclose(sharded_logits, q_logits, atol=1e-4)))

# %%
fig, ax = plt.subplots(figsize=(7, 3))
bins = np.linspace(-0.3, 0.3, 121)
for logits, label in ((q_logits, "int8/int4/fp8 weights"), (w8a8_logits, "W8A8")):
    ax.hist(np.ravel(logits - float_logits), bins=bins, histtype="step", label=label)
ax.set_yscale("log")
ax.set_xlabel("quantized - float32 logit")
ax.set_title("Logit error over the test batch")
ax.legend()
plt.show()
workdir.cleanup()
