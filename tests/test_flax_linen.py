"""jaxquant.flax on linen models: rules, QAT against hand-made fake-quant references,
training with optax, nn.scan / nn.remat, inference on QTensor trees."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

from jaxpr_utils import find_eqns, integer_convolution  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import ActSpec, QuantConfig, quantize_linen  # noqa: E402


def _x(*shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32) * 0.37).reshape(shape)


SPECS = [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, block_size=2),
         jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=None), jq.QuantSpec(dtype="nf4", block_size=4),
         jq.QuantSpec(dtype="mxfp4")]
TOKENS = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])


@functools.partial(jax.jit, static_argnums=1)  # one program, not op-by-op dispatch
def _fq_params(params, spec):
    """The reference: kernels fake-quantized by hand (scanned ones layer by layer)."""
    def fq(path, leaf):
        keys = jax.tree_util.keystr(path)
        if not ("kernel" in keys or "embedding" in keys):
            return leaf
        f = lambda k: jq.fake_quant(k, dtype=spec.dtype, axis=spec.axis,
                                    block_size=spec.block_size)
        return jax.vmap(f)(leaf) if "ScanBlock" in keys else f(leaf)
    return jax.tree_util.tree_map_with_path(fq, params)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, name="fc1")(x))
        return nn.Dense(3, name="head")(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return c + nn.tanh(nn.Dense(8)(c)), None


class Zoo(nn.Module):
    """Every covered layer: Embed (lookup and attend), a remat Dense, DenseGeneral on one
    and on two axes, an Einsum with an ellipsis, two nn.scan'd Dense blocks, a Conv."""

    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(11, 8)
        x = nn.remat(nn.Dense)(8)(emb(tokens))
        x = nn.DenseGeneral((2, 4), axis=-1)(x)
        x = nn.DenseGeneral(8, axis=(-2, -1))(x)
        x = nn.Einsum((8, 8), "...c,cd->...d")(x)
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=2)
        x, _ = blocks()(x, None)
        x = nn.Conv(8, (3,), padding="SAME")(x)
        return emb.attend(x)


@pytest.fixture(scope="module")
def zoo():
    return Zoo(), jax.jit(Zoo().init)(jax.random.key(0), TOKENS)


@pytest.fixture(scope="module")
def zoo_float(zoo):
    return np.asarray(jax.jit(zoo[0].apply)(zoo[1], TOKENS))


# ----------------------------------------------------------------------------- rules


ZOO_LAYERS = ["Embed_0", "CheckpointDense_0", "DenseGeneral_0", "DenseGeneral_1", "Einsum_0",
              "ScanBlock_0/Dense_0", "Conv_0"]


def test_layers_paths_first_match_none_and_unused_rules(zoo):
    model, params = zoo
    w4 = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4))
    rules = [("Embed", None), ("ScanBlock_0/", w4), ("Dense", QuantConfig()),
             ("Conv", QuantConfig()), ("Dense_0", None), ("typo", QuantConfig())]
    qm = quantize_linen(model, rules)
    layers = qm.layers(params, TOKENS)
    assert list(layers) == ZOO_LAYERS
    assert layers == {"Embed_0": None, "CheckpointDense_0": QuantConfig(),
                      "DenseGeneral_0": QuantConfig(), "DenseGeneral_1": QuantConfig(),
                      "Einsum_0": None, "ScanBlock_0/Dense_0": w4, "Conv_0": QuantConfig()}
    assert qm.unused_rules(params, TOKENS) == [("Dense_0", None), ("typo", QuantConfig())]
    # None (and no match) keep a layer float; scanned kernels become stacked per-layer QTensors
    q = jax.jit(qm.quantize_params)(params, TOKENS)["params"]
    assert not jq.is_qtensor(q["Embed_0"]["embedding"])
    assert not jq.is_qtensor(q["Einsum_0"]["kernel"])
    k = q["ScanBlock_0"]["Dense_0"]["kernel"]
    assert k.qvalue.shape == (2, 8, 8) and k.qvalue.dtype == jnp.int4 and k.scale.shape == (2, 8)
    for name in ("CheckpointDense_0", "DenseGeneral_0", "DenseGeneral_1", "Conv_0"):
        assert q[name]["kernel"].qvalue.dtype == jnp.int8


def test_single_config_selects_every_layer(zoo):
    model, params = zoo
    qm = quantize_linen(model, QuantConfig())
    assert qm.layers(params, TOKENS) == dict.fromkeys(ZOO_LAYERS, QuantConfig())
    assert qm.unused_rules(params, TOKENS) == []


@pytest.mark.parametrize("rules, exc, match", [
    ([("a", "int8")], TypeError, r"rules\[0\] must be a \(pattern: str, QuantConfig"),
    ("Dense", TypeError, "rules must be a QuantConfig or a sequence"),
    ([("(", QuantConfig())], ValueError, r"rules\[0\] has an invalid pattern '\('"),
    ([("w{99999999999}", QuantConfig())], ValueError, r"rules\[0\] has an invalid pattern"),
])
def test_bad_rules(rules, exc, match):
    with pytest.raises(exc, match=match):
        quantize_linen(MLP(), rules)


def test_rule_pairs_may_be_lists():
    """Rules read from JSON/YAML arrive as lists of lists."""
    model, x = MLP(), _x(4, 8)
    params = jax.jit(model.init)(jax.random.key(0), x)
    as_lists = quantize_linen(model, [["head", None], ["", QuantConfig()]])
    as_tuples = quantize_linen(model, [("head", None), ("", QuantConfig())])
    assert as_lists.layers(params, x) == as_tuples.layers(params, x)
    assert as_lists.layers(params, x)["head"] is None


def test_bad_module():
    with pytest.raises(TypeError, match="module must be a flax.linen.Module, got function"):
        quantize_linen(lambda x: x, QuantConfig())


# ----------------------------------------------------------------------------- QAT


@pytest.mark.parametrize("spec", SPECS, ids=["int8", "int4-block2", "fp8-tensor", "nf4-block4",
                                              "mxfp4"])
def test_qat_forward_equals_fake_quantized_params(zoo, zoo_float, spec):
    model, params = zoo
    qm = quantize_linen(model, QuantConfig(weight=spec))
    y, ref = jax.jit(lambda p: (qm.apply(p, TOKENS),
                                model.apply(_fq_params(p, spec), TOKENS)))(params)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(ref) - zoo_float).max() > 1e-3


def test_qat_activation_per_token_and_static():
    model, x = nn.Dense(4), _x(3, 6) * 3.0
    params = jax.jit(model.init)(jax.random.key(2), x)
    cases = [(ActSpec(), lambda x: jq.fake_quant(x, axis=0)),  # one scale per row
             (ActSpec(granularity="tensor", dtype=jnp.int4),
              lambda x: jq.fake_quant(x, dtype=jnp.int4)),
             (ActSpec(scale=0.05), lambda x: jq.fake_quant(x, jnp.float32(0.05)))]

    @jax.jit  # the three QAT models and their references in one program
    def run(params, x):
        fq = _fq_params(params, jq.QuantSpec())
        return [(quantize_linen(model, QuantConfig(act=act)).apply(params, x),
                 model.apply(fq, fq_x(x))) for act, fq_x in cases]

    for y, ref in run(params, x):
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6)


def test_qat_kernel_and_input_gradients_are_ste():
    model, x = nn.Dense(4), _x(3, 6)
    params = jax.jit(model.init)(jax.random.key(3), x)
    act = ActSpec(dtype=jnp.int4, scale=0.1)  # codes in [-8, 7]: |x| > 0.75 is clipped
    qm = quantize_linen(model, QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=None), act=act))
    gp, gx = jax.jit(jax.grad(lambda p, x: jnp.sum(qm.apply(p, x) ** 2), argnums=(0, 1)))(params, x)
    # reference: the float model at the fake-quantized point, times the clipped-STE mask
    fq = _fq_params(params, jq.QuantSpec(dtype=jnp.int4, axis=None))
    fx = jq.fake_quant(x, jnp.float32(0.1), dtype=jnp.int4)
    ref_gp, ref_gx = jax.jit(jax.grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2), argnums=(0, 1)))(fq, fx)
    inside = (jnp.round(x / 0.1) >= -8) & (jnp.round(x / 0.1) <= 7)
    assert 0 < int(inside.sum()) < x.size
    np.testing.assert_allclose(np.asarray(gp["params"]["kernel"]),
                               np.asarray(ref_gp["params"]["kernel"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(jnp.where(inside, ref_gx, 0.0)),
                               rtol=1e-6)


def _train(apply, variables, x, y, steps=25, trainable=("params",)):
    opt = optax.adam(1e-2)
    train = {k: variables[k] for k in trainable}
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(train)

    def loss_fn(train):
        return jnp.mean((apply({**variables, **train}, x) - y) ** 2)

    @jax.jit
    def step(train, state):
        loss, g = jax.value_and_grad(loss_fn)(train)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes python floats and int32
            updates, state = opt.update(g, state, train)
        return optax.apply_updates(train, updates), state, loss

    losses = []
    for _ in range(steps):
        train, state, loss = step(train, state)
        losses.append(float(loss))
    return {**variables, **train}, losses


def test_train_mlp_with_adam_under_jit():
    model, x = MLP(), _x(32, 8)
    y = jnp.cos(x[:, :3] * 2.0)
    qm = quantize_linen(model, [("head", QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4))),
                                ("fc1", QuantConfig(act=ActSpec()))])
    params = jax.jit(qm.init)(jax.random.key(4), x)
    trained, losses = _train(qm.apply, params, x, y)
    assert losses[-1] < 0.5 * losses[0]
    # the trained model runs quantized: weight int4 head, int8 x int8 fc1
    q = jax.jit(qm.quantize_params)(trained, x)
    y_qat, y_inf = jax.jit(qm.apply)(trained, x), jax.jit(qm.apply)(q, x)
    np.testing.assert_allclose(np.asarray(y_inf), np.asarray(y_qat), atol=1e-5)




def test_learned_scale_moves_and_becomes_the_qtensor_scale():
    model, x = MLP(), _x(32, 8)
    y = jnp.cos(x[:, :3] * 2.0)
    spec = jq.QuantSpec(dtype=jnp.int4)
    qm = quantize_linen(model, QuantConfig(weight=spec, learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(6), x)
    s0 = v["quant"]["fc1"]["kernel_scale"]
    np.testing.assert_array_equal(np.asarray(s0),
                                  np.asarray(spec(v["params"]["fc1"]["kernel"]).scale))
    trained, losses = _train(qm.apply, v, x, y, trainable=("params", "quant"))
    assert losses[-1] < 0.5 * losses[0]
    s1 = trained["quant"]["fc1"]["kernel_scale"]
    assert np.abs(np.asarray(s1) - np.asarray(s0)).max() > 1e-4
    q = jax.jit(qm.quantize_params)(trained, x)
    assert "quant" not in q
    # a scale that training took below zero is used, and stored, as float32's eps (as torch)
    np.testing.assert_array_equal(np.asarray(q["params"]["fc1"]["kernel"].scale),
                                  np.maximum(np.asarray(s1), np.finfo(np.float32).eps))
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, x)),
                               np.asarray(jax.jit(qm.apply)(trained, x)), atol=1e-5)


def test_learned_zero_point_moves_and_becomes_the_qtensor_zero_point():
    # LSQ+: an asymmetric spec learns a float zero point beside the scale
    model, x = MLP(), _x(32, 8)
    y = jnp.cos(x[:, :3] * 2.0)
    spec = jq.QuantSpec(dtype=jnp.int4, symmetric=False)
    qm = quantize_linen(model, QuantConfig(weight=spec, learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(6), x)
    init = spec(v["params"]["fc1"]["kernel"])
    np.testing.assert_array_equal(np.asarray(v["quant"]["fc1"]["kernel_scale"]),
                                  np.asarray(init.scale))
    z0 = v["quant"]["fc1"]["kernel_zero_point"]
    assert z0.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(z0), np.asarray(init.zero_point, np.float32))
    trained, losses = _train(qm.apply, v, x, y, steps=60, trainable=("params", "quant"))
    assert losses[-1] < 0.5 * losses[0]
    z1 = np.asarray(trained["quant"]["fc1"]["kernel_zero_point"])
    assert np.abs(z1 - np.asarray(z0)).max() > 0.05  # clipped weights pulled it
    q = jax.jit(qm.quantize_params)(trained, x)
    kernel = q["params"]["fc1"]["kernel"]
    assert kernel.zero_point.dtype == jnp.int4
    np.testing.assert_array_equal(np.asarray(kernel.zero_point, np.float32),
                                  np.clip(np.round(z1), -8, 7))
    np.testing.assert_array_equal(np.asarray(kernel.scale),
                                  np.maximum(np.asarray(trained["quant"]["fc1"]["kernel_scale"]),
                                             np.finfo(np.float32).eps))
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, x)),
                               np.asarray(jax.jit(qm.apply)(trained, x)), atol=1e-5)


def test_learned_zero_point_gradients_match_torch_lsq_plus():
    # a Dense layer's learned scale and zero point against
    # torch._fake_quantize_learnable_per_channel_affine (uint8: PyTorch's backward
    # truncates the zero point, which agrees with rounding for non-negative ones only)
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    x = rng.normal(size=(6, 24)).astype(np.float32)
    g = rng.normal(size=(6, 10)).astype(np.float32)
    spec = jq.QuantSpec(dtype=jnp.uint8, symmetric=False)
    qm = quantize_linen(nn.Dense(10), QuantConfig(weight=spec, learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(0), jnp.asarray(x))
    scale = v["quant"]["kernel_scale"] * 0.4  # a narrower range: weights clip at both ends
    zp = v["quant"]["kernel_zero_point"] + jnp.asarray(rng.uniform(-0.3, 0.3, 10), jnp.float32)
    v = {"params": v["params"], "quant": {"kernel_scale": scale, "kernel_zero_point": zp}}

    @jax.jit
    def forward_and_vjp(v, x, g):
        y, vjp = jax.vjp(lambda v: qm.apply(v, x), v)
        return y, vjp(g)[0]

    y, grads = forward_and_vjp(v, jnp.asarray(x), jnp.asarray(g))

    kt = torch.tensor(np.asarray(v["params"]["kernel"]), requires_grad=True)
    st = torch.tensor(np.asarray(scale), requires_grad=True)
    zt = torch.tensor(np.asarray(zp), requires_grad=True)
    fq = torch._fake_quantize_learnable_per_channel_affine(kt, st, zt, 1, 0, 255, 1.0)
    yt = torch.from_numpy(x) @ fq + torch.tensor(np.asarray(v["params"]["bias"]))
    yt.backward(torch.from_numpy(g))
    np.testing.assert_allclose(np.asarray(y), yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["params"]["kernel"]), kt.grad.numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["quant"]["kernel_scale"]), st.grad.numpy(),
                               rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(grads["quant"]["kernel_zero_point"]),
                               zt.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(zt.grad.numpy()) > 0)  # every channel clips: LSQ+ moves them all


class TiedScanned(nn.Module):
    """Embed lookup and attend (one table), around two nn.scan'd Dense blocks."""

    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(11, 8)
        blocks = nn.scan(Block, variable_axes={"params": 0, "quant": 0},
                         split_rngs={"params": True}, length=2)
        return emb.attend(blocks()(emb(tokens), None)[0])


def test_learned_zero_points_shared_by_lookup_and_attend_and_stacked_by_scan():
    tokens = jnp.arange(7) % 11
    spec = jq.QuantSpec(dtype=jnp.int8, axis=0, symmetric=False)  # per row, as the table's
    qm = quantize_linen(TiedScanned(), QuantConfig(weight=spec, learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(0), tokens)
    quant = v["quant"]
    assert jax.tree.map(jnp.shape, quant) == {
        "Embed_0": {"embedding_scale": (11,), "embedding_zero_point": (11,)},
        "ScanBlock_0": {"Dense_0": {"kernel_scale": (2, 8), "kernel_zero_point": (2, 8)}}}
    moved = {**v, "quant": jax.tree.map(lambda a: a + 0.3 if a.ndim == 2 else a * 1.1, quant)}
    q = jax.jit(qm.quantize_params)(moved, tokens)
    kernel = q["params"]["ScanBlock_0"]["Dense_0"]["kernel"]
    zp = np.asarray(quant["ScanBlock_0"]["Dense_0"]["kernel_zero_point"]) + 0.3
    np.testing.assert_array_equal(np.asarray(kernel.zero_point, np.float32),
                                  np.clip(np.round(zp), -128, 127))
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, tokens)),
                               np.asarray(jax.jit(qm.apply)(moved, tokens)), atol=1e-5)


def test_int8_dot_training_matches_fake_quant_and_runs_int8_dots():
    pytest.importorskip("jaxquant._qat_dot")
    model, x = MLP(), _x(16, 8)
    params = jax.jit(model.init)(jax.random.key(7), x)
    fast = quantize_linen(model, QuantConfig(act=ActSpec(), int8_dot=True))
    fake = quantize_linen(model, QuantConfig(act=ActSpec()))
    loss = lambda qm: jax.jit(jax.value_and_grad(lambda p: jnp.sum(qm.apply(p, x) ** 2)))
    (l1, g1), (l2, g2) = loss(fast)(params), loss(fake)(params)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g1, g2)
    dots = list(find_eqns(jax.make_jaxpr(fast.apply)(params, x).jaxpr))
    assert len(dots) == 2
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.int8, jnp.int8]
        assert eqn.outvars[0].aval.dtype == jnp.int32


# ----------------------------------------------------------------------------- inference


@jax.jit  # one program, not op-by-op dispatch
def _dequantized(q):
    """The reference params: every QTensor dequantized (scanned ones layer by layer)."""
    def deq(path, leaf):
        if not jq.is_qtensor(leaf):
            return leaf
        return jax.vmap(jq.dequantize)(leaf) if "ScanBlock" in jax.tree_util.keystr(path) \
            else jq.dequantize(leaf)
    return jax.tree_util.tree_map_with_path(deq, q, is_leaf=jq.is_qtensor)


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, packed=True),
                                  jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=4, packed=True),
                                  jq.QuantSpec(dtype="nf4", axis=0, block_size=4, packed=True),
                                  jq.QuantSpec(dtype="nvfp4", axis=0, packed=True)],
                         ids=["int8", "int4-packed", "int4-block4-packed", "nf4-packed",
                              "nvfp4-packed"])
def test_weight_only_inference_equals_float_on_dequantized_params(zoo, spec):
    model, params = zoo
    qm = quantize_linen(model, QuantConfig(weight=spec))
    q = jax.jit(qm.quantize_params)(params, TOKENS)
    assert sum(map(jq.is_qtensor, jax.tree.leaves(q, is_leaf=jq.is_qtensor))) == len(ZOO_LAYERS)
    y = jax.jit(qm.apply)(q, TOKENS)
    ref = jax.jit(model.apply)(_dequantized(q), TOKENS)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # the jitted program takes the codes: no float kernel comes in, every dot is inside it
    jaxpr = jax.make_jaxpr(jax.jit(qm.apply))(q, TOKENS)
    in_avals = [v.aval for v in jaxpr.jaxpr.invars]
    assert any(a.dtype == jq.get_format(jq.SCHEMES[spec.dtype].element
                                        if isinstance(spec.dtype, str) else spec.dtype).dtype
               or a.dtype == jnp.uint8 for a in in_avals)
    assert not any(a.dtype == jnp.float32 and a.shape in {(8, 8), (3, 8, 8), (2, 8, 8)}
                   for a in in_avals)


def test_w8a8_inference_close_to_float_and_dots_are_int8(zoo, zoo_float):
    model, params = zoo
    qm = quantize_linen(model, [("Embed", QuantConfig()), ("", QuantConfig(act=ActSpec()))])
    q = jax.jit(qm.quantize_params)(params, TOKENS)
    y, ref = np.asarray(jax.jit(qm.apply)(q, TOKENS)), zoo_float
    assert np.abs(y - ref).max() < 0.03 * np.abs(ref).max()
    # the same values as QAT with per-token activations (per tensor in the Conv)
    y_qat = np.asarray(jax.jit(qm.apply)(params, TOKENS))
    np.testing.assert_allclose(y, y_qat, rtol=1e-4, atol=1e-4 * np.abs(y_qat).max())
    jaxpr = jax.make_jaxpr(qm.apply)(q, TOKENS).jaxpr
    dots = list(find_eqns(jaxpr))
    int_dots = [e for e in dots if [v.aval.dtype for v in e.invars] == [jnp.int8, jnp.int8]]
    # remat Dense, 2 DenseGeneral, Einsum, scanned Dense: int8 x int8 -> int32; only the
    # weight-only Embed.attend (dequantized inside the jit, in lax.cond branches) is float
    assert len(int_dots) == 5
    assert all(e.invars[1].aval.shape == (11, 8) for e in dots if e not in int_dots)
    assert all(e.outvars[0].aval.dtype == jnp.int32 for e in int_dots)
    conv = integer_convolution(jaxpr)
    assert conv.outvars[0].aval.dtype == jnp.int32


def test_static_activation_scale_inference_equals_qat():
    model, x = MLP(), _x(4, 8)
    params = jax.jit(model.init)(jax.random.key(8), x)
    qm = quantize_linen(model, QuantConfig(act=ActSpec(scale=0.01)))
    q = jax.jit(qm.quantize_params)(params, x)
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, x)),
                               np.asarray(jax.jit(qm.apply)(params, x)), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- errors


def test_int4_activations_cannot_run_int8_inference():
    model, x = MLP(), _x(4, 8)
    qm = quantize_linen(model, QuantConfig(act=ActSpec(dtype=jnp.int4)))
    q = jax.jit(qm.quantize_params)(jax.jit(model.init)(jax.random.key(0), x), x)
    with pytest.raises(ValueError, match=r"needs ActSpec\(dtype=jnp.int8\), got dtype=int4"):
        jax.eval_shape(qm.apply, q, x)  # raised while tracing: nothing to compile


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(weight="int8"), TypeError, "QuantConfig.weight must be a jaxquant.QuantSpec or None, got str"),
    (dict(act=jq.ActQuant()), TypeError, "QuantConfig.act must be an ActSpec or None, got ActQuant"),
    (dict(int8_dot=1), TypeError, "QuantConfig.int8_dot must be a bool, got 1"),
    (dict(learn_scale=True, weight=None), ValueError, "learn_scale=True needs a weight spec, got weight=None"),
    (dict(int8_dot=True, weight=jq.QuantSpec(dtype=jnp.int4)), ValueError,
     r"int8_dot=True needs weight=QuantSpec\(dtype=jnp.int8"),
    (dict(int8_dot=True, act=ActSpec(scale=0.1)), ValueError,
     "int8_dot=True needs act=None or a dynamic int8 ActSpec"),
    (dict(int8_dot=True, learn_scale=True), ValueError, "cannot be combined with learn_scale"),
    (dict(int8_dot=True, weight=jq.QuantSpec(scale_dtype=jnp.bfloat16)), ValueError,
     "int8_dot=True .* needs a weight spec with scale_dtype=None"),
    (dict(int8_dot=True, weight=jq.QuantSpec(block_size=4, double_quant=True)), ValueError,
     "double_quant=False"),
    (dict(int8_dot=True, weight=jq.QuantSpec(block_size=(2, 2))), ValueError,
     "an int or None block_size, got weight=.*block_size=\\(2, 2\\)"),
])
def test_bad_config(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        QuantConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(granularity="row"), "ActSpec.granularity must be 'token' or 'tensor', got 'row'"),
    (dict(scale=0.0), "ActSpec.scale must be None or a positive finite float, got 0.0"),
    (dict(scale=float("inf")), "ActSpec.scale must be None or a positive finite float, got inf"),
])
def test_bad_act_spec(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActSpec(**kwargs)


@pytest.mark.parametrize("model,x,key,shape", [
    (nn.Dense(5, use_bias=False), _x(4, 6), "kernel", (6, 4)),
    (nn.Dense(5, use_bias=False), _x(4, 6), "kernel", (6, 5, 1)),
    (nn.Einsum((6, 5), "bd,dk->bk", use_bias=False), _x(4, 6), "kernel", (6, 4)),
    (nn.DenseGeneral((2, 3)), _x(4, 6), "kernel", (6, 3, 2)),
    (nn.Conv(5, (3,)), _x(1, 4, 6), "kernel", (3, 7, 5)),
    (nn.Embed(8, 6), TOKENS % 8, "embedding", (8, 5)),
    (nn.Embed(8, 6), TOKENS % 8, "embedding", (3, 6)),
], ids=["dense-out", "dense-3d", "einsum", "dense-general", "conv", "embed-feat", "embed-rows"])
def test_qtensor_kernel_of_the_wrong_shape_raises(model, x, key, shape):
    # regression: a QTensor kernel was used whatever its shape (float flax raises)
    # shapes only (jax.eval_shape): the check is made while tracing, nothing is compiled
    qm = quantize_linen(model, QuantConfig())
    params = jax.eval_shape(qm.init, jax.random.key(0), x)
    params["params"][key] = jax.eval_shape(lambda: jq.quantize(jnp.ones(shape), axis=-1))
    with pytest.raises(ValueError, match=rf"QTensor {key} has shape \({shape[0]}, .*expects"):
        jax.eval_shape(qm.apply, params, x)


def test_quantize_params_takes_frozen_dicts():
    flax = pytest.importorskip("flax")
    qm = quantize_linen(MLP(), QuantConfig())
    x = _x(2, 6)
    params = flax.core.freeze(jax.jit(qm.init)(jax.random.key(0), x))
    q = qm.quantize_params(params, x)
    assert isinstance(q, flax.core.FrozenDict)
    assert jq.is_qtensor(q["params"]["fc1"]["kernel"])
    apply = jax.jit(qm.apply)
    np.testing.assert_allclose(apply(q, x), apply(params, x), atol=1e-6)


class _Attend(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, t):
        e = nn.Embed(11, 6, dtype=self.dtype)
        return e.attend(e(t).astype(jnp.float32))


@pytest.mark.parametrize("cfg", [QuantConfig(), QuantConfig(act=ActSpec())], ids=["w", "w+act"])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_embed_attend_inference_matches_qat(cfg, dtype):
    # regressions: inference ignored Embed.dtype, and left the query float with an act rule
    model = _Attend(dtype)
    qm = quantize_linen(model, cfg)
    params = jax.jit(qm.init)(jax.random.key(0), TOKENS)
    yt = jax.jit(qm.apply)(params, TOKENS)
    yq = jax.jit(qm.apply)(jax.jit(qm.quantize_params)(params, TOKENS), TOKENS)
    assert yq.dtype == yt.dtype == jax.eval_shape(model.apply, params, TOKENS).dtype
    np.testing.assert_allclose(np.asarray(yq, np.float32), np.asarray(yt, np.float32),
                               atol=1e-5 if dtype is None else 2e-2)


class _Tied(nn.Module):
    @nn.compact
    def __call__(self, t):
        e = nn.Embed(11, 6)
        return e(t) @ e.embedding.T


@pytest.mark.parametrize("rules", [QuantConfig(), [("Embed", None)]], ids=["rule", "no-rule"])
def test_reading_the_embedding_table_directly(rules):
    # regression: `embed.embedding` was missing on a QTensor table (AttributeError)
    qm = quantize_linen(_Tied(), rules)
    params = jax.jit(qm.init)(jax.random.key(0), TOKENS)
    spec = jq.QuantSpec()
    q = jax.jit(lambda p: jq.quantize_tree(p, [("embedding", spec)]))(params)

    @jax.jit
    def want_fn(q):
        table = q["params"]["Embed_0"]["embedding"].dequantize()
        return jnp.take(table, TOKENS, axis=0) @ table.T

    want = want_fn(q)
    apply = jax.jit(qm.apply)
    np.testing.assert_allclose(apply(q, TOKENS), want, atol=1e-5)
    if isinstance(rules, QuantConfig):  # QAT reads the fake-quantized table
        np.testing.assert_allclose(apply(params, TOKENS), want, atol=1e-5)


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(6)(x), None


class _ScanOnAxis(nn.Module):
    axis: int

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(_ScanBlock, variable_axes={"params": self.axis},
                         split_rngs={"params": True}, length=3)
        return blocks()(x, None)[0]


@pytest.mark.parametrize("axis", [0, 1])
def test_layers_stacked_on_another_axis_are_quantized_layer_by_layer(axis, tmp_path):
    model = _ScanOnAxis(axis)
    x = jax.random.normal(jax.random.key(0), (2, 6))
    qm = quantize_linen(model, QuantConfig(weight=jq.QuantSpec(axis=-1)))
    params = jax.jit(qm.init)(jax.random.key(1), x)
    (name,) = params["params"]
    kernel = np.asarray(params["params"][name]["Dense_0"]["kernel"])
    assert kernel.shape == ((3, 6, 6) if axis == 0 else (6, 3, 6))
    layers = np.moveaxis(kernel, axis, 0)
    q = jax.jit(qm.quantize_params)(params, x)
    qt = q["params"][name]["Dense_0"]["kernel"]
    per_layer = jax.jit(lambda qt: [jax.tree.map(lambda a, i=i: jnp.take(a, i, axis=axis),
                                                 qt).dequantize() for i in range(len(layers))])
    for w, g in zip(layers, per_layer(qt), strict=True):  # per output channel, by NumPy
        g = np.asarray(g)
        s = np.abs(w).max(axis=0) / np.float32(127)
        np.testing.assert_allclose(g, np.clip(np.rint(w / s), -127, 127) * s, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, x)),
                               np.asarray(jax.jit(qm.apply)(params, x)), rtol=1e-5, atol=1e-6)
    if axis:  # no tree or file form: refused by name, not misread
        for tree_tool in (jq.dequantize_tree, lambda q: jq.save_safetensors(tmp_path / "q", q)):
            with pytest.raises(ValueError, match="stacked on a later axis.*no tree or file form"):
                tree_tool(q)
    else:
        np.testing.assert_array_equal(jq.dequantize_tree(q)["params"][name]["Dense_0"]["kernel"],
                                      np.stack([np.asarray(g) for g in per_layer(qt)]))


class _ScanQuantOn(nn.Module):
    params_axis: int
    quant_axis: int

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(_ScanBlock, split_rngs={"params": True}, length=3,
                         variable_axes={"params": self.params_axis, "quant": self.quant_axis})
        return blocks()(x, None)[0]


@pytest.mark.parametrize("params_axis,quant_axis", [(1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_learned_scales_stacked_on_their_own_axis_convert(params_axis, quant_axis, symmetric):
    # before: the learned scale was vmapped along the params' stacking axis, and the
    # failure was reported as "a per-tensor scale" for a per-channel spec
    x = jax.random.normal(jax.random.key(0), (2, 6))
    spec = jq.QuantSpec(axis=-1) if symmetric else jq.QuantSpec(dtype=jnp.uint8, axis=-1,
                                                                 symmetric=False)
    qm = quantize_linen(_ScanQuantOn(params_axis, quant_axis),
                        QuantConfig(weight=spec, learn_scale=True))
    v = jax.jit(qm.init)(jax.random.key(1), x)
    (name,) = v["params"]
    v["quant"][name]["Dense_0"]["kernel_scale"] *= 1.5  # as trained: not what absmax gives
    q = jax.jit(qm.quantize_params)(v, x)
    qt = q["params"][name]["Dense_0"]["kernel"]
    scales = np.moveaxis(np.asarray(v["quant"][name]["Dense_0"]["kernel_scale"]), quant_axis, 0)
    for i, s in enumerate(scales):  # layer i keeps its own learned scale
        layer = jax.tree.map(lambda a, i=i: jnp.take(a, i, axis=params_axis), qt)
        np.testing.assert_array_equal(np.asarray(layer.scale).reshape(-1), s.reshape(-1))
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(q, x)),
                               np.asarray(jax.jit(qm.apply)(v, x)), rtol=1e-5, atol=1e-6)


def test_per_tensor_scales_stacked_on_a_later_axis_are_refused():
    model = _ScanOnAxis(1)
    x = jnp.ones((2, 6))
    qm = quantize_linen(model, QuantConfig(weight=jq.QuantSpec(axis=None)))
    params = jax.jit(qm.init)(jax.random.key(1), x)
    with pytest.raises(ValueError, match=r"stacked along axis 1 .*per-tensor scale"):
        jax.jit(qm.quantize_params)(params, x)  # raised while tracing


def test_a_spec_that_does_not_fit_a_layer_names_the_layer():
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="head")(nn.Dense(4, name="body")(x))

    x = jnp.ones((2, 5))
    rules = [("head", QuantConfig(weight=jq.QuantSpec(axis=2))), ("", QuantConfig())]
    with pytest.raises(ValueError, match=r"layer 'head' \(Dense\): axis must be in \[-2, 2\)"):
        jax.eval_shape(quantize_linen(Two(), rules).init, jax.random.key(0), x)  # training
    params = jax.jit(quantize_linen(Two(), QuantConfig()).init)(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"layer 'head'.*axis must be in \[-2, 2\)"):
        jax.jit(quantize_linen(Two(), rules).quantize_params)(params, x)  # conversion


class _DenseRelu(nn.Dense):
    """A covered layer's subclass with a __call__ of its own."""

    def __call__(self, x):
        return nn.relu(super().__call__(x)) * 3.0


@pytest.mark.parametrize("cfg", [QuantConfig(),
                                 QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0,
                                                                 block_size=2, packed=True)),
                                 QuantConfig(act=ActSpec())], ids=["int8", "int4p", "w8a8"])
def test_a_dense_subclass_runs_its_own_call_when_quantized(cfg):
    x = jax.random.normal(jax.random.key(0), (3, 6))
    model = _DenseRelu(4)
    qm = quantize_linen(model, cfg)
    params = model.init(jax.random.key(1), x)
    q = qm.quantize_params(params, x)
    y = qm.apply(q, x)
    assert np.all(np.asarray(y) >= 0)  # the relu ran
    if cfg.act is None:  # weight-only: the float model on the dequantized kernel
        np.testing.assert_allclose(y, model.apply(_dequantized(q), x), rtol=1e-6, atol=1e-6)
    else:  # int8 x int8: as in training (fake-quantized input and kernel)
        np.testing.assert_allclose(y, qm.apply(params, x), rtol=1e-5, atol=1e-5)


def test_a_subclass_overriding_what_jaxquant_computes_is_refused():
    """Embed (training and inference) and DenseGeneral / Einsum (inference) are computed by
    jaxquant itself on a quantized kernel: an override of theirs would be skipped silently."""
    class MyEmbed(nn.Embed):
        def __call__(self, t):
            return super().__call__(t) * 10.0

    class MyGeneral(nn.DenseGeneral):
        def __call__(self, x):
            return super().__call__(x) + 1.0

    t, x = jnp.array([1, 2]), jnp.ones((2, 6))
    embed = quantize_linen(MyEmbed(5, 4), QuantConfig())
    params = MyEmbed(5, 4).init(jax.random.key(0), t)
    match = "MyEmbed overrides Embed.__call__, which jaxquant computes itself"
    with pytest.raises(ValueError, match=match):
        embed.apply(params, t)
    with pytest.raises(ValueError, match=match):
        embed.quantize_params(params, t)
    general = quantize_linen(MyGeneral(3), QuantConfig())
    params = MyGeneral(3).init(jax.random.key(0), x)
    np.testing.assert_allclose(general.apply(params, x), MyGeneral(3).apply(
        {"params": {**params["params"], "kernel": jq.fake_quant(params["params"]["kernel"],
                                                                axis=1)}}, x), rtol=1e-6)
    with pytest.raises(ValueError, match="MyGeneral overrides DenseGeneral.__call__"):
        general.apply(general.quantize_params(params, x), x)


def test_quantize_params_names_variables_that_are_not_the_models():
    """None said "argument of type 'NoneType' is not iterable"."""
    x = jnp.ones((2, 8))
    model = nn.Dense(3)
    variables = model.init(jax.random.key(0), x)
    qm = quantize_linen(model, QuantConfig())
    with pytest.raises(TypeError, match=r"^variables must be the model's variables, a dict with "
                                        r"'params' \(what init returns\), got NoneType None\.$"):
        qm.quantize_params(None, x)
    with pytest.raises(TypeError, match=r"got keys \['bias', 'kernel'\]\.$"):
        qm.quantize_params(variables["params"], x)
