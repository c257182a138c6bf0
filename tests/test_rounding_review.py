"""Stochastic rounding, the Hadamard transform and codebook rounding against independent
references: exact fractions and float64 nearest entries in NumPy, a float64 butterfly
Walsh-Hadamard transform, SciPy's Hadamard matrix."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import jaxquant as jq
from jaxquant._codebooks import encode
from jaxquant._formats import CODEBOOKS


def _fwht(x: np.ndarray, axis: int) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform of the whole ``axis`` in float64 (butterflies)."""
    y = np.moveaxis(np.asarray(x, np.float64), axis, -1).copy()
    n, h = y.shape[-1], 1
    while h < n:
        v = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = v[..., 0, :].copy(), v[..., 1, :].copy()
        v[..., 0, :], v[..., 1, :] = a + b, a - b
        h *= 2
    return np.moveaxis(y / np.sqrt(n), -1, axis)


def test_hadamard_of_a_long_axis_keeps_its_constants_small():
    """One Hadamard matrix of a 2**19 block (the default for a vector of that length) holds
    2**26 entries (256 MiB as float32; a 2**22 vector needed 4 GiB and ran out of memory):
    the Kronecker factors must stay at most 128 x 128."""
    traced = jax.make_jaxpr(jq.hadamard_transform)(jax.ShapeDtypeStruct((2**19,), jnp.float32))
    sizes = [int(np.size(c)) for c in traced.consts]
    assert sizes and max(sizes) <= 128 * 128, sizes


def test_hadamard_with_three_kronecker_factors_equals_the_butterflies():
    x = np.random.default_rng(0).normal(size=(2**15, 2)).astype(np.float32)  # 2 x 128 x 128
    y = jq.hadamard_transform(x, 0)
    ref = _fwht(x, 0)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, atol=2e-5)
    np.testing.assert_allclose(jq.hadamard_transform(y, 0), x, atol=2e-5)  # its own inverse


def test_hadamard_jacobian_is_the_scipy_matrix_on_the_kronecker_path():
    """Linear, so its Jacobian is the matrix itself, and symmetric: the gradient of
    ``<H x, c>`` is ``H^T c = H c``, forward and reverse mode alike."""
    h = scipy.linalg.hadamard(256) / 16.0
    rev = jax.jacrev(lambda v: jq.hadamard_transform(v, block_size=256))(jnp.zeros(256))
    fwd = jax.jacfwd(lambda v: jq.hadamard_transform(v, block_size=256))(jnp.zeros(256))
    np.testing.assert_allclose(rev, h, atol=1e-7)
    np.testing.assert_allclose(fwd, h, atol=1e-7)


def test_hadamard_vmap_and_default_block_of_a_non_power_of_two_axis():
    x = np.random.default_rng(1).normal(size=(3, 24, 5)).astype(np.float32)
    y = jax.vmap(lambda a: jq.hadamard_transform(a, 0))(x)  # 24 = 3 x 8: blocks of 8
    ref = np.stack([_fwht(b, 1) for b in x.reshape(3, 3, 8, 5)], axis=0).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_hadamard_of_half_precision_is_rounded_once_from_float32(dtype):
    x = np.random.default_rng(2).normal(size=(4, 64)).astype(dtype)
    y = np.asarray(jq.hadamard_transform(jnp.asarray(x)), np.float64)
    ref = _fwht(x.astype(np.float64), 1)
    # within half an ulp of the exact value, plus the float32 products' error
    ulp = np.spacing(np.abs(ref).astype(dtype)).astype(np.float64)
    assert np.all(np.abs(y - ref) <= 0.5 * ulp + 1e-5)


def test_nan_gets_the_zero_point_code_in_every_integer_width():
    """quantize's contract: a NaN gets the zero point's code, as int32 codes already did; an
    8-bit code was 0, which dequantizes to ``-zero_point * scale``, a finite wrong value."""
    t = jnp.array([jnp.nan, -jnp.nan, 1.0], jnp.float32)
    for dtype in (jnp.uint8, jnp.int8, jnp.uint4, jnp.int16, jnp.int32):
        zp = jnp.asarray(3, dtype)
        for key in (None, jax.random.key(0)):
            qt = jq.quantize(t, jnp.float32(0.5), zp, dtype=dtype, key=key)
            np.testing.assert_array_equal(np.asarray(qt.qvalue).astype(np.int64), [3, 3, 5])
            np.testing.assert_array_equal(np.asarray(qt.dequantize()), [0.0, 0.0, 1.0])


def test_probability_of_rounding_up_is_the_fraction():
    """Each element draws its own noise: over 20000 copies of ``k + f`` the share rounded up
    is ``f`` within 6 standard errors (fixed keys: the check is deterministic)."""
    n, fracs = 20000, np.array([0.125, 0.375, 0.5, 0.875])
    for dtype, base in ((jnp.int8, -3.0), (jnp.float8_e4m3fn, -12.0)):  # float8: steps of 1
        t = np.repeat(np.float32(base + fracs), n)
        q = np.asarray(jq.quantize(t, jnp.float32(1), dtype=dtype, key=jax.random.key(11))
                       .dequantize(), np.float64).reshape(4, n)
        assert np.all((q == base) | (q == base + 1))
        up = (q == base + 1).mean(axis=1)
        assert np.all(np.abs(up - fracs) <= 6 * np.sqrt(fracs * (1 - fracs) / n))


@pytest.mark.parametrize("name", ["fp4", "float6_e2m3fn", "float6_e3m2fn"])
def test_stochastic_codebook_rounding_is_unbiased(name):
    fmt = CODEBOOKS[name]
    rng = np.random.default_rng(3)
    x = rng.uniform(-0.99, 0.99, 48).astype(np.float32) * np.float32(fmt.max_finite)
    draws = 4000
    keys = jax.random.split(jax.random.key(4), draws)
    d = np.asarray(jax.jit(jax.vmap(lambda k: jq.quantize(x, jnp.float32(1), dtype=name,
                                                          key=k).dequantize()))(keys), np.float64)
    table = np.unique(np.float32(fmt.values).astype(np.float64))
    lo = table[np.searchsorted(table, x, side="right") - 1]  # the neighbours from the table
    hi = table[np.minimum(np.searchsorted(table, x, side="left"), len(table) - 1)]
    assert np.all((d == lo) | (d == hi))
    p = np.where(hi > lo, (x - lo) / np.where(hi > lo, hi - lo, 1), 0)
    se = (hi - lo) * np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(d.mean(axis=0) - x) <= 6 * se + 1e-6)


@pytest.mark.parametrize("name", ["nf4", "fp4", "float6_e3m2fn"])
def test_table_entries_never_move_under_any_noise(name):
    fmt = CODEBOOKS[name]
    t = jnp.asarray(np.float32(fmt.values))
    nearest = np.asarray(encode(t, fmt))
    for u in (0.0, 0.5, 1 - 2.0**-23):  # the smallest and largest draws of `uniform`
        np.testing.assert_array_equal(np.asarray(encode(t, fmt, jnp.full(t.shape, u))), nearest)


def test_stochastic_rounding_of_nan_and_inf_matches_nearest():
    t = jnp.array([jnp.nan, -jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0], jnp.float32)

    def codes(qt):
        c = np.asarray(qt.qvalue)
        return c.view(np.uint8) if c.dtype.itemsize == 1 else c  # float8 NaN patterns too

    @functools.partial(jax.jit, static_argnames="dtype")
    def both(t, key, dtype):
        return (jq.quantize(t, jnp.float32(1), dtype=dtype),
                jq.quantize(t, jnp.float32(1), dtype=dtype, key=key))

    for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn, "fp4",
                  "float6_e2m3fn"):
        near, sr = both(t, jax.random.key(5), dtype=dtype)
        np.testing.assert_array_equal(codes(sr), codes(near))


def test_legacy_and_typed_keys_draw_the_same_codes():
    x = np.random.default_rng(6).normal(size=(4, 64)).astype(np.float32)
    raw = jax.random.PRNGKey(7)
    a = jq.quantize(x, dtype=jnp.int4, axis=0, key=raw).qvalue
    b = jq.quantize(x, dtype=jnp.int4, axis=0, key=jax.random.wrap_key_data(raw)).qvalue
    assert np.any(np.asarray(a) != np.asarray(jq.quantize(x, dtype=jnp.int4, axis=0).qvalue))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stochastic_fake_quant_gradient_is_the_straight_through_one_inside_the_range():
    x = jnp.linspace(-6.4, 6.4, 257)  # int4, scale 1: codes stay within [-7, 7]
    g = jax.jit(jax.grad(lambda v: jq.fake_quant(v, jnp.float32(1), dtype=jnp.int4,
                                                 key=jax.random.key(8)).sum()))(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones(x.shape))


def test_fp4_takes_the_nearer_entry_next_to_every_midpoint():
    """Float32 values within 40 ulps of each midpoint (both signs) against a float64 nearest
    entry; exact float64 ties go toward zero, as bitsandbytes' ``x > threshold``."""
    fmt = CODEBOOKS["fp4"]
    mags = np.unique(np.abs(np.float32(fmt.values)).astype(np.float64))
    mids = (mags[:-1] + mags[1:]) / 2
    steps = np.arange(-40, 41, dtype=np.int32)
    t = (np.float32(mids).view(np.int32)[:, None] + steps).view(np.float32).ravel()
    t = np.concatenate([t, -t])
    got = np.asarray(jq.quantize(t, jnp.float32(1), dtype="fp4").dequantize(), np.float64)
    a = np.abs(t.astype(np.float64))
    below = mags[np.searchsorted(mags, a, side="right") - 1]
    above = mags[np.searchsorted(mags, a, side="right")]
    want = np.where(a - below <= above - a, below, above) * np.sign(t)
    np.testing.assert_array_equal(np.abs(got), np.abs(want))
    assert np.all(np.signbit(got) == np.signbit(t))
