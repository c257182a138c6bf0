"""Correctly rounded division without trusting the hardware division.

`correct_quotient` is fed deliberately inexact quotients (the reciprocal
rewrite ``x * (1 / s)``, and the true quotient moved by up to 64 ulps) and
must return NumPy's correctly rounded ``np.float32(x) / np.float32(s)`` bit for
bit. This is what `divide` does on TPUs (and on any backend but CPUs and GPUs),
whose division is not correctly rounded; the CPU (which runs these tests in CI)
checks the same code path. The
float8 NaN fixes that the GPU needs are checked the same way, on quotients and
codes shaped like the GPU's (one positive NaN pattern).

``JAXQUANT_EXACT_SIZE`` (default ``2**22``) sets the size of the end-to-end
check of `jaxquant.quantize` against the NumPy formula of ONNX QuantizeLinear.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from float_bits import TINY, f32, near_midpoints, u32

import jaxquant as jq
import jaxquant._rounding as rounding
from jaxquant._quantize import _signed_nan
from jaxquant._rounding import (
    _corrected_division,
    correct_quotient,
    divide,
    signed_nan_codes,
)

OFFSETS = (-64, -2, -1, 0, 1, 2, 64)  # ulps (float32 bit-pattern steps) away from the quotient


@jax.jit
def _all_corrections(x, s, q):
    """``correct_quotient`` of the reciprocal rewrite and of ``q`` moved by each offset."""
    qb = jax.lax.bitcast_convert_type(q, jnp.int32)
    starts = [x * (1 / s)] + [
        jax.lax.bitcast_convert_type(qb + k, jnp.float32) for k in OFFSETS
    ]
    return jnp.stack([correct_quotient(x, s, q0) for q0 in starts])


def _check(x: np.ndarray, s: np.ndarray, what: str) -> int:
    """Asserts every correction equals NumPy's quotient; returns the count checked."""
    with np.errstate(all="ignore"):
        ref = x / s
    # The reciprocal start is within 2 ulps only where 1 / s is a normal number.
    recip_ok = np.abs(s) < np.float32(1 / TINY)
    # A start must be a normal number (``q0`` is returned as is otherwise).
    starts = [f32(u32(ref).astype(np.int64) + k) for k in OFFSETS]
    valid = [recip_ok] + [np.isfinite(q) & (np.abs(q) >= TINY) for q in starts]
    out = np.asarray(_all_corrections(x, s, ref)).view(np.uint32)
    for i, name in enumerate(["x * (1 / s)", *(f"{k:+d} ulps" for k in OFFSETS)]):
        bad = np.flatnonzero((out[i] != u32(ref)) & valid[i])
        assert bad.size == 0, (
            f"{what}, start {name}: {bad.size} of {x.size} differ, e.g. x={x[bad[:3]].tolist()} "
            f"s={s[bad[:3]].tolist()} got {f32(out[i][bad[:3]]).tolist()} "
            f"expected {ref[bad[:3]].tolist()}"
        )
    return x.size


def _normal_operands(rng, n, exp_range):
    """Random normal x, s (random significands and signs) with normal quotients."""
    x = f32(rng.integers(0x3F800000, 0x40000000, n)) * np.exp2(
        rng.integers(-exp_range, exp_range, n)).astype(np.float32)
    s = f32(rng.integers(0x3F800000, 0x40000000, n)) * np.exp2(
        rng.integers(-exp_range, exp_range, n)).astype(np.float32)
    return x * rng.choice(np.float32([-1, 1]), n), s * rng.choice(np.float32([-1, 1]), n)


def test_correct_quotient_is_numpy_division_on_random_values():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(2):  # 2 x 2**22 values, each from 8 starting quotients
        checked += _check(*_normal_operands(rng, 1 << 22, 60), "random")
    assert checked == 1 << 23


def test_correct_quotient_near_midpoints():
    x, s = near_midpoints(np.random.default_rng(1), 1 << 22)
    n = x.size
    naive = x * (np.float32(1) / s)
    assert np.count_nonzero(u32(naive) != u32(x / s)) > n // 10  # the test can fail
    _check(x, s, "near midpoints")


def test_correct_quotient_at_binade_boundaries_and_extreme_exponents():
    rng = np.random.default_rng(2)
    n = 1 << 21
    # x = s * 2**k moved by a few ulps: quotients just below and above powers of two.
    s = f32(rng.integers(0x00800000, 0x7F000000, n))
    k = rng.integers(-24, 24, n)
    with np.errstate(over="ignore"):
        x = (s.astype(np.float64) * np.exp2(k)).astype(np.float32)
    x = f32(u32(x).astype(np.int64) + rng.integers(-3, 4, n))
    with np.errstate(all="ignore"):
        q = x / s
    keep = (np.abs(x) >= TINY) & np.isfinite(x) & (np.abs(q) >= TINY) & np.isfinite(q)
    assert keep.mean() > 0.9
    _check(x[keep], s[keep], "binade boundaries")
    # Operands and quotients near the ends of the normal range.
    x, s = _normal_operands(rng, n, 126)
    with np.errstate(all="ignore"):
        q = x / s
    keep = (np.abs(q) >= TINY) & np.isfinite(q)
    _check(x[keep], s[keep], "extreme exponents")


EDGES = [
    (1.0, 63.75), (1.0, 3.0), (-1.0, 3.0), (1.0, -3.0), (-1.0, -3.0), (0.3, 0.1),
    (1.0, 1.0), (1.0, 2.0**-126), (2.0**-126, 1.0), (2.0**-126, 2.0**126),
    (3.4028235e38, 1.0), (3.4028235e38, 3.4028235e38), (1.1754944e-38, 1.1754944e-38),
    (3.4028235e38, 2.0), (1.5, 1.0000001), (1.9999999, 1.0000001), (1.0, 1.9999999),
    (255.0, 127.0), (4.0, 255.0), (-128.0, 0.0078125), (7.0, 2.0**-20), (1e30, 1e-8),
]


@pytest.mark.parametrize("x, s", EDGES)
def test_correct_quotient_edge_cases(x, s):
    x, s = np.float32(x), np.float32(s)
    _check(np.array([x]), np.array([s]), f"{x} / {s}")


def test_correct_quotient_keeps_q0_outside_the_normal_range():
    """Zeros, infinities, NaN, overflowing or subnormal quotients: ``q0`` unchanged."""
    inf, nan = np.inf, np.nan
    x = np.float32([0.0, -0.0, inf, -inf, nan, 1.0, 1.0, 1.0, 3e38, 1e-30, 2.0**-126, 5.0])
    s = np.float32([3.0, 3.0, 3.0, 3.0, 3.0, 0.0, inf, nan, 1e-3, 1e10, 4.0, 1.0])
    with np.errstate(all="ignore"):
        q0 = x / s
    q0[-1] = np.float32(64.0)  # a start off by a factor of 8 or more is not corrected
    got = np.asarray(jax.jit(correct_quotient)(x, s, q0))
    np.testing.assert_array_equal(u32(got), u32(q0))


def test_corrected_division_propagates_nan_like_x86():
    """x's NaN (quieted, with its sign) first, then the scale's, as NumPy on x86 returns."""
    snan_neg, qnan_neg, qnan = 0xFF800001, 0xFFC00000, 0x7FC00000
    x = f32([snan_neg, qnan_neg, qnan, u32(np.float32(1.5)), qnan_neg])
    s = f32([u32(np.float32(2.0)), u32(np.float32(-2.0)), qnan_neg, qnan_neg, qnan])
    got = u32(jax.jit(_corrected_division)(x, s))
    np.testing.assert_array_equal(got, [0xFFC00001, qnan_neg, qnan, qnan_neg, qnan_neg])


def test_divide_on_cpu_is_one_division_instruction():
    """The CPU lowering keeps the plain (correctly rounded, memory-bound) division: one
    divide, none of the correction's Newton step and residuals (a few bit operations
    for subnormal operands aside)."""
    cpu = jax.devices("cpu")[0]
    x, s = jax.device_put(jnp.ones((8, 16)), cpu), jax.device_put(jnp.ones((8, 1)), cpu)

    def ops(fn):
        hlo = jax.jit(fn).lower(x, s).compile().as_text()
        return hlo.count(" divide("), hlo.count(" multiply(")

    divides, multiplies = ops(divide)
    assert divides == 1 and multiplies <= 4
    corrected_divides, corrected_multiplies = ops(_corrected_division)
    assert corrected_multiplies > 3 * multiplies


def test_divide_reads_subnormal_operands_on_cpu():
    """XLA:CPU reads subnormals as zero; the quotient is still IEEE's (NumPy's), and a
    quotient that would be subnormal flushes to a zero of its sign."""
    x = np.float32([1e-40, -3e-39, 1e-38, 1e-3, 2.0**-149, 1e-40, -1e-40, 1e-40])
    s = np.float32([2.0**-126, 1e-40, 1e-39, 1e-41, 1e-44, 1e-45, 1.0, -2.0])
    cpu = jax.devices("cpu")[0]  # also where the default backend is a GPU
    got = np.asarray(jax.jit(divide)(jax.device_put(x, cpu), jax.device_put(s, cpu)))
    want = x / s
    normal = np.abs(want) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(u32(got[normal]), u32(want[normal]))
    np.testing.assert_array_equal(u32(got[~normal]), u32(np.copysign(np.float32(0), want[~normal])))
    # scale_kind="normal" (computed scales): subnormal x still read from the bits
    s = np.where(np.abs(s) < np.finfo(np.float32).tiny, np.float32(2.0**-126), s)
    got = np.asarray(jax.jit(divide, static_argnums=2)(jax.device_put(x, cpu),
                                                       jax.device_put(s, cpu), "normal"))
    want = x / s
    normal = np.abs(want) >= np.finfo(np.float32).tiny
    assert normal.sum() >= 4
    np.testing.assert_array_equal(u32(got[normal]), u32(want[normal]))


def test_divide_is_differentiable_as_a_quotient():
    dx, ds = jax.grad(lambda x, s: divide(x, s), argnums=(0, 1))(jnp.float32(3.0),
                                                                 jnp.float32(2.0))
    assert (float(dx), float(ds)) == (0.5, -0.75)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_signed_nan_codes_are_ml_dtypes_patterns(name):
    dtype = getattr(ml_dtypes, name)
    t = np.concatenate([
        f32([0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001]),
        np.float32([np.inf, -np.inf, 1e6, -1e6, 1.0, -0.0, 0.3]),
    ])
    with np.errstate(invalid="ignore"):
        expected = t.astype(dtype)  # ml_dtypes: NaN keeps its sign; overflow is NaN/inf
    # Codes as XLA:GPU converts them: every NaN one positive pattern.
    gpu_like = expected.view(np.uint8).copy()
    gpu_like[np.isnan(expected.astype(np.float32))] = 0x7F
    assert np.count_nonzero(gpu_like != expected.view(np.uint8)) >= 3
    got = signed_nan_codes(jnp.asarray(t), jnp.asarray(gpu_like.view(dtype)))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_dequantized_nan_keeps_the_code_sign(name, out_dtype):
    codes = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name))
    expected = (codes.astype(np.float32) * np.float32(0.5)).astype(out_dtype)  # ONNX's formula
    uint = np.dtype(f"uint{8 * np.dtype(out_dtype).itemsize}")
    gpu_like = expected.view(uint).copy()
    gpu_like[np.isnan(expected.astype(np.float32))] = np.iinfo(uint).max >> 1  # canonical NaN
    got = _signed_nan(jnp.asarray(gpu_like.view(out_dtype)), jnp.asarray(codes))
    np.testing.assert_array_equal(np.asarray(got).view(uint), expected.view(uint))


# ---------------------------------------------------------------------------
# End to end: jaxquant.quantize against the NumPy formula of ONNX QuantizeLinear
# ---------------------------------------------------------------------------

EXACT_SIZE = int(os.environ.get("JAXQUANT_EXACT_SIZE", 1 << 22))


def _near_tie_data(rng, rows: int, cols: int):
    """Per-row few-bit scales and values within 3 ulps of ``(k + 0.5) * scale``."""
    m = 2 * rng.integers(0, 32, rows) + 1
    scale = (m * np.exp2(rng.integers(-10, 4, rows))).astype(np.float32)
    k = rng.integers(-200, 200, (rows, cols)).astype(np.float32)
    x = (k + np.float32(0.5)) * scale[:, None]  # exact in float32
    x = f32(u32(x).astype(np.int64) + rng.integers(-3, 4, (rows, cols)))
    noise = rng.standard_normal((rows, cols)).astype(np.float32) * scale[:, None] * 40
    x = np.where(rng.random((rows, cols)) < 0.25, noise, x).astype(np.float32)
    x.ravel()[rng.integers(0, x.size, 64)] = f32(rng.choice([0x7FC00000, 0xFFC00000], 64))
    return x, scale


@pytest.fixture(params=["cpu", "gpu"])
def division(request, monkeypatch):
    """The CPU's division, or (on the CPU) the float64 one `divide` lowers to on GPUs."""
    if request.param == "gpu":
        jax.clear_caches()  # programs traced with the CPU's division
        for kind in rounding.CPU_DIVISIONS:  # by the scales' kind
            monkeypatch.setitem(rounding.CPU_DIVISIONS, kind, rounding._wide_division)
    yield request.param
    if request.param == "gpu":
        jax.clear_caches()


@pytest.mark.parametrize("name", ["int8", "uint8", "int4", "float8_e4m3fn", "float8_e5m2"])
def test_quantize_codes_exact_at_scale(name, division):
    rng = np.random.default_rng(sum(map(ord, name)))
    fmt = jq.get_format(name)
    x, scale = _near_tie_data(rng, max(EXACT_SIZE // 1024, 1), 1024)
    with np.errstate(all="ignore"):
        t = x / scale[:, None]  # NumPy: correctly rounded
    zp, checked = None, ~np.isnan(x)  # integer codes of NaN are unspecified
    if fmt.is_integer:
        if not fmt.signed:
            zp = rng.integers(0, fmt.qmax + 1, scale.shape).astype(fmt.dtype)
        z = np.float32(0) if zp is None else zp.astype(np.float32)[:, None]
        ref = np.clip(np.nan_to_num(np.rint(t) + z), fmt.qmin, fmt.qmax).astype(fmt.dtype)
    else:
        ref = np.clip(t, -fmt.max_finite, fmt.max_finite).astype(fmt.dtype)
        checked[:] = True  # NaN codes too: ml_dtypes' patterns, sign kept
        assert np.any(np.isnan(ref.astype(np.float32)) & (ref.view(np.uint8) >= 0x80))
    quantize = jax.jit(jq.quantize, static_argnames=("dtype", "axis"))
    if division == "gpu":  # the swap took effect
        assert "xf64>" in quantize.lower(x, scale, zp, dtype=fmt.dtype, axis=0).as_text()
    got = np.asarray(quantize(x, scale, zp, dtype=fmt.dtype, axis=0).qvalue)
    assert got.dtype == ref.dtype
    a, e = got.view(np.uint8), ref.view(np.uint8)
    bad = np.flatnonzero((a != e) & checked)
    assert bad.size == 0, (
        f"{name}: {bad.size} of {x.size} codes differ, e.g. x={x.ravel()[bad[:4]].tolist()} "
        f"got {a.ravel()[bad[:4]].tolist()} expected {e.ravel()[bad[:4]].tolist()}"
    )
