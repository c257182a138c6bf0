"""Edge cases of quantized inference of unmodified Flax models (linen and nnx) on QTensor
kernels, each checked against the float model on the dequantized tree or a NumPy
emulation of the int8 x int8 -> int32 path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

from jaxpr_utils import find_eqns, integer_convolution  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import ActSpec, QuantConfig, nnx_qat, nnx_quantize, quantize_linen  # noqa: E402

WA = QuantConfig(act=ActSpec())


def _x(*shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


@jax.jit  # one program, not op-by-op dispatch
def _dequantized(tree):
    return jax.tree.map(lambda v: v.dequantize() if jq.is_qtensor(v) else v, tree,
                        is_leaf=jq.is_qtensor)


def _np_act(x, red):
    """NumPy emulation of the dynamic symmetric int8 activation: codes times scale."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=red, keepdims=True)
    s = np.where(amax == 0, np.float32(1), amax / np.float32(127)).astype(np.float32)
    return np.clip(np.rint(x / s), -127, 127).astype(np.float64) * s


# ----------------------------------------------------------------------------- Embed


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, packed=True),
                                  jq.QuantSpec(axis=0)], ids=["int8", "int4-packed", "rows"])
def test_linen_embed_lookup_follows_flax_for_one_row_and_out_of_range_indices(spec):
    # regression: Embed(1, F) ignored Flax's broadcast of its single row (out-of-range
    # codes came back as -128 * scale), and indices out of range gave finite values where
    # the float table gives NaN (per-column scales: the int8 fill value times the scale)
    for model, init, tokens in [(nn.Embed(1, 6), jnp.array([0]), jnp.array([[0, 2, -7]])),
                                (nn.Embed(11, 6), jnp.array([0]),
                                 jnp.array([[11, -1, -11, -12, 30, 3]]))]:
        qm = quantize_linen(model, QuantConfig(weight=spec))
        q = jax.jit(qm.quantize_params)(jax.jit(model.init)(jax.random.key(0), init), init)
        y = np.asarray(jax.jit(qm.apply)(q, tokens))
        ref = np.asarray(jax.jit(model.apply)(_dequantized(q), tokens))
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, packed=True),
                                  jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=0)],
                         ids=["int8", "int4-packed", "fp8-rows"])
def test_embed_lookup_never_holds_the_float_table(spec):
    """A lookup on a QTensor table, jitted, needs no float copy of the table: the dequantize
    runs on the gathered rows only (linen: rows first; nnx: XLA fuses it into the gather)."""
    n, f = 4096, 256
    float_table = n * f * 4
    ids = jnp.zeros((4, 32), jnp.int32)
    layer = nnx_quantize(nnx.Embed(n, f, rngs=nnx.Rngs(0)), QuantConfig(weight=spec))
    graph, state = nnx.split(layer)
    compiled = jax.jit(lambda s, i: nnx.merge(graph, s)(i)).lower(state, ids).compile()
    model = nn.Embed(n, f)
    qm = quantize_linen(model, QuantConfig(weight=spec))
    q = jax.jit(qm.quantize_params)(jax.jit(model.init)(jax.random.key(0), ids), ids)
    linen = jax.jit(qm.apply).lower(q, ids).compile()
    for c in (compiled, linen):
        assert c.memory_analysis().temp_size_in_bytes < float_table / 16


def test_empty_batches_run_with_per_token_activations():
    # regression: per-token fake quantization of an empty batch divided by zero
    # (Embed.attend at inference, every layer with an ActSpec in QAT and in
    # quantize_params' survey of the model)
    model, empty = nn.Embed(11, 6), jnp.zeros((0, 6))
    qm = quantize_linen(model, WA)
    params = jax.jit(lambda k: model.init(k, jnp.ones((1, 6)), method="attend"))(
        jax.random.key(0))
    q = jax.jit(lambda p, e: qm.quantize_params(p, e, method="attend"))(params, empty)
    assert jax.jit(lambda q, e: qm.apply(q, e, method="attend"))(q, empty).shape == (0, 11)
    dense = quantize_linen(nn.Dense(5), WA)
    assert jax.jit(lambda e: dense.apply(dense.init(jax.random.key(0), e), e))(
        empty).shape == (0, 5)
    layer = nnx_quantize(nnx.Embed(11, 6, rngs=nnx.Rngs(0)), WA)
    assert nnx.jit(lambda m, e: m.attend(e))(layer, empty).shape == (0, 11)


# ----------------------------------------------------------------------------- dtypes


def test_nnx_weight_only_conv_keeps_preferred_element_type():
    # regression: the weight-only convolution dropped preferred_element_type, rounding
    # a bfloat16 convolution's float32 result to bfloat16
    make = lambda: nnx.Conv(6, 5, (3,), dtype=jnp.bfloat16, use_bias=False,
                            preferred_element_type=jnp.float32, rngs=nnx.Rngs(0))
    x = _x(2, 9, 6)
    q, ref = nnx_quantize(make(), QuantConfig()), make()
    ref.kernel.set_value(_dequantized(q.kernel[...]))
    y, r = q(x), ref(x)  # eagerly: under jit XLA:CPU may fold the bfloat16 rounding away
    assert y.dtype == r.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(r), rtol=1e-6, atol=1e-6)
    graphdef, state = nnx.split(q)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(x))(state).jaxpr
    (conv,) = find_eqns(jaxpr, "conv_general_dilated")
    assert conv.outvars[0].aval.dtype == jnp.float32


def _to_bfloat16(*args, dtype=None, inexact=True):
    """A custom ``promote_dtype`` (linen and nnx calling conventions): everything to bfloat16."""
    as_tuple = len(args) == 1 and isinstance(args[0], tuple)
    out = [None if a is None else jnp.asarray(a).astype(jnp.bfloat16)
           for a in (args[0] if as_tuple else args)]
    return tuple(out) if as_tuple else out


class _OwnPromote(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(11, 6, promote_dtype=_to_bfloat16)
        x = nn.Dense(6, promote_dtype=_to_bfloat16)(emb(tokens))
        x = nn.Conv(6, (3,), promote_dtype=_to_bfloat16)(x)
        x = nn.Einsum((6, 6), "btd,dk->btk", promote_dtype=_to_bfloat16)(x)
        return emb.attend(x)


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, packed=True)],
                         ids=["int8", "int4-packed"])
def test_a_layers_own_promote_dtype_is_kept_at_inference(spec):
    # regression: inference replaced a layer's promote_dtype by Flax's, so a model whose
    # layers compute in bfloat16 ran in float32 (QAT kept it)
    model, tokens = _OwnPromote(), jnp.array([[1, 2, 3, 4], [5, 6, 7, 10]])
    qm = quantize_linen(model, QuantConfig(weight=spec))
    q = jax.jit(qm.quantize_params)(jax.jit(model.init)(jax.random.key(0), tokens), tokens)
    y = jax.jit(qm.apply)(q, tokens)
    ref = jax.jit(model.apply)(_dequantized(q), tokens)
    assert y.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                               rtol=1e-2, atol=1e-2)

    def make():
        return nnx.Sequential(nnx.Linear(6, 6, promote_dtype=_to_bfloat16, rngs=nnx.Rngs(0)),
                              nnx.Conv(6, 6, (3,), promote_dtype=_to_bfloat16,
                                       rngs=nnx.Rngs(1)))

    layers = nnx_quantize(make(), QuantConfig(weight=spec))
    ref_layers = make()
    kernels = _dequantized([a.kernel[...] for a in layers.layers])
    for k, b in zip(kernels, ref_layers.layers, strict=True):
        b.kernel.set_value(k)
    x = _x(2, 5, 6)
    run = nnx.jit(lambda m, x: m(x))
    y, ref = run(layers, x), run(ref_layers, x)
    assert y.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                               rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- errors


class _Two(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(6, name="body")(x)
        if self.kind == "Conv":
            return nn.Conv(4, (3,), name="head")(x)
        if self.kind == "Einsum":
            return nn.Einsum((4, 6), "btd,kd->btk", name="head")(x)
        return nn.Dense(4, name="head")(x)


class _NnxTwo(nnx.Module):
    def __init__(self, kind):
        self.body = nnx.Linear(6, 6, rngs=nnx.Rngs(0))
        self.head = {"Conv": lambda: nnx.Conv(6, 4, (3,), rngs=nnx.Rngs(1)),
                     "Einsum": lambda: nnx.Einsum("btd,kd->btk", (4, 6), rngs=nnx.Rngs(1)),
                     "Linear": lambda: nnx.Linear(6, 4, rngs=nnx.Rngs(1))}[kind]()

    def __call__(self, x):
        return self.head(self.body(x))


_HEAD_RULES = {
    # per-input-channel scales: they cannot be applied after an int8 dot
    "wrong-axis": (QuantConfig(weight=jq.QuantSpec(axis=0), act=ActSpec()),
                   "constant along the contracting|per output feature"),
    "int4-act": (QuantConfig(act=ActSpec(dtype=jnp.int4)), r"needs ActSpec\(dtype=jnp.int8\)"),
}


@pytest.mark.parametrize("kind", ["Dense", "Conv", "Einsum"])
@pytest.mark.parametrize("case", sorted(_HEAD_RULES))
def test_linen_inference_errors_name_the_layer(kind, case):
    # regression: a QTensor or ActSpec the int8 path cannot take raised without the layer
    cfg, match = _HEAD_RULES[case]
    if kind == "Einsum" and case == "wrong-axis":  # its kernel is (out, in): axis -1 is in
        cfg = WA
    model, x = _Two(kind), _x(2, 5, 6)
    qm = quantize_linen(model, [("head", cfg), ("", QuantConfig())])
    # shapes only (jax.eval_shape): abstract QTensors, the error is raised while tracing
    q = jax.eval_shape(qm.quantize_params, jax.eval_shape(model.init, jax.random.key(0), x), x)
    assert jq.is_qtensor(q["params"]["head"]["kernel"])
    with pytest.raises(ValueError, match=rf"layer 'head' \({kind}\): .*({match})"):
        jax.eval_shape(qm.apply, q, x)


@pytest.mark.parametrize("kind", ["Linear", "Conv", "Einsum"])
@pytest.mark.parametrize("case", sorted(_HEAD_RULES))
def test_nnx_inference_errors_name_the_layer(kind, case):
    cfg, match = _HEAD_RULES[case]
    if kind == "Einsum" and case == "wrong-axis":
        cfg = WA
    model = nnx_quantize(_NnxTwo(kind), [("head", cfg), ("", QuantConfig())])
    with pytest.raises(ValueError, match=rf"layer 'head' \({kind}\): .*({match})"):
        model(_x(2, 5, 6))


@pytest.mark.parametrize("kind", ["Linear", "Conv", "Einsum"])
def test_nnx_qtensor_replaced_by_one_of_the_wrong_shape_names_the_layer(kind):
    # a QTensor put in a quantized layer later (a checkpoint of another model)
    model = nnx_quantize(_NnxTwo(kind), QuantConfig())
    shape = (3, 5, 4) if kind == "Conv" else (4, 5) if kind == "Einsum" else (5, 4)
    model.head.kernel.set_value(jq.quantize(jnp.ones(shape), axis=-1))
    with pytest.raises(ValueError, match=rf"^layer 'head' \({kind}\): .*\b6\b.*\b5\b"):
        model(_x(2, 5, 6))


def test_linen_einsum_string_given_twice_is_refused_as_in_flax():
    # regression: inference took the call's equation where float Flax raises
    model, x = nn.Einsum((6, 5), "bd,dk->bk"), _x(3, 6)
    params = jax.jit(model.init)(jax.random.key(0), x)
    with pytest.raises(ValueError, match="einsum_str.*passed to the constructor and at call"):
        jax.eval_shape(lambda p, x: model.apply(p, x, "bd,dk->bk"), params, x)
    qm = quantize_linen(model, QuantConfig())
    q = jax.jit(qm.quantize_params)(params, x)
    with pytest.raises(ValueError, match="einsum_str.*passed to the constructor and at call"):
        jax.eval_shape(lambda q, x: qm.apply(q, x, "bd,dk->bk"), q, x)


# ----------------------------------------------------------------------------- int8 x int8


def _int8_dots(jaxpr):
    convs = list(find_eqns(jaxpr, "conv_general_dilated"))
    eqns = list(find_eqns(jaxpr)) + ([integer_convolution(jaxpr)] if convs else [])
    return [[v.aval.dtype for v in e.invars] + [e.outvars[0].aval.dtype] for e in eqns]


@pytest.mark.parametrize("model, x, spec, ref", [
    # DenseGeneral with a batch axis, asymmetric uint8 kernel scaled along that batch axis
    (nn.DenseGeneral(5, batch_dims=(0,)), (3, 4, 6),
     jq.QuantSpec(dtype=jnp.uint8, axis=0, symmetric=False),
     lambda a, w, b: np.einsum("btd,bdk->btk", a, w) + b[:, None]),
    # an Einsum with a batch letter, blocked along the contracted axis
    (nn.Einsum((4, 6, 5), "btd,tdk->btk"), (3, 4, 6), jq.QuantSpec(axis=1, block_size=2),
     lambda a, w, b: np.einsum("btd,tdk->btk", a, w) + b),
], ids=["dense-general-batch-asym", "einsum-batch-blocked"])
def test_linen_w8a8_equals_numpy_emulation(model, x, spec, ref):
    x = _x(*x)
    qm = quantize_linen(model, QuantConfig(weight=spec, act=ActSpec()))
    params = jax.jit(model.init)(jax.random.key(1), x)
    q = jax.jit(qm.quantize_params)(params, x)
    y = np.asarray(jax.jit(qm.apply)(q, x), np.float64)
    w = np.asarray(_dequantized(q["params"]["kernel"]), np.float64)
    bias = np.asarray(params["params"]["bias"], np.float64)
    expected = ref(_np_act(x, -1), w, bias)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert _int8_dots(jax.make_jaxpr(qm.apply)(q, x).jaxpr) == [[jnp.int8, jnp.int8, jnp.int32]]


def test_nnx_grouped_strided_conv_w8a8_equals_numpy_emulation():
    x = _x(2, 9, 9, 6)
    model = nnx_quantize(nnx.Conv(6, 6, (3, 3), strides=2, feature_group_count=3,
                                  rngs=nnx.Rngs(0)), WA)
    y = np.asarray(nnx.jit(lambda m, x: m(x))(model, x), np.float64)
    a = _np_act(x, None)  # one scale per tensor
    w = np.asarray(_dequantized(model.kernel[...]), np.float64)
    expected = np.asarray(jax.jit(lambda a, w: jax.lax.conv_general_dilated(
        a, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=3, precision=jax.lax.Precision.HIGHEST))(
        jnp.asarray(a, jnp.float32), jnp.asarray(w, jnp.float32)), np.float64)
    np.testing.assert_allclose(y, expected + np.asarray(model.bias[...]), rtol=1e-5, atol=1e-5)
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(x))(state).jaxpr
    assert _int8_dots(jaxpr) == [[jnp.int8, jnp.int8, jnp.int32]]


@pytest.mark.parametrize("shape", [(2, 8, 3, 8), (2, 4, 3, 8)], ids=["equal-sizes", "unequal"])
@pytest.mark.parametrize("act", [None, ActSpec()], ids=["weight-only", "w8a8"])
def test_linen_dense_general_axes_out_of_order_are_flax_s_sorted_axes(shape, act):
    """Flax sorts DenseGeneral's axes: ``axis=(-1, 1)`` contracts input axes (1, 3) with kernel
    axes (0, 1). Inference on the QTensor kernel must pair them as Flax's own layer does."""
    x = _x(*shape)
    model = nn.DenseGeneral(5, axis=(-1, 1))
    qm = quantize_linen(model, QuantConfig(act=act))
    params = jax.jit(model.init)(jax.random.key(1), x)
    assert params["params"]["kernel"].shape == (shape[1], shape[3], 5)
    q = jax.jit(qm.quantize_params)(params, x)
    y = jax.jit(qm.apply)(q, x)
    # the reference: Flax's float layer on the dequantized kernel (and fake-quantized input)
    a = x if act is None else jnp.asarray(_np_act(x, (1, 3)), jnp.float32)
    want = model.clone(precision=jax.lax.Precision.HIGHEST).apply(_dequantized(q), a)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_weight_only_einsum_that_sums_out_an_input_letter_runs():
    # before: trained and converted, then qeinsum refused 't' (lhs only, not in the output);
    # weight-only, the layer runs on its dequantized kernel. An int8 ActSpec still refuses
    # it clearly (its per-token codes would be summed over t).
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 6)), jnp.float32)
    model = nn.Einsum((6, 7), "btd,df->bf")
    qm = quantize_linen(model, QuantConfig())
    v = model.init(jax.random.key(0), x)
    q = qm.quantize_params(v, x)
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, x)), np.asarray(qm.apply(v, x)),
                               rtol=1e-6, atol=1e-6)
    layer = nnx.Einsum("btd,df->bf", (6, 7), (7,), rngs=nnx.Rngs(0))
    trained = nnx_qat(nnx.clone(layer), QuantConfig())(x)
    np.testing.assert_allclose(np.asarray(nnx_quantize(layer, QuantConfig())(x)),
                               np.asarray(trained), rtol=1e-6, atol=1e-6)
    w8a8 = quantize_linen(model, QuantConfig(act=ActSpec()))
    with pytest.raises(ValueError, match="'t' occurs in lhs only"):
        w8a8.apply(w8a8.quantize_params(v, x), x)
