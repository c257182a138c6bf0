"""`hadamard_transform` against SciPy's Hadamard matrix, its algebra (orthonormal, its own
inverse, a dot unchanged when both operands are rotated), what it does to an outlier's
quantization error, and its argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import jaxquant as jq


def _reference(x, axis, block_size):
    """``x`` times the block-diagonal ``scipy.linalg.hadamard(block_size) / sqrt(block_size)``."""
    x64 = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    h = scipy.linalg.hadamard(block_size) / np.sqrt(block_size)
    out = x64 @ scipy.linalg.block_diag(*[h] * (x64.shape[-1] // block_size))
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("shape,axis,block_size", [
    ((5, 16), -1, None), ((5, 16), -1, 4), ((1536, 7), 0, None), ((1536, 7), 0, 128),
    ((2, 24, 3), 1, None), ((2, 24, 3), 1, 2), ((64,), 0, 64), ((3, 32), 1, 32),
])
def test_equals_scipy_hadamard_blocks(shape, axis, block_size):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    expected_block = block_size or {16: 16, 1536: 512, 24: 8, 64: 64, 32: 32}[shape[axis]]
    got = jq.hadamard_transform(x, axis, block_size=block_size)
    assert got.shape == x.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _reference(x, axis, expected_block), atol=2e-6)


def test_orthonormal_and_its_own_inverse():
    x = jax.random.normal(jax.random.key(1), (4, 2048))
    y = jq.hadamard_transform(x)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=1), jnp.linalg.norm(x, axis=1),
                               rtol=1e-5)
    np.testing.assert_allclose(jq.hadamard_transform(y), x, atol=1e-5)


def test_rotated_operands_give_the_same_dot():
    kx, kw = jax.random.split(jax.random.key(2))
    x, w = jax.random.normal(kx, (8, 384)), jax.random.normal(kw, (384, 48))
    rotated = jq.hadamard_transform(x, -1, block_size=128) @ jq.hadamard_transform(
        w, 0, block_size=128)
    np.testing.assert_allclose(rotated, x @ w, rtol=1e-4, atol=1e-4)


def test_spreads_an_outlier_so_its_channel_quantizes_finer():
    w = np.random.default_rng(3).normal(scale=0.2, size=(512, 8)).astype(np.float32)
    w[100, 5] = 8.0  # 40 standard deviations: channel 5's int8 scale is 8x too coarse
    x = np.random.default_rng(4).normal(size=(64, 512)).astype(np.float32)

    def output_error(kernel, inputs):
        dq = jq.dequantize(jq.quantize(kernel, dtype=jnp.int8, axis=-1))
        return float(jnp.abs(inputs @ dq - x @ w)[:, 5].mean())

    rotated = output_error(jq.hadamard_transform(w, 0), jq.hadamard_transform(x))
    assert rotated < 0.25 * output_error(jnp.asarray(w), x)
    assert float(jnp.abs(jq.hadamard_transform(w, 0)[:, 5]).max()) < 1.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float64])
def test_keeps_the_dtype(dtype):
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        dtype = jnp.float32
    x = jnp.arange(32, dtype=dtype).reshape(2, 16)
    y = jq.hadamard_transform(x)
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), _reference(x, -1, 16),
                               rtol=1e-2, atol=1e-1)


def test_jit_and_gradient():
    x = jax.random.normal(jax.random.key(5), (3, 64))
    c = jax.random.normal(jax.random.key(6), (3, 64))
    fn = jax.jit(lambda x: jnp.sum(jq.hadamard_transform(x, block_size=32) * c))
    np.testing.assert_allclose(fn(x), jnp.sum(jq.hadamard_transform(x, block_size=32) * c),
                               rtol=1e-5)
    # linear and symmetric: the gradient of <H x, c> is H c
    np.testing.assert_allclose(jax.grad(fn)(x), jq.hadamard_transform(c, block_size=32),
                               atol=1e-5)


def test_block_size_one_is_the_identity_and_an_odd_axis_needs_it_said():
    """An odd length has no power-of-two block above 1: the default once returned x
    unchanged, silently; now only an explicit block_size=1 does."""
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jq.hadamard_transform(x, block_size=1), x)
    with pytest.raises(ValueError, match=r"x.shape\[1\] = 3 is odd: no Hadamard block larger "
                                         r"than 1 divides it"):
        jq.hadamard_transform(x)
    np.testing.assert_array_equal(jq.hadamard_transform(jnp.ones((2, 0))), jnp.ones((2, 0)))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"x": jnp.arange(8)}, TypeError, "x must be a float array, got dtype int32"),
    ({"axis": 2}, ValueError, r"axis must be an int in \[-2, 2\) .* got 2"),
    ({"axis": 1.0}, TypeError, "axis must be an int, got float 1.0"),
    ({"block_size": 3}, ValueError, r"power of two dividing x.shape\[1\] = 16, got 3"),
    ({"block_size": 32}, ValueError, "got 32"),
    ({"block_size": 0}, ValueError, "got 0"),
    ({"block_size": True}, ValueError, "got True"),
])
def test_argument_errors(kwargs, error, match):
    kwargs = {"x": jnp.ones((2, 16)), **kwargs}
    with pytest.raises(error, match=match):
        jq.hadamard_transform(**kwargs)


def test_a_qtensor_is_refused_by_name():
    with pytest.raises(TypeError, match="x must be a float array, got a jaxquant.QTensor"):
        jq.hadamard_transform(jq.quantize(jnp.ones((2, 16))))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("shape,spec,axis,block_size", [
    ((64, 512), ("d", None), -1, 64),     # data-parallel rows, features rotated in blocks
    ((64, 512), (None, "d"), -1, 64),     # features sharded, each block on one device
    ((64, 512), (None, "d"), -1, 256),    # two blocks over eight devices: gathered, rotated
    ((64, 512), ("d", None), 0, 8),       # rotating the sharded axis itself
    ((8, 2**15), ("d", None), -1, 2**15),  # a Kronecker-factored block beside a sharded axis
])
def test_sharded_inputs_give_the_one_device_result(axis_type, shape, spec, axis, block_size):
    from host_mesh import cpu_normal, host_mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    # before: explicit mesh axes refused the block reshape (it merged the leading axes)
    mesh = host_mesh((8,), ("d",), getattr(jax.sharding.AxisType, axis_type))
    x = cpu_normal(*shape)
    want = np.asarray(jq.hadamard_transform(x, axis, block_size=block_size))
    xs = jax.device_put(x, NamedSharding(mesh, P(*spec)))
    got = jax.jit(lambda v: jq.hadamard_transform(v, axis, block_size=block_size))(xs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)  # summation order
    if axis_type == "Explicit":
        assert jax.typeof(got).sharding.spec == jax.typeof(xs).sharding.spec
