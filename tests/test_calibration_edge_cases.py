"""Edge cases of the calibration observers, against NumPy and PyTorch references.

Complements ``tests/test_calibration.py``: re-binned (fractional) histograms,
formats other than 8-bit, half-precision batches, degenerate batches and
states that do not belong to the observer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import _calibration as cal
from jaxquant import _histogram


def _growing_batches(seed, n=500, batches=3):
    """Heavy-tailed batches whose range grows: the histogram is re-binned into fractions."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_t(3, n) * (1 + 0.7 * i)).astype(np.float32) for i in range(batches)]


@pytest.mark.parametrize("seed", range(20))
def test_percentile_of_rebinned_histogram_is_within_two_bins_of_numpy(seed):
    """Re-binning moves old counts as sixteenths, so a bin may hold 1/16 of a value. The
    percentile read-out must spread that mass over its own bin, not several bins further
    (seed 17 was 6.5 bins off): within the two bins re-binning can cost, as in
    ``test_percentile_matches_numpy``."""
    batches = _growing_batches(seed)
    state = cal.calibrate(cal.percentile(99.0, bins=256), batches)
    lo, hi = _histogram.percentile_range(_histogram.as_rows(state), jnp.float32(99.0))
    width = float(state.max - state.min) / 256
    ref_lo, ref_hi = np.percentile(np.concatenate(batches), [1.0, 99.0])
    assert abs(float(lo[0]) - ref_lo) <= 2 * width
    assert abs(float(hi[0]) - ref_hi) <= 2 * width


@pytest.mark.parametrize("make", [cal.histogram, lambda bins: cal.percentile(99.0, bins=bins),
                                  lambda bins: cal.mse(10, bins=bins)])
def test_state_with_other_bins_is_refused(make):
    """PyTorch's HistogramObserver refuses a histogram of another length ("The number of
    bins in histogram should be equal to the number of bins supplied"); a state of 8 bins
    must not be folded or read as if it were the observer's 64."""
    x = jnp.linspace(-1.0, 3.0, 100)
    other = cal.calibrate(make(8), [x])
    obs = make(64)
    with pytest.raises(ValueError, match=r"state.hist must have shape \(64,\).*got \(8,\)"):
        obs.update(other, x)
    with pytest.raises(ValueError, match=r"state.hist must have shape \(64,\).*got \(8,\)"):
        obs.compute(other, dtype=jnp.uint8, symmetric=False)
    rows = _histogram.HistogramState(jnp.zeros((3, 64)), other.min, other.max)  # (3, bins)
    with pytest.raises(ValueError, match=r"state.hist must have shape \(64,\).*got \(3, 64\)"):
        obs.update(rows, x)


def _torch_observe(observer, batches):
    import torch

    for b in batches:
        observer(b if isinstance(b, torch.Tensor) else torch.from_numpy(b))
    return observer


def test_torch_tensor_batches_are_read_as_arrays():
    """`calibrate` takes "a data loader"; PyTorch's yields tensors, whose dtype (torch.float32)
    is no NumPy dtype: read as arrays, they must give PyTorch's own ranges."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(21)
    batches = [torch.from_numpy(rng.standard_normal((8, 3)).astype(np.float32) * (1 + i))
               for i in range(3)]
    ref = _torch_observe(torch.ao.quantization.PerChannelMinMaxObserver(ch_axis=1), batches)
    state = cal.calibrate(cal.minmax(axis=1), batches)
    np.testing.assert_array_equal(state.min, ref.min_val.numpy())
    np.testing.assert_array_equal(state.max, ref.max_val.numpy())


@pytest.mark.parametrize("dtype,tdtype,qmin,qmax", [
    (jnp.int4, "qint8", -8, 7), (jnp.uint4, "quint8", 0, 15),
    (jnp.int16, "int16", -32768, 32767), (jnp.uint16, "uint16", 0, 65535)])
@pytest.mark.parametrize("shift", [0.0, 4.0, -4.0])  # mixed signs, positive-only, negative-only
def test_affine_qparams_of_other_widths_match_torch(dtype, tdtype, qmin, qmax, shift):
    """Affine qparams over [min(lo, 0), max(hi, 0)] for 4- and 16-bit formats, as PyTorch's
    observers with that quant_min/quant_max; one-signed data still put 0.0 in range."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(22)
    batches = [(rng.standard_normal((30, 2)) * (1 + i) + shift).astype(np.float32)
               for i in range(3)]
    q = torch.ao.quantization
    kw = dict(dtype=getattr(torch, tdtype), quant_min=qmin, quant_max=qmax)
    for obs, ref in [(cal.minmax(), q.MinMaxObserver(**kw)),
                     (cal.moving_average_minmax(0.3, axis=-1),
                      q.MovingAveragePerChannelMinMaxObserver(0.3, ch_axis=-1, **kw))]:
        scale, zp = obs.compute(cal.calibrate(obs, batches), dtype=dtype, symmetric=False)
        t_scale, t_zp = _torch_observe(ref, batches).calculate_qparams()
        np.testing.assert_array_equal(np.ravel(scale), t_scale.numpy())
        np.testing.assert_array_equal(np.ravel(zp).astype(np.int64), t_zp.numpy())


@pytest.mark.parametrize("jdtype,tdtype", [(jnp.bfloat16, "bfloat16"), (jnp.float16, "float16")])
def test_half_precision_batches_match_torch(jdtype, tdtype):
    """bf16/f16 batches: float32 ranges and moving averages, as PyTorch's observers, which
    cast each batch to their float32 buffers."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(23)
    batches = [rng.standard_normal((20, 3)).astype(np.float32) * (1 + i) for i in range(3)]
    q = torch.ao.quantization
    for obs, ref in [(cal.minmax(axis=1), q.PerChannelMinMaxObserver(ch_axis=1)),
                     (cal.moving_average_minmax(0.1), q.MovingAverageMinMaxObserver(0.1))]:
        state = cal.calibrate(obs, [jnp.asarray(b, jdtype) for b in batches])
        ref = _torch_observe(ref, [torch.from_numpy(b).to(getattr(torch, tdtype))
                                   for b in batches])
        assert state.min.dtype == jnp.float32
        np.testing.assert_array_equal(np.ravel(state.min), ref.min_val.numpy().ravel())
        np.testing.assert_array_equal(np.ravel(state.max), ref.max_val.numpy().ravel())


@pytest.mark.parametrize("dtype,tdtype,qmin,qmax", [(jnp.int4, "qint8", -8, 7),
                                                    (jnp.uint4, "quint8", 0, 15)])
def test_histogram_search_for_int4_is_torchs_with_16_levels(dtype, tdtype, qmin, qmax):
    """The search spreads ``2 ** bits`` levels of ``dtype``: for int4, PyTorch's search with
    ``dst_nbins = 16`` (PyTorch itself keeps 256 for a qint8 observer with a 4-bit
    quant range), then PyTorch's affine qparams for that range."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(24)
    batches = [(rng.standard_t(3, 3000) * (1 + 0.5 * i) + 0.2 * i).astype(np.float32)
               for i in range(3)]
    ref = torch.ao.quantization.HistogramObserver(
        bins=512, dtype=getattr(torch, tdtype), quant_min=qmin, quant_max=qmax)
    ref.dst_nbins = 16
    ref = _torch_observe(ref, batches)
    obs = cal.histogram(512)
    scale, zp = obs.compute(cal.calibrate(obs, batches), dtype=dtype, symmetric=False)
    t_scale, t_zp = ref.calculate_qparams()
    assert float(scale) == t_scale.item() and int(zp) == t_zp.item()


@pytest.mark.parametrize("value", [0.75, -3.0, 1e8, -3e38])
@pytest.mark.parametrize("bins", [15, 16])
def test_histogram_of_a_constant_is_torchs(value, bins):
    """``torch.histc`` over an empty range ``[v, v]`` bins the values over ``[v - 1, v + 1]``
    in float32 (mostly bin ``bins // 2``, sometimes the one below). ``v - 1``/``v + 1`` are
    ``v`` once ``|v| >= 2**24``: the constant must not fall out of the middle (it landed in
    bin 0)."""
    torch = pytest.importorskip("torch")
    batches = [np.full(10, value, np.float32), np.full(3, value, np.float32)]
    ref = _torch_observe(torch.ao.quantization.HistogramObserver(bins=bins), batches)
    state = cal.calibrate(cal.histogram(bins), batches)
    np.testing.assert_array_equal(state.hist, ref.histogram.numpy())
    assert float(state.min) == float(state.max) == ref.min_val.item() == ref.max_val.item()


def test_histogram_search_errors_name_dtype():
    obs = cal.histogram(8)
    state = cal.calibrate(obs, [jnp.arange(8.0)])
    with pytest.raises(ValueError, match="dtype must be an integer format, got float8_e4m3fn"):
        obs.compute(state, dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="dtype must have at most 16 bits, got int32"):
        obs.compute(state, dtype=jnp.int32)


def test_empty_batches_are_skipped_as_torch_does():
    """PyTorch's observers return early on an empty batch: a moving average is then started
    by the first non-empty batch, and the histogram is not re-binned."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(25)
    empty = np.zeros((0, 3), np.float32)
    batches = [empty] + [rng.standard_normal((40, 3)).astype(np.float32) * (1 + i)
                         for i in range(2)]
    batches.insert(2, empty)
    q = torch.ao.quantization
    obs = cal.moving_average_minmax(0.25, axis=1)
    state = cal.calibrate(obs, batches)
    ref = _torch_observe(q.MovingAveragePerChannelMinMaxObserver(0.25, ch_axis=1), batches)
    assert int(state.count) == 2
    np.testing.assert_array_equal(state.min, ref.min_val.numpy())
    np.testing.assert_array_equal(state.max, ref.max_val.numpy())
    state = cal.calibrate(cal.histogram(64), batches)
    ref = _torch_observe(q.HistogramObserver(bins=64), batches)
    np.testing.assert_array_equal(state.hist, ref.histogram.numpy())


@pytest.mark.parametrize("make", [lambda: cal.moving_average_minmax(0.2, axis=-1),
                                  lambda: cal.histogram(32, axis=-1)])
def test_update_and_compute_vmap_over_independent_states(make):
    """Four calibrations in one ``vmap`` (the histogram's growth branch and the moving
    average's first batch differ per member) equal four separate ones."""
    obs = make()
    rng = np.random.default_rng(26)
    xs = rng.standard_normal((4, 3, 30, 2)).astype(np.float32)
    xs *= rng.uniform(0.5, 4.0, (4, 3, 1, 1)).astype(np.float32)
    init = obs.init(xs[0, 0])
    states = jax.tree.map(lambda a: jnp.broadcast_to(a, (4, *a.shape)), init)

    def run(state, batches):
        for b in batches:
            state = obs.update(state, b)
        return state, obs.compute(state, dtype=jnp.uint8, symmetric=False)

    got = jax.vmap(run)(states, jnp.asarray(xs))
    for i in range(4):
        state = cal.calibrate(obs, list(xs[i]))
        want = (state, obs.compute(state, dtype=jnp.uint8, symmetric=False))
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(lambda a, i=i: a[i], got), want)


@pytest.mark.parametrize("make", [cal.minmax, cal.moving_average_minmax, cal.histogram,
                                  cal.percentile, cal.mse])
@pytest.mark.parametrize("axis", ["a", 1.0, True])
def test_an_axis_that_is_not_an_int_is_refused_when_the_observer_is_made(make, axis):
    """Accepted when built, refused only at the first update."""
    with pytest.raises(TypeError, match=rf"^axis must be an int or None, got {axis!r}\.$"):
        make(axis=axis)
