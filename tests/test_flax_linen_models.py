"""jaxquant.flax on realistic linen models: BatchNorm's mutable collections, integer (uint8)
inputs with activation quantization, surveys of quantized trees, learned scales of a
weight-tied nn.scan, gradients through W8A8 inference, lifted, shared and setup() layers.
References are plain Flax float models on kernels fake-quantized with `jq.fake_quant`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")

import jaxquant as jq  # noqa: E402
from jaxquant.flax import ActSpec, QuantConfig, quantize_linen  # noqa: E402


def _x(*shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32) * 0.37).reshape(shape)


def _fq_kernels(params, stacked=()):
    """Every kernel fake-quantized per output channel (int8), layer by layer under the
    module names in ``stacked`` (nn.vmap / nn.scan)."""
    def fq(path, leaf):
        keys = jax.tree_util.keystr(path)
        if "kernel" not in keys:
            return leaf
        f = lambda k: jq.fake_quant(k, dtype=jnp.int8, axis=-1)
        return jax.vmap(f)(leaf) if any(s in keys for s in stacked) else f(leaf)
    return jax.tree_util.tree_map_with_path(fq, params)


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(6)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(2, name="head")(nn.relu(x))


def test_quantize_params_takes_the_mutable_argument_of_apply():
    # regression: quantize_params / layers / unused_rules passed `mutable=True` to apply
    # besides the caller's own `mutable=[...]` (a keyword argument of module.apply, needed
    # by a training-mode BatchNorm): TypeError "got multiple values for keyword argument"
    model, x = _BNNet(), _x(4, 5)
    qm = quantize_linen(model, [("head", None), ("", QuantConfig())])
    v = jax.jit(model.init)(jax.random.key(0), x)
    kw = dict(train=True, mutable=["batch_stats"])
    assert list(qm.layers(v, x, **kw)) == ["Dense_0", "head"]
    assert qm.unused_rules(v, x, **kw) == []
    q = jax.jit(lambda v, x: qm.quantize_params(v, x, **kw))(v, x)
    assert jq.is_qtensor(q["params"]["Dense_0"]["kernel"])
    assert not jq.is_qtensor(q["params"]["head"]["kernel"])
    ref_params = dict(v, params=dict(v["params"], Dense_0=jax.jit(_fq_kernels)(
        v["params"]["Dense_0"])))
    y_ref, s_ref = jax.jit(lambda v, x: model.apply(v, x, **kw))(ref_params, x)
    y, s = jax.jit(lambda q, x: qm.apply(q, x, **kw))(q, x)
    _close(y, y_ref)
    _close(s["batch_stats"]["BatchNorm_0"]["mean"], s_ref["batch_stats"]["BatchNorm_0"]["mean"])


class _Pixels(nn.Module):
    @nn.compact
    def __call__(self, img):
        x = nn.Conv(4, (3, 3), strides=2, padding="CIRCULAR", name="conv")(img)
        return nn.Dense(3, name="fc")(img.reshape(img.shape[0], -1)) + x.mean((1, 2))[:, :3]


@pytest.mark.parametrize("act", [ActSpec(), ActSpec(scale=2.0)], ids=["dynamic", "static"])
def test_activation_quantization_takes_integer_inputs_as_the_float_layer_does(act):
    # regression: QAT with an ActSpec fake-quantized the input before the layer's own
    # promote_dtype, so uint8 images (which Flax's Conv / Dense cast to float) raised
    # "x must be a floating-point array", while weight-only QAT and inference took them
    with jax.numpy_dtype_promotion("standard"):  # Flax's uint8 + float32 (as users run it)
        _check_integer_inputs(act)


def _check_integer_inputs(act):
    model = _Pixels()
    img = ((jnp.arange(2 * 4 * 4 * 3) * 37) % 256).astype(jnp.uint8).reshape(2, 4, 4, 3)
    x32 = img.astype(jnp.float32)
    qm = quantize_linen(model, QuantConfig(act=act))
    params = jax.jit(model.init)(jax.random.key(0), x32)  # QAT without learned scales: the same
    y = jax.jit(qm.apply)(params, img)

    def fq_in(path, x):  # what the layer's input is fake-quantized to (NumPy-free: jq)
        if act.scale is not None:
            return jq.fake_quant(x, jnp.float32(act.scale), dtype=jnp.int8)
        if path == "conv":  # convolutions: one scale per tensor
            return jq.fake_quant(x, dtype=jnp.int8)
        return jq.fake_quant(x, dtype=jnp.int8, axis=0)  # Dense: per row

    @jax.jit
    def ref(params, x32):  # float layers on fake-quantized kernels and float32 inputs
        p = _fq_kernels(params)["params"]
        conv = nn.Conv(4, (3, 3), strides=2, padding="CIRCULAR").apply(
            {"params": p["conv"]}, fq_in("conv", x32))
        fc = nn.Dense(3).apply({"params": p["fc"]}, fq_in("fc", x32.reshape(2, -1)))
        return fc + conv.mean((1, 2))[:, :3]

    _close(y, ref(params, x32))
    q = jax.jit(qm.quantize_params)(params, x32)
    _close(jax.jit(qm.apply)(q, img), y, tol=1e-4)


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(6, name="body")(x)
        return nn.Embed(5, 6, name="emb").attend(x)


def test_layers_and_unused_rules_see_the_layers_of_a_quantized_tree():
    # regression: the survey recorded only float kernels, so on the tree of quantize_params
    # `layers` was {} and `unused_rules` reported every rule as unused
    model, x = _Stack(), _x(3, 4)
    rules = [("emb", QuantConfig(act=ActSpec())), ("body", QuantConfig()), ("typo", None)]
    qm = quantize_linen(model, rules)
    params = jax.jit(model.init)(jax.random.key(0), x)
    q = jax.jit(qm.quantize_params)(params, x)
    assert jq.is_qtensor(q["params"]["body"]["kernel"])
    assert qm.layers(q, x) == qm.layers(params, x) == {"body": rules[1][1], "emb": rules[0][1]}
    assert qm.unused_rules(q, x) == qm.unused_rules(params, x) == [("typo", None)]
    again = qm.quantize_params(q, x)  # already quantized: kept as it is
    assert again["params"]["body"]["kernel"] is q["params"]["body"]["kernel"]


class _Step(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return c + nn.tanh(nn.Dense(6)(c)), None


class _Shared(nn.Module):
    """One Dense applied three times by nn.scan (params broadcast: a weight-tied loop)."""

    @nn.compact
    def __call__(self, x):
        steps = nn.scan(_Step, variable_broadcast=["params", "quant"],
                        split_rngs={"params": False}, length=3)
        return steps(name="steps")(x, None)[0]


def test_learned_scales_of_a_weight_tied_scan_and_the_error_that_leads_there():
    # regression: the error for missing "quant" variables told users to put "quant" in
    # nn.scan's variable_axes; for broadcast params that gives one scale per step for the
    # one shared kernel, which quantize_params then refused ("scale must ... be 1-D")
    x, cfg = _x(2, 6), QuantConfig(learn_scale=True)
    params = jax.eval_shape(_Shared().init, jax.random.key(0), x)  # float: no "quant"
    with pytest.raises(ValueError, match=r"Dense_0.*'quant'.*variable_broadcast"):
        jax.eval_shape(quantize_linen(_Shared(), cfg).apply, params, x)  # while tracing
    qm = quantize_linen(_Shared(), cfg)
    v = jax.jit(qm.init)(jax.random.key(0), x)
    kernel = np.asarray(v["params"]["steps"]["Dense_0"]["kernel"])
    scale = np.asarray(v["quant"]["steps"]["Dense_0"]["kernel_scale"])
    np.testing.assert_allclose(scale, np.abs(kernel).max(0) / np.float32(127), rtol=1e-6)
    q = jax.jit(qm.quantize_params)(v, x)
    _close(jax.jit(qm.apply)(q, x), jax.jit(qm.apply)(v, x), tol=1e-5)


def test_a_module_class_instead_of_an_instance_is_named():
    # regression: quantize_linen(nn.Dense, ...) said "got type", neither the class nor the fix
    with pytest.raises(TypeError, match=r"module must be a flax.linen.Module instance, got "
                                        r"the class Dense; pass Dense\(\.\.\.\)"):
        quantize_linen(nn.Dense, QuantConfig())


class _Branches(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.concatenate([nn.Conv(3, (2,), name="conv")(x), nn.Dense(3, name="fc")(x),
                                nn.Einsum((4, 3), "btd,dk->btk", name="ein")(x)], -1)


@pytest.mark.parametrize("scale", [None, 0.005], ids=["dynamic", "static"])
def test_w8a8_inference_gradients_pass_straight_through_the_input_quantization(scale):
    # regression: the int8 convolution (and, with a static ActSpec scale, the int8 dot and
    # einsum) quantized the input outside any straight-through rule, so gradients through a
    # W8A8 model (a LoRA or bias trained in front of it) were silently zero there, while the
    # dynamic int8 dot passes them straight through
    model, x = _Branches(), _x(2, 5, 4)
    w = jnp.cos(jnp.arange(2 * 5 * 9, dtype=jnp.float32)).reshape(2, 5, 9)
    qm = quantize_linen(model, QuantConfig(act=ActSpec(scale=scale)))
    q = jax.jit(qm.quantize_params)(jax.jit(model.init)(jax.random.key(0), x), x)
    g = jax.jit(jax.grad(lambda x: jnp.sum(qm.apply(q, x) * w)))(x)
    # the layers are linear: d/dx sum(y * w) is the float model's vjp of w (dequantized
    # kernels), zero where the static scale clips the input (as jaxquant.fake_quant's)
    ref = np.asarray(jax.jit(lambda q, x, w: jax.vjp(
        lambda x: model.apply(jq.dequantize_tree(q), x), x)[1](w)[0])(q, x, w))
    if scale is not None:
        codes = np.rint(np.asarray(x) / np.float32(scale))
        assert (np.abs(codes) > 127).any() and (np.abs(codes) < 127).any()
        ref = np.where((codes >= -128) & (codes <= 127), ref, 0)
    assert np.abs(ref).max() > 0.1
    _close(g, ref)


# ----------------------------------------------------------------------------- held up


class _Lifted(nn.Module):
    """An nn.vmap'd Dense, a Dense called twice and a DenseGeneral with batch_dims, set up
    in setup() (a list)."""

    def setup(self):
        self.vdense = nn.vmap(nn.Dense, variable_axes={"params": 0},
                              split_rngs={"params": True}, in_axes=0)(6)
        self.shared = nn.Dense(6)
        self.heads = [nn.DenseGeneral((2, 3), axis=-1, batch_dims=0)]

    def __call__(self, x):
        x = self.shared(nn.relu(self.shared(self.vdense(x))))
        return self.heads[0](x)


def test_lifted_shared_and_setup_layers_train_and_infer_as_the_float_model():
    model, x = _Lifted(), _x(3, 5, 6)
    qm = quantize_linen(model, QuantConfig())
    params = jax.jit(model.init)(jax.random.key(0), x)
    assert list(qm.layers(params, x)) == ["vdense", "shared", "heads_0"]
    y = jax.jit(qm.apply)(params, x)
    ref = jax.jit(lambda p, x: model.apply(_fq_kernels(p, stacked=("vdense",)), x))
    _close(y, ref(params, x), tol=1e-6)
    q = jax.jit(qm.quantize_params)(params, x)
    assert q["params"]["vdense"]["kernel"].qvalue.shape == (3, 6, 6)
    _close(jax.jit(qm.apply)(q, x), y, tol=1e-5)
