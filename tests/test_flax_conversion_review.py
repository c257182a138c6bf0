"""Converting trained Flax models for inference: learned scales are never dropped, act-only
rules mean the same in linen and nnx, and a layer that QAT cannot reach is an error. The
references are jaxquant's own public functions on the float kernels (`fake_quant`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxquant as jq
from jaxquant.flax import ActSpec, QuantConfig, nnx_qat, nnx_quantize, quantize_linen

X = jax.random.normal(jax.random.key(0), (16, 16)) * 3
INT4 = jq.QuantSpec(dtype=jnp.int4)


def _trained_learned_scales():
    qm = quantize_linen(nn.Dense(8), [("", QuantConfig(weight=INT4, learn_scale=True))])
    v = qm.init(jax.random.key(2), X)
    y = jax.random.normal(jax.random.key(1), (16, 8))
    opt = optax.adam(1e-2)
    state = opt.init(v)
    for _ in range(5):
        g = jax.grad(lambda v: jnp.mean((qm.apply(v, X) - y) ** 2))(v)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes python floats and int32
            u, state = opt.update(g, state, v)
        v = optax.apply_updates(v, u)
    return qm, v


def test_linen_learned_scale_is_used_with_the_training_rules():
    qm, v = _trained_learned_scales()
    q = qm.quantize_params(v, X)
    np.testing.assert_allclose(np.asarray(q["params"]["kernel"].scale),
                               np.asarray(v["quant"]["kernel_scale"]))
    np.testing.assert_allclose(np.asarray(qm.apply(q, X)), np.asarray(qm.apply(v, X)),
                               rtol=1e-6, atol=1e-6)


def test_linen_learned_scale_met_by_a_rule_without_learn_scale_is_an_error():
    # before: the "quant" collection was dropped and computed scales used (2.4 off the QAT model)
    _, v = _trained_learned_scales()
    other = quantize_linen(nn.Dense(8), [("", QuantConfig(weight=INT4))])
    with pytest.raises(ValueError, match="layer '': its kernel has a learned scale .* "
                                         "learn_scale=False"):
        other.quantize_params(v, X)


def test_nnx_act_only_rule_fake_quantizes_the_input_after_conversion():
    # before: nnx_quantize left a float model's act-only layers float; linen and the QAT route
    # fake-quantized their input
    act = ActSpec(dtype=jnp.int4, granularity="tensor")
    rules = [("", QuantConfig(weight=None, act=act))]
    layer = nnx.Linear(16, 8, rngs=nnx.Rngs(1))
    kernel, bias = layer.kernel[...], layer.bias[...]
    nnx_quantize(layer, rules)
    x_q = jq.fake_quant(X, dtype=jnp.int4)  # one computed per-tensor scale, as the ActSpec
    np.testing.assert_allclose(np.asarray(layer(X)), np.asarray(x_q @ kernel + bias[None, :]),
                               rtol=1e-6, atol=1e-5)
    trained = nnx_qat(nnx.Linear(16, 8, rngs=nnx.Rngs(1)), rules)
    np.testing.assert_array_equal(np.asarray(nnx_quantize(trained, rules)(X)),
                                  np.asarray(layer(X)))
    linen_rules = quantize_linen(nn.Dense(8), rules)
    v = {"params": {"kernel": kernel, "bias": bias}}
    np.testing.assert_allclose(np.asarray(linen_rules.apply(linen_rules.quantize_params(v, X), X)),
                               np.asarray(layer(X)), rtol=1e-6, atol=1e-6)


def test_linen_subclass_that_never_calls_promote_dtype_is_an_error_in_qat():
    # before: QAT trained it float with no warning; quantize_params then failed at deploy
    class OwnDense(nn.Dense):
        @nn.compact
        def __call__(self, x):
            k = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
            return x @ k

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return OwnDense(4, name="d")(x)

    qm = quantize_linen(Model(), QuantConfig(weight=INT4))
    with pytest.raises(ValueError, match="layer 'd' .*OwnDense.__call__ never calls "
                                         "self.promote_dtype"):
        qm.init(jax.random.key(1), X)
    # a subclass that goes through promote_dtype trains quantized
    class Scaled(nn.Dense):
        def __call__(self, x):
            return 2.0 * super().__call__(x)

    qm = quantize_linen(Scaled(4), QuantConfig(weight=INT4))
    v = qm.init(jax.random.key(1), X)
    kernel = v["params"]["kernel"]
    np.testing.assert_allclose(np.asarray(qm.apply(v, X)),
                               np.asarray(2.0 * (X @ jq.fake_quant(kernel, dtype=jnp.int4,
                                                                   axis=-1))),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, None], ids=["float32", "inferred"])
def test_w8a8_qat_of_bfloat16_params_computed_in_float32_is_the_deployed_model(dtype):
    # before: QAT rounded the fake-quantized kernel to bfloat16, the deployed int8 dot
    # multiplies the codes by float32 scales exactly: 6.4e-3 apart (|y| about 4); with
    # dtype=None (Flax's default: float32 inferred from the float32 input) still 4.3e-3
    with jax.numpy_dtype_promotion("standard"):  # float32 with bfloat16: refused if strict
        _check_w8a8_qat_is_deployed(dtype)


def _check_w8a8_qat_is_deployed(dtype):
    rules = QuantConfig(act=ActSpec())
    dense = nn.Dense(256, dtype=dtype, param_dtype=jnp.bfloat16)
    qm = quantize_linen(dense, rules)
    v = qm.init(jax.random.key(3), X)
    assert qm.apply(v, X).dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(qm.apply(qm.quantize_params(v, X), X)),
                               np.asarray(qm.apply(v, X)), rtol=1e-5, atol=1e-5)
    layer = nnx.Linear(16, 256, dtype=dtype, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    nnx_qat(layer, rules)
    trained = layer(X)
    np.testing.assert_allclose(np.asarray(nnx_quantize(layer, rules)(X)), np.asarray(trained),
                               rtol=1e-5, atol=1e-5)


def _twice_dot(*args, **kwargs):
    return 2 * jax.lax.dot_general(*args, **kwargs)


def test_a_layer_built_with_its_own_dot_is_refused_not_replaced():
    # before: quantized inference replaced the layer's dot_general / conv_general_dilated /
    # einsum_op with jaxquant's and returned half the float model's output, silently
    rules = QuantConfig()
    dense = nn.Dense(4, dot_general=_twice_dot)
    qm = quantize_linen(dense, rules)
    v = dense.init(jax.random.key(0), X)
    np.testing.assert_allclose(np.asarray(qm.apply(v, X)),  # QAT runs the layer's own dot
                               np.asarray(2 * (X @ jq.fake_quant(v["params"]["kernel"], axis=-1))
                                          + v["params"]["bias"][None, :]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Dense was built with its own dot_general"):
        qm.apply(qm.quantize_params(v, X), X)
    with pytest.raises(ValueError, match="Dense was built with its own dot_general"):
        quantize_linen(dense, QuantConfig(act=ActSpec(), int8_dot=True)).init(
            jax.random.key(0), X)
    layer = nnx.Linear(16, 4, dot_general=_twice_dot, rngs=nnx.Rngs(0))
    kernel = layer.kernel[...]
    with pytest.raises(ValueError, match="layer '': Linear was built with its own dot_general"):
        nnx_quantize(layer, rules)
    assert layer.kernel[...] is kernel  # refused before any change
    conv = nnx.Conv(16, 4, (3,), conv_general_dilated=lambda *a, **k: jax.lax.conv_general_dilated(
        *a, **k), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Conv was built with its own conv_general_dilated"):
        nnx_quantize(conv, rules)
    # Flax's defaults and jaxquant's own ops pass
    plain = nnx_quantize(nnx.Linear(16, 4, rngs=nnx.Rngs(0)), rules)
    assert plain(X).shape == (16, 4)


_EYE = lambda *a, **k: jnp.eye(2, dtype=jnp.float32)  # noqa: E731


@pytest.mark.parametrize("kind", ["DenseGeneral", "Conv", "Einsum", "nnx.LinearGeneral",
                                  "nnx.Conv", "nnx.Einsum"])
def test_w8a8_qat_casts_the_input_to_the_compute_dtype_before_quantizing(kind):
    # before: QAT quantized the float32 input, then the bfloat16 layer cast the fake-quantized
    # values; inference casts first (0.79126 -> 0.79297 in bfloat16): code 100 vs 101 of 127
    x = jnp.array([[1.0, 0.79126]], jnp.float32)
    rules, bf16 = QuantConfig(act=ActSpec()), jnp.bfloat16
    conv_eye = lambda *a, **k: jnp.eye(2, dtype=jnp.float32)[None]  # noqa: E731
    if kind.startswith("nnx."):
        rngs = nnx.Rngs(0)
        make = {"nnx.LinearGeneral": lambda: nnx.LinearGeneral(2, 2, use_bias=False, dtype=bf16,
                                                               kernel_init=_EYE, rngs=rngs),
                "nnx.Conv": lambda: nnx.Conv(2, 2, (1,), use_bias=False, dtype=bf16,
                                             kernel_init=conv_eye, rngs=rngs),
                "nnx.Einsum": lambda: nnx.Einsum("bd,dk->bk", (2, 2), dtype=bf16,
                                                 kernel_init=_EYE, rngs=rngs)}[kind]
        xs = x[None] if kind == "nnx.Conv" else x
        trained, served = nnx_qat(make(), rules)(xs), nnx_quantize(make(), rules)(xs)
    else:
        model = {"DenseGeneral": nn.DenseGeneral(2, use_bias=False, dtype=bf16, kernel_init=_EYE),
                 "Conv": nn.Conv(2, (1,), use_bias=False, dtype=bf16, kernel_init=conv_eye),
                 "Einsum": nn.Einsum((2, 2), "bd,dk->bk", use_bias=False, dtype=bf16,
                                     kernel_init=_EYE)}[kind]
        xs = x[None] if kind == "Conv" else x
        qm = quantize_linen(model, rules)
        v = qm.init(jax.random.key(0), xs)
        trained, served = qm.apply(v, xs), qm.apply(qm.quantize_params(v, xs), xs)
    assert float(np.asarray(served, np.float32).ravel()[1]) == 0.796875  # code 101 / 127
    np.testing.assert_array_equal(np.asarray(trained, np.float32), np.asarray(served, np.float32))


def test_w8a8_qat_of_a_bfloat16_input_to_a_float32_layer_is_the_deployed_model():
    # before: the fake-quantized input stayed bfloat16 (1.7e-3 off); inference casts to
    # float32 first and quantizes there
    x = jax.random.normal(jax.random.key(0), (4, 3, 16)).astype(jnp.bfloat16)
    rules = QuantConfig(act=ActSpec())
    model = nn.Conv(8, (3,))
    qm = quantize_linen(model, rules)
    with jax.numpy_dtype_promotion("standard"):
        v = qm.init(jax.random.key(1), x)
        trained, served = qm.apply(v, x), qm.apply(qm.quantize_params(v, x), x)
        layer = nnx.Conv(16, 8, (3,), rngs=nnx.Rngs(1))
        nnx_trained = nnx_qat(layer, rules)(x)
        nnx_served = nnx_quantize(layer, rules)(x)
    assert trained.dtype == served.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(trained), np.asarray(served), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(nnx_trained), np.asarray(nnx_served), rtol=1e-5, atol=1e-5)
