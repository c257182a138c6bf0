"""fake_quant: value identity with quantize/dequantize, STE masks, computed-mode constants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _fake_quant


# int8 takes int4's path (signed, no zero point); uint8 covers the zero point.
@pytest.mark.parametrize("fmt", ["int4", "uint8", "float8_e4m3fn", "float4_e2m1fn"])
@pytest.mark.parametrize("gran", [dict(), dict(axis=1), dict(axis=1, block_size=3)])
def test_value_is_dequantize_of_quantize(fmt, gran):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 7)).astype(np.float32)) * 3
    np.testing.assert_array_equal(jq.fake_quant(x, dtype=fmt, **gran),
                                  jq.dequantize(jq.quantize(x, dtype=fmt, **gran)))
    f = jq.get_format(fmt)
    scale = jq.quantize(x, dtype=fmt, **gran).scale * 0.5  # half the range: some values clip
    zp = None if f.is_integer and f.signed or not f.is_integer else jnp.full(scale.shape, 3, f.dtype)
    np.testing.assert_array_equal(jq.fake_quant(x, scale, zp, dtype=fmt, **gran),
                                  jq.dequantize(jq.quantize(x, scale, zp, dtype=fmt, **gran)))


def test_ste_mask_at_the_range_edges():
    s = jnp.float32(1.0)
    # int8 codes: 127 and -128 are inside; 127.5 rounds to 128 (even) -> outside; 127.49 -> 127 inside
    x = jnp.array([126.0, 127.0, 127.49, 127.5, 128.0, -128.0, -128.5, -128.51, 1e9, -1e9], jnp.float32)
    g = jax.grad(lambda x: jq.fake_quant(x, s).sum())(x)
    np.testing.assert_array_equal(g, [1, 1, 1, 0, 0, 1, 1, 0, 0, 0])


def test_ste_mask_with_zero_point_and_float_format():
    s = jnp.float32(0.5)
    x = jnp.array([-1.0, -0.5, 0.0, 6.0, 6.5], jnp.float32)
    # uint4 with zero point 1: codes -1, 0, 1, 13, 14 -> [0, 15] range keeps all but the first
    g = jax.grad(lambda x: jq.fake_quant(x, s, jnp.uint4(1), dtype=jnp.uint4).sum())(x)
    np.testing.assert_array_equal(g, [0, 1, 1, 1, 1])
    xf = jnp.array([1.0, 448.0, 500.0, -1000.0], jnp.float32)
    g = jax.grad(lambda x: jq.fake_quant(x, jnp.float32(1), dtype=jnp.float8_e4m3fn).sum())(xf)
    np.testing.assert_array_equal(g, [1, 1, 0, 0])


def test_computed_mode_scale_is_constant_in_backward():
    x = jnp.array([0.1, -0.7, 0.35, 1.0], jnp.float32)
    g = jax.grad(lambda x: jq.fake_quant(x, dtype=jnp.int4).sum())(x)
    np.testing.assert_array_equal(g, jnp.ones(4))  # absmax scale never clips


@pytest.mark.parametrize("fmt", ["int8", "int2"])  # the widest and the narrowest qmax
@pytest.mark.parametrize("gran", [dict(), dict(axis=-1), dict(axis=0, block_size=5)])
def test_computed_absmax_gradient_equals_the_clipped_ste(fmt, gran):
    # Computed symmetric scales take a backward pass that returns g unchanged; it must
    # equal the clipped STE with the same scale given explicitly, extremes included.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((12, 9)) * np.linspace(0.1, 30, 9), jnp.float32)
    x = x.at[3, 4].set(0.0).at[:, 2].set(0.0)  # an all-zero channel: scale 1
    g = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    @jax.jit  # both backward passes in one program
    def vjps(x, g):
        scale = jq.quantize(x, dtype=fmt, **gran).scale
        return (jax.vjp(lambda x: jq.fake_quant(x, dtype=fmt, **gran), x)[1](g)[0],
                jax.vjp(lambda x: jq.fake_quant(x, scale, dtype=fmt, **gran), x)[1](g)[0])

    computed, explicit = vjps(x, g)
    np.testing.assert_array_equal(computed, explicit)
    np.testing.assert_array_equal(computed, g)


def test_gradient_dtype_follows_input():
    x = jnp.ones((3,), jnp.bfloat16)
    g = jax.jit(jax.grad(lambda x: jq.fake_quant(x, jnp.float32(0.1)).astype(jnp.float32).sum()))(x)
    assert g.dtype == jnp.bfloat16


def test_learnable_scale_moves_to_reduce_clipping():
    """Training only the scale on data that clips must grow the scale (LSQ direction)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(512).astype(np.float32))
    loss = jax.jit(lambda s: jnp.mean((jq.fake_quant(x, s, dtype=jnp.int4) - x) ** 2))
    step = jax.jit(lambda s: s - 0.05 * jax.grad(loss)(s))
    s = jnp.float32(0.05)  # codes clip at +-0.35 while |x| reaches ~3
    for _ in range(50):
        s = step(s)
    assert float(s) > 0.2 and float(loss(s)) < float(loss(jnp.float32(0.05))) / 4


def test_jit_and_vmap_of_fake_quant():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32))
    f = jax.jit(jax.grad(lambda x, s: jq.fake_quant(x, s, axis=0).sum(), argnums=(0, 1)))
    gx, gs = f(x, jnp.full((5,), 0.01, jnp.float32))
    assert gx.shape == x.shape and gs.shape == (5,)
    v = jax.jit(jax.vmap(lambda r: jq.fake_quant(r, jnp.float32(0.1))))(x)
    np.testing.assert_array_equal(v, jq.fake_quant(x, jnp.float32(0.1)))


@pytest.mark.parametrize("fmt", ["int8", "int4", "uint8", "int32"])
@pytest.mark.parametrize("gran", [dict(), dict(axis=1), dict(axis=1, block_size=2)])
def test_a_nan_input_is_the_zero_points_code_as_in_quantize(fmt, gran):
    """With an explicit scale, quantize gives a NaN the zero point's code; fake_quant's value
    is that code's (0.0), and the NaN adds nothing to any gradient."""
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32) * 3
    x[1, 2] = np.nan
    f = jq.get_format(fmt)
    scale = jq.quantize(np.nan_to_num(x), dtype=fmt, **gran).scale * 0.5  # some values clip
    zp = jnp.full(scale.shape, 3, f.dtype) if not f.signed else None
    want = jq.dequantize(jq.quantize(x, scale, zp, dtype=fmt, **gran))
    assert want[1, 2] == 0
    np.testing.assert_array_equal(jq.fake_quant(x, scale, zp, dtype=fmt, **gran), want)

    def loss(x, s, z):
        return jnp.sum(jq.fake_quant(x, s, z, dtype=fmt, **gran) * jnp.arange(1.0, 13.0).reshape(3, 4))

    zf = None if zp is None else zp.astype(jnp.float32)
    got = jax.grad(loss, argnums=(0, 1, 2) if zf is not None else (0, 1))(x, scale, zf)
    assert got[0][1, 2] == 0
    # the scale's and zero point's as with the NaN replaced by the zero point's value, 0.0
    # (exact: no contribution); x's elsewhere as they were
    clean = jax.grad(loss, argnums=(0, 1, 2) if zf is not None else (0, 1))(
        np.nan_to_num(x), scale, zf)
    np.testing.assert_array_equal(np.delete(got[0], 6), np.delete(clean[0], 6))
    for a, b in zip(got[1:], clean[1:], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("gran, scale_shape", [(dict(), ()), (dict(axis=1), (3,)),
                                               (dict(axis=1, block_size=2), (0, 2))])
def test_lsq_grad_scale_of_an_empty_input_is_zero_not_nan(gran, scale_shape):
    # a sum over no elements is 0; 1 / sqrt(N * qmax) with N = 0 must not turn it into NaN
    x = jnp.zeros((0, 3))
    scale = jnp.full(scale_shape, 0.1)
    zp = jnp.zeros(scale.shape)
    g = jax.grad(lambda s, z: jq.fake_quant(x, s, z, dtype="uint8", lsq_grad_scale=True,
                                            **gran).sum(), argnums=(0, 1))(scale, zp)
    for a in g:
        assert not np.isnan(np.asarray(a)).any()
        np.testing.assert_array_equal(a, np.zeros(scale.shape))


def test_a_python_float_scale_is_the_float32_scales_program():
    # a weakly typed scale would otherwise be a new jit cache entry (and a new compile)
    x = jnp.linspace(-1.0, 1.0, 7)
    before = _fake_quant._fake_quant_program._cache_size()
    a = jq.fake_quant(x, jnp.float32(0.1))
    mid = _fake_quant._fake_quant_program._cache_size()
    b = jq.fake_quant(x, 0.1)
    assert _fake_quant._fake_quant_program._cache_size() == mid <= before + 1
    np.testing.assert_array_equal(a, b)
