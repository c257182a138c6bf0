"""End-to-end nnx flows: learned-scale QAT under nnx.Optimizer against a hand-written
jq.fake_quant training loop, nnx.split / merge / clone / pickle round trips, tied kernels
through QAT, conversion and checkpoints, converting twice, and misuse errors."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
pytest.importorskip("safetensors")

from nnx_training import SharedKernel  # noqa: E402

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

X = jnp.sin(jnp.arange(64, dtype=jnp.float32) * 0.37).reshape(8, 8)
Y = jnp.cos(X[:, :3] * 2.0)
INT4 = jq.QuantSpec(dtype=jnp.int4)
RULES = [("fc1", QuantConfig(weight=INT4, learn_scale=True)),
         ("mid|alias", QuantConfig(learn_scale=True)),
         ("head", None)]
run = nnx.jit(lambda model, x: model(x))


class MLP(nnx.Module):
    """fc1, a layer reachable at two paths (``mid``, ``alias``) called twice, a head."""

    def __init__(self, rngs):
        self.fc1 = nnx.Linear(8, 16, rngs=rngs)
        self.mid = nnx.Linear(16, 16, rngs=rngs)
        self.alias = self.mid
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.fc1(x))
        x = nnx.relu(self.alias(nnx.relu(self.mid(x))))
        return self.head(x)


def _params(model):
    """The trainable arrays of MLP under RULES, as the reference loop holds them."""
    def layer(m, learned=True):
        out = {"kernel": m.kernel[...], "bias": m.bias[...]}
        return out | ({"scale": m.promote_dtype.scale[...]} if learned else {})

    return {"fc1": layer(model.fc1), "mid": layer(model.mid),
            "head": layer(model.head, learned=False)}


def _reference_apply(p, x):
    """MLP written out with jq.fake_quant on the kernels and their learned scales."""
    def dense(q, x, dtype):
        return x @ jq.fake_quant(q["kernel"], q["scale"], dtype=dtype, axis=-1) + q["bias"][None]

    x = jax.nn.relu(dense(p["fc1"], x, jnp.int4))
    x = jax.nn.relu(dense(p["mid"], jax.nn.relu(dense(p["mid"], x, jnp.int8)), jnp.int8))
    return x @ p["head"]["kernel"] + p["head"]["bias"][None]


def test_lsq_training_equals_a_hand_written_fake_quant_loop():
    # nnx_qat + nnx.Optimizer(wrt=nnx.Param) under nnx.jit, and the same model through
    # nnx.split / merge under jax.jit with optax, against a loop on plain arrays that calls
    # jq.fake_quant explicitly: the same ops in the same order, so the parameters, learned
    # scales and adam moments agree to float32 rounding (bit for bit on CPU). The learning
    # rate keeps the scales positive: the layers clamp a learned scale at float32's eps
    # (as PyTorch's learnable fake quantization does), the reference does not.
    tx, steps = optax.adam(1e-4), 5
    model = nnx_qat(MLP(nnx.Rngs(0)), RULES)
    twin = nnx.clone(model)
    with jax.numpy_dtype_promotion("standard"):
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss = lambda y: jnp.mean((y - Y) ** 2)  # noqa: E731

    @nnx.jit
    def step(model, opt):
        grads = nnx.grad(lambda m: loss(m(X)))(model)
        with jax.numpy_dtype_promotion("standard"):
            opt.update(model, grads)

    graphdef, params, rest = nnx.split(twin, nnx.Param, ...)

    @jax.jit
    def split_step(params, state):
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest)(X)))(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def ref_step(p, state):
        grads = jax.grad(lambda p: loss(_reference_apply(p, X)))(p)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    p = _params(model)
    with jax.numpy_dtype_promotion("standard"):
        ref_state, split_state = tx.init(p), tx.init(params)
    for _ in range(steps):
        step(model, opt)
        params, split_state = split_step(params, split_state)
        p, ref_state = ref_step(p, ref_state)
    assert all(float(p[k]["scale"].min()) > 1e-6 for k in ("fc1", "mid"))
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)  # noqa: E731
    jax.tree.map(close, _params(model), p)
    nnx.update(twin, params)
    jax.tree.map(close, _params(twin), p)
    mu = opt.opt_state[0].mu
    close(mu["fc1"]["promote_dtype"]["scale"][...], ref_state[0].mu["fc1"]["scale"])
    close(mu["alias"]["kernel"][...], ref_state[0].mu["mid"]["kernel"])  # first path: alias
    assert float(jnp.abs(mu["fc1"]["promote_dtype"]["scale"][...]).max()) > 0  # scales learn

    # a wrt filter without the scales: they stay, the kernels move
    frozen = nnx_qat(MLP(nnx.Rngs(0)), RULES)
    before = _params(frozen)
    kernels = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("promote_dtype")))
    with jax.numpy_dtype_promotion("standard"):
        opt = nnx.Optimizer(frozen, tx, wrt=kernels)

    @nnx.jit
    def kernel_step(model, opt):
        grads = nnx.grad(lambda m: loss(m(X)), argnums=nnx.DiffState(0, kernels))(model)
        with jax.numpy_dtype_promotion("standard"):
            opt.update(model, grads)

    kernel_step(frozen, opt)
    after = _params(frozen)
    np.testing.assert_array_equal(after["fc1"]["scale"], before["fc1"]["scale"])
    assert not np.array_equal(after["fc1"]["kernel"], before["fc1"]["kernel"])


class Block(nnx.Module):
    """Conv, BatchNorm, Dropout and LinearGeneral in one model."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.lg = nnx.LinearGeneral((4,), (2, 3), axis=-1, rngs=rngs)

    def __call__(self, x):
        return self.lg(self.drop(nnx.relu(self.bn(self.conv(x)))))


def test_train_eval_convert_and_run_split_without_retracing():
    # BatchNorm and Dropout in train mode for two steps, then eval mode; the converted
    # model equals the QAT model in eval mode, under nnx.jit and under jax.jit on the
    # split state, traced once per input shape; graphdefs pickle, and a second
    # conversion with the same rules changes nothing
    rules = [("conv", QuantConfig(act=ActSpec(granularity="tensor"), learn_scale=True)),
             ("lg", QuantConfig(weight=INT4, act=ActSpec()))]
    x = jnp.sin(jnp.arange(2 * 6 * 6 * 3, dtype=jnp.float32)).reshape(2, 6, 6, 3)
    model = nnx_qat(Block(nnx.Rngs(0, dropout=1)), rules)
    with jax.numpy_dtype_promotion("standard"):
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        with jax.numpy_dtype_promotion("standard"):
            opt.update(model, grads)

    for _ in range(2):
        step(model, opt)
    model.eval()
    y_qat = run(model, x)
    graphdef = nnx.graphdef(model)
    assert pickle.loads(pickle.dumps(graphdef)) == graphdef
    nnx_quantize(model, rules)
    traces = []

    @nnx.jit
    def infer(model, x):
        traces.append(x.shape)
        return model(x)

    y = infer(model, x)
    np.testing.assert_allclose(y, y_qat, rtol=1e-5, atol=1e-5)
    for xx in (x[:1], x, x[:1]):
        infer(model, xx)
    assert len(traces) == 2
    graphdef, state = nnx.split(model)
    assert pickle.loads(pickle.dumps(graphdef)) == graphdef
    split_traces = []

    @jax.jit
    def infer_split(state, x):
        split_traces.append(x.shape)
        return nnx.merge(graphdef, state)(x)

    for xx in (x, x[:1], x):
        infer_split(state, xx)
    assert len(split_traces) == 2
    np.testing.assert_array_equal(infer_split(state, x), y)
    np.testing.assert_array_equal(infer(nnx.clone(model), x), y)
    nnx_quantize(model, rules)
    np.testing.assert_array_equal(infer(model, x), y)
    assert len(traces) == 2  # a clone, a second conversion: the same graphdef


def test_tied_kernel_stays_one_variable_after_quantize(tmp_path):
    # regression: nnx_quantize gave each of two layers sharing a kernel Variable its own
    # QuantizedParam: the tie was lost (two copies in nnx.state and in every checkpoint)
    model, x = SharedKernel(), X
    nnx_quantize(model, QuantConfig())
    assert model.a.kernel is model.b.kernel
    state = nnx.state(model)
    assert "kernel" not in state["b"]  # the Variable is listed once, at its first path
    y = run(model, x)
    jq.save_safetensors(tmp_path / "t.safetensors", state)
    abstract = nnx.eval_shape(lambda: nnx_quantize(SharedKernel(), QuantConfig()))
    graphdef, target = nnx.split(abstract)
    back = nnx.merge(graphdef, jq.load_safetensors(tmp_path / "t.safetensors", target))
    assert back.a.kernel is back.b.kernel
    np.testing.assert_array_equal(run(back, x), y)


def test_tied_kernel_learns_one_scale_and_converts_to_the_qat_model():
    # regression: each layer sharing a kernel Variable learned its own scale; conversion
    # quantized the one kernel with the first layer's, so the second layer ran other codes
    # than in training (max |inference - QAT| ~1e-2)
    cfg = QuantConfig(weight=jq.QuantSpec(dtype=jnp.uint4, symmetric=False), learn_scale=True)
    model = nnx_qat(SharedKernel(), cfg)
    assert model.a.promote_dtype.scale is model.b.promote_dtype.scale
    assert model.a.promote_dtype.zero_point is model.b.promote_dtype.zero_point
    with jax.numpy_dtype_promotion("standard"):
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        grads = nnx.grad(lambda m: jnp.mean((m(X) - X) ** 2))(model)
        with jax.numpy_dtype_promotion("standard"):
            opt.update(model, grads)

    for _ in range(3):
        step(model, opt)
    y_qat = run(model, X)
    nnx_quantize(model, cfg)
    np.testing.assert_allclose(run(model, X), y_qat, rtol=1e-5, atol=1e-6)


def test_converting_with_another_spec_than_the_learned_scales_raises():
    # regression: int8 scales learned in QAT were used as they are for an int4 rule (codes
    # clipped at 7: every kernel value shrunk to 7/127 of its range), or along another axis
    model = nnx_qat(SharedKernel(), QuantConfig(learn_scale=True))
    nnx_quantize(nnx_qat(SharedKernel(), QuantConfig(learn_scale=True)),
                 QuantConfig(weight=jq.QuantSpec(axis=1)))  # axis 1 is axis -1 here
    for weight in (INT4, jq.QuantSpec(axis=0)):
        with pytest.raises(ValueError, match=r"layer 'a' learned its scales in nnx_qat for "
                                             r"weight=QuantSpec\(dtype=dtype\('int8'\), axis=-1"):
            nnx_quantize(model, QuantConfig(weight=weight))
    assert not jq.is_qtensor(model.a.kernel[...])
    packed = jq.QuantSpec(dtype=jnp.int4, packed=True)
    model = nnx_qat(SharedKernel(), QuantConfig(weight=INT4, learn_scale=True))
    y_qat = run(model, X)
    nnx_quantize(model, QuantConfig(weight=packed))  # packing is storage only
    assert model.a.kernel[...].packed
    np.testing.assert_allclose(run(model, X), y_qat, rtol=1e-5, atol=1e-6)


def test_converting_twice_with_another_format_raises():
    # regression: a second nnx_quantize with an int4 rule kept the int8 QTensor silently
    model = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
    nnx_quantize(model, QuantConfig())
    with pytest.raises(ValueError, match=r"Linear at 'layers/0' holds a int8 QTensor kernel"
                                         r".*weight dtype int4"):
        nnx_quantize(model, QuantConfig(weight=INT4))
    # regression: the same format with another axis, block or zero points was kept silently
    for weight in (jq.QuantSpec(axis=0), jq.QuantSpec(symmetric=False),
                   jq.QuantSpec(axis=0, block_size=4)):
        with pytest.raises(ValueError, match=r"Linear at 'layers/0' holds QTensor\(int8\[8, 4\], "
                                             r"axis=1, scale\[4\].*rule gives weight=QuantSpec"):
            nnx_quantize(model, QuantConfig(weight=weight))
    y = run(model, X)
    nnx_quantize(model, QuantConfig(weight=jq.QuantSpec(axis=1)))  # axis 1 is axis -1 here
    nnx_quantize(model, QuantConfig(act=ActSpec()))  # same format, now w8a8
    ref = jq.fake_quant(X, dtype=jnp.int8, axis=0) @ model.layers[0].kernel[...].dequantize()
    np.testing.assert_allclose(run(model, X), ref + model.layers[0].bias[...][None], rtol=1e-5,
                               atol=1e-5)
    assert not np.array_equal(run(model, X), y)


def test_never_called_qat_layers_convert_to_their_fake_quantized_kernels():
    model = nnx_qat(MLP(nnx.Rngs(0)), RULES)
    want = jq.fake_quant(model.fc1.kernel[...], model.fc1.promote_dtype.scale[...],
                         dtype=jnp.int4, axis=-1)
    nnx_quantize(model, RULES)
    np.testing.assert_array_equal(model.fc1.kernel[...].dequantize(), want)
    assert not jq.is_qtensor(model.head.kernel[...])


def test_functions_given_no_nnx_module_raise_type_error():
    # regression: nnx_layers / nnx_unused_rules of a linen model answered {} / every rule,
    # nnx_input_grams failed inside linen (CallCompactUnboundModuleError)
    for fn in (nnx_layers, nnx_unused_rules, nnx_qat, nnx_quantize):
        with pytest.raises(TypeError, match=r"model must be a flax.nnx.Module, got Dense; a "
                                            r"linen Module takes quantize_linen"):
            fn(nn.Dense(3), QuantConfig())
        with pytest.raises(TypeError, match=r"got State\.$"):
            fn(nnx.state(MLP(nnx.Rngs(0))), QuantConfig())
    with pytest.raises(TypeError, match="got Dense"):
        nnx_input_grams(nn.Dense(3), QuantConfig(), X)
    # rules that select nothing are not an error: nnx_unused_rules lists them
    model = MLP(nnx.Rngs(0))
    assert nnx_unused_rules(model, [("fc1", None), ("typo", QuantConfig())]) == \
        [("typo", QuantConfig())]


@pytest.mark.parametrize("learn_scale", [False, True])
def test_a_none_rule_at_conversion_runs_a_qat_layer_float(learn_scale):
    # before: the layer kept nnx_qat's fake quantization (0.17 from its float output), where
    # linen's None rule runs it float
    model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, rngs=nnx.Rngs(1)))
    cfg = QuantConfig(weight=INT4, learn_scale=learn_scale)
    nnx_qat(model, cfg)
    first = model.layers[0]
    assert float(jnp.max(jnp.abs(first(X) - (X @ first.kernel[...] + first.bias[...][None])))) > 0
    nnx_quantize(model, [("layers/0", None), ("", cfg)])
    assert not jq.is_qtensor(first.kernel[...]) and jq.is_qtensor(model.layers[1].kernel[...])
    np.testing.assert_array_equal(np.asarray(first(X)),
                                  np.asarray(X @ first.kernel[...] + first.bias[...][None]))
    assert nnx_layers(model, [("layers/0", None), ("", cfg)])["layers/0"] is None
