"""Observers against PyTorch's ``torch.ao.quantization`` observers and float64 NumPy
references: data far from unit scale (values near float32's largest, ranges of a few
subnormal bin widths), degenerate and one-signed batches, per-channel layouts of 3-D
batches, long moving averages and states saved to files.

Scales far from 1 are checked against the same data at unit scale: multiplying the data by
a power of two must multiply every range and scale by it (each rounding is the same), as
long as nothing overflows or becomes subnormal in float32 itself.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _calibration as cal
from jaxquant import _histogram

QRANGE = {"uint8": (0, 255), "int8": (-128, 127), "int4": (-8, 7)}


def _skewed(seed, n=3000, batches=2):
    """Long-tailed batches of values >= 1 (still normal numbers when scaled by 2**-126)."""
    rng = np.random.default_rng(seed)
    return [(1 + rng.lognormal(0.0, 0.6, n) * (1 + i)).astype(np.float32)
            for i in range(batches)]


def _torch_observe(observer, batches):
    import torch

    for b in batches:
        observer(torch.from_numpy(np.ascontiguousarray(b)))
    return observer


def _torch_qparams(ref):
    return tuple(t.numpy() for t in ref.calculate_qparams())


# ----------------------------------------------------------------------------- far from unit scale


@pytest.mark.parametrize("power", [-126, 120])
def test_histogram_and_search_at_the_ends_of_float32_are_torchs_at_unit_scale(power):
    """Data of magnitude 1e37 (2**120): ``(x - min) * bins`` overflows float32, and every
    count landed in the last bin. Ranges of 1e-37 (2**-126): the bin width is subnormal,
    XLA:CPU flushes it to zero, and the search returned ``[min, min]``. Both must be
    PyTorch's histogram and search of the same data at unit scale, scaled back."""
    torch = pytest.importorskip("torch")
    batches = _skewed(30)
    ref = _torch_observe(torch.ao.quantization.HistogramObserver(bins=256), batches)
    t_lo, t_hi = (t.item() for t in ref._non_linear_param_search())
    f = np.float32(2.0 ** power)
    state = cal.calibrate(cal.histogram(256), [b * f for b in batches])
    np.testing.assert_array_equal(state.hist, ref.histogram.numpy())
    assert float(state.min) == ref.min_val.item() * float(f)
    assert float(state.max) == ref.max_val.item() * float(f)
    lo, hi = _histogram.search_range(_histogram.as_rows(state), dst_bins=256)
    assert t_hi - t_lo < ref.max_val.item() - ref.min_val.item()  # a real clip
    assert (float(lo[0]), float(hi[0])) == (t_lo * float(f), t_hi * float(f))


@pytest.mark.parametrize("power", [-126, 120])
def test_percentile_at_the_ends_of_float32_is_within_a_bin_of_numpy(power):
    """The percentile read-out interpolates inside bins of width ``(max - min) / bins``; a
    subnormal width (flushed to zero) put every percentile at the minimum."""
    f = np.float32(2.0 ** power)
    x = _skewed(31, batches=1)[0] * f
    state = cal.calibrate(cal.percentile(99.0, bins=256), [x])
    lo, hi = _histogram.percentile_range(_histogram.as_rows(state), jnp.float32(99.0))
    width = (float(state.max) - float(state.min)) / 256
    ref_lo, ref_hi = np.percentile(x.astype(np.float64), [1.0, 99.0])
    assert abs(float(lo[0]) - ref_lo) <= width and abs(float(hi[0]) - ref_hi) <= width


def _np_mse_scale(hist, lo, hi, name, symmetric, k):
    """`mse`'s docstring in float64: bin centers, candidate ranges ``r * [min, max]``,
    the first ratio with the least ``sum(count * (fq(center) - center)**2)``."""
    qmin, qmax = QRANGE[name]
    hist, lo, hi = np.asarray(hist, np.float64), float(lo), float(hi)
    centers = lo + (hi - lo) / hist.size * (np.arange(hist.size) + 0.5)

    def qparams(r):
        a, b = lo * r, hi * r
        if symmetric:
            return max(abs(a), abs(b)) / qmax, 0.0
        a, b = min(a, 0.0), max(b, 0.0)
        s = (b - a) / (qmax - qmin)
        return s, float(np.clip(qmin - np.rint(a / s), qmin, qmax))

    errors = []
    for i in range(1, k + 1):
        s, z = qparams(i / k)
        fq = (np.clip(np.rint(centers / s) + z, qmin, qmax) - z) * s
        errors.append(np.sum(hist * (fq - centers) ** 2))
    return qparams((int(np.argmin(errors)) + 1) / k)


@pytest.mark.parametrize("power,dtype,symmetric", [(-70, jnp.int4, True), (0, jnp.int4, True),
                                                   (60, jnp.uint8, False)])
def test_mse_clip_is_the_float64_search_at_any_magnitude(power, dtype, symmetric):
    """The squared errors were float32 sums: they underflow to zero for data below about
    1e-19 and overflow to inf above about 1e17, every candidate ties and the first one,
    a clip at 1% of the range, won."""
    name, k = np.dtype(dtype).name, 50
    rng = np.random.default_rng(32)
    x = rng.standard_t(3, 20000).astype(np.float32) * np.float32(2.0 ** power)
    obs = cal.mse(k, bins=512)
    state = cal.calibrate(obs, [x])
    scale, zp = obs.compute(state, dtype=dtype, symmetric=symmetric)
    want_scale, want_zp = _np_mse_scale(state.hist, state.min, state.max, name, symmetric, k)
    np.testing.assert_allclose(float(scale), want_scale, rtol=1e-6)
    assert zp is None if symmetric else int(zp) == want_zp
    qmin, qmax = QRANGE[name]
    full, levels = ((np.abs(x).max(), qmax) if symmetric
                    else (x.max() - min(x.min(), 0), qmax - qmin))
    assert 0.1 * full < float(scale) * levels < full  # clipped, not to 1%


# ----------------------------------------------------------------------------- degenerate batches


def test_histogram_of_a_constant_batch_uses_torchs_bin():
    """``torch.histc`` over ``[v, v]`` bins the values over ``[v - 1, v + 1]`` in float32:
    bin ``bins // 2`` only where ``v - (v - 1)`` and ``(v + 1) - (v - 1)`` round to 1 and 2
    (-0.3 is in bin 31 of 64, not 32)."""
    torch = pytest.importorskip("torch")
    for bins in (64, 15):
        for v in (-0.3, 0.1, 1.0 / 3.0, 2.0 ** 23 + 1, 3e7):
            batches = [np.full(4, v, np.float32)] * 2
            ref = _torch_observe(torch.ao.quantization.HistogramObserver(bins=bins), batches)
            state = cal.calibrate(cal.histogram(bins), batches)
            np.testing.assert_array_equal(state.hist, ref.histogram.numpy(), err_msg=f"{v}")


@pytest.mark.parametrize("data", ["negative", "positive", "zeros"])
def test_one_signed_and_degenerate_batches_match_torch(data):
    """Affine qparams of data on one side of zero and of zeros: PyTorch's
    range ``[min(lo, 0), max(hi, 0)]``, so 0.0 stays exactly representable (an integer zero
    point in range). All-zero data: scale 1 (documented), where PyTorch clamps to eps."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(33)
    x = np.abs(rng.standard_t(3, (40, 3))).astype(np.float32) + np.float32(0.25)
    x = {"negative": -x, "positive": x, "zeros": np.zeros_like(x)}[data]
    batches = [x, x * np.float32(1.5)]
    q = torch.ao.quantization
    for jdtype, tdtype in [(jnp.uint8, torch.quint8), (jnp.int8, torch.qint8)]:
        for obs, ref in [(cal.minmax(), q.MinMaxObserver(dtype=tdtype)),
                         (cal.minmax(axis=-1), q.PerChannelMinMaxObserver(-1, dtype=tdtype)),
                         (cal.moving_average_minmax(0.3), q.MovingAverageMinMaxObserver(
                             0.3, dtype=tdtype)),
                         (cal.histogram(64), q.HistogramObserver(64, dtype=tdtype))]:
            scale, zp = obs.compute(cal.calibrate(obs, batches), dtype=jdtype, symmetric=False)
            t_scale, t_zp = _torch_qparams(_torch_observe(ref, batches))
            np.testing.assert_array_equal(np.ravel(zp).astype(np.int64), t_zp.ravel())
            if data == "zeros":
                np.testing.assert_array_equal(np.ravel(scale), np.ones_like(t_scale.ravel()))
            else:
                np.testing.assert_array_equal(np.ravel(scale), t_scale.ravel())
            zero = jq.quantize(jnp.zeros_like(x), scale, zp, dtype=jdtype,
                               axis=-1 if np.ndim(scale) else None).dequantize()
            assert np.all(np.asarray(zero) == 0.0)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_channel_symmetric_of_3d_batches_is_torchs_absmax(axis):
    """``per_channel_symmetric`` qint8 on every axis of 3-D batches, plain and moving
    average: the same absmax per channel (PyTorch divides it by 127.5, jaxquant by 127)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(34)
    batches = [(rng.standard_normal((4, 5, 6)) * (1 + i) - 0.5 * i).astype(np.float32)
               for i in range(3)]
    q, sym = torch.ao.quantization, torch.per_channel_symmetric
    for obs, ref in [(cal.minmax(axis=axis), q.PerChannelMinMaxObserver(
                         axis, dtype=torch.qint8, qscheme=sym)),
                     (cal.moving_average_minmax(0.3, axis=axis),
                      q.MovingAveragePerChannelMinMaxObserver(
                          0.3, axis, dtype=torch.qint8, qscheme=sym))]:
        state = cal.calibrate(obs, batches)
        ref = _torch_observe(ref, batches)
        np.testing.assert_array_equal(state.min, ref.min_val.numpy())
        np.testing.assert_array_equal(state.max, ref.max_val.numpy())
        scale, zp = obs.compute(state, dtype=jnp.int8)
        t_scale, t_zp = _torch_qparams(ref)
        assert zp is None and not t_zp.any() and scale.shape == t_scale.shape
        np.testing.assert_allclose(np.asarray(scale) * 127, t_scale * 127.5, rtol=2e-7)


def test_moving_average_over_many_batches_is_torchs():
    """Two hundred batches at PyTorch's default constant 0.01: the same float32 rounding of
    every step (a product rounded before the add), so the same range bit for bit."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(35)
    batches = [(rng.standard_normal(64) * (1 + 0.01 * i) + 0.02 * i).astype(np.float32)
               for i in range(200)]
    ref = _torch_observe(torch.ao.quantization.MovingAverageMinMaxObserver(), batches)
    state = cal.calibrate(cal.moving_average_minmax(), batches)
    assert (float(state.min), float(state.max)) == (ref.min_val.item(), ref.max_val.item())
    assert int(state.count) == 200


def test_states_saved_and_loaded_continue_the_calibration(tmp_path):
    """The states are pytrees of arrays: saved with `save_safetensors` and loaded on their
    init's tree, they continue bit for bit as if never interrupted."""
    pytest.importorskip("safetensors")
    rng = np.random.default_rng(36)
    batches = [rng.standard_t(3, (30, 4)).astype(np.float32) * (1 + i) for i in range(4)]
    for i, obs in enumerate([cal.moving_average_minmax(0.2, axis=-1), cal.histogram(64)]):
        path = os.fspath(tmp_path / f"state{i}.safetensors")
        jq.save_safetensors(path, cal.calibrate(obs, batches[:2]))
        loaded = jq.load_safetensors(path, target=obs.init(batches[0]))
        assert type(loaded) is type(obs.init(batches[0]))
        got = cal.calibrate(obs, batches[2:], state=loaded)
        jax.tree.map(np.testing.assert_array_equal, got, cal.calibrate(obs, batches))


@pytest.mark.parametrize("make", [lambda: jq.calibration.histogram(bins=256),
                                  lambda: jq.calibration.percentile(99.0),
                                  lambda: jq.calibration.mse(),
                                  lambda: jq.calibration.histogram(bins=64, axis=1)],
                         ids=["histogram", "percentile", "mse", "histogram-per-axis"])
def test_histogram_observers_under_x64_and_strict_promotion(make):
    # before: jnp.arange(bins) is int64 with x64 on, compared with int32 bin indices:
    # TypePromotionError under strict promotion (the setting of this test suite)
    rng = np.random.default_rng(3)
    batches = [jnp.asarray(rng.standard_normal((16, 8)) * k, jnp.float32) for k in (1, 3)]
    obs = make()
    want = obs.compute(jq.calibration.calibrate(obs, batches), dtype=jnp.int8)
    with jax.enable_x64():
        got = obs.compute(jq.calibration.calibrate(obs, batches), dtype=jnp.int8)
    for a, b in zip(got, want, strict=True):
        if b is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
