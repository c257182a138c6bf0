"""A linen user's whole journey, from the README and the docstrings alone: a pre-LayerNorm
transformer block (``nn.Embed``, ``nn.MultiHeadDotProductAttention`` with dropout, ``nn.Dense`` with
and without bias, a ``DenseGeneral`` head; the block computes in bfloat16 on float32 params)
trained a few steps with optax under quantization-aware training (int8 W8A8 attention with
learned LSQ scales, packed int4 blocks, float8 head, int8 embedding), converted with
``quantize_params``, run jitted, saved and reloaded (safetensors and orbax; no target, a concrete
target, abstract targets), reported, and its rules checked.

The references are independent: a NumPy float64 transcription of the fake-quantized model
(codes ``rint(w / s)`` clipped, float8 codes through ``ml_dtypes``), byte counts and SQNR
computed from the formulas, and the docs' own statements.
"""

import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import jaxquant as jq
from jaxquant.flax import ActSpec, QuantConfig, nnx_qat, nnx_quantize, quantize_linen

V, D, H, T, B = 32, 16, 2, 6, 4


class Block(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, h, deterministic):
        y = nn.LayerNorm()(h).astype(self.dtype)  # strict promotion: a float32 norm
        y = nn.MultiHeadDotProductAttention(num_heads=H, dtype=self.dtype,
                                            param_dtype=jnp.float32, dropout_rate=0.1,
                                            deterministic=deterministic, name="attn")(y, y)
        h = h + nn.Dropout(0.1, deterministic=deterministic)(y).astype(h.dtype)
        y = nn.LayerNorm()(h)
        y = nn.Dense(2 * D, use_bias=False, dtype=self.dtype, name="up")(y)
        y = nn.Dense(D, dtype=self.dtype, name="down")(nn.gelu(y))
        return h + y.astype(h.dtype)


class LM(nn.Module):
    block_dtype: object = jnp.bfloat16  # the params are the same whatever the compute dtype

    @nn.compact
    def __call__(self, tokens, deterministic=True):
        h = nn.Embed(V, D, name="embed")(tokens)
        h = Block(self.block_dtype, name="b0")(h, deterministic)
        h = nn.LayerNorm()(h)
        return nn.DenseGeneral((2, V // 2), name="head")(h).reshape(h.shape[:-1] + (V,))


INT4 = jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=8, packed=True)
RULES = [("embed", QuantConfig(weight=jq.QuantSpec(axis=0))),  # int8, one scale per row
         ("attn", QuantConfig(act=ActSpec(), learn_scale=True)),  # W8A8, LSQ kernel scales
         ("up|down", QuantConfig(weight=INT4)),
         ("head", QuantConfig(weight=jq.QuantSpec(dtype=jnp.float8_e4m3fn))),
         ("LayerNorm", QuantConfig()),  # not a covered layer: matches nothing
         ("attn/query", None),  # shadowed by "attn"
         ("typo_layer", None)]
ATTN = [f"b0/attn/{p}" for p in ("query", "key", "value", "out")]


@pytest.fixture(scope="module")
def journey():
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    targets = jnp.roll(tokens, -1, axis=1)
    qm = quantize_linen(LM(), RULES)
    variables = jax.jit(qm.init)(jax.random.key(0), tokens)
    opt = optax.adam(1e-3)
    state = opt.init(variables)

    @jax.jit
    def step(v, state, key):
        def loss(v):
            logits = qm.apply(v, tokens, deterministic=False, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        value, grads = jax.value_and_grad(loss)(v)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes python floats and int32
            updates, state = opt.update(grads, state, v)
        return optax.apply_updates(v, updates), state, value, grads

    trained, losses = variables, []
    for i in range(3):
        trained, state, value, grads = step(trained, state, jax.random.key(10 + i))
        losses.append(float(value))
    q = qm.quantize_params(trained, tokens)
    return dict(tokens=tokens, qm=qm, init=variables, trained=trained, grads=grads,
                losses=losses, q=q, apply=jax.jit(qm.apply))


# --- an independent float64 transcription of the fake-quantized model ------------------------


def _f64(a):
    return np.asarray(a, np.float64)


def _int_fq(w, keep, bits, scale=None):
    """Symmetric integer fake quantization, one scale per index of the axes ``keep``."""
    qmax = 2 ** (bits - 1) - 1
    red = tuple(a for a in range(w.ndim) if a not in {k % w.ndim for k in keep})
    if scale is None:
        scale = np.max(np.abs(w), axis=red, keepdims=True) / qmax
    else:  # a learned scale, used as at least float32's eps (README)
        scale = np.maximum(_f64(scale), np.finfo(np.float32).eps)
        scale = scale.reshape([1 if a in red else w.shape[a] for a in range(w.ndim)])
    return np.clip(np.rint(w / scale), -qmax - 1, qmax) * scale


def _int4_blocks(w, block=8):
    return np.concatenate([_int_fq(w[i:i + block], (1,), 4) for i in range(0, len(w), block)])


def _float8_last(w):
    s = np.max(np.abs(w), axis=tuple(range(w.ndim - 1)), keepdims=True) / 448.0
    return np.clip(w / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s


def _act(x, n_contract):
    """int8 per token: one absmax / 127 scale per index of the leading axes."""
    return _int_fq(x, tuple(range(x.ndim - n_contract)), 8)


def _layernorm(x, p):
    m, v = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-6) * _f64(p["scale"]) + _f64(p["bias"])


def _kernels(params, quant):
    """The fake-quantized kernel of every covered layer, by path."""
    out = {"embed": _int_fq(_f64(params["embed"]["embedding"]), (0,), 8),
           "head": _float8_last(_f64(params["head"]["kernel"]))}
    for path in ATTN:
        b, _, p = path.split("/")
        out[path] = _int_fq(_f64(params[b]["attn"][p]["kernel"]), (-1,), 8,
                            quant[b]["attn"][p]["kernel_scale"])
    for p in ("up", "down"):
        out[f"b0/{p}"] = _int4_blocks(_f64(params["b0"][p]["kernel"]))
    return out


def reference_logits(params, quant, tokens):
    k = _kernels(params, quant)
    h = k["embed"][np.asarray(tokens)]
    for b in ("b0",):
        p = params[b]
        y = _layernorm(h, p["LayerNorm_0"])
        qkv = [np.einsum("btd,dhk->bthk", _act(y, 1), k[f"{b}/attn/{n}"])
               + _f64(p["attn"][n]["bias"]) for n in ("query", "key", "value")]
        logits = np.einsum("bqhd,bkhd->bhqk", qkv[0] / np.sqrt(D // H), qkv[1])
        w = np.exp(logits - logits.max(-1, keepdims=True))
        o = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), qkv[2])
        h = h + np.einsum("bqhd,hdf->bqf", _act(o, 2), k[f"{b}/attn/out"]) \
            + _f64(p["attn"]["out"]["bias"])
        y = _layernorm(h, p["LayerNorm_1"]) @ k[f"{b}/up"]
        y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))  # nn.gelu
        h = h + y @ k[f"{b}/down"] + _f64(p["down"]["bias"])
    h = _layernorm(h, params["LayerNorm_0"])
    out = np.einsum("btd,dgv->btgv", h, k["head"]) + _f64(params["head"]["bias"])
    return out.reshape(h.shape[:2] + (V,))


# --- training ---------------------------------------------------------------------------------


def test_training_reaches_params_and_learned_scales(journey):
    assert all(np.isfinite(journey["losses"])), journey["losses"]
    init, trained, grads = journey["init"], journey["trained"], journey["grads"]
    assert set(trained["quant"]) == {"b0"}  # LSQ scales of the attention layers only
    assert set(trained["quant"]["b0"]["attn"]) == {"query", "key", "value", "out"}
    for p in ("query", "key", "value", "out"):
        g = grads["quant"]["b0"]["attn"][p]["kernel_scale"]
        assert np.abs(np.asarray(g)).max() > 0, p
        assert not np.array_equal(trained["quant"]["b0"]["attn"][p]["kernel_scale"],
                                  init["quant"]["b0"]["attn"][p]["kernel_scale"])
    # the STE reaches every kernel, through dropout and the bfloat16 block
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(grads["params"])):
        assert np.abs(leaf).max() > 0, jax.tree_util.keystr(path)


# --- conversion and inference -----------------------------------------------------------------


def test_quantized_tree_holds_the_rules_formats(journey):
    p = journey["q"]["params"]
    assert set(journey["q"]) == {"params"}  # "quant" dropped, as documented
    assert repr(p["embed"]["embedding"]) == "QTensor(int8[32, 16], axis=0, scale[32], dtype=float32)"
    assert repr(p["b0"]["up"]["kernel"]) == ("QTensor(int4(packed)[16, 32], axis=0, block_size=8, "
                                             "scale[2, 32], dtype=float32)")
    assert repr(p["b0"]["attn"]["out"]["kernel"]) == ("QTensor(int8[2, 8, 16], axis=2, "
                                                      "scale[16], dtype=float32)")
    assert repr(p["head"]["kernel"]) == ("QTensor(float8_e4m3fn[16, 2, 16], axis=2, scale[16], "
                                         "dtype=float32)")
    # learned scales are stored as trained (clamped at eps, here all above it)
    np.testing.assert_array_equal(p["b0"]["attn"]["key"]["kernel"].scale,
                                  journey["trained"]["quant"]["b0"]["attn"]["key"]["kernel_scale"])
    assert not jq.is_qtensor(p["b0"]["attn"]["key"]["bias"])


def test_float32_inference_and_qat_equal_the_float64_fake_quant_model(journey):
    """With the whole model in float32 (same params), the jitted quantized inference (int8 x
    int8 -> int32 attention, packed int4, float8, int8 embedding rows) and the QAT forward both
    equal the float64 transcription to float32 rounding."""
    qm32 = quantize_linen(LM(block_dtype=jnp.float32), RULES)
    ref = reference_logits(journey["trained"]["params"], journey["trained"]["quant"],
                           journey["tokens"])
    both = jax.jit(lambda t, q, x: (qm32.apply(q, x), qm32.apply(t, x)))
    inferred, qat = (np.asarray(y, np.float64)
                     for y in both(journey["trained"], journey["q"], journey["tokens"]))
    scale = np.abs(ref).max()
    assert np.abs(inferred - ref).max() <= 1e-5 * scale
    assert np.abs(qat - ref).max() <= 1e-5 * scale


def test_bfloat16_block_inference_stays_near_the_float64_model(journey):
    """The first block computes in bfloat16: the quantized inference is off the float64 model
    by bfloat16 rounding only (8 bits: a few 2**-8 of the logits' range), no code moved."""
    ref = reference_logits(journey["trained"]["params"], journey["trained"]["quant"],
                           journey["tokens"])
    out = journey["apply"](journey["q"], journey["tokens"])
    assert out.dtype == jnp.float32
    assert np.abs(np.asarray(out, np.float64) - ref).max() <= 3e-2 * np.abs(ref).max()


# --- checkpoints ------------------------------------------------------------------------------


def _assert_bit_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb  # QTensor metadata (packed, axis, block size, dtype) is in the treedef
    for x, y in zip(la, lb, strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.fixture(scope="module")
def abstract_targets(journey):
    """Checkpoint targets without values: ``jax.eval_shape`` of the conversion of the trained
    variables, and ``quantize_params`` of the placeholders ``jax.eval_shape(qm.init, ...)``."""
    qm, tokens = journey["qm"], journey["tokens"]
    converted = jax.eval_shape(lambda v: qm.quantize_params(v, tokens), journey["trained"])
    abstract_vars = jax.eval_shape(lambda: qm.init(jax.random.key(0), tokens))
    return {"eval_shape": converted, "abstract init": qm.quantize_params(abstract_vars, tokens)}


def test_abstract_quantize_params_from_abstract_init(abstract_targets):
    """``quantize_params`` of ``jax.eval_shape(qm.init, ...)`` placeholders gives abstract
    QTensors (as ``quantize_tree`` does for ShapeDtypeStruct leaves); it raised a TypeError
    ("float() argument must be ... not 'ShapeDtypeStruct'")."""
    abstract, want = abstract_targets["abstract init"], abstract_targets["eval_shape"]
    kernel = abstract["params"]["b0"]["down"]["kernel"]
    assert jq.is_qtensor(kernel) and kernel.packed
    assert isinstance(kernel.scale, jax.ShapeDtypeStruct)
    assert jax.tree.structure(abstract) == jax.tree.structure(want)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(want)]


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_checkpoint_round_trips_bit_for_bit(journey, abstract_targets, fmt):
    q, tokens = journey["q"], journey["tokens"]
    expected = journey["apply"](q, tokens)
    save, load = ((jq.save_safetensors, jq.load_safetensors) if fmt == "safetensors"
                  else (jq.save_orbax, jq.load_orbax))
    with tempfile.TemporaryDirectory() as d:
        save(f"{d}/model", q)
        for name, target in {"none": None, "concrete": q, **abstract_targets}.items():
            back = load(f"{d}/model", target)
            _assert_bit_equal(back, q)
            np.testing.assert_array_equal(journey["apply"](back, tokens), expected, err_msg=name)


# --- report and rules -------------------------------------------------------------------------


def test_report_rows_for_every_layer(journey):
    params = journey["trained"]["params"]
    rows = {r.path: r for r in jq.quantization_report({"params": params}, journey["q"])}
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): x
            for p, x in jax.tree_util.tree_leaves_with_path({"params": params})}
    assert set(rows) == set(flat)
    fq = _kernels(params, journey["trained"]["quant"])
    expect = {"embed": ("int8", "axis=0", 32 * 16 + 32 * 4),
              "head": ("float8_e4m3fn", "axis=2", 16 * 32 + 16 * 4),
              **{p: ("int8", "axis=2", 256 + (16 if p.endswith("out") else 8) * 4)
                 for p in ATTN},
              # 512 codes two per byte; scales [2, 32] (up) or [4, 16] (down) in float32
              **{f"b0/{p}": ("int4(packed)", "axis=0 block=8", 256 + 64 * 4)
                 for p in ("up", "down")}}
    for path, row in rows.items():
        layer = path[len("params/"):].rsplit("/", 1)[0]
        kernel = path.endswith(("/kernel", "/embedding"))
        assert row.dtype == "float32" and row.nbytes_before == flat[path].size * 4, path
        if not kernel:
            assert (row.format, row.granularity, row.nbytes_after) == ("-", "-", row.nbytes_before)
            assert not row.compared and np.isnan(row.sqnr_db)
            continue
        assert (row.format, row.granularity, row.nbytes_after) == expect[layer], path
        w = _f64(flat[path])
        err = w - fq[layer]
        assert row.compared
        np.testing.assert_allclose(row.sqnr_db, 10 * np.log10((w ** 2).sum() / (err ** 2).sum()),
                                   rtol=1e-4, err_msg=path)
        np.testing.assert_allclose(row.max_abs_error, np.abs(err).max(), rtol=1e-5, err_msg=path)


def test_layers_and_unused_rules(journey):
    qm, tokens = journey["qm"], journey["tokens"]
    layers = qm.layers(journey["trained"], tokens)
    assert list(layers) == ["embed", *ATTN, "b0/up", "b0/down", "head"]
    assert all(layers[p] is RULES[1][1] for p in ATTN)
    assert layers["head"] is RULES[3][1] and layers["b0/up"] is RULES[2][1]
    assert qm.layers(journey["q"], tokens) == layers  # the quantized tree finds the same layers
    assert qm.unused_rules(journey["trained"], tokens) == RULES[4:]
    assert qm.unused_rules(journey["q"], tokens) == RULES[4:]


# --- int8_dot with a compute dtype narrower than the params -----------------------------------

# A kernel entry whose float32 code is 63 (63.49) but whose bfloat16 rounding (0.5) gives 64.
W2 = np.float32(63.49 / 127)
assert np.rint(W2 * 127) == 63 and np.rint(np.float32(jnp.bfloat16(W2)) * 127) == 64
X = jnp.array([[0.0, 1.0]])  # its int8 code is 127 with scale 1/127: the output is code / 127


@pytest.mark.parametrize("act", [ActSpec(), None])
def test_linen_int8_dot_trains_with_the_codes_it_deploys(act):
    """``Dense(dtype=bfloat16, param_dtype=float32)`` with ``int8_dot=True``: the training dot
    quantized the kernel after Flax cast it to bfloat16 (code 64), ``quantize_params`` stores
    the float32 kernel's code (63, as fake quantization trains with), so the deployed model ran
    other codes than it trained with. Training must use the float32 kernel's codes."""
    qm = quantize_linen(nn.Dense(1, use_bias=False, dtype=jnp.bfloat16),
                        QuantConfig(act=act, int8_dot=True))
    v = {"params": {"kernel": jnp.array([[1.0], [W2]], jnp.float32)}}
    q = qm.quantize_params(v, X)
    assert int(q["params"]["kernel"].qvalue[1, 0]) == 63
    assert float(qm.apply(v, X)[0, 0]) == float(jnp.bfloat16(63 / 127))
    assert float(qm.apply(q, X)[0, 0]) == float(jnp.bfloat16(63 / 127))
    g = jax.grad(lambda v: qm.apply(v, X).astype(jnp.float32).sum())(v)
    assert g["params"]["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(g["params"]["kernel"], [[0.0], [1.0]])  # STE: x^T . 1


def test_nnx_int8_dot_trains_with_the_codes_it_deploys():
    m = nnx.Linear(2, 1, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    m.kernel[...] = jnp.array([[1.0], [W2]], jnp.float32)
    cfg = QuantConfig(act=ActSpec(), int8_dot=True)
    nnx_qat(m, cfg)
    trained = float(m(X)[0, 0])
    nnx_quantize(m, cfg)
    assert int(m.kernel[...].qvalue[1, 0]) == 63
    assert trained == float(m(X)[0, 0]) == float(jnp.bfloat16(63 / 127))


def test_weight_only_bfloat16_inference_equals_the_qat_forward():
    """The docs' example promises ``qm.apply(params) ~= qm.apply(qparams)`` (atol 1e-6) for
    weight-only rules; it holds bit for bit with a bfloat16 compute dtype on float32 params
    (the packed int4 kernel is dequantized to float32 and cast, as the fake-quantized kernel
    is)."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 16))
    layer = nn.DenseGeneral((2, 8), dtype=jnp.bfloat16)
    qm = quantize_linen(layer, QuantConfig(weight=INT4))
    v = layer.init(jax.random.key(1), x)
    q = qm.quantize_params(v, x)
    assert q["params"]["kernel"].packed
    inferred, qat = jax.jit(lambda q, v: (qm.apply(q, x), qm.apply(v, x)))(q, v)
    np.testing.assert_array_equal(inferred, qat)
