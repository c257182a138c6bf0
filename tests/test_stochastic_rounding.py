"""Stochastic rounding: unbiased in expectation, always one of the two neighbours."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

DRAWS = 4000


def _values(name) -> tuple[np.ndarray, dict]:
    rng = np.random.default_rng(0)
    if name in ("int8", "int4"):  # explicit scale: every value inside the range
        return rng.uniform(-7, 7, 64).astype(np.float32), dict(scale=jnp.float32(1.0))
    if name == "float8_e4m3fn":
        return rng.uniform(-400, 400, 64).astype(np.float32), dict(scale=jnp.float32(1.0))
    return rng.uniform(-0.99, 0.99, 64).astype(np.float32), dict(scale=jnp.float32(1.0))


@pytest.mark.parametrize("name", ["int8", "int4", "float8_e4m3fn", "float4_e2m1fn", "nf4"])
def test_unbiased_mean_over_many_draws(name):
    x, kw = _values(name)
    if name == "float4_e2m1fn":
        x = x * 6
    dtype = name if name == "nf4" else jnp.dtype(name)

    def one(key):
        return jq.quantize(x, kw["scale"], dtype=dtype, key=key).dequantize()

    draws = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), DRAWS)))
    nearest = np.asarray(jq.quantize(x, kw["scale"], dtype=dtype).dequantize())
    lo, hi = draws.min(axis=0), draws.max(axis=0)
    # each draw is one of the two neighbours around x
    assert np.all(lo <= x) and np.all(hi >= x)
    assert np.all((draws == lo) | (draws == hi))
    # the mean is x: |mean - x| within 5 standard errors of a two-point distribution
    gap = hi - lo
    p = np.where(gap > 0, (x - lo) / np.where(gap > 0, gap, 1), 0)
    se = gap * np.sqrt(p * (1 - p) / DRAWS)
    assert np.all(np.abs(draws.mean(axis=0) - x) <= 5 * se + 1e-6 * np.abs(x))
    # and it is really stochastic where x is not on the grid (nearest rounding is biased)
    assert np.any(draws != nearest)


def test_same_key_same_codes_and_jit_vmap_grad():
    x = jax.random.normal(jax.random.key(1), (8, 64))
    k = jax.random.key(2)
    a = jq.quantize(x, dtype=jnp.int4, axis=0, key=k)
    b = jax.jit(lambda x, k: jq.quantize(x, dtype=jnp.int4, axis=0, key=k))(x, k)
    np.testing.assert_array_equal(np.asarray(a.qvalue), np.asarray(b.qvalue))
    c = jq.quantize(x, dtype=jnp.int4, axis=0, key=jax.random.key(3))
    assert np.any(np.asarray(a.qvalue) != np.asarray(c.qvalue))
    g = jax.jit(jax.grad(lambda x: jq.fake_quant(x, dtype="mxfp4", key=k).sum()))(x)
    assert g.shape == x.shape and set(np.unique(np.asarray(g))) <= {0.0, 1.0}
    legacy = jq.quantize(x, dtype=jnp.int8, key=jax.random.PRNGKey(0))  # raw uint32 keys too
    assert legacy.qvalue.dtype == jnp.int8


def test_gradient_quantization_is_unbiased_on_average():
    """Low-bit gradient compression: the mean of stochastic int4 gradients is the gradient."""
    g = jax.random.normal(jax.random.key(4), (256,)) * 1e-3
    keys = jax.random.split(jax.random.key(5), DRAWS)
    q = jax.jit(jax.vmap(lambda k: jq.fake_quant(g, dtype=jnp.int4, key=k)))(keys)
    nearest = jq.fake_quant(g, dtype=jnp.int4)
    err_sr = float(jnp.abs(q.mean(0) - g).mean())
    err_nearest = float(jnp.abs(nearest - g).mean())
    assert err_sr < err_nearest / 10


def test_bad_key_is_rejected():
    with pytest.raises(TypeError, match="key must be a PRNG key"):
        jq.quantize(jnp.ones(4), key=3)
    with pytest.raises(TypeError, match="key must be a PRNG key"):
        jq.fake_quant(jnp.ones(4), key=jnp.ones(2))


@pytest.mark.parametrize("value, dtype", [(1e7, jnp.int32), (12345678.0, jnp.int32),
                                          (2.0**22 + 0.5, jnp.int32)])
def test_large_integer_codes_round_stochastically_without_bias(value, dtype):
    """float32 ``t + noise`` rounds for |t| >= 2**22; the codes must not."""
    t = jnp.full((4000,), value, jnp.float32)
    codes = np.asarray(jq.quantize(t, jnp.float32(1), dtype=dtype, key=jax.random.key(3)).qvalue)
    low = np.floor(np.float64(np.float32(value)))
    frac = np.float64(np.float32(value)) - low
    assert set(np.unique(codes) - low) <= ({0.0} if frac == 0 else {0.0, 1.0})
    assert abs(codes.astype(np.float64).mean() - low - frac) < 0.05


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn])
def test_grid_values_never_move_under_the_largest_noise(dtype):
    """A value on the grid is its own floor and ceil: no noise may move it. The float32 sum
    ``t / quantum + noise`` rounds up for the largest draws of `jax.random.uniform`."""
    from jaxquant._formats import get_format
    from jaxquant._rounding import stochastic_float

    grid = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    grid = jnp.asarray(np.unique(grid[np.isfinite(grid)]))
    noise = jnp.full(grid.shape, 1 - 2.0**-23, jnp.float32)  # uniform's largest draw
    np.testing.assert_array_equal(np.asarray(stochastic_float(grid, get_format(dtype), noise)),
                                  np.asarray(grid))


@pytest.mark.parametrize("dtype, kwargs", [("mxfp4", {}), ("nvfp4", {}),
                                           (jnp.int8, dict(axis=1, block_size=24)),
                                           (jnp.int4, dict(block_size=(2, 16)))])
def test_quantize_draws_the_noise_of_fake_quant_with_partial_blocks(dtype, kwargs):
    """`fake_quant` is `dequantize(quantize(...))` for one key too: the noise of an element
    must not depend on the padding of a partial last block."""
    x = jax.random.normal(jax.random.key(7), (5, 40))
    k = jax.random.key(8)

    @jax.jit  # both in one program: one compile instead of op-by-op dispatch
    def both(x, k):
        return (jq.quantize(x, dtype=dtype, key=k, **kwargs).dequantize(),
                jq.fake_quant(x, dtype=dtype, key=k, **kwargs))

    q, fq = both(x, k)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(fq))


@pytest.mark.parametrize("key", [jax.random.split(jax.random.key(0), 2),
                                 jnp.zeros((4,), jnp.uint32)])
def test_key_of_the_wrong_shape_names_the_argument(key):
    for fn in (jq.quantize, jq.fake_quant):
        with pytest.raises(TypeError, match=r"key must be a single PRNG key.*shape \((2|4),\)"):
            fn(jnp.ones(4), jnp.float32(1), key=key)


def test_legacy_keys_of_the_rbg_prng_are_taken():
    """Under ``jax_default_prng_impl='rbg'`` a ``jax.random.PRNGKey`` is uint32 of shape (4,);
    it was refused as "a batch of keys"."""
    x = jnp.linspace(-3.0, 3.0, 64)
    with jax.default_prng_impl("rbg"):
        key = jax.random.PRNGKey(3)
        assert key.shape == (4,)
        got = jq.quantize(x, jnp.float32(0.5), key=key).qvalue
        want = jq.quantize(x, jnp.float32(0.5), key=jax.random.wrap_key_data(key)).qvalue
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        with pytest.raises(TypeError, match=r"jax.random.PRNGKey: uint32 of shape \(4,\)"):
            jq.fake_quant(x, jnp.float32(0.5), key=jnp.zeros((2,), jnp.uint32))
