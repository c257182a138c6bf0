"""jaxquant.flax on nnx models: rules, QAT by surgery against hand-made fake-quant
references, training with nnx.Optimizer(optax.adam), LSQ scales, QTensor inference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

from jaxpr_utils import find_eqns, integer_convolution  # noqa: E402
from nnx_training import train_nnx  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import (  # noqa: E402
    ActSpec,
    QuantConfig,
    nnx_input_grams,
    nnx_layers,
    nnx_qat,
    nnx_quantize,
    nnx_unused_rules,
)

TOKENS = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
NAMES = {nnx.Embed: "embedding"}


class Zoo(nnx.Module):
    """Every covered layer: Embed (lookup and attend), Linear, LinearGeneral on one and on
    two axes, an Einsum with an ellipsis, a list of blocks, a Conv."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(11, 8, rngs=rngs)
        self.dense = nnx.Linear(8, 8, rngs=rngs)
        self.dg = nnx.LinearGeneral(8, (2, 4), rngs=rngs)
        self.dg2 = nnx.LinearGeneral((2, 4), 8, axis=(-2, -1), rngs=rngs)
        self.ein = nnx.Einsum("...c,cd->...d", (8, 8), (8,), rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.conv = nnx.Conv(8, 8, (3,), padding="SAME", rngs=rngs)

    def __call__(self, tokens):
        x = self.dg2(self.dg(self.dense(self.emb(tokens))))
        x = self.ein(x)
        for block in self.blocks:
            x = x + jnp.tanh(block(x))
        return self.emb.attend(self.conv(x))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(8, 16, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.fc1(x)))


ZOO_LAYERS = ["blocks/0", "blocks/1", "conv", "dense", "dg", "dg2", "ein", "emb"]
run = nnx.jit(lambda model, x: model(x))


def _x(*shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32) * 0.37).reshape(shape)


def _kernels(model):
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear | nnx.LinearGeneral | nnx.Einsum | nnx.Conv | nnx.Embed):
            yield getattr(node, NAMES.get(type(node), "kernel"))


def _with_kernels(model, fn):
    """A copy of ``model`` (float layers) with ``fn`` applied to every kernel by hand."""
    ref = nnx.clone(model)
    kernels = list(_kernels(ref))
    new = jax.jit(lambda ks: [fn(k) for k in ks])([var[...] for var in kernels])  # one program
    for var, k in zip(kernels, new, strict=True):
        var.set_value(k)
    return ref


@pytest.fixture(scope="module")
def zoo():
    return Zoo(nnx.Rngs(0))


@pytest.fixture(scope="module")
def zoo_float(zoo):
    return np.asarray(run(zoo, TOKENS))


# ----------------------------------------------------------------------------- rules


def test_layers_first_match_none_and_unused_rules(zoo):
    w4 = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4))
    rules = [("emb", None), ("blocks/1", w4), ("^d", QuantConfig()), ("blocks", QuantConfig()),
             ("dense", None), ("typo", None)]
    assert nnx_layers(zoo, rules) == {
        "blocks/0": QuantConfig(), "blocks/1": w4, "conv": None, "dense": QuantConfig(),
        "dg": QuantConfig(), "dg2": QuantConfig(), "ein": None, "emb": None}
    assert nnx_unused_rules(zoo, rules) == [("dense", None), ("typo", None)]
    assert list(nnx_layers(zoo, QuantConfig())) == ZOO_LAYERS
    q = nnx_quantize(nnx.clone(zoo), rules)
    assert q.blocks[1].kernel[...].qvalue.dtype == jnp.int4
    assert q.dense.kernel[...].qvalue.dtype == jnp.int8
    assert not jq.is_qtensor(q.conv.kernel[...]) and not jq.is_qtensor(q.emb.embedding[...])


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be a flax.nnx.Module, got dict"):
        nnx_qat({}, QuantConfig())
    with pytest.raises(TypeError, match="model must be a flax.nnx.Module, got list"):
        nnx_quantize([], QuantConfig())
    with pytest.raises(TypeError, match=r"rules\[1\] must be a \(pattern: str, QuantConfig"):
        nnx_layers(MLP(nnx.Rngs(0)), [("fc1", None), ("head",)])
    conv = nnx.Conv(2, 2, (3,), mask=jnp.ones((3, 2, 2)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="has a mask and cannot run on a QTensor kernel"):
        nnx_quantize(conv, QuantConfig())


# ----------------------------------------------------------------------------- QAT


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, block_size=2),
                                  jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=None),
                                  jq.QuantSpec(dtype="mxfp8_e4m3")],
                         ids=["int8", "int4-block2", "fp8-tensor", "mxfp8"])
def test_qat_forward_equals_fake_quantized_kernels(zoo, zoo_float, spec):
    fq = lambda k: jq.fake_quant(k, dtype=spec.dtype, axis=spec.axis, block_size=spec.block_size)
    ref = run(_with_kernels(zoo, fq), TOKENS)
    y = run(nnx_qat(nnx.clone(zoo), QuantConfig(weight=spec)), TOKENS)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(ref) - zoo_float).max() > 1e-3


def test_qat_gradients_are_ste():
    model, x = nnx.Linear(6, 4, rngs=nnx.Rngs(1)), _x(3, 6)
    act = ActSpec(dtype=jnp.int4, scale=0.1)  # codes in [-8, 7]: |x| > 0.75 is clipped
    spec = jq.QuantSpec(dtype=jnp.int4, axis=None)
    q = nnx_qat(nnx.clone(model), QuantConfig(weight=spec, act=act))
    grad = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1)))
    gm, gx = grad(q, x)
    ref = _with_kernels(model, lambda k: jq.fake_quant(k, dtype=jnp.int4))
    ref_gm, ref_gx = grad(ref, jq.fake_quant(x, jnp.float32(0.1), dtype=jnp.int4))
    inside = (jnp.round(x / 0.1) >= -8) & (jnp.round(x / 0.1) <= 7)
    assert 0 < int(inside.sum()) < x.size
    np.testing.assert_allclose(np.asarray(gm["kernel"][...]), np.asarray(ref_gm["kernel"][...]),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(jnp.where(inside, ref_gx, 0.0)),
                               rtol=1e-6)


def test_train_with_adam_learned_scale_then_quantize():
    x = _x(32, 8)
    y = jnp.cos(x[:, :3] * 2.0)
    w4 = jq.QuantSpec(dtype=jnp.int4)
    rules = [("fc1", QuantConfig(act=ActSpec())),
             ("head", QuantConfig(weight=w4, learn_scale=True))]
    model = nnx_qat(MLP(nnx.Rngs(2)), rules)
    s0 = model.head.promote_dtype.scale[...]
    np.testing.assert_array_equal(np.asarray(s0), np.asarray(w4(model.head.kernel[...]).scale))
    losses = train_nnx(model, x, y)
    assert losses[-1] < 0.5 * losses[0]
    s1 = model.head.promote_dtype.scale[...]
    assert np.abs(np.asarray(s1) - np.asarray(s0)).max() > 1e-4
    y_qat = run(model, x)
    nnx_quantize(model, rules)  # fc1: int8 x int8; head: int4 codes with the learned scale
    np.testing.assert_array_equal(np.asarray(model.head.kernel[...].scale), np.asarray(s1))
    np.testing.assert_allclose(np.asarray(run(model, x)), np.asarray(y_qat), atol=1e-5)


def test_learned_zero_point_moves_and_becomes_the_qtensor_zero_point():
    x = _x(32, 8)
    y = jnp.cos(x[:, :3] * 2.0)
    spec = jq.QuantSpec(dtype=jnp.int4, symmetric=False)
    rules = [("head", QuantConfig(weight=spec, learn_scale=True))]
    model = nnx_qat(MLP(nnx.Rngs(2)), rules)
    hook = model.head.promote_dtype
    init = spec(model.head.kernel[...])
    np.testing.assert_array_equal(np.asarray(hook.scale[...]), np.asarray(init.scale))
    z0 = np.asarray(hook.zero_point[...])
    np.testing.assert_array_equal(z0, np.asarray(init.zero_point, np.float32))
    losses = train_nnx(model, x, y, steps=60)
    assert losses[-1] < 0.5 * losses[0]
    z1 = np.asarray(hook.zero_point[...])
    assert np.abs(z1 - z0).max() > 0.05
    y_qat = run(model, x)
    nnx_quantize(model, rules)
    kernel = model.head.kernel[...]
    np.testing.assert_array_equal(np.asarray(kernel.zero_point, np.float32),
                                  np.clip(np.round(z1), -8, 7))
    np.testing.assert_allclose(np.asarray(run(model, x)), np.asarray(y_qat), atol=1e-5)


def test_int8_dot_training_matches_fake_quant_and_runs_int8_dots():
    pytest.importorskip("jaxquant._qat_dot")
    model, x = MLP(nnx.Rngs(3)), _x(16, 8)
    fast = nnx_qat(nnx.clone(model), QuantConfig(act=ActSpec(), int8_dot=True))
    fake = nnx_qat(nnx.clone(model), QuantConfig(act=ActSpec()))
    vg = nnx.jit(nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2)))
    (l1, g1), (l2, g2) = vg(fast), vg(fake)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 nnx.state(g1, nnx.Param), nnx.state(g2, nnx.Param))
    graphdef, state = nnx.split(fast)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(x))(state).jaxpr
    dots = list(find_eqns(jaxpr))
    assert len(dots) == 2
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.int8, jnp.int8]
        assert eqn.outvars[0].aval.dtype == jnp.int32


# ----------------------------------------------------------------------------- inference


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, packed=True),
                                  jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=4, packed=True),
                                  jq.QuantSpec(dtype="nf4", axis=0, block_size=4, packed=True,
                                               double_quant=True)],
                         ids=["int8", "int4-packed", "int4-block4-packed", "nf4-double-quant"])
def test_weight_only_inference_equals_float_on_dequantized_kernels(zoo, spec):
    q = nnx_quantize(nnx.clone(zoo), QuantConfig(weight=spec))
    codes = [var[...] for var in _kernels(q)]
    assert len(codes) == len(ZOO_LAYERS) and all(map(jq.is_qtensor, codes))
    ref = nnx.clone(zoo)
    dequantized = jax.jit(lambda qts: [qt.dequantize() for qt in qts])(codes)  # one program
    for var, k in zip(_kernels(ref), dequantized, strict=True):
        var.set_value(k)
    np.testing.assert_allclose(np.asarray(run(q, TOKENS)), np.asarray(run(ref, TOKENS)),
                               rtol=1e-5, atol=1e-5)
    # the jitted program takes the codes: no float kernel comes in
    graphdef, state = nnx.split(q)
    jaxpr = jax.make_jaxpr(jax.jit(lambda s: nnx.merge(graphdef, s)(TOKENS)))(state)
    in_avals = [v.aval for v in jaxpr.jaxpr.invars]
    assert not any(a.dtype == jnp.float32 and a.shape in {(8, 8), (3, 8, 8), (11, 8)}
                   for a in in_avals)


def test_w8a8_inference_close_to_float_and_dots_are_int8(zoo, zoo_float):
    rules = [("emb", QuantConfig()), ("", QuantConfig(act=ActSpec()))]
    qat = nnx_qat(nnx.clone(zoo), rules)
    y_qat = np.asarray(run(qat, TOKENS))
    q = nnx_quantize(qat, rules)
    y, ref = np.asarray(run(q, TOKENS)), zoo_float
    assert np.abs(y - ref).max() < 0.03 * np.abs(ref).max()
    # the same values as QAT with per-token activations (per tensor in the Conv)
    np.testing.assert_allclose(y, y_qat, rtol=1e-4, atol=1e-4 * np.abs(y_qat).max())
    graphdef, state = nnx.split(q)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(TOKENS))(state).jaxpr
    dots = list(find_eqns(jaxpr))
    int_dots = [e for e in dots if [v.aval.dtype for v in e.invars] == [jnp.int8, jnp.int8]]
    # Linear, 2 LinearGeneral, Einsum, 2 blocks: int8 x int8 -> int32; Embed.attend: float
    assert len(int_dots) == 6
    assert all(e.outvars[0].aval.dtype == jnp.int32 for e in int_dots)
    assert all(e.outvars[0].aval.shape == (2, 5, 11) for e in dots if e not in int_dots)
    conv = integer_convolution(jaxpr)
    assert conv.outvars[0].aval.dtype == jnp.int32


def test_einsum_per_token_scales_follow_the_call_equation():
    # regression: QAT took the per-token axes from the constructor's equation
    x = jax.random.normal(jax.random.key(1), (2, 6, 5, 6)) * jnp.arange(1, 7.)[None, :, None, None]
    cfg = QuantConfig(act=ActSpec())
    call = nnx.jit(lambda m, x: m(x, "abcd,bk->acdk"))
    m = nnx.Einsum("abcd,dk->abck", (6, 4), rngs=nnx.Rngs(0))
    ref = nnx.Einsum("abcd,bk->acdk", (6, 4), rngs=nnx.Rngs(0))
    nnx_qat(m, cfg)
    nnx_qat(ref, cfg)
    yt = call(m, x)
    np.testing.assert_allclose(yt, run(ref, x), atol=1e-6)
    nnx_quantize(m, cfg)
    np.testing.assert_allclose(call(m, x), yt, atol=1e-5)


class _Layer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


@nnx.vmap(in_axes=0, out_axes=0)
def _make_layers(key):
    return _Layer(nnx.Rngs(key))


@nnx.jit
def _run_layers(layers, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
        return layer(x)
    return body(x, layers)


@functools.partial(jax.jit, static_argnums=3)
def _fq_layer_by_layer(x, k, bias, spec):
    """The reference: each layer's kernel fake-quantized on its own, applied in turn."""
    for i in range(k.shape[0]):
        kk = jq.fake_quant(k[i], **spec.computed_kwargs())
        x = jnp.tanh(x @ kk + bias[i][None, None])
    return x


@pytest.mark.parametrize("cfg", [
    QuantConfig(), QuantConfig(act=ActSpec()), QuantConfig(learn_scale=True),
    QuantConfig(weight=jq.QuantSpec(axis=0)), QuantConfig(weight=jq.QuantSpec(axis=None)),
    QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=4, packed=True)),
], ids=["w8", "w8a8", "lsq", "axis0", "tensor", "int4-block"])
def test_stacked_layers_are_quantized_layer_by_layer(cfg):
    # regression: the stack was one tensor (one scale for all layers), then scan failed
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    layers = _make_layers(jax.random.split(jax.random.key(0), 3))
    k = layers.lin.kernel[...]
    nnx_qat(layers, cfg)
    yt = _run_layers(layers, x)
    if cfg.act is None:  # the reference: each layer's kernel fake-quantized on its own
        ref = _fq_layer_by_layer(x, k, layers.lin.bias[...], cfg.weight)
        np.testing.assert_allclose(yt, ref, atol=1e-5)
    nnx_quantize(layers, cfg)
    qt = layers.lin.kernel[...]
    assert jq.is_qtensor(qt) and jax.tree.leaves(qt.scale)[0].shape[0] == 3
    np.testing.assert_allclose(_run_layers(layers, x), yt, atol=1e-5)


def test_qtensor_kernel_of_the_wrong_shape_raises():
    m = nnx.Linear(6, 5, rngs=nnx.Rngs(0))
    m.kernel.set_value(jq.quantize(jnp.ones((6, 4)), axis=-1))
    with pytest.raises(ValueError, match=r"Linear at ''.*\(6, 5\).*QTensor of shape \(6, 4\)"):
        nnx_quantize(m, QuantConfig())


def test_embed_attend_with_act_inference_matches_qat():
    # regression: inference left the query float where QAT fake-quantizes it per token
    m = nnx.Embed(11, 6, rngs=nnx.Rngs(0))
    call = lambda m, t: m.attend(m(t))
    cfg = QuantConfig(act=ActSpec())
    nnx_qat(m, cfg)
    yt = nnx.jit(call)(m, TOKENS)
    nnx_quantize(m, cfg)
    np.testing.assert_allclose(nnx.jit(call)(m, TOKENS), yt, atol=1e-6)


def test_nnx_a_spec_that_does_not_fit_a_layer_names_the_layer():
    class Two(nnx.Module):
        def __init__(self):
            self.body = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
            self.head = nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    with pytest.raises(ValueError, match=r"layer 'head': cannot quantize its kernel "
                                         r"\(float32\[4, 3\]\) as its rule says: .*axis"):
        nnx_quantize(Two(), [("head", QuantConfig(weight=jq.QuantSpec(axis=2))),
                             ("", QuantConfig())])


@pytest.mark.parametrize("extra", [{}, {"learn_scale": True}, {"int8_dot": True}, "einsum"])
def test_nnx_qat_rule_that_does_not_fit_a_layer_names_the_layer(extra):
    class Two(nnx.Module):
        def __init__(self):
            self.body = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
            self.head = (nnx.Einsum("bi,io->bo", (4, 3), rngs=nnx.Rngs(1)) if extra == "einsum"
                         else nnx.Linear(4, 3, rngs=nnx.Rngs(1)))

        def __call__(self, x):
            return self.head(self.body(x))

    kind = "Einsum" if extra == "einsum" else "Linear"
    cfg = QuantConfig(weight=jq.QuantSpec(axis=2), **({} if extra == "einsum" else extra))
    with pytest.raises(ValueError, match=rf"layer 'head' \({kind}\): .*axis must be in "
                                         r"\[-2, 2\)"):
        nnx_qat(Two(), [("head", cfg), ("", QuantConfig())])(jnp.ones((2, 5)))


class _Tied(nnx.Module):
    """One Embed held at two paths: the lookup table and the output head (tied weights)."""

    def __init__(self):
        self.embed = nnx.Embed(11, 6, rngs=nnx.Rngs(0))
        self.body = nnx.Linear(6, 6, rngs=nnx.Rngs(1))
        self.head = self.embed

    def __call__(self, tokens):
        return self.head.attend(self.body(self.embed(tokens)))


def test_nnx_shared_layer_rules_must_agree_across_its_paths():
    int8 = QuantConfig(weight=jq.QuantSpec(axis=0))
    disagree = [("head", int8), ("", None)]  # would have left the tied table float silently
    for fn in (nnx_layers, nnx_unused_rules, nnx_qat, nnx_quantize):
        with pytest.raises(ValueError, match=r"Embed at 'embed' is also reachable at 'head'.*"
                                             r"'embed' None and 'head' QuantConfig"):
            fn(_Tied(), disagree)
    agree = [("head", int8), ("embed", int8), ("body", None)]
    assert nnx_layers(_Tied(), agree) == {"embed": int8, "body": None}
    assert nnx_unused_rules(_Tied(), agree) == []  # "head" selects the table at its own path
    model, ref = _Tied(), _Tied()
    ref.embed.embedding.set_value(jax.jit(jq.fake_quant, static_argnames="axis")(
        ref.embed.embedding[...], axis=0))
    nnx_quantize(model, agree)
    assert model.head is model.embed and jq.is_qtensor(model.head.embedding[...])
    np.testing.assert_allclose(run(model, TOKENS), run(ref, TOKENS), atol=1e-5)


def test_a_failing_nnx_qat_leaves_the_model_as_it_was():
    """Rules checked and learned scales initialized for every layer before any is rewired: an
    error in a later layer keeps the earlier layers' trained scales and the model's output."""
    class Two(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.a, self.b = nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 48, rngs=rngs)

        def __call__(self, x):
            return self.b(self.a(x))

    model, x = Two(), jax.random.normal(jax.random.key(1), (3, 64))
    nnx_qat(model, QuantConfig(learn_scale=True))
    before, promotes = model(x), (model.a.promote_dtype, model.b.promote_dtype)
    bad = [("a", QuantConfig(act=ActSpec())),
           ("b", QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=2), learn_scale=True))]
    with pytest.raises(ValueError, match="layer 'b' .*axis"):
        nnx_qat(model, bad)
    assert (model.a.promote_dtype, model.b.promote_dtype) == promotes
    np.testing.assert_array_equal(model(x), before)


def test_input_grams_of_a_linear_subclass():
    class MyLinear(nnx.Linear):
        pass

    x = jax.random.normal(jax.random.key(1), (32, 16))
    grams = [nnx_input_grams(nnx.Sequential(cls(16, 8, rngs=nnx.Rngs(0))), QuantConfig(), x)
             for cls in (nnx.Linear, MyLinear)]
    assert list(grams[1]) == ["layers/0"]
    np.testing.assert_array_equal(grams[1]["layers/0"], grams[0]["layers/0"])
