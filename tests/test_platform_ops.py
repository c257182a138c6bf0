"""`platform_op`: only the branch of the platform lowered is traced, each platform gets its own
branch (exports included), and vmap / jvp / eager calls give what the branch gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxquant as jq
from jaxquant._platform_ops import platform_op
from jaxquant._rounding import divide

# the branch that jax.jit runs here, and its offset in `_counting_op`
HERE = {"cpu": "cpu", "gpu": "cuda"}.get(jax.default_backend(), "default")
OFFSET = {"cpu": 1.0, "cuda": 2.0, "default": 3.0}


def _counting_op(name):
    traced = {"cpu": 0, "cuda": 0, "default": 0}

    def branch(platform, offset):
        def f(x, s, *, k):
            traced[platform] += 1
            return x * s + (offset + k)
        return f

    op = platform_op(name, like=0, **{p: branch(p, k) for p, k in OFFSET.items()})
    return op, traced


def test_only_the_lowered_platforms_branch_is_traced():
    op, traced = _counting_op("test_counting")
    f = jax.jit(lambda x, s: op(x, s, k=10.0))
    x, s = jnp.arange(4.0), jnp.float32(2.0)
    assert jax.make_jaxpr(f)(x, s) is not None and traced == {"cpu": 0, "cuda": 0, "default": 0}
    np.testing.assert_array_equal(f(x, s), np.arange(4.0) * 2 + 10 + OFFSET[HERE])
    assert traced == {p: int(p == HERE) for p in OFFSET}
    other = "cuda" if HERE == "cpu" else "cpu"
    text = f.trace(x, s).lower(lowering_platforms=(other,)).as_text()
    assert traced[other] == 1 and traced["default"] == int(HERE == "default")
    assert f"{10 + OFFSET[other]:.6e}" in text


def test_a_multi_platform_export_runs_each_platforms_branch():
    op, traced = _counting_op("test_export")
    exp = export.export(jax.jit(lambda x: op(x, jnp.float32(2.0), k=0.0)),
                        platforms=("tpu", "cpu", "cuda"))(jax.ShapeDtypeStruct((3,), jnp.float32))
    assert traced == {"cpu": 1, "cuda": 1, "default": 1}
    # x * 2 + the offset of the platform it runs on
    np.testing.assert_array_equal(exp.call(jnp.ones(3)), [2.0 + OFFSET[HERE]] * 3)


def test_quantize_exported_for_tpu_and_cpu_gives_the_cpus_codes():
    """A program exported for several platforms carries each division; on CPU it gives the
    codes of a program compiled for the CPU alone."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
    f = jax.jit(lambda x: jq.quantize(x, dtype=jnp.int8, axis=-1).qvalue)
    exp = export.export(f, platforms=("tpu", "cuda", "cpu"))(x)
    mlir = exp.mlir_module()
    assert "f64" in mlir  # the GPUs' division is in float64
    np.testing.assert_array_equal(exp.call(x), f(x))
    cpu = f.trace(x).lower(lowering_platforms=("cpu",)).as_text()
    assert "f64" not in cpu  # the CPU's own program is float32 only


@pytest.mark.parametrize("x_axis,s_axis", [(0, None), (None, 0), (1, 0), (0, 1), (1, 1)])
def test_vmap_equals_a_loop(x_axis, s_axis):
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(3, 5, 4)).astype(np.float32)
    ss = rng.uniform(0.5, 2, size=(3, 5, 1)).astype(np.float32)
    x = xs[0] if x_axis is None else np.moveaxis(xs, 0, x_axis)
    s = ss[0] if s_axis is None else np.moveaxis(ss, 0, s_axis)
    got = jax.vmap(lambda a, b: divide(a, b), in_axes=(x_axis, s_axis))(x, s)
    for i in range(3):
        want = (xs[0] if x_axis is None else xs[i]) / (ss[0] if s_axis is None else ss[i])
        np.testing.assert_array_equal(got[i], want)


def test_eager_call_and_identity_tangent():
    op = platform_op("test_identity", like=0, identity_tangent=True, cpu=lambda x: x,
                     default=jax.lax.optimization_barrier)
    x = jnp.array([1.0, -2.0])
    np.testing.assert_array_equal(op(x), x)
    y, t = jax.jvp(op, (x,), (jnp.array([3.0, 4.0]),))
    np.testing.assert_array_equal(t, [3.0, 4.0])
    np.testing.assert_array_equal(jax.grad(lambda v: (op(v) ** 2).sum())(x), 2 * x)


def test_an_op_without_a_derivative_says_so():
    op = platform_op("test_no_derivative", like=0, cpu=lambda x: x, default=lambda x: x)
    with pytest.raises(NotImplementedError, match="test_no_derivative"):
        jax.grad(lambda v: op(v).sum())(jnp.ones(2))


def test_a_gpu_branch_is_refused():
    with pytest.raises(ValueError, match="'cuda' and 'rocm'"):
        platform_op("test_gpu", like=0, cpu=lambda x: x, default=lambda x: x, gpu=lambda x: x)
