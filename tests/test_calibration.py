"""Calibration observers against PyTorch's observers and NumPy references.

PyTorch comparisons feed the same float32 batches to ``torch.ao.quantization``
observers. Ranges (``min_val``/``max_val``, histograms, the histogram search)
must match exactly. Affine qparams match exactly too; symmetric qparams
differ by design (jaxquant maps the absmax to ``qmax``, PyTorch to
``(qmax - qmin) / 2``), so for those the tests check that both scales come
from the same absmax.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _calibration as cal
from jaxquant import _histogram

QRANGE = {"uint8": (0, 255), "int8": (-128, 127), "int4": (-8, 7)}


def _batches(seed=0, shape=(2000,), kind="normal", n=4):
    """Batches whose range grows and shifts, so running statistics matter."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if kind == "normal":
            b = rng.standard_normal(shape) * (0.5 + i) + 0.3 * i
        elif kind == "student":
            b = rng.standard_t(2, shape) * (1 + 0.5 * i)
        else:  # "constant_first": one value, then spread data
            b = np.full(shape, 1.5) if i == 0 else rng.uniform(-1, 3, shape) * i
        out.append(b.astype(np.float32))
    return out


def _torch_observe(observer, batches):
    import torch

    for b in batches:
        observer(torch.from_numpy(b))
    return observer


def _assert_qparams_like_torch(scale, zp, ref, dtype, symmetric):
    t_scale, t_zp = (t.numpy().reshape(np.shape(scale)) for t in ref.calculate_qparams())
    qmin, qmax = QRANGE[np.dtype(dtype).name]
    if symmetric:  # same absmax; PyTorch divides it by (qmax - qmin) / 2, jaxquant by
        # qmax (signed) or by qmax - 128 around the mid-range zero point (unsigned)
        levels = qmax if qmin < 0 else qmax - (qmax + 1) // 2
        np.testing.assert_allclose(np.asarray(scale) * levels, t_scale * (qmax - qmin) / 2,
                                   rtol=2e-7)
        expected_zp = np.zeros_like(t_zp) if zp is None else np.asarray(zp)
        np.testing.assert_array_equal(expected_zp, t_zp)
    else:
        np.testing.assert_array_equal(np.asarray(scale), t_scale)
        np.testing.assert_array_equal(np.asarray(zp).astype(np.int64), t_zp)


# ----------------------------------------------------------------------------- min/max


@pytest.mark.parametrize("dtype,tdtype", [(jnp.uint8, "quint8"), (jnp.int8, "qint8")])
@pytest.mark.parametrize("symmetric", [False, True])
def test_minmax_per_tensor_matches_torch(dtype, tdtype, symmetric):
    torch = pytest.importorskip("torch")
    batches = _batches(1)
    qscheme = torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine
    ref = _torch_observe(torch.ao.quantization.MinMaxObserver(
        dtype=getattr(torch, tdtype), qscheme=qscheme), batches)
    obs = cal.minmax()
    state = cal.calibrate(obs, batches)
    assert float(state.min) == ref.min_val.item() and float(state.max) == ref.max_val.item()
    assert int(state.count) == len(batches)
    scale, zp = obs.compute(state, dtype=dtype, symmetric=symmetric)
    _assert_qparams_like_torch(scale, zp, ref, dtype, symmetric)


@pytest.mark.parametrize("axis", [0, 1, -1, -3])
def test_minmax_per_axis_matches_torch(axis):
    torch = pytest.importorskip("torch")
    batches = _batches(2, shape=(6, 5, 4))
    ref = _torch_observe(torch.ao.quantization.PerChannelMinMaxObserver(ch_axis=axis), batches)
    obs = cal.minmax(axis=axis)
    state = cal.calibrate(obs, batches)
    np.testing.assert_array_equal(state.min, ref.min_val.numpy())
    np.testing.assert_array_equal(state.max, ref.max_val.numpy())
    scale, zp = obs.compute(state, dtype=jnp.uint8, symmetric=False)
    _assert_qparams_like_torch(scale, zp, ref, jnp.uint8, False)


@pytest.mark.parametrize("axis", [None, 1, -1])
def test_moving_average_matches_torch(axis):
    torch = pytest.importorskip("torch")
    batches = _batches(3, shape=(50, 3))
    q = torch.ao.quantization
    if axis is None:
        ref = q.MovingAverageMinMaxObserver(averaging_constant=0.1)
    else:
        ref = q.MovingAveragePerChannelMinMaxObserver(averaging_constant=0.1, ch_axis=axis)
    ref = _torch_observe(ref, batches)
    obs = cal.moving_average_minmax(0.1, axis=axis)
    state = cal.calibrate(obs, batches)
    np.testing.assert_array_equal(np.ravel(state.min), ref.min_val.numpy().ravel())
    np.testing.assert_array_equal(np.ravel(state.max), ref.max_val.numpy().ravel())
    # The moving average is not the running min: it has moved inside it.
    assert np.all(np.asarray(state.max) < np.max([b.max() for b in batches]))
    scale, zp = obs.compute(state, dtype=jnp.uint8, symmetric=False)
    _assert_qparams_like_torch(scale, zp, ref, jnp.uint8, False)


@pytest.mark.parametrize("dtype,symmetric", [(jnp.int8, True), (jnp.uint8, False),
                                             (jnp.int4, False), (jnp.float8_e4m3fn, True)])
def test_minmax_scale_is_quantize_computed_scale(dtype, symmetric):
    batches = _batches(4, shape=(7, 3))
    obs = cal.minmax(axis=-1)
    scale, zp = obs.compute(cal.calibrate(obs, batches), dtype=dtype, symmetric=symmetric)
    qt = jq.quantize(jnp.asarray(np.concatenate(batches)), dtype=dtype, axis=-1,
                     symmetric=symmetric)
    np.testing.assert_array_equal(scale, qt.scale)
    if qt.zero_point is None:
        assert zp is None
    else:
        np.testing.assert_array_equal(zp, qt.zero_point)


# ----------------------------------------------------------------------------- histogram


def test_a_bin_of_more_than_2_24_values_keeps_every_count():
    """A batch's counts are summed as integers: a float32 sum stuck at 2**24 for the bin of a
    large batch's zeros (ReLU or padded activations); torch.histc keeps them all."""
    torch = pytest.importorskip("torch")
    x = np.zeros(2**24 + 3001, np.float32)
    x[:1000] = np.linspace(-1.0, 1.0, 1000)
    ref = _torch_observe(torch.ao.quantization.HistogramObserver(bins=256), [x])
    state = cal.calibrate(cal.histogram(256), [x])
    np.testing.assert_array_equal(state.hist, ref.histogram.numpy())
    assert np.sum(np.asarray(state.hist, np.float64)) == x.size - 1  # (an odd count: rounded)


@pytest.mark.parametrize("kind,bins", [("normal", 2048), ("student", 2048),
                                       ("constant_first", 256)])
def test_histogram_matches_torch(kind, bins):
    torch = pytest.importorskip("torch")
    batches = _batches(5, shape=(20000,), kind=kind)
    ref = _torch_observe(torch.ao.quantization.HistogramObserver(bins=bins), batches)
    obs = cal.histogram(bins)
    state = cal.calibrate(obs, batches)
    np.testing.assert_array_equal(state.hist, ref.histogram.numpy())
    assert float(state.min) == ref.min_val.item() and float(state.max) == ref.max_val.item()
    lo, hi = _histogram.search_range(_histogram.as_rows(state), dst_bins=256)
    t_lo, t_hi = ref._non_linear_param_search()
    assert (float(lo[0]), float(hi[0])) == (t_lo.item(), t_hi.item())
    assert float(hi[0] - lo[0]) < float(state.max - state.min)  # the search clipped something
    scale, zp = obs.compute(state, dtype=jnp.uint8, symmetric=False)
    _assert_qparams_like_torch(scale, zp, ref, jnp.uint8, False)


def test_histogram_symmetric_matches_torch():
    torch = pytest.importorskip("torch")
    batches = _batches(6, shape=(20000,), kind="student")
    ref = _torch_observe(torch.ao.quantization.HistogramObserver(
        dtype=torch.qint8, qscheme=torch.per_tensor_symmetric), batches)
    obs = cal.histogram()
    scale, zp = obs.compute(cal.calibrate(obs, batches), dtype=jnp.int8)
    _assert_qparams_like_torch(scale, zp, ref, jnp.int8, True)


def test_histogram_per_axis_is_torch_per_channel():
    torch = pytest.importorskip("torch")
    batches = [b * np.float32([1.0, 10.0, 0.1]) for b in _batches(7, shape=(4000, 3))]
    obs = cal.histogram(axis=-1)
    state = cal.calibrate(obs, batches)
    scale, zp = obs.compute(state, dtype=jnp.uint8, symmetric=False)
    assert state.hist.shape == (3, 2048) and scale.shape == zp.shape == (3,)
    for c in range(3):
        ref = _torch_observe(torch.ao.quantization.HistogramObserver(),
                             [np.ascontiguousarray(b[:, c]) for b in batches])
        np.testing.assert_array_equal(state.hist[c], ref.histogram.numpy())
        _assert_qparams_like_torch(scale[c], zp[c], ref, jnp.uint8, False)


def test_histogram_skips_infinities_and_propagates_nan():
    x = _batches(8, shape=(1000,))[0]
    obs = cal.histogram(64)
    clean = obs.update(obs.init(x), x)
    with_inf = obs.update(obs.init(x), np.concatenate([x, np.float32([np.inf, -np.inf])]))
    jax.tree.map(np.testing.assert_array_equal, with_inf, clean)
    with_nan = obs.update(clean, np.float32([0.5, np.nan]))
    assert np.isnan(obs.compute(with_nan, dtype=jnp.uint8, symmetric=False)[0])


# ----------------------------------------------------------------------------- percentile


@pytest.mark.parametrize("q", [99.99, 99.0, 90.0])
def test_percentile_matches_numpy(q):
    batches = _batches(9, shape=(20000,), kind="student")
    state = cal.calibrate(cal.percentile(q), batches[:1])
    lo, hi = _histogram.percentile_range(_histogram.as_rows(state), jnp.float32(q))
    width = float(state.max - state.min) / 2048
    ref_lo, ref_hi = np.percentile(batches[0], [100 - q, q])
    assert abs(float(lo[0]) - ref_lo) <= width and abs(float(hi[0]) - ref_hi) <= width
    # Over growing ranges the old counts are re-binned: allow two (new) bins.
    state = cal.calibrate(cal.percentile(q), batches)
    lo, hi = _histogram.percentile_range(_histogram.as_rows(state), jnp.float32(q))
    width = float(state.max - state.min) / 2048
    ref_lo, ref_hi = np.percentile(np.concatenate(batches), [100 - q, q])
    assert abs(float(lo[0]) - ref_lo) <= 2 * width and abs(float(hi[0]) - ref_hi) <= 2 * width


def test_percentile_scales_per_axis():
    batches = _batches(10, shape=(3, 5000), kind="student")
    obs = cal.percentile(99.0, axis=-2)
    state = cal.calibrate(obs, batches[:1])
    scale, zp = obs.compute(state, dtype=jnp.int8)
    assert zp is None and scale.shape == (3,)
    ref = np.percentile(batches[0], [1.0, 99.0], axis=1)
    amax = np.max(np.abs(ref), axis=0)
    width = (np.asarray(state.max) - np.asarray(state.min)) / 2048
    assert np.all(np.abs(np.asarray(scale) * 127 - amax) <= width * (1 + 1e-6))
    assert np.all(np.asarray(scale) * 127 < np.max(np.abs(batches[0]), axis=1))  # clipped


def test_percentile_100_is_minmax():
    batches = _batches(11, shape=(500,))
    obs, mm = cal.percentile(100.0), cal.minmax()
    got = obs.compute(cal.calibrate(obs, batches), dtype=jnp.uint8, symmetric=False)
    want = mm.compute(cal.calibrate(mm, batches), dtype=jnp.uint8, symmetric=False)
    jax.tree.map(np.testing.assert_array_equal, got, want)


# ----------------------------------------------------------------------------- mse


def _np_fake_quant(x, scale, zp, qmin, qmax):
    q = np.clip(np.rint(x / scale) + zp, qmin, qmax)
    return ((q - zp) * scale).astype(np.float32)


def _np_scale(lo, hi, name, symmetric):
    qmin, qmax = QRANGE[name]
    if symmetric:
        return np.float32(max(abs(lo), abs(hi))) / np.float32(qmax), np.float32(0)
    lo, hi = min(lo, np.float32(0)), max(hi, np.float32(0))
    scale = (hi - lo) / np.float32(qmax - qmin)
    return scale, np.clip(np.float32(qmin) - np.rint(lo / scale), qmin, qmax)


def _heavy_tailed(seed, n=50000):
    rng = np.random.default_rng(seed)
    return rng.standard_t(3, n).astype(np.float32)


@pytest.mark.parametrize("dtype,symmetric", [(jnp.int4, True), (jnp.uint8, False)])
def test_mse_equals_numpy_brute_force(dtype, symmetric):
    name, k = np.dtype(dtype).name, 100
    x = _heavy_tailed(12)
    obs = cal.mse(k)
    state = cal.calibrate(obs, [x])
    scale, zp = obs.compute(state, dtype=dtype, symmetric=symmetric)
    # The same search in NumPy (float64 sums) over the observer's histogram.
    hist, lo, hi = (np.asarray(a) for a in state)
    width = (hi - lo) / np.float32(hist.size)
    centers = lo + width * (np.arange(hist.size, dtype=np.float32) + np.float32(0.5))
    errors = []
    for i in range(1, k + 1):
        r = np.float32(i) / np.float32(k)
        s, z = _np_scale(lo * r, hi * r, name, symmetric)
        fq = _np_fake_quant(centers, s, z, *QRANGE[name])
        errors.append(np.sum(hist.astype(np.float64) * (fq.astype(np.float64) - centers) ** 2))
    r = np.float32(np.argmin(errors) + 1) / np.float32(k)
    s, z = _np_scale(lo * r, hi * r, name, symmetric)
    assert float(scale) == s and (zp is None or int(zp) == z)
    assert r < 1  # heavy tails: a real clip, not the full range


def test_mse_beats_minmax_on_heavy_tailed_data():
    x = _heavy_tailed(13)
    obs, mm = cal.mse(), cal.minmax()
    scale, _ = obs.compute(cal.calibrate(obs, [x]), dtype=jnp.int4)
    mm_scale, _ = mm.compute(cal.calibrate(mm, [x]), dtype=jnp.int4)

    def data_error(s):
        return float(np.sum((np.asarray(jq.fake_quant(x, s, dtype=jnp.int4)) - x) ** 2))

    assert data_error(scale) < 0.5 * data_error(mm_scale)
    # Near the best clip of the same candidates measured on the data itself.
    amax = float(np.max(np.abs(x)))
    best = min(data_error(jnp.float32(amax * i / 100 / 7)) for i in range(1, 101))
    assert data_error(scale) <= 1.01 * best


def test_mse_per_axis_is_per_tensor_per_channel():
    x = np.stack([_heavy_tailed(14, 4000), _heavy_tailed(15, 4000) * 3], axis=1)
    obs = cal.mse(50, bins=512, axis=-1)
    scale, _ = obs.compute(cal.calibrate(obs, [x]), dtype=jnp.int8)
    one = cal.mse(50, bins=512)
    for c in range(2):
        want, _ = one.compute(cal.calibrate(one, [np.ascontiguousarray(x[:, c])]), dtype=jnp.int8)
        assert float(scale[c]) == float(want)


# ----------------------------------------------------------------------------- protocol


OBSERVERS = {
    "minmax": cal.minmax,
    "moving_average": lambda axis: cal.moving_average_minmax(0.2, axis=axis),
    "histogram": lambda axis: cal.histogram(64, axis=axis),
    "percentile": lambda axis: cal.percentile(99.0, bins=64, axis=axis),
    "mse": lambda axis: cal.mse(20, bins=64, axis=axis),
}


@pytest.mark.parametrize("name", sorted(OBSERVERS))
@pytest.mark.parametrize("axis", [None, -1])
def test_state_is_a_pytree_and_update_runs_under_jit(name, axis):
    obs = OBSERVERS[name](axis=axis)
    batches = _batches(16, shape=(40, 3))
    state = obs.init(jax.ShapeDtypeStruct((40, 3), jnp.float32))
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(a, jax.Array) for a in leaves)
    eager = cal.calibrate(obs, batches, state=state)

    @jax.jit
    def run(state, xs):  # update traced under jit, the state carried through lax.scan
        state, _ = jax.lax.scan(lambda s, x: (obs.update(s, x), None), state, xs)
        return state, obs.compute(state, dtype=jnp.uint8, symmetric=False)

    jitted, qparams = run(state, jnp.stack(batches))
    assert jax.tree.structure(jitted) == jax.tree.structure(state)
    assert [a.shape for a in jax.tree.leaves(jitted)] == [a.shape for a in leaves]
    jax.tree.map(np.testing.assert_array_equal, jitted, eager)
    jax.tree.map(np.testing.assert_array_equal, qparams,
                 obs.compute(eager, dtype=jnp.uint8, symmetric=False))
    scale, zp = qparams
    assert scale.shape == zp.shape == (() if axis is None else (3,))
    assert np.all(np.asarray(scale) > 0) and np.all(np.isfinite(scale))


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8])
@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_uncalibrated_state_gives_unit_scale(name, dtype):
    """As torch's observers before any batch (scale 1, zero point 0, for quint8 and qint8)."""
    obs = OBSERVERS[name](axis=None)
    scale, zp = obs.compute(obs.init(jnp.zeros(4)), dtype=dtype, symmetric=False)
    assert float(scale) == 1.0 and int(zp) == 0


def test_errors():
    obs = cal.minmax(axis=-1)
    state = obs.init(jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"ranges of shape \(4,\).*holds ranges of shape \(3,\)"):
        obs.update(state, jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"axis must be in \[-1, 1\)"):
        cal.minmax(axis=1).init(jnp.zeros(3))
    with pytest.raises(TypeError, match="floating-point"):
        obs.update(state, jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="symmetric=False needs an integer format"):
        obs.compute(state, dtype=jnp.float8_e4m3fn, symmetric=False)
    with pytest.raises(TypeError, match="quantized formats"):
        obs.compute(state, dtype=jnp.float32)
    with pytest.raises(ValueError, match="evenly spaced integer levels"):
        cal.histogram().compute(cal.histogram().init(jnp.zeros(3)), dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"averaging_constant must be in \(0, 1\]"):
        cal.moving_average_minmax(0.0)
    with pytest.raises(ValueError, match=r"q must be in \[50, 100\]"):
        cal.percentile(1.0)
    with pytest.raises(ValueError, match="bins must be a positive int, got 0"):
        cal.histogram(0)
    with pytest.raises(TypeError, match="num_candidates must be a positive int, got 2.5"):
        cal.mse(2.5)
    with pytest.raises(ValueError, match="no batches and no initial state"):
        cal.calibrate(obs, [])


def test_second_update_does_not_retrace():
    obs = cal.histogram(64, axis=0)
    x = _batches(18, shape=(3, 50))
    state = obs.update(obs.init(x[0]), x[0])
    before = cal._histogram_update._cache_size()
    state = obs.update(obs.update(state, x[1]), x[2])
    assert cal._histogram_update._cache_size() == before
    assert state.hist.shape == (3, 64)


def test_nan_gives_nan_scale_and_empty_batch_is_ignored():
    obs = cal.minmax()
    state = cal.calibrate(obs, [jnp.array([1.0, -2.0])])
    assert obs.update(state, jnp.zeros((0,))) is state
    scale, _ = obs.compute(obs.update(state, jnp.array([jnp.nan])), dtype=jnp.int8)
    assert np.isnan(scale)


def test_calibrate_progress_with_and_without_tqdm(monkeypatch, capsys):
    obs = cal.minmax()
    batches = _batches(17, shape=(10,))
    want = cal.calibrate(obs, batches)
    try:
        import tqdm  # noqa: F401  (optional)
    except ImportError:
        pass
    else:
        got = cal.calibrate(obs, iter(batches), progress=True)
        jax.tree.map(np.testing.assert_array_equal, got, want)
        assert "calibrating" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    got = cal.calibrate(obs, batches, progress=True)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("observer", ["minmax", "moving_average_minmax", "percentile", "mse"])
@pytest.mark.parametrize("name", ["nf4", "fp4", "float6_e2m3fn"])
def test_observers_give_codebook_scales_not_storage_dtype_ones(observer, name):
    """A codebook's storage dtype is uint4/uint8; its scale maps absmax to the table's
    largest entry, without a zero point, as `quantize` computes it."""
    x = jnp.array([-1.0, 2.0, 0.5, 3.0])
    obs = getattr(jq.calibration, observer)()
    scale, zero_point = obs.compute(jq.calibration.calibrate(obs, [x]), dtype=name)
    assert zero_point is None
    want = jq.quantize(x, dtype=name).scale
    np.testing.assert_allclose(float(scale), np.asarray(want).max(), rtol=0.05)  # mse: close
    back = np.asarray(jq.quantize(x, scale, dtype=name).dequantize())
    assert np.abs(back - np.asarray(x)).max() < 0.5


def test_histogram_search_refuses_wide_formats():
    obs = jq.calibration.histogram()
    state = jq.calibration.calibrate(obs, [jnp.arange(8.0)])
    with pytest.raises(ValueError, match="at most 16 bits, got int32"):
        obs.compute(state, dtype=jnp.int32)


# ----------------------------------------------------------------------------- review


@pytest.mark.parametrize("power", [-100, -60, 50, 70])
def test_histogram_search_is_the_same_far_from_unit_scale(power):
    """The L2 error of the search is a cube of bin widths: in float32 it underflows for
    data below about 1e-13 and overflows above about 1e12, and the search then collapses
    to a sliver of the range. Scaled by a power of two, the data must give PyTorch's range
    at unit scale, scaled back."""
    torch = pytest.importorskip("torch")
    batches = _batches(19, shape=(5000,), kind="student", n=2)
    ref = _torch_observe(torch.ao.quantization.HistogramObserver(bins=256), batches)
    t_lo, t_hi = (t.item() for t in ref._non_linear_param_search())
    assert t_hi - t_lo > 0.5 * (ref.max_val.item() - ref.min_val.item())  # a real range
    f = np.float32(2.0 ** power)
    obs = cal.histogram(256)
    state = cal.calibrate(obs, [b * f for b in batches])
    np.testing.assert_array_equal(state.hist, ref.histogram.numpy())
    lo, hi = _histogram.search_range(_histogram.as_rows(state), dst_bins=256)
    assert (float(lo[0]), float(hi[0])) == (t_lo * float(f), t_hi * float(f))


def test_histogram_of_tiny_values_is_torchs():
    """PyTorch's histogram of values near 1e-30 involves no subnormal number; the emulation
    of its rounding must not flush any either."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(20)
    for scale in (1e-30, 1e-33, 1e-36):
        batches = [(rng.standard_normal(200) * scale * (1 + i)).astype(np.float32)
                   for i in range(3)]
        ref = _torch_observe(torch.ao.quantization.HistogramObserver(bins=256), batches)
        state = cal.calibrate(cal.histogram(256), batches)
        np.testing.assert_array_equal(state.hist, ref.histogram.numpy())
        assert float(state.min) == ref.min_val.item() and float(state.max) == ref.max_val.item()


def test_state_of_another_observer_is_a_type_error():
    x = jnp.ones((4, 3))
    with pytest.raises(TypeError, match="state must be a RangeState.*got HistogramState"):
        cal.minmax().update(cal.histogram(8).init(x), x)
    with pytest.raises(TypeError, match="state must be a HistogramState.*got RangeState"):
        cal.histogram(8).update(cal.minmax().init(x), x)
    with pytest.raises(TypeError, match="state must be a HistogramState.*got NoneType"):
        cal.mse(4).compute(None)
    with pytest.raises(TypeError, match="state must be a RangeState.*got tuple"):
        cal.moving_average_minmax().compute((jnp.ones(()), jnp.ones(()), 1))


@pytest.mark.parametrize("make,name", [
    (lambda v: cal.moving_average_minmax(v), "averaging_constant"),
    (lambda v: cal.percentile(v), "q"),
])
@pytest.mark.parametrize("value", ["0.5", None, True, jnp.ones(2)])
def test_non_numbers_are_type_errors_naming_the_argument(make, name, value):
    with pytest.raises(TypeError, match=rf"{name} must be a (real )?number, got"):
        make(value)
    make(np.float32(0.5) if name == "averaging_constant" else np.float64(99.0))  # NumPy scalars


def test_calibrate_refuses_a_single_array_and_compute_a_non_bool_symmetric():
    obs = cal.minmax(axis=1)
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    for single in (x, jnp.asarray(x)):
        with pytest.raises(TypeError, match=r"single array of shape \(3, 4\).*pass \[x\]"):
            cal.calibrate(obs, single)
    state = cal.calibrate(obs, [x])
    with pytest.raises(TypeError, match="symmetric must be a bool.*'no'"):
        obs.compute(state, dtype=jnp.uint8, symmetric="no")
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        obs.compute(state, symmetric=1)
