"""Values at the edges of float32 and of the formats, against ONNX's and PyTorch's references.

int32 codes beyond float32's integers, ranges wider than float32's largest value,
empty arrays, one-element scales of any rank, subnormal inputs and scales (which
XLA:CPU reads as zero), the clipped STE of float formats at their largest value,
and the sign of zero in `fake_quant`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from onnx import TensorProto
from test_onnx_reference import assert_same_bits, np_dtype, onnx_run

import jaxquant as jq

I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def _int32_reference(x: np.ndarray, zero_point: int) -> np.ndarray:
    """``clip(rint(x) + zero_point)`` in Python integers (x is float32, scale 1)."""
    out = []
    for v in x.astype(np.float64):
        r = int(np.rint(v)) if np.isfinite(v) else int(np.sign(v)) * 2**40
        out.append(min(I32_MAX, max(I32_MIN, r + zero_point)))
    return np.array(out, np.int64)


@pytest.mark.parametrize("zero_point", [0, 1, -1, 10, -10, 2**30, -(2**30), I32_MAX, I32_MIN,
                                        I32_MAX - 200, I32_MIN + 200, 123456789])
def test_int32_codes_saturate_exactly_with_any_zero_point(zero_point):
    """float32 holds neither 2**31 - 1 nor most sums near the ends: still exact codes."""
    edges = [0.0, 1.0, -1.0, 2.0**31, -(2.0**31), 2.0**31 + 256, -(2.0**31) - 256, 2.0**32 - 256,
             2.0**32, -(2.0**32), -(2.0**32) + 256, 2147483520.0, -2147483520.0, 3e9, -3e9, 1e10,
             -1e10, np.inf, -np.inf]
    rng = np.random.default_rng(abs(zero_point) % 1000)
    x = np.concatenate([np.float32(edges), rng.uniform(-5e9, 5e9, 300).astype(np.float32)])
    zp = None if zero_point == 0 else jnp.int32(zero_point)
    got = np.asarray(jq.quantize(jnp.asarray(x), jnp.float32(1), zp, dtype=jnp.int32).qvalue)
    np.testing.assert_array_equal(got.astype(np.int64), _int32_reference(x, zero_point))


@pytest.mark.parametrize("zero_point", [1, -1, 127, 2**30, -(2**30), I32_MAX, I32_MIN,
                                        I32_MAX - 200, I32_MIN + 200, 123456789])
def test_int32_fake_quant_is_dequantize_of_quantize_with_its_exact_mask(zero_point):
    """fake_quant added the zero point in float32 (123456789 + 4 -> 8 away) and read the
    clipped STE's mask from that sum (a code of exactly 2**31 - 1 counted as clipped):
    now its values are dequantize(quantize(x)) and its mask the exact r + zp in range."""
    edges = [0.0, 4.0, 5.0, 100.0, 2.0**31, -(2.0**31), 2147483520.0, -2147483520.0,
             2147483520.0 - 128, 3e9, -3e9, 5e9, -5e9, np.nan]
    edges += [float(I32_MAX - zero_point + d) for d in (-1, 0, 1)]  # around the top code
    edges += [float(I32_MIN - zero_point + d) for d in (-1, 0, 1)]
    rng = np.random.default_rng(abs(zero_point) % 1000)
    x = np.concatenate([np.float32(edges), rng.uniform(-5e9, 5e9, 300).astype(np.float32),
                        rng.uniform(-3e3, 3e3, 100).astype(np.float32)])
    zp, s = jnp.int32(zero_point), jnp.float32(1)
    fq = jax.jit(lambda v: jq.fake_quant(v, s, zp, dtype=jnp.int32))
    want = jq.dequantize(jq.quantize(jnp.asarray(x), s, zp, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(fq(jnp.asarray(x))), np.asarray(want))
    grad = np.asarray(jax.grad(lambda v: jnp.sum(fq(v)))(jnp.asarray(x)))
    r = np.array([int(np.rint(v)) if np.isfinite(v) else 2**40 for v in x.astype(np.float64)])
    inside = [I32_MIN <= ri + zero_point <= I32_MAX and np.isfinite(v)
              for ri, v in zip(r, x, strict=True)]
    np.testing.assert_array_equal(grad, np.float32(inside))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning")
@pytest.mark.parametrize("zero_point", [0, 10, -10])
def test_int32_saturation_matches_torch_qint32(zero_point):
    x = torch.tensor([3e9, -3e9, 1e10, 2.5e9, 1e3, -7.5], dtype=torch.float32)
    want = torch.quantize_per_tensor(x, 1.0, zero_point, torch.qint32).int_repr().numpy()
    zp = None if zero_point == 0 else jnp.int32(zero_point)
    got = jq.quantize(jnp.asarray(x.numpy()), jnp.float32(1), zp, dtype=jnp.int32).qvalue
    np.testing.assert_array_equal(np.asarray(got), want)


def test_int32_computed_scales_reach_both_ends():
    sym = jq.quantize(jnp.array([0.5, 1.0, -2.0]), dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(sym.qvalue), [2**29, 2**30, I32_MIN])
    asym = jq.quantize(jnp.array([0.5, 1.0, 2.0]), dtype=jnp.int32, symmetric=False)
    assert int(asym.qvalue[-1]) == I32_MAX
    np.testing.assert_allclose(np.asarray(asym.dequantize()), [0.5, 1.0, 2.0], rtol=1e-6)


def test_asymmetric_range_wider_than_float32_max_is_finite():
    """hi - lo overflows to inf for finite inputs; the scale must not."""
    x = jnp.array([3e38, -3e38, 1.0])
    qt = jq.quantize(x, dtype=jnp.int8, symmetric=False)
    assert np.isfinite(float(qt.scale))
    np.testing.assert_array_equal(np.asarray(qt.qvalue), [127, -128, 0])
    np.testing.assert_allclose(np.asarray(qt.dequantize())[:2], [3e38, -3e38], rtol=0.01)
    assert np.isfinite(np.asarray(jq.fake_quant(x, symmetric=False))).all()


# Every layout and format family on the array with no rows; on the array with no columns,
# those whose groups change shape with it (a mirrored layout, e.g. axis=0 on (4, 0) as
# axis=1 on (0, 4), and a group-wise format on top of a layout already covered, reach the
# same empty-array branch of `group_reduce` with the same shapes).
EMPTY_CASES = [((0, 4), kw) for kw in [
    {}, {"axis": 1}, {"axis": 0}, {"axis": 1, "block_size": 2}, {"axis": 0, "block_size": 2},
    {"block_size": (2, 2)}, {"axis": 1, "symmetric": False},
    {"axis": 1, "block_size": 2, "dtype": jnp.float8_e4m3fn}, {"axis": 1, "dtype": "mxfp4"},
    {"axis": 1, "block_size": 2, "dtype": "nf4"},
]] + [((4, 0), kw) for kw in [
    {"axis": 1}, {"axis": 0, "block_size": 2}, {"axis": 1, "block_size": 2},
    {"axis": 1, "symmetric": False}, {"axis": 1, "dtype": "mxfp4"},
]]


@pytest.mark.parametrize("shape,kwargs", EMPTY_CASES, ids=[f"{s}-{k}" for s, k in EMPTY_CASES])
def test_empty_arrays_in_computed_mode(shape, kwargs):
    x = jnp.zeros(shape)
    qt = jq.quantize(x, **kwargs)
    assert qt.shape == shape and qt.dequantize().shape == shape
    assert not np.isnan(np.asarray(qt.scale, np.float32)).any()
    assert jq.fake_quant(x, **kwargs).shape == shape
    assert jax.grad(lambda v: jq.fake_quant(v, **kwargs).sum())(x).shape == shape
    assert jq.quantize_tree({"w": x})["w"].shape == shape


@pytest.mark.parametrize("scale_shape", [(1, 1), (1, 1, 1)])
@pytest.mark.parametrize("block_size", [None, 2])
def test_one_element_scale_of_any_rank_is_per_tensor_as_onnx(scale_shape, block_size):
    x = np.float32([[0.1, -0.5, 0.25, 2.0], [1.0, 0.75, -3.0, 0.0]])
    scale = np.full(scale_shape, 0.25, np.float32)
    zp = np.zeros(scale_shape, np.int8)
    attrs = {} if block_size is None else {"axis": 1, "block_size": block_size}
    want = onnx_run("QuantizeLinear", {"x": x, "s": scale, "z": zp}, **attrs)
    qt = jq.quantize(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(zp), axis=attrs.get("axis"),
                     block_size=block_size)
    assert qt.layout.kind == "tensor"
    assert_same_bits(qt.qvalue, want, "codes")
    assert_same_bits(jq.QTensor(jnp.asarray(want), jnp.asarray(scale), jnp.asarray(zp)).dequantize(),
                     onnx_run("DequantizeLinear", {"q": want, "s": scale, "z": zp}), "values")
    grad = jax.grad(lambda s: jq.fake_quant(jnp.asarray(x), s).sum())(jnp.asarray(scale))
    assert grad.shape == scale_shape


SUBNORMAL_SCALES = [2.0**-126, 3e-39, 1e-40, 1e-45, 2.0**-120, 1.0]


def _with_subnormals(rng) -> np.ndarray:
    mantissas = rng.integers(1, 2**23, 600).astype(np.uint32)
    signs = rng.integers(0, 2, 600).astype(np.uint32) << 31
    tiny = (mantissas | signs).view(np.float32)  # every subnormal magnitude range
    return np.concatenate([tiny, rng.normal(size=200).astype(np.float32) * np.float32(1e-37),
                           np.float32([0.0, -0.0, 1e-45, -1e-45, 1e-30])])


@pytest.mark.parametrize("fmt", ["int8", "uint8", "int16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scale", SUBNORMAL_SCALES)
def test_subnormal_inputs_and_scales_match_onnx(fmt, scale):
    """XLA:CPU reads subnormals as zero; codes and values are ONNX's all the same."""
    x = _with_subnormals(np.random.default_rng(7))
    s, zp = np.float32(scale), np.zeros((), np_dtype(fmt))
    with np.errstate(all="ignore"):
        # ONNX's int32 cast wraps beyond; zeros in their place keep one shape for every scale
        # (the scale is an argument: one compiled program per format)
        x = np.where(np.abs(x.astype(np.float64) / s) < 2.0**31, x, np.float32(0))
    want = onnx_run("QuantizeLinear", {"x": x, "s": s, "z": zp})
    quantize = lambda v: jq.quantize(v, jnp.float32(s), dtype=np_dtype(fmt)).qvalue
    assert_same_bits(quantize(jnp.asarray(x)), want, "codes")
    assert_same_bits(jax.jit(quantize)(jnp.asarray(x)), want, "jitted codes")
    values = np.asarray(jq.QTensor(jnp.asarray(want), jnp.asarray(s)).dequantize())
    ref = onnx_run("DequantizeLinear", {"q": want, "s": s, "z": zp})
    normal = ~(np.abs(ref) < np.finfo(np.float32).tiny)  # products below 2**-126 flush to 0
    assert_same_bits(values[normal], ref[normal], "values")
    fake = np.asarray(jq.fake_quant(jnp.asarray(x), jnp.float32(s), dtype=np_dtype(fmt)))
    assert_same_bits(fake[normal], values[normal], "fake_quant")


@pytest.mark.parametrize("fmt", ["int8", "float8_e5m2"])
@pytest.mark.parametrize("smallest_max", [2.0**-126, 1.0], ids=["tiny-scales", "large-scales"])
def test_subnormal_inputs_with_computed_scales_match_onnx(fmt, smallest_max):
    """Computed scales are never subnormal (the division skips their rescaling); the
    subnormal inputs of their groups still quantize as ONNX does, in quantize, fake_quant and
    the dynamic int8 activations of qdot_general."""
    dt = np_dtype(fmt)
    qmax = np.float64(ml_dtypes.finfo(dt).max if fmt.startswith("float") else 127)
    columns = 100
    x = _with_subnormals(np.random.default_rng(11))[:8 * columns].reshape(8, columns)
    # the groups' maxima: normal (a group of subnormals alone reads as zeros, scale 1)
    ratios = np.float32([1, 3, 100, 2**20, 1.5, 1, 2, 4])
    x[:, 0] = np.float32(smallest_max) * ratios * (np.float32(qmax) if smallest_max > 2.0**-126
                                                   else 1)
    x[7, 1] = np.float32(2.0**-126) - np.float32(2.0**-149)  # the largest subnormal
    amax = np.abs(x).max(axis=1, keepdims=True).astype(np.float64)
    want_s = np.maximum(amax / qmax, 2.0**-126).astype(np.float32)  # every group has a max
    assert (want_s.min() >= 2.0**-100) == (smallest_max == 1)
    qt = jq.quantize(jnp.asarray(x), dtype=dt, axis=0)
    np.testing.assert_array_equal(np.asarray(qt.scale)[:, None], want_s)
    for i in range(8):
        want = onnx_run("QuantizeLinear", {"x": x[i], "s": want_s[i, 0],
                                           "z": np.zeros((), dt)})
        assert_same_bits(np.asarray(qt.qvalue)[i], want, f"codes of group {i}")
    assert_same_bits(np.asarray(jax.vmap(lambda r: jq.quantize(r, dtype=dt).qvalue)(x)),
                     np.asarray(qt.qvalue), "vmapped codes")
    fake = np.asarray(jq.fake_quant(jnp.asarray(x), dtype=dt, axis=0))
    assert_same_bits(fake, np.asarray(jq.dequantize(qt)), "fake_quant")
    if fmt == "int8":  # per-token activation codes: the same groups, summed against ones
        out = jq.qdot_general(jnp.asarray(x), jq.quantize(jnp.ones((columns, 1)), axis=1),
                              (((1,), (0,)), ((), ())), act_quant=jq.ActQuant())
        codes = np.asarray(qt.qvalue, np.int64).sum(axis=1, keepdims=True)
        np.testing.assert_allclose(np.asarray(out), codes * want_s, rtol=2e-7)


@pytest.mark.parametrize("dtype,symmetric", [("int8", True), ("uint8", True), ("uint8", False),
                                             ("float8_e4m3fn", True)])
def test_a_group_of_subnormals_alone_gets_scale_one_on_every_backend(dtype, symmetric):
    """XLA:CPU reads subnormals as zeros, XLA:GPU does not: a group whose largest magnitude is
    subnormal gets scale 1 and zero codes on both (an H200 gave it the smallest normal scale).
    The affine group's range (twice 0.9 * 2**-126) is normal, its ends are not."""
    tiny = np.float32(0.9 * 2.0**-126)
    x = np.array([[1e-39, -5e-40, 0.0, 2e-45], [tiny, -tiny, 0.0, 0.0], [1.0, -0.5, 1e-39, 0.0]],
                 np.float32)
    for f in (lambda x: jq.quantize(x, dtype=dtype, axis=0, symmetric=symmetric),
              jax.jit(lambda x: jq.quantize(x, dtype=dtype, axis=0, symmetric=symmetric))):
        qt = f(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(qt.scale)[:2], [1.0, 1.0])
        zero = 0 if qt.zero_point is None else np.asarray(qt.zero_point)[:2, None]
        np.testing.assert_array_equal(np.asarray(qt.qvalue[:2], np.float32) - zero, 0.0)
        np.testing.assert_array_equal(np.asarray(jq.dequantize(qt))[:2], 0.0)
        assert np.asarray(qt.scale)[2] > 2.0**-126


@pytest.mark.parametrize("fmt, inside, outside", [
    ("float8_e4m3fn", [447.0, 455.0, 463.9, 464.0], [464.1, 500.0]),  # 464 ties down to 448
    ("float8_e5m2", [57344.0, 61439.0], [61440.0, 70000.0]),  # 61440 ties up, beyond
    ("float4_e2m1fn", [6.0, 6.5, 6.99], [7.0, 8.0]),  # 7 ties up to 8, beyond
])
def test_float_ste_passes_quotients_that_round_to_the_largest_value(fmt, inside, outside):
    """The clipped STE tests the rounded, unclipped code, as for integers: x / s = 455
    rounds to float8_e4m3fn's 448, which is in range."""
    for sign in (1.0, -1.0):
        x = jnp.float32(sign) * jnp.array(inside + outside, jnp.float32)
        g = jax.grad(lambda v: jq.fake_quant(v, jnp.float32(1.0), dtype=fmt).sum())(x)
        np.testing.assert_array_equal(np.asarray(g), [1.0] * len(inside) + [0.0] * len(outside))


@pytest.mark.parametrize("fmt,wider,top", [("float6_e2m3fn", ml_dtypes.float8_e4m3fn, 7.5),
                                           ("float6_e3m2fn", ml_dtypes.float8_e5m2, 28.0)])
def test_float6_ste_passes_quotients_that_round_to_the_largest_value(fmt, wider, top):
    """float6 rounds as an IEEE float: a quotient is clipped only when rounding to nearest
    even with its mantissa bits and no largest value (a float8 of as many mantissa bits and a
    wider exponent) goes beyond the largest value; as in MXFP6 blocks (block max / scale lies
    in [4, 8) for E2M3)."""
    q = np.linspace(top * 0.9, top * 1.2, 301, dtype=np.float32)
    q = np.concatenate([q, -q, np.float32([7.75, 30.0])])  # the ties of E2M3 and E3M2
    want = (np.abs(q.astype(wider).astype(np.float32)) <= top).astype(np.float32)
    assert 0 < want.sum() < want.size
    g = jax.grad(lambda v: jq.fake_quant(v, jnp.float32(1.0), dtype=fmt).sum())(jnp.asarray(q))
    np.testing.assert_array_equal(np.asarray(g), want)
    if fmt == "float6_e2m3fn":  # a block whose largest value sets the scale 1
        x = np.zeros((1, 32), np.float32)
        x[0, 0], x[0, 1:4] = 4.0, [7.6, 7.74, 7.75]
        g = jax.grad(lambda v: jq.fake_quant(v, dtype="mxfp6_e2m3").sum())(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(g)[0, :4], [1.0, 1.0, 1.0, 0.0])


@pytest.mark.parametrize("fmt, zero_point", [
    ("int8", None), ("int8", 0), ("uint8", 128), ("int4", None), ("int32", None),
    ("float4_e2m1fn", 0.0), ("float4_e2m1fn", None), ("float8_e4m3fn", None),
])
def test_fake_quant_has_the_bits_of_dequantize_quantize(fmt, zero_point):
    """Also the sign of zero: an integer code has no -0.0; ONNX adds a float4 zero point."""
    x = jnp.array([-0.1, -0.0, 0.0, 0.1, -0.7, 3.0, -1e-3, 1e-3], jnp.float32)
    dt = np_dtype(fmt)
    zp = None if zero_point is None else jnp.asarray(np.asarray(zero_point, dt))
    want = jq.quantize(x, jnp.float32(0.5), zp, dtype=dt).dequantize()
    assert_same_bits(jq.fake_quant(x, jnp.float32(0.5), zp, dtype=dt), want, "fake_quant")
    assert_same_bits(jax.jit(lambda v: jq.fake_quant(v, jnp.float32(0.5), zp, dtype=dt))(x), want,
                     "jitted fake_quant")


def test_float4_zero_point_makes_negative_zero_positive_as_onnx():
    x = np.float32([-0.1, -0.0, 0.3])
    zp = np.zeros((), ml_dtypes.float4_e2m1fn)
    want = onnx_run("QuantizeLinear", {"x": x, "s": np.float32(1.0), "z": zp})
    got = jq.quantize(jnp.asarray(x), jnp.float32(1.0), jnp.asarray(zp), dtype=jnp.float4_e2m1fn)
    assert_same_bits(got.qvalue, want, "codes", nbits=4)


def test_float4_zero_point_under_jit_as_onnx():
    """A zero point known when the program is compiled (a closure constant) still turns
    -0.0 into +0.0: XLA may delete an addition of a constant 0.0."""
    x = np.float32([-0.1, -0.0, 0.0, 0.3, -2.0])
    zp = np.zeros((), ml_dtypes.float4_e2m1fn)
    want = onnx_run("QuantizeLinear", {"x": x, "s": np.float32(1.0), "z": zp})
    values = onnx_run("DequantizeLinear", {"q": want, "s": np.float32(1.0), "z": zp})
    for s in (np.float32(1.0), jnp.float32(1.0)):  # constant-folded and not
        codes = jax.jit(lambda v, s=s: jq.quantize(v, s, zp, dtype=jnp.float4_e2m1fn).qvalue)
        assert_same_bits(codes(jnp.asarray(x)), want, "jitted codes", nbits=4)
        fake = jax.jit(lambda v, s=s: jq.fake_quant(v, s, zp, dtype=jnp.float4_e2m1fn))
        assert_same_bits(fake(jnp.asarray(x)), values, "jitted fake_quant")


def test_float4_saturates_without_saturate_and_the_ste_clips_there():
    """ONNX ignores ``saturate`` for float4 (it has no inf or NaN): values beyond 6
    clip either way, so the clipped STE must stop their gradient either way, and the
    LSQ scale gradient takes the range end (+-6) there."""
    x = np.float32([1.0, 5.0, 6.9, 7.0, 100.0, -100.0, -6.5, -7.0, np.inf])
    s = np.float32(1.0)
    codes = onnx_run("QuantizeLinear", {"x": x, "s": s}, output_dtype=TensorProto.FLOAT4E2M1,
                     saturate=0)
    want = onnx_run("DequantizeLinear", {"q": codes, "s": s})
    inside = np.abs(x) < 7.0  # 7 ties to 8 (even mantissa), beyond the largest value 6
    fq = lambda v, s: jq.fake_quant(v, s, dtype=jnp.float4_e2m1fn, saturate=False)
    assert_same_bits(fq(jnp.asarray(x), jnp.float32(s)), want, "values")
    gx, gs = jax.grad(lambda v, s: fq(v, s).sum(), argnums=(0, 1))(jnp.asarray(x), jnp.float32(s))
    np.testing.assert_array_equal(np.asarray(gx), inside.astype(np.float32))
    lsq = np.where(inside, (want - x) / s, np.sign(x) * 6.0)  # LSQ, as the contract states
    np.testing.assert_allclose(float(gs), lsq.sum(), rtol=1e-6)


@pytest.mark.parametrize("axis", [None, 1, -3, 5])
def test_one_element_scale_with_block_size_ignores_axis_as_onnx(axis):
    """API.md: a one-element scale is per-tensor and ``axis`` is then ignored; ONNX reads
    it so whatever ``block_size`` and ``axis`` say (here, ONNX's default axis=1 on a 1-D
    input)."""
    x = np.float32([0.1, -0.5, 0.25, 2.0, 1.0])
    scale, zp = np.float32(0.25), np.int8(3)
    want = onnx_run("QuantizeLinear", {"x": x, "s": scale, "z": zp}, axis=1, block_size=2)
    qt = jq.quantize(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(zp), axis=axis,
                     block_size=2)
    assert qt.layout.kind == "tensor"
    assert_same_bits(qt.qvalue, want, "codes")
    values = jq.QTensor(jnp.asarray(want), jnp.asarray(scale), jnp.asarray(zp), axis=axis,
                        block_size=2).dequantize()
    ref = onnx_run("DequantizeLinear", {"q": want, "s": scale, "z": zp}, axis=1, block_size=2)
    assert_same_bits(values, ref, "values")
    fake = jq.fake_quant(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(zp), axis=axis,
                         block_size=2)
    assert_same_bits(fake, ref, "fake_quant")


@pytest.mark.parametrize("kw", [
    {}, {"axis": 0}, {"axis": 1, "block_size": 2}, {"dtype": jnp.uint8, "axis": 0, "symmetric": False},
    {"dtype": jnp.float8_e4m3fn, "axis": 0}, {"dtype": "nf4", "axis": 1, "block_size": 2},
], ids=["tensor", "axis", "block", "asym", "float8", "nf4"])
def test_a_group_holding_a_nan_gets_a_nan_scale_as_torch_observers(kw):
    """PyTorch's min/max observers give a NaN scale to a group holding a NaN (and
    OCP MX a NaN shared scale), so that the group dequantizes to NaN; a scale of 1
    would quantize the group's other values silently wrong."""
    from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

    x = np.float32([[1.0, np.nan, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    qt = jq.quantize(jnp.asarray(x), **kw)
    if kw.get("axis") == 0:
        obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8,
                                       qscheme=torch.per_channel_symmetric)
    else:
        obs = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    obs(torch.from_numpy(x))
    torch_nan = np.isnan(obs.calculate_qparams()[0].numpy())
    scale_nan = np.isnan(np.asarray(qt.scale, np.float32))
    if "block_size" in kw:  # the first block of row 0 holds the NaN
        assert scale_nan.tolist() == [[True, False], [False, False]]
    else:
        assert scale_nan.ravel().tolist() == torch_nan.tolist()
    want = np.zeros(x.shape, bool)  # the NaN's group dequantizes to NaN, the others do not
    want[:1 if kw else 2, :2 if "block_size" in kw else 4] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(qt.dequantize())), want)


@pytest.mark.parametrize("scheme", ["mxfp8_e4m3", "mxfp4", "mxint8"])
def test_an_mx_block_holding_a_nan_gets_the_nan_scale(scheme):
    x = jnp.ones((2, 64)).at[0, 3].set(jnp.nan)
    qt = jq.quantize(x, dtype=scheme)
    stored = np.asarray(qt.scale).view(np.uint8)
    clean = np.asarray(jq.quantize(jnp.ones((2, 64)), dtype=scheme).scale).view(np.uint8)
    assert stored[0, 0] == 255 and clean[0, 0] != 255  # OCP MX: 0xFF is the NaN scale
    np.testing.assert_array_equal(stored.ravel()[1:], clean.ravel()[1:])
    deq = np.asarray(qt.dequantize())
    assert np.isnan(deq[0, :32]).all() and np.isfinite(deq[0, 32:]).all()
    assert np.isnan(np.asarray(jq.fake_quant(x, dtype=scheme))[0, :32]).all()


@pytest.mark.parametrize("kw", [dict(), dict(dtype=jnp.uint8, symmetric=False),
                                dict(dtype=jnp.uint4, axis=0),
                                dict(dtype=jnp.float8_e4m3fn, axis=0)],
                         ids=["int8", "uint8-affine", "uint4", "fp8"])
def test_tiny_normal_groups_keep_their_values(kw):
    # regression: absmax / qmax underflowed to 0 on CPU (a subnormal, flushed), and the
    # group was taken for all zeros: scale 1, every code 0
    x = np.array([5e-38, -2.5e-38, 6e-38, 3e-38], np.float32)  # normal, / qmax subnormal
    qt = jq.quantize(jnp.asarray(x), **kw)
    scale = np.asarray(jax.device_get(qt.scale), np.float64)
    assert np.all(scale > 0) and np.all(scale < 1e-30)
    y = np.asarray(jq.dequantize(qt), np.float64)
    step = scale if kw.get("dtype") != jnp.float8_e4m3fn else np.abs(x) / 8
    assert np.all(np.abs(y - x) <= 0.5 * step + 1e-45), (x, y)
