"""GPTQ through jaxquant.flax: input Gram matrices recorded on linen and nnx models, GPTQ
kernels that equal `jaxquant.gptq` and beat round to nearest on calibration outputs, and clear
errors for grams that cannot be used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import QuantConfig, nnx_input_grams, nnx_quantize, quantize_linen  # noqa: E402

INT4 = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="up")(x))
        return nn.Dense(16, name="down")(x)


def _calibration(n=256, k=32, seed=0):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((6, k)).astype(np.float32)  # correlated features
    return jnp.asarray(rng.standard_normal((n, 6)).astype(np.float32) @ mix)


def _hidden(params, x):
    return jax.nn.relu(x @ params["params"]["up"]["kernel"] + params["params"]["up"]["bias"][None])


def test_linen_grams_are_the_layers_inputs():
    qm = quantize_linen(MLP(), INT4)
    x = _calibration()
    params = qm.init(jax.random.key(0), x)
    grams = qm.input_grams(params, x)
    assert set(grams) == {"up", "down"}
    np.testing.assert_allclose(grams["up"], x.T @ x, rtol=1e-5, atol=1e-3)
    h = _hidden(params, x)
    np.testing.assert_allclose(grams["down"], h.T @ h, rtol=1e-4, atol=1e-3)
    half = qm.input_grams(params, x[:128])  # grams of batches add up
    total = jax.tree.map(jnp.add, half, qm.input_grams(params, x[128:]))
    np.testing.assert_allclose(total["up"], grams["up"], rtol=1e-4, atol=1e-2)


def test_linen_gptq_kernels_equal_jq_gptq_and_beat_round_to_nearest():
    qm = quantize_linen(MLP(), INT4)
    x = _calibration()
    params = qm.init(jax.random.key(0), x)
    grams = qm.input_grams(params, x)
    q = qm.quantize_params(params, x, grams=grams)
    rtn = qm.quantize_params(params, x)
    w = params["params"]["up"]["kernel"]
    ref = jq.pack(jq.gptq(w, grams["up"], dtype=jnp.int4, axis=0, block_size=16))
    np.testing.assert_array_equal(np.asarray(q["params"]["up"]["kernel"].qvalue.data),
                                  np.asarray(ref.qvalue.data))
    y = MLP().apply(params, x)
    err = [float(jnp.linalg.norm(qm.apply(t, x) - y)) for t in (q, rtn)]
    assert err[0] < 0.8 * err[1]


def test_nnx_grams_and_gptq_quantize():
    x = _calibration()
    model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(64, 16, rngs=nnx.Rngs(1)))
    y = model(x)
    w0 = model.layers[0].kernel[...]
    grams = nnx_input_grams(model, INT4, x)
    assert set(grams) == {"layers/0", "layers/2"}
    np.testing.assert_allclose(grams["layers/0"], x.T @ x, rtol=1e-5, atol=1e-3)
    assert type(model.layers[0].dot_general) is not jq.flax._gptq.GramRecorder  # removed
    rtn = nnx_quantize(nnx.clone(model), INT4)
    nnx_quantize(model, INT4, grams=grams)
    ref = jq.pack(jq.gptq(w0, grams["layers/0"], dtype=jnp.int4, axis=0, block_size=16))
    np.testing.assert_array_equal(np.asarray(model.layers[0].kernel[...].qvalue.data),
                                  np.asarray(ref.qvalue.data))
    assert float(jnp.linalg.norm(model(x) - y)) < 0.8 * float(jnp.linalg.norm(rtn(x) - y))


@pytest.mark.parametrize("rules,grams,match", [
    (INT4, {"nope": jnp.eye(32)}, r"grams has entries for no covered layer.*\['nope'\]"),
    ((("up", QuantConfig(weight=jq.QuantSpec(dtype="mxfp4"))), ("down", INT4)),
     {"up": jnp.eye(32)}, r"grams\['up'\] cannot be used: .*scales in another format"),
    ((("up", QuantConfig(weight=jq.QuantSpec(axis=0))), ("down", INT4)),
     {"up": jnp.eye(32)}, r"grams\['up'\] cannot be used: .*axis=0, block_size=None"),
    ((("up", None), ("down", INT4)), {"up": jnp.eye(32)},
     r"grams\['up'\] cannot be used: no rule gives it a weight spec"),
])
def test_linen_unusable_grams_raise(rules, grams, match):
    qm = quantize_linen(MLP(), rules)
    x = _calibration(n=8)
    params = MLP().init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=match):
        qm.quantize_params(params, x, grams=grams)


def test_linen_grams_under_scan_raise():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return nn.Dense(8)(c), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=2)()(x, None)[0]

    x = jnp.ones((4, 8))
    qm = quantize_linen(Stack(), QuantConfig())
    params = Stack().init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="layers inside nn.scan / nn.remat are not supported"):
        qm.input_grams(params, x)


def test_a_failing_nnx_quantize_leaves_the_model_unchanged():
    """nnx_quantize changes the model in place: every kernel (GPTQ's too) is computed before
    any is set, so an error in a later layer leaves the earlier ones float, and a corrected
    call then converts the model."""
    x = _calibration(150, 24)
    model = nnx.Sequential(nnx.Linear(24, 10, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(10, 4, rngs=nnx.Rngs(1)))
    before = [np.asarray(model.layers[i].kernel[...]) for i in (0, 2)]
    cfg = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=8))
    grams = nnx_input_grams(model, cfg, x)
    with pytest.raises(ValueError, match=r"grams\['layers/2'\].*dividing in=10, got 8"):
        nnx_quantize(model, cfg, grams=grams)  # GPTQ needs blocks that divide in
    masked = nnx.Sequential(nnx.Linear(24, 6, rngs=nnx.Rngs(2)),
                            nnx.Conv(6, 6, (3,), mask=jnp.ones((3, 6, 6)), rngs=nnx.Rngs(3)))
    with pytest.raises(ValueError, match="has a mask"):
        nnx_quantize(masked, QuantConfig())
    assert not jq.is_qtensor(masked.layers[0].kernel[...])
    for i, k in zip((0, 2), before, strict=True):
        np.testing.assert_array_equal(model.layers[i].kernel[...], k)  # still float, as before
    fixed = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=2))
    nnx_quantize(model, fixed, grams=nnx_input_grams(model, fixed, x))
    for i, k in zip((0, 2), before, strict=True):
        want = jq.gptq(k, grams[f"layers/{i}"], dtype=jnp.int4, axis=0, block_size=2)
        np.testing.assert_array_equal(model.layers[i].kernel[...].qvalue, want.qvalue)


def test_nnx_layers_sharing_a_kernel_sum_their_grams():
    # before: the shared kernel took the first layer's gram only, and a gram for the second
    # layer alone was dropped (round to nearest); linen sums a module's calls the same way
    class Tied(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(16, 16, rngs=nnx.Rngs(1))
            self.b.kernel = self.a.kernel

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 16)) @ rng.standard_normal((16, 16)), jnp.float32)
    cfg = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4))
    model = Tied()
    w, grams = model.a.kernel[...], nnx_input_grams(model, cfg, x)
    assert sorted(grams) == ["a", "b"]
    for given, gram in [(grams, grams["a"] + grams["b"]), ({"b": grams["b"]}, grams["b"])]:
        tied = nnx_quantize(nnx.clone(model), cfg, grams=given)
        assert tied.a.kernel is tied.b.kernel
        want = jq.gptq(w, gram, dtype=jnp.int4)
        np.testing.assert_array_equal(np.asarray(tied.a.kernel[...].qvalue), np.asarray(want.qvalue))
        np.testing.assert_array_equal(np.asarray(tied.a.kernel[...].scale), np.asarray(want.scale))
