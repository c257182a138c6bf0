"""An nnx model taken from quantization-aware training to quantized checkpoints, as the
README and docs describe it, checked at the seams between the modules.

The model (not one of the other tests'): ``nnx.Embed``, a ``nnx.Conv`` over the sequence,
``nnx.LayerNorm``, ``nnx.MultiHeadAttention`` (``LinearGeneral`` projections with a
two-axis output or input), ``nnx.Dropout``, two feed-forward blocks made by
``nnx.vmap`` and run by ``nnx.scan`` (a ``Linear`` with and one without bias), and a
bfloat16 ``Linear`` head. References: NumPy float64 (ONNX's ``QuantizeLinear`` rule,
``rint(x / scale)`` of the float32 quotient, and the ONNX packed-int4 byte layout), the
QAT model's own forward pass, and the bytes that were saved.
"""

import itertools
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
pytest.importorskip("safetensors")
pytest.importorskip("orbax.checkpoint")

import jaxquant as jq  # noqa: E402
from jaxquant.flax import (  # noqa: E402
    ActSpec,
    QuantConfig,
    nnx_layers,
    nnx_qat,
    nnx_quantize,
    nnx_unused_rules,
)

V, D, T, L = 32, 16, 8, 2
EPS32 = float(np.finfo(np.float32).eps)

RULES = [
    ("embed", QuantConfig()),
    ("attn/query", QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, block_size=8, packed=True),
                               learn_scale=True)),
    ("attn/(key|value)", QuantConfig(act=ActSpec(), learn_scale=True)),
    ("attn/out", QuantConfig(weight=jq.QuantSpec(dtype=jnp.float8_e4m3fn))),
    ("conv", QuantConfig(act=ActSpec(granularity="tensor"))),
    ("stack/up", QuantConfig(act=ActSpec())),
    ("stack/down", QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, packed=True))),
    ("head", QuantConfig(learn_scale=True)),
    ("decoder", None),  # a typo: selects nothing
]


_calls = itertools.count(1)


def _init(key, shape, dtype=jnp.float32):
    """Deterministic weights of variance about 1/fan_in, from NumPy (random initializers
    would compile one XLA program per shape, most of this file's time)."""
    c = next(_calls)
    fan_in = math.prod(shape[:-1]) if len(shape) > 1 else 1
    v = np.sin(np.arange(math.prod(shape)) * (0.7311 + 0.013 * c) + c) * math.sqrt(3 / fan_in)
    return jnp.asarray(v.reshape(shape), dtype)


class FFN(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, 2 * D, kernel_init=_init, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, use_bias=False, kernel_init=_init, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.relu(self.up(x)))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, embedding_init=_init, rngs=rngs)
        self.conv = nnx.Conv(D, D, kernel_size=(3,), padding="SAME", kernel_init=_init,
                             rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, qkv_features=D,
                                           decode=False, kernel_init=_init,
                                           out_kernel_init=_init, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return FFN(rngs)

        self.stack = make(rngs)  # vmap traces _init once: make the two layers differ
        self.stack.up.kernel[...] *= jnp.array([1.0, -0.75]).reshape(L, 1, 1)
        self.head = nnx.Linear(D, V, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                               kernel_init=_init, rngs=rngs)

    def features(self, tok):
        h = self.embed(tok)
        h = self.norm(h + self.conv(h))
        h = self.drop(h + self.attn(h))

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, x):
            return block(x)

        return run(self.stack, h)

    def __call__(self, tok):
        return self.head(self.features(tok)).astype(jnp.float32)


def _rngs(seed=0):
    # RBG keys: Dropout's random bits compile far faster than threefry's
    return nnx.Rngs(jax.random.key(seed, impl="rbg"))


def _quantized_net(seed=0):
    m = nnx_quantize(nnx_qat(Net(_rngs(seed)), RULES), RULES)
    m.eval()
    return m


@nnx.jit
def _outputs(m, tok):
    """The features before the head, the model's output, and the head on a fixed input."""
    h = m.features(tok)  # m(tok) is m.head(h), cast
    return h, m.head(h).astype(jnp.float32), m.head(jnp.linspace(-2, 2, 2 * D).reshape(2, D))


@pytest.fixture(scope="module")
def journey():
    tok = jnp.asarray(np.random.default_rng(1).integers(0, V, (4, T)), jnp.int32)
    tgt = jnp.roll(tok, -1, axis=1)
    m = Net(_rngs())
    assert nnx_unused_rules(m, RULES) == [("decoder", None)]
    nnx_qat(m, RULES)
    init_scale = np.asarray(m.attn.query.promote_dtype.scale[...])
    with jax.numpy_dtype_promotion("standard"):  # optax mixes python floats and int32
        opt = nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, tok, tgt):
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(tok), tgt).mean()

        value, grads = nnx.value_and_grad(loss)(m)
        with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic only
            opt.update(m, grads)
        return value

    losses = [float(step(m, opt, tok, tgt)) for _ in range(3)]
    m.eval()
    qat = {"outputs": _outputs(m, tok),
           "query_scale": np.asarray(m.attn.query.promote_dtype.scale[...]),
           # a copy: nnx_quantize works in place, on these Variables too
           "float_params": jax.tree.map(jnp.copy, nnx.state(m, nnx.Param))}
    nnx_quantize(m, RULES)
    return dict(m=m, tok=tok, losses=losses, init_scale=init_scale, qat=qat)


def test_qat_trains_under_nnx_jit_with_learned_scales(journey):
    assert journey["losses"][-1] < journey["losses"][0]
    assert not np.array_equal(journey["qat"]["query_scale"], journey["init_scale"])


def test_converted_kernels_and_learned_scales(journey):
    m = journey["m"]
    kinds = {
        "embed": (m.embed.embedding, "int8", None),
        "attn/query": (m.attn.query.kernel, "int4", 8),
        "attn/key": (m.attn.key.kernel, "int8", None),
        "attn/out": (m.attn.out.kernel, "float8_e4m3fn", None),
        "conv": (m.conv.kernel, "int8", None),
        "stack/down": (m.stack.down.kernel, "int4", None),
        "head": (m.head.kernel, "int8", None),
    }
    for path, (var, fmt, block) in kinds.items():
        qt = var[...]
        assert jq.is_qtensor(qt), path
        assert (qt.format.name, qt.block_size) == (fmt, block), path
    assert m.attn.query.kernel[...].packed and m.stack.down.kernel[...].packed
    assert m.head.kernel[...].dtype == jnp.bfloat16
    # One QTensor per stacked layer: per-layer scales along the leading axis.
    assert m.stack.up.kernel[...].scale.shape == (L, 2 * D)
    assert m.stack.up.kernel.get_metadata()["stacked"] == 1
    # The learned scale (clamped at float32's eps, as documented) is the QTensor's.
    learned = np.maximum(journey["qat"]["query_scale"], np.float32(EPS32))
    np.testing.assert_array_equal(np.asarray(m.attn.query.kernel[...].scale), learned)


def test_quantized_forward_matches_qat_forward(journey):
    feats, out, head = (np.asarray(a, np.float32) for a in _outputs(journey["m"], journey["tok"]))
    want_feats, want_out, want_head = (np.asarray(a, np.float32)
                                       for a in journey["qat"]["outputs"])
    # Weight-only layers run the kernels fake quantization trained with; W8A8 layers the
    # same codes as an int32 dot: float32 rounding apart.
    np.testing.assert_allclose(feats, want_feats, rtol=0, atol=1e-5 * np.abs(want_feats).max())
    # The bfloat16 head, weight-only: bit for bit on the same input.
    np.testing.assert_array_equal(head, want_head)
    # Whole model: a bfloat16 output of inputs equal to float32 rounding (a few ulps).
    assert np.abs(out - want_out).max() <= 2.0**-6 * np.abs(want_out).max()


def _np_int4_unpack(data):
    """ONNX's int4 packing: two codes per byte along the last axis, low nibble first."""
    b = np.asarray(data).astype(np.int16)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    return np.where(codes >= 8, codes - 16, codes)


def test_layers_against_numpy_float64(journey):
    m, fp = journey["m"], journey["qat"]["float_params"]
    x = np.random.default_rng(7).normal(size=(3, D)).astype(np.float32)
    # attn/query: packed int4, blocks of 8, learned scales; weight-only.
    qt = m.attn.query.kernel[...]
    w = _np_int4_unpack(qt.qvalue.data)[..., :D // 2] * np.asarray(qt.scale, np.float64)
    want = np.einsum("bi,ihd->bhd", x.astype(np.float64), w)
    want = want + np.asarray(m.attn.query.bias[...], np.float64)
    got = nnx.jit(lambda m, x: m.attn.query(x))(m, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    # stack/up, layer 1 of the nnx.vmap stack: W8A8, per output channel and per token.
    graphdef, state = nnx.split(m.stack.up)
    layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[1], state))
    w_float = np.asarray(fp["stack"]["up"]["kernel"][...][1])
    sw = (np.abs(w_float).max(axis=0) / np.float32(127)).astype(np.float32)
    cw = np.clip(np.rint(w_float / sw), -128, 127)  # float32 quotient, half to even
    np.testing.assert_array_equal(np.asarray(layer.kernel[...].qvalue), cw)
    sx = (np.abs(x).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    cx = np.clip(np.rint(x / sx), -128, 127)
    want = (cx @ cw) * sx.astype(np.float64) * sw.astype(np.float64)
    want = want + np.asarray(layer.bias[...], np.float64)
    got = nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6)


def _bits(a):
    a = np.asarray(a)
    return a.reshape(-1).view(f"u{a.dtype.itemsize}") if a.size else a.reshape(-1)


def _same_leaves(a, b):
    """Same structure (QTensor metadata included), dtypes, shapes and bits."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        np.testing.assert_array_equal(_bits(x), _bits(y))


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_checkpoint_into_eval_shape_target(journey, tmp_path, fmt):
    m, tok = journey["m"], journey["tok"]
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    save, load = {"safetensors": (jq.save_safetensors, jq.load_safetensors),
                  "orbax": (jq.save_orbax, jq.load_orbax)}[fmt]
    path = tmp_path / "ckpt"
    save(path, params)
    abstract = nnx.eval_shape(_quantized_net)
    _, target, _ = nnx.split(abstract, nnx.Param, ...)
    back = load(path, target)
    _same_leaves(params, back)
    if fmt == "orbax":  # the same leaves as safetensors': the outputs are checked there
        return
    want = [np.asarray(a, np.float32) for a in _outputs(m, tok)]
    merged = nnx.merge(graphdef, back, rest)
    for got, w in zip(_outputs(merged, tok), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), w)
    # nnx.update into a model of the same structure holding zeros everywhere.
    zeros = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, params), rest)
    nnx.update(zeros, back)
    for got, w in zip(_outputs(zeros, tok), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), w)


def test_rng_state_is_refused_by_name(journey, tmp_path):
    with pytest.raises(TypeError, match="drop/rngs/key/value.*PRNG key"):
        jq.save_safetensors(tmp_path / "all.safetensors", nnx.state(journey["m"]))


def test_reports_and_rules_on_the_model(journey):
    m = journey["m"]
    assert set(nnx_layers(m, RULES)) == {"embed", "conv", "attn/query", "attn/key",
                                         "attn/value", "attn/out", "stack/up",
                                         "stack/down", "head"}
    qstate = nnx.state(m, nnx.Param)
    # The learned scales live in the QAT model only (they are the QTensors' scales now).
    flat = [(k, v) for k, v in nnx.to_flat_state(journey["qat"]["float_params"])
            if "promote_dtype" not in k]
    some = lambda tree: {k: tree[k] for k in ("stack", "head")}  # noqa: E731 (time)
    rows = {r.path: r for r in jq.quantization_report(some(nnx.from_flat_state(flat)),
                                                      some(qstate))}
    down = rows["stack/down/kernel/value"]
    assert (down.format, down.shape) == ("int4(packed)", (L, 2 * D, D))
    assert down.nbytes_after == L * 2 * D * D // 2 + L * D * 4  # packed codes + f32 scales
    assert rows["head/kernel/value"].nbytes_after == D * V + V * 4
    assert rows["stack/up/kernel/value"].granularity == "stacked=1 axis=1"  # one layer's axis
    assert not rows["head/bias/value"].compared
    assert all(np.isfinite(r.sqnr_db) for r in rows.values() if r.compared)
    # Tree-level rules on nnx.State paths end in /value, as the README says.
    assert jq.unused_rules(qstate, [("kernel/value$", None), ("kernel$", None)]) == [
        ("kernel$", None)]


def test_qtensors_stacked_by_vmap_round_trip(tmp_path):
    """The checkpoint of layers stacked by jax.vmap (as nn.scan / nnx.vmap stack them): the
    file used to record one layer's packed shape (unloadable) and per-layer metadata that
    the loader checked against the stacked arrays."""
    w = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8, 32)), jnp.float32)
    tree = {"int8": jax.vmap(lambda a: jq.quantize(a, dtype=jnp.int8, axis=1))(w),
            "int4": jax.vmap(lambda a: jq.quantize(a, dtype=jnp.int4, axis=0, packed=True))(w)}
    jq.save_safetensors(tmp_path / "s.safetensors", tree)
    for target in (None, jax.eval_shape(lambda: tree)):
        back = jq.load_safetensors(tmp_path / "s.safetensors", target)
        _same_leaves(tree, back)
        np.testing.assert_array_equal(np.asarray(jax.vmap(jq.dequantize)(back["int4"])),
                                      np.asarray(jax.vmap(jq.dequantize)(tree["int4"])))
