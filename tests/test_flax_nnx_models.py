"""jaxquant.flax on realistic nnx models: layers sharing a kernel Variable, GPTQ Gram
matrices of layers inside nnx transforms, inputs of the wrong rank, and an attention block
(MultiHeadAttention, grouped causal Conv) with learned scales and int8 activations."""

import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

from nnx_training import SharedKernel  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import (  # noqa: E402
    ActSpec,
    QuantConfig,
    nnx_input_grams,
    nnx_layers,
    nnx_qat,
    nnx_quantize,
)

run = nnx.jit(lambda model, x: model(x))


def _x(*shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32) * 0.37).reshape(shape)


# ----------------------------------------------------------------------------- shared kernels


@pytest.mark.parametrize("b_cfg", [None, QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4))],
                         ids=["b-float", "b-int4"])
def test_layers_sharing_a_kernel_variable_must_get_the_same_rule(b_cfg):
    # regression: nnx_quantize put layer a's int8 QTensor in the shared Variable, then b
    # (rule None) crashed on it without naming a layer, or (rule int4) ran a's int8 codes
    rules = [("a", QuantConfig()), ("b", b_cfg)]
    for fn in (nnx_layers, nnx_qat, nnx_quantize):
        with pytest.raises(ValueError, match=r"Linear at 'b' shares its kernel Variable with "
                                             r"the layer at 'a'.*'b' (None|QuantConfig)"):
            fn(SharedKernel(), rules)


def test_layers_sharing_a_kernel_variable_quantize_once():
    model, x = SharedKernel(), _x(3, 8)
    ref = SharedKernel()
    ref.a.kernel.set_value(jq.fake_quant(ref.a.kernel[...], axis=-1))
    assert ref.b.kernel is ref.a.kernel
    nnx_quantize(model, QuantConfig())
    assert jq.is_qtensor(model.b.kernel[...])
    np.testing.assert_allclose(run(model, x), run(ref, x), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- GPTQ grams


class _Layer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class _Scanned(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _Layer(rngs)

        self.layers = make(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)

        return self.head(body(x, self.layers))


class _Remat(nnx.Module):
    def __init__(self, rngs):
        self.block = _Layer(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.remat(lambda block, x: block(x))(self.block, x))


class _RematThenDirect(nnx.Module):  # the layer's gram escapes, then is summed with another
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.lin(nnx.remat(lambda m, x: m(x))(self.lin, x))


class _Cond(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return nnx.cond(True, lambda m, x: m(x), lambda m, x: 2 * m(x), self.lin, x)


@pytest.mark.parametrize("make,inner", [(_RematThenDirect, "lin"), (_Cond, "lin")],
                         ids=["remat-then-direct", "cond"])
def test_input_grams_of_a_layer_run_in_a_transform_and_again_name_it(make, inner):
    # before: jax's UnexpectedTracerError from inside the model call, no layer named
    with pytest.raises(ValueError, match=rf"layer at '{inner}' runs inside a transform"):
        nnx_input_grams(make(nnx.Rngs(0)), QuantConfig(), _x(4, 8))


@pytest.mark.parametrize("make,inner", [(_Scanned, "layers/lin"), (_Remat, "block/lin")],
                         ids=["scan", "remat"])
def test_input_grams_of_layers_inside_transforms_is_an_error(make, inner):
    # regression: the Gram of a layer run inside nnx.scan / nnx.remat was a tracer that had
    # escaped the transform, returned as if it were a Gram matrix
    model, x = make(nnx.Rngs(0)), _x(16, 8)
    with pytest.raises(ValueError, match=rf"layer at '{inner}' runs inside a transform"):
        nnx_input_grams(model, QuantConfig(), x)
    grams = nnx_input_grams(model, [(inner, None), ("", QuantConfig())], x)
    assert list(grams) == ["head"]
    rows = np.asarray(model.block(x) if make is _Remat else x, np.float64)
    if make is _Scanned:
        for i in range(3):
            k, b = model.layers.lin.kernel[...][i], model.layers.lin.bias[...][i]
            rows = np.tanh(rows @ np.asarray(k, np.float64) + np.asarray(b, np.float64))
    np.testing.assert_allclose(grams["head"], rows.T @ rows, rtol=1e-4, atol=1e-4)


def test_input_grams_under_an_outer_jit_are_not_refused():
    model, x = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0))), _x(16, 8)
    grams = nnx.jit(lambda m, x: nnx_input_grams(m, QuantConfig(), x))(model, x)
    np.testing.assert_allclose(grams["layers/0"], np.asarray(x).T @ np.asarray(x), rtol=1e-5)


# ----------------------------------------------------------------------------- bad inputs


def test_per_token_activations_of_an_input_without_the_contracted_axes_raise_value_error():
    # regression: a scalar input raised ZeroDivisionError (integer modulo by zero)
    for layer, x in [(nnx.Linear(8, 6, rngs=nnx.Rngs(0)), jnp.ones(())),
                     (nnx.LinearGeneral((5, 8), 6, axis=(-2, -1), rngs=nnx.Rngs(0)),
                      jnp.ones((8,)))]:
        kind = type(layer).__name__
        nnx_qat(layer, QuantConfig(act=ActSpec()))
        with pytest.raises(ValueError, match=rf"layer '' \({kind}\): the layer contracts input "
                                             rf"axes \(.*-1,?\), but its input has shape "
                                             rf"\({'8,' if x.ndim else ''}\)"):
            run(layer, x)


def test_int8_conv_of_an_input_of_the_wrong_rank_names_the_shapes():
    # regression: the error blamed the kernel's quantization ("per output feature (axis 1)")
    conv = nnx_quantize(nnx.Conv(8, 6, (3,), rngs=nnx.Rngs(0)), QuantConfig(act=ActSpec()))
    with pytest.raises(ValueError, match=r"layer '' \(Conv\): conv_general_dilated lhs and rhs "
                                         r"must have the same number of dimensions, got lhs of "
                                         r"shape \(1, 8\) and a kernel of shape \(3, 8, 6\)"):
        run(conv, jnp.ones((8,)))


# ----------------------------------------------------------------------------- attention


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, 16, decode=False, rngs=rngs)
        self.conv = nnx.Conv(16, 16, (3,), feature_group_count=4, padding="CAUSAL", rngs=rngs)
        self.mlp = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln(x))
        x = x + self.conv(x)
        return x + jnp.tanh(self.mlp(x))


def test_attention_block_w8a8_lsq_inference_equals_qat():
    x = _x(2, 6, 16)
    cfg = QuantConfig(act=ActSpec(), learn_scale=True)
    model = nnx_qat(_Block(nnx.Rngs(0)), cfg)
    assert len(nnx_layers(model, cfg)) == 6  # 4 attention projections, conv, mlp
    y_qat = run(model, x)
    nnx_quantize(model, cfg)
    assert jq.is_qtensor(model.attn.query.kernel[...])
    np.testing.assert_allclose(run(model, x), y_qat, atol=1e-5 * float(jnp.abs(y_qat).max()))
