"""Quantization-aware distillation of all-MiniLM-L6-v2: QAT with `jaxquant.flax` on text
that is never the benchmark's evaluation sentences.

The student is the unmodified Flax encoder of `benchmarks.minilm_model` under
``jaxquant.flax.quantize_linen``: every encoder Dense kernel fake-quantized with
the variant's spec and a learned scale (LSQ) per group, and for an asymmetric spec
a learned zero point (LSQ+), initialized to the values `jaxquant.quantize` computes.
The teacher is the same model in float32. The loss is ``1 - cosine`` of
the two sentence embeddings (unit-norm, mean-pooled), averaged over a batch, plus
``hidden_weight`` times each layer's output error relative to the teacher's
(``sum |s - t|^2 / sum |t|^2`` over the real tokens, averaged over the layers:
layer-wise distillation, as in TernaryBERT); Adam updates kernels, biases,
LayerNorms, scales and zero points. The training text
(`distillation_texts`) is English every Python 3.11 install carries: the sentences
of `benchmarks.minilm.calibration_sentences` (standard-library docstrings), those
of ``pydoc_data.topics`` (the language reference's prose), and random runs of 2
to 10 words cut from them, because short inputs lean on the [CLS]/[SEP] tokens
as the evaluation's short sentences do.

`distill` returns the trained variables; ``quantize_params`` of the same
`QuantizedLinen` turns them into `QTensor` kernels with the learned scales.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxquant as jq
from jaxquant.flax import QuantConfig, QuantizedLinen, quantize_linen

try:  # python -m benchmarks.minilm
    from benchmarks import minilm_model
    from benchmarks.minilm_calibration import reference_sentences, word_runs
except ImportError:  # python benchmarks/minilm.py
    import minilm_model
    from minilm_calibration import reference_sentences, word_runs


def distillation_texts(calibration: list[str], seed: int = 0) -> list[str]:
    """``calibration`` and `reference_sentences`, then their `word_runs`.

    Args:
      calibration: sentences (`benchmarks.minilm.calibration_sentences`).
      seed: for the cuts.

    Returns:
      The texts, sentences first (5484 with the 470 docstring sentences on Python 3.11).
    """
    sentences = list(calibration) + reference_sentences()
    return sentences + word_runs(sentences, seed)


def student(model, spec: jq.QuantSpec) -> QuantizedLinen:
    """``model`` with every encoder Dense kernel fake-quantized by ``spec``, scales learned."""
    return quantize_linen(model, [("encoder/", QuantConfig(weight=spec, learn_scale=True))])


def _is_layer(module, method_name: str) -> bool:
    return isinstance(module, minilm_model.Layer) and method_name == "__call__"


def embeddings_and_layers(apply, variables: dict, batch: dict) -> tuple[jax.Array, list]:
    """``apply``'s embeddings and every encoder layer's output, in order."""
    emb, state = apply(variables, **batch, capture_intermediates=_is_layer,
                       mutable=["intermediates"])
    layers = state["intermediates"]["encoder"]
    return emb, [layers[f"layer_{i}"]["__call__"][0] for i in range(len(layers))]


def distill(model, params: dict, tokenizer, spec: jq.QuantSpec, texts: list[str], *,
            steps: int, batch_size: int = 32, learning_rate: float = 2e-5,
            hidden_weight: float = 1.0, seed: int = 0) -> tuple[QuantizedLinen, dict]:
    """Trains the `student` of ``model`` to reproduce the float32 embeddings of ``texts``.

    Args:
      model: the Flax encoder (`minilm_model.load`).
      params: its float32 variables (``{"params": ...}``), the teacher and the start.
      tokenizer: the model's tokenizer.
      spec: the kernels' format (asymmetric integer specs learn zero points too).
      texts: training text (`distillation_texts`).
      steps: Adam steps, ``batch_size`` texts each, drawn without replacement per step.
      learning_rate: Adam's.
      hidden_weight: the weight of the layer outputs' relative error (0: the
        embeddings' cosine alone).
      seed: batch order.

    Returns:
      ``(qm, variables)``: the `QuantizedLinen` and its trained variables
      (``"params"`` and ``"quant"``); ``qm.quantize_params(variables, **batch)``
      quantizes them.
    """
    qm = student(model, spec)
    tokens = minilm_model.tokenize(tokenizer, texts)
    lengths = tokens["attention_mask"].sum(axis=1)
    batch = {k: jnp.asarray(v[:2]) for k, v in tokens.items()}
    _, init = qm.apply(params, **batch, mutable=["quant"])  # computed scales (zero points)
    variables = {**params, "quant": init["quant"]}
    tx = optax.adam(learning_rate)
    state = tx.init(variables)

    def loss(v, teacher, b):
        t_emb, t_layers = embeddings_and_layers(model.apply, teacher, b)
        emb, layers = embeddings_and_layers(qm.apply, v, b)
        cosine = jnp.mean(1.0 - jnp.sum(emb * t_emb, axis=-1))
        real = b["attention_mask"][..., None].astype(jnp.float32)
        hidden = sum(jnp.sum(jnp.square(s - t) * real) / jnp.sum(jnp.square(t) * real)
                     for s, t in zip(layers, t_layers, strict=True)) / len(layers)
        return cosine + hidden_weight * hidden, cosine

    @jax.jit
    def step(v, state, teacher, b):
        (_, cosine), grads = jax.value_and_grad(loss, has_aux=True)(v, teacher, b)
        updates, state = tx.update(grads, state, v)
        return optax.apply_updates(v, updates), state, cosine

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for i in range(steps):
        idx = rng.choice(len(texts), batch_size, replace=False)
        width = -(-int(lengths[idx].max()) // 32) * 32  # a few padded widths: a few compiles
        b = {k: jnp.asarray(v[idx, :width]) for k, v in tokens.items()}
        variables, state, value = step(variables, state, params, b)
        if i % 100 == 0 or i == steps - 1:
            print(f"  distill {spec.dtype} step {i}: 1 - cos {float(value):.5f} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return qm, variables
