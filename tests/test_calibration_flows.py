"""Calibration as users run it: sharded batches, data loader batches, wrong arguments, and
calibrated static scales in Flax models (ranges checked against NumPy on the layer inputs,
int8 inference against the fake-quantized model)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from host_mesh import host_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant import calibration as cal
from jaxquant.flax import ActSpec, QuantConfig, nnx_qat, nnx_quantize, quantize_linen

EXPLICIT = jax.sharding.AxisType.Explicit


def _batches(seed, n=4, shape=(64, 8)):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * (1 + i)).astype(np.float32) for i in range(n)]


def _assert_same_state(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got, want)


# ----------------------------------------------------------------------------- sharded batches


# percentile observers update with the histogram's own kernel: the histogram covers them.
@pytest.mark.parametrize("make", [lambda axis: cal.histogram(64, axis=axis),
                                  lambda axis: cal.moving_average_minmax(0.3, axis=axis),
                                  lambda axis: cal.minmax(axis=axis)])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_batches_sharded_on_an_explicit_mesh_give_the_one_device_state(make, axis):
    """Batches on JAX's default (explicit) mesh axes, sharded along rows or columns and not
    all alike: the histogram's reshapes and the moving average's select refused them."""
    mesh = host_mesh((8,), ("d",), EXPLICIT)
    obs, batches = make(axis), _batches(30)
    specs = [P("d", None), P(None, "d"), P(), P("d", None)]
    state = obs.init(batches[0])
    for b, spec in zip(batches, specs, strict=True):
        state = obs.update(state, jax.device_put(b, NamedSharding(mesh, spec)))
    want = cal.calibrate(obs, batches)
    _assert_same_state(state, want)
    np.testing.assert_array_equal(obs.compute(state, dtype=jnp.uint8, symmetric=False)[0],
                                  obs.compute(want, dtype=jnp.uint8, symmetric=False)[0])


@pytest.mark.parametrize("make", [lambda: cal.histogram(64, axis=-1),
                                  lambda: cal.moving_average_minmax(0.3, axis=-1)])
def test_a_state_sharded_by_channel_keeps_its_sharding(make):
    """A per-channel state the user put on the mesh, one channel range per device."""
    mesh = host_mesh((8,), ("d",), EXPLICIT)
    obs, batches = make(), _batches(35)
    state = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P(*"d"[:a.ndim]))),
                         obs.init(batches[0]))
    for b, spec in zip(batches, [P("d", None), P(None, "d"), P(), P()], strict=True):
        state = obs.update(state, jax.device_put(b, NamedSharding(mesh, spec)))
    assert state.min.sharding.spec == P("d")
    want = cal.calibrate(obs, batches)
    _assert_same_state(state, want)
    np.testing.assert_array_equal(obs.compute(state, dtype=jnp.int8)[0],
                                  obs.compute(want, dtype=jnp.int8)[0])


def test_histogram_scan_over_a_sharded_stack_of_batches():
    mesh = host_mesh((8,), ("d",), EXPLICIT)
    obs, batches = cal.histogram(64, axis=-1), _batches(31)
    xs = jax.device_put(np.stack(batches), NamedSharding(mesh, P(None, "d", None)))

    @jax.jit
    def run(state, xs):
        return jax.lax.scan(lambda s, x: (obs.update(s, x), None), state, xs)[0]

    _assert_same_state(run(obs.init(batches[0]), xs), cal.calibrate(obs, batches))


# ----------------------------------------------------------------------------- data loaders


def test_input_label_pairs_of_a_data_loader_are_refused():
    """A data loader yields (inputs, labels): stacked into one array, the labels (here up
    to 30) were observed as activations."""
    x = np.linspace(-1.0, 1.0, 4, dtype=np.float32)
    y = np.arange(4) * 10
    rows, labels = np.ones((4, 3), np.float32), np.arange(4)  # unequal shapes: refused by init
    for batch in [(x, y), [x, y], (jnp.asarray(x), jnp.asarray(2 * x)), (rows, labels)]:
        for obs in [cal.minmax(), cal.minmax(axis=-1), cal.histogram(16)]:
            with pytest.raises(TypeError, match="x must be one array, got a (tuple|list) of 2"):
                cal.calibrate(obs, [batch])
    state = cal.calibrate(cal.minmax(), [[1.0, 2.0]])  # nested numbers are still one batch
    assert float(state.max) == 2.0


def test_bfloat16_and_grad_requiring_torch_batches_are_observed():
    """Activations recorded from a PyTorch model: bfloat16 (no NumPy dtype) or still
    attached to the autograd graph (``.numpy()`` refuses both)."""
    torch = pytest.importorskip("torch")
    batches = _batches(32, n=3, shape=(16, 3))
    as_bf16 = [np.asarray(jnp.asarray(b, jnp.bfloat16).astype(jnp.float32)) for b in batches]
    for obs in [cal.minmax(axis=-1), cal.histogram(32)]:
        got = cal.calibrate(obs, [torch.from_numpy(b).bfloat16() for b in batches])
        _assert_same_state(got, cal.calibrate(obs, as_bf16))
        got = cal.calibrate(obs, [torch.from_numpy(b).requires_grad_() * 1 for b in batches])
        _assert_same_state(got, cal.calibrate(obs, batches))
        # a column slice (strided: DLPack takes compact tensors only)
        got = cal.calibrate(obs, [torch.from_numpy(b).bfloat16()[:, :2] for b in batches])
        _assert_same_state(got, cal.calibrate(obs, [b[:, :2] for b in as_bf16]))


# ----------------------------------------------------------------------------- errors


def test_calibrate_names_a_wrong_observer_or_batches():
    with pytest.raises(TypeError, match=r"observer must be an Observer.*call it: minmax\(\)"):
        cal.calibrate(cal.minmax, [jnp.ones(3)])  # the factory, not called
    with pytest.raises(TypeError, match="observer must be an Observer"):
        cal.calibrate("minmax", [jnp.ones(3)])
    with pytest.raises(TypeError, match="batches must be an iterable of arrays, got NoneType"):
        cal.calibrate(cal.minmax(), None)


@pytest.mark.parametrize("obs,state,field", [
    (cal.histogram(16), cal.HistogramState(jnp.zeros(16, jnp.int32), jnp.float32(0),
                                           jnp.float32(1)), "hist"),
    (cal.minmax(), cal.RangeState(jnp.int32(0), jnp.int32(1), jnp.int32(1)), "min"),
    (cal.moving_average_minmax(0.5), cal.RangeState(jnp.float32(0), jnp.float32(1),
                                                    jnp.float32(1)), "count"),
])
def test_state_fields_of_another_kind_are_type_errors_naming_the_field(obs, state, field):
    """An integer histogram failed inside ``lax.cond``; integer ranges or a float count went
    through unnoticed."""
    for call in (lambda: obs.update(state, jnp.ones(3)), lambda: obs.compute(state)):
        with pytest.raises(TypeError, match=rf"state\.{field} must be a"):
            call()
    ok = cal.RangeState(np.float64(0.0), 1.0, 1)  # a state read back from a file
    assert float(cal.minmax().update(ok, jnp.full(3, 2.0)).max) == 2.0


# ----------------------------------------------------------------------------- Flax


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))  # Dense_0
        return nn.Dense(4)(h)


class _NMLP(nnx.Module):
    def __init__(self, rngs):
        self.l0, self.l1 = nnx.Linear(5, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l1(nnx.relu(self.l0(x)))


def _calibrated_rules(inputs_per_batch, dtype):
    """Static ActSpecs from a minmax observer per layer, checked against NumPy's absmax."""
    obs, states = cal.minmax(), {}
    for inputs in inputs_per_batch:
        for path, v in inputs.items():
            states[path] = obs.update(states.get(path) or obs.init(v), v)
    rules = []
    for path, state in states.items():
        absmax = max(float(np.abs(np.asarray(ins[path])).max()) for ins in inputs_per_batch)
        assert max(-float(state.min), float(state.max)) == absmax
        scale, _ = obs.compute(state, dtype=dtype)
        assert float(scale) == pytest.approx(absmax / 127, rel=1e-6)
        rules.append((path, QuantConfig(act=ActSpec(dtype=dtype, scale=scale))))
    return rules


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8])
def test_linen_calibrated_static_scales_inference_equals_fake_quant(dtype):
    rng = np.random.default_rng(33)
    model, batches = _MLP(), _batches(33, shape=(8, 5))
    params = model.init(jax.random.key(0), batches[0])
    inputs = []
    for b in batches:  # each layer's input: the batch, and relu of what Dense_0 returned
        _, inter = model.apply(params, b, capture_intermediates=True)
        h = np.maximum(np.asarray(inter["intermediates"]["Dense_0"]["__call__"][0]), 0)
        inputs.append({"Dense_0": b, "Dense_1": h})
    rules = _calibrated_rules(inputs, dtype)
    qm = quantize_linen(model, rules)
    x = rng.standard_normal((8, 5)).astype(np.float32) * 6  # beyond the calibrated range
    fq = qm.apply(params, x)
    p, s = params["params"], {path: cfg.act.scale for path, cfg in rules}
    zp = None if dtype == jnp.int8 else jnp.uint8(128)

    def layer(h, name):  # by hand: the static input scale and per-channel int8 kernels
        a = jq.fake_quant(h, jnp.float32(s[name]), zp, dtype=dtype)
        return a @ jq.fake_quant(p[name]["kernel"], dtype=jnp.int8, axis=-1) + p[name]["bias"][None]

    np.testing.assert_allclose(fq, layer(jnp.maximum(layer(x, "Dense_0"), 0), "Dense_1"),
                               rtol=1e-6, atol=1e-6)
    out = jax.jit(qm.apply)(qm.quantize_params(params, x), x)
    np.testing.assert_allclose(out, fq, rtol=1e-5, atol=1e-5)


def test_nnx_calibrated_static_scales_inference_equals_fake_quant():
    model, batches = _NMLP(nnx.Rngs(0)), _batches(34, shape=(8, 5))
    inputs = [{"l0": b, "l1": np.maximum(np.asarray(model.l0(b)), 0)} for b in batches]
    rules = _calibrated_rules(inputs, jnp.int8)
    x = np.random.default_rng(34).standard_normal((8, 5)).astype(np.float32) * 6
    fq = nnx_qat(model, rules)(x)
    out = nnx_quantize(model, rules)(x)
    np.testing.assert_allclose(out, fq, rtol=1e-5, atol=1e-5)
