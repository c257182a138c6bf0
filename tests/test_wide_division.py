"""The GPU quotient: float32 operands divided in float64 and rounded to float32.

`jaxquant._rounding.divide` lowers to this on CUDA and ROCm. CI has no GPU, so the
float64 route runs here on the CPU (the same StableHLO: ``convert``, ``add``, ``divide``,
``convert``) against NumPy's correctly rounded float32 division, bit for bit, and the
claim that makes it safe on a GPU is checked in NumPy: a float64 quotient that is a few
float64 ulps off (an approximate division, or XLA's ``x * (1 / s)`` rewrite) still
rounds to the correctly rounded float32 quotient, even next to a rounding midpoint.
The same tests passed on an NVIDIA H200 (2026-11-26) once the operands were doubled.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_bits import TINY, f32, near_midpoints, u32
from host_mesh import host_mesh
from jax.sharding import PartitionSpec as P
from jaxpr_utils import lowered_text

import jaxquant as jq
import jaxquant._rounding as rounding
from jaxquant._wide_division import wide_divide


def _assert_bits_equal(got, x, s):
    with np.errstate(all="ignore"):
        ref = x / s
    keep = ~((np.abs(ref) < TINY) & (ref != 0))  # XLA:CPU flushes subnormal results
    bad = np.flatnonzero((u32(got) != u32(ref)) & keep)
    assert bad.size == 0, (f"{bad.size} of {x.size} differ, e.g. x={x[bad[:3]].tolist()} "
                           f"s={s[bad[:3]].tolist()} got {np.asarray(got)[bad[:3]].tolist()}")


def test_equals_numpy_near_midpoints_where_the_reciprocal_rewrite_fails():
    x, s = near_midpoints(np.random.default_rng(0), 1 << 22)
    naive = x * (np.float32(1) / s)
    assert np.count_nonzero(u32(naive) != u32(x / s)) > x.size // 10  # the test can fail
    _assert_bits_equal(jax.jit(wide_divide)(x, s), x, s)


def test_equals_numpy_across_the_exponent_range():
    rng = np.random.default_rng(1)
    n = 1 << 21
    x = f32(rng.integers(0x00800000, 0x7F800000, n)) * rng.choice(np.float32([-1, 1]), n)
    s = f32(rng.integers(0x00800000, 0x7F800000, n)) * rng.choice(np.float32([-1, 1]), n)
    _assert_bits_equal(jax.jit(wide_divide)(x, s), x, s)


@pytest.mark.parametrize("ulps", [-8, -3, -1, 1, 3, 8])
def test_a_float64_quotient_a_few_ulps_off_still_rounds_right(ulps):
    """Why an approximate float64 division (or ``x * (1 / s)``) is safe: a float32
    quotient is at least ``2**-49`` (relative) from every float32 midpoint."""
    x, s = near_midpoints(np.random.default_rng(2), 1 << 22, exp_range=60)
    wide = x.astype(np.float64) / s.astype(np.float64)
    moved = (wide.view(np.int64) + ulps).view(np.float64)
    recip = x.astype(np.float64) * (1.0 / s.astype(np.float64))
    assert np.count_nonzero(u32(x * (np.float32(1) / s)) != u32(x / s)) > x.size // 10
    np.testing.assert_array_equal(u32(moved.astype(np.float32)), u32(x / s))
    np.testing.assert_array_equal(u32(recip.astype(np.float32)), u32(x / s))


EDGES = [(0.0, 3.0), (-0.0, 3.0), (1.0, 0.0), (-1.0, 0.0), (np.inf, 3.0), (-np.inf, 2.0),
         (1.0, np.inf), (3.4028235e38, 0.5), (1e-30, 1e10), (2.0**-126, 4.0),
         (3.4028235e38, 3.4028235e38), (1.0, 63.75), (0.3, 0.1), (255.0, 127.0)]


def test_edge_cases_match_numpy():
    x, s = (np.float32([e[i] for e in EDGES]) for i in (0, 1))
    _assert_bits_equal(jax.jit(wide_divide)(x, s), x, s)


def test_nan_propagates_like_x86_through_divide():
    """``x``'s NaN (quieted, with its sign) first, then the scale's, as on CPU."""
    snan_neg, qnan_neg, qnan = 0xFF800001, 0xFFC00000, 0x7FC00000
    x = f32([snan_neg, qnan_neg, qnan, u32(np.float32(1.5)), qnan_neg, 0])
    s = f32([u32(np.float32(2.0)), u32(np.float32(-2.0)), qnan_neg, qnan_neg, qnan, 0])
    got = u32(jax.jit(rounding._wide_division)(x, s))
    np.testing.assert_array_equal(got[:5], [0xFFC00001, qnan_neg, qnan, qnan_neg, qnan_neg])
    assert np.isnan(f32(got[5]))


def test_broadcasts_batches_and_keeps_float32():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 5, 4)).astype(np.float32)
    s = np.abs(rng.standard_normal((1, 5, 1))).astype(np.float32)
    ref = x / s
    out = wide_divide(x, s)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    _assert_bits_equal(out, x, s)
    _assert_bits_equal(jax.vmap(wide_divide, (0, None))(x, s[0]), x, s)
    _assert_bits_equal(jax.vmap(wide_divide, (2, None), 2)(x, s[..., 0]), x, s)
    both = jax.vmap(wide_divide, (1, 1), 1)(x, np.broadcast_to(s, x.shape))
    np.testing.assert_array_equal(u32(both), u32(ref))
    with jax.enable_x64(True):
        _assert_bits_equal(jax.jit(wide_divide)(x, s), x, s)


@pytest.mark.parametrize("name,dtype", [("x", jnp.bfloat16), ("scale", jnp.float16)])
def test_rejects_non_float32_operands(name, dtype):
    args = {"x": jnp.ones(3), "scale": jnp.ones(3)}
    args[name] = args[name].astype(dtype)
    with pytest.raises(TypeError, match=f"{name} must be float32, got {jnp.dtype(dtype)}"):
        wide_divide(**args)


def test_shard_map_types_the_result_like_a_plain_division():
    """A result that varies over the mesh is typed as varying: returning it as
    replicated is refused, as JAX refuses it for ``x / s``."""
    mesh = host_mesh((8,), ("i",), jax.sharding.AxisType.Auto)
    x, s = np.float32([3.0]), np.arange(1, 9, dtype=np.float32) + 0.5
    ok = jax.shard_map(wide_divide, mesh=mesh, in_specs=(P(), P("i")), out_specs=P("i"))
    np.testing.assert_array_equal(jax.jit(ok)(x, s), x / s)
    wrong = jax.shard_map(wide_divide, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(wrong)(x, s)


def test_divide_lowers_to_a_float64_division_on_gpus_only():
    x, s = jnp.ones((8, 16)), jnp.ones((1, 16))
    mantissa_mask = str(0x7FFFFF)  # a constant of the float32 correction
    for platform in ("cuda", "rocm"):
        text = lowered_text(rounding.divide, x, s, platform=platform)
        assert "stablehlo.divide" in text and "xf64>" in text
        assert mantissa_mask not in text
    tpu = lowered_text(rounding.divide, x, s, platform="tpu")
    assert "xf64>" not in tpu and mantissa_mask in tpu
    cpu = lowered_text(rounding.divide, x, s, platform="cpu")
    assert "xf64>" not in cpu and mantissa_mask not in cpu
    exported = jax.export.export(jax.jit(rounding.divide), platforms=("cpu", "cuda"))(x, s)
    np.testing.assert_array_equal(exported.call(x, s), np.ones((8, 16), np.float32))


def test_shape_polymorphic_export_for_gpus_and_cpu():
    """A symbolic batch dimension lowers through the float64 division (its MLIR types
    have a dynamic dimension) and the exported codes run on any batch size."""
    (b,) = jax.export.symbolic_shape("b")
    fn = jax.jit(lambda x: jq.quantize(x, jnp.float32(0.1)).qvalue)
    exported = jax.export.export(fn, platforms=("cuda", "rocm", "cpu"))(
        jax.ShapeDtypeStruct((b, 8), jnp.float32))
    assert "tensor<?x8xf64>" in exported.mlir_module()
    x = np.float32([[0.05, 0.15, -0.25, 1.0, 12.7, 12.75, -12.85, 0.0]] * 3)
    np.testing.assert_array_equal(exported.call(x), fn(x))
    np.testing.assert_array_equal(exported.call(x[:1]), fn(x[:1]))


def test_the_float64_division_is_not_of_bare_conversions():
    """XLA:GPU shrinks ``convert(divide(convert(x), convert(s)))`` to a float32 division,
    which is not correctly rounded there (22-32% of quotients a unit off on an H200); the
    lowering doubles both operands first, so that no such pattern is left."""
    text = lowered_text(wide_divide, jnp.ones((8, 16)), jnp.ones((1, 16)), platform="cuda")
    producers = dict(re.findall(r"(%\w+) = stablehlo\.(\w+)", text))
    divides = re.findall(r"= stablehlo\.divide (%\w+), (%\w+) : tensor<[\dx]*xf64>", text)
    assert len(divides) == 1
    assert [producers[v] for v in divides[0]] == ["add", "add"]
