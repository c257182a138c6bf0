"""Edge cases of the low-bit path (MX / NVFP4 scales, scale storage, GPTQ, Hadamard,
scaled_matmul), each against an independent NumPy / ml_dtypes / SciPy computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

# scheme -> (ml_dtypes element type or None for int8, emax, mantissa bits): OCP MX v1.0 Table 1
MX = {"mxfp8_e4m3": (ml_dtypes.float8_e4m3fn, 8, 3), "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 15, 2),
      "mxfp6_e2m3": (ml_dtypes.float6_e2m3fn, 2, 3), "mxfp6_e3m2": (ml_dtypes.float6_e3m2fn, 4, 2),
      "mxfp4": (ml_dtypes.float4_e2m1fn, 2, 1), "mxint8": (None, 6, None)}


def _round_unbounded(t: np.ndarray, mbits: int) -> np.ndarray:
    """``t > 0`` rounded to nearest even with ``mbits`` mantissa bits and no exponent limit."""
    ulp = np.exp2(np.floor(np.log2(t)) - mbits)
    return np.rint(t / ulp) * ulp


def _mx_reference(w: np.ndarray, name: str, mode: str):
    """Shared exponent ``floor(log2(amax)) - emax`` (OCP MX v1.0 section 6.3), raised by one
    for ``ceil`` where ``amax / X`` exceeds the element maximum and for ``up_on_overflow``
    where it would round beyond it; elements cast with saturation."""
    elem, emax, mbits = MX[name]
    top = 127.0 if elem is None else float(ml_dtypes.finfo(elem).max)
    b = w.reshape(w.shape[0], -1, 32).astype(np.float64)
    amax = np.abs(b).max(-1, keepdims=True)
    e = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - emax
    t = amax / np.exp2(e)
    if mode == "ceil":
        e = e + (t > top)
    elif mode == "up_on_overflow":
        e = e + ((np.rint(t) if elem is None else _round_unbounded(np.maximum(t, 1), mbits)) > top)
    x = np.exp2(np.clip(e, -126, 127))
    if elem is None:
        codes = np.clip(np.rint(b / x), -128, 127).astype(np.int8)
    else:
        codes = np.clip(b / x, -top, top).astype(np.float32).astype(elem).view(np.uint8)
    return codes.reshape(w.shape), x[..., 0]


@pytest.mark.parametrize("mode", ["floor", "ceil", "up_on_overflow"])
def test_mx_scales_and_codes_bit_exact_on_block_maxima_at_the_boundaries(mode):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((16, 128)).astype(np.float32)
    w *= np.exp2(rng.integers(-40, 40, (16, 1))).astype(np.float32)
    tops = [1.0, 6.5, 7.0, 7.5, 7.75, 28.0, 30.0, 448.0, 464.0, 480.0, 57344.0, 61440.0,
            127.4, 127.5, 127.6, 1.9999999]
    for i in range(16):  # put boundary values (ties at the top of each grid) as block maxima
        for j in range(4):
            v = np.float32(tops[(i * 4 + j) % len(tops)] * 2.0 ** int(rng.integers(-20, 20)))
            blk = slice(32 * j, 32 * j + 32)
            w[i, blk] = np.clip(w[i, blk], -v, v)
            w[i, 32 * j + int(rng.integers(32))] = v * rng.choice([-1, 1])
    for name in MX:
        qt = jq.quantize(w, dtype=name, scale_rounding=mode)
        codes, x = _mx_reference(w, name, mode)
        np.testing.assert_array_equal(np.asarray(qt.scale).astype(np.float64), x, err_msg=name)
        got = np.asarray(jq.unpack(qt).qvalue)
        np.testing.assert_array_equal(got if name == "mxint8" else got.view(np.uint8), codes,
                                      err_msg=name)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_mx_nan_block_gets_the_nan_scale_and_leaves_its_neighbours_alone(bad):
    """OCP MX v1.0 (and microxcaling): a block whose maximum is NaN or infinite gets the NaN
    scale 0xFF; an inf once got the largest finite scale, which zeroed the block's others."""
    w = np.ones((1, 64), np.float32)
    w[0, 3] = bad
    for name in MX:
        qt = jq.quantize(w, dtype=name)
        bits = np.asarray(qt.scale).view(np.uint8)
        np.testing.assert_array_equal(bits, [[0xFF, 127 - MX[name][1]]])  # NaN, 2**-emax
        y = np.asarray(qt.dequantize())
        assert np.isnan(y[0, :32]).all() and (y[0, 32:] == 1).all()


# --- e8m0 scales of unsigned integer formats -------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint4, jnp.uint2])
@pytest.mark.parametrize("mode", ["floor", "ceil", "up_on_overflow"])
def test_e8m0_scales_of_unsigned_formats_use_their_symmetric_range(dtype, mode):
    """Symmetric unsigned codes sit around the mid-range zero point ``mid = (qmax + 1) // 2``
    and reach ``qmax - mid`` above it (127 for uint8), not ``qmax``; a power-of-two scale
    chosen from ``qmax`` clipped every block's top half (1.3 -> 0.99 with "ceil")."""
    qmax = int(jnp.iinfo(dtype).max)
    mid = (qmax + 1) // 2
    top = qmax - mid
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((6, 64)) * np.exp2(rng.integers(-6, 6, (6, 1)))).astype(np.float32)
    b = w.reshape(6, 8, 8).astype(np.float64)
    amax = np.abs(b).max(-1, keepdims=True)
    e = np.floor(np.log2(amax)) - np.floor(np.log2(top))
    t = amax / np.exp2(e)
    if mode == "ceil":
        e += t > top
    elif mode == "up_on_overflow":
        e += np.rint(t) > top
    x = np.exp2(e)
    codes = np.clip(np.rint(b / x) + mid, 0, qmax).reshape(6, 64)
    qt = jq.quantize(w, dtype=dtype, axis=-1, block_size=8, scale_dtype=jnp.float8_e8m0fnu,
                     scale_rounding=mode)
    np.testing.assert_array_equal(np.asarray(qt.scale).astype(np.float64), x[..., 0])
    np.testing.assert_array_equal(np.asarray(qt.qvalue).astype(np.float64), codes)
    if mode == "ceil":  # never clips
        err = np.abs(np.asarray(qt.dequantize()) - w)
        assert np.all(err <= np.repeat(x[..., 0], 8, axis=1) / 2)


# --- float16 / bfloat16 scales -----------------------------------------------------------

def _half_scale(s: np.float32) -> np.float16:
    """float32 scale -> float16: saturating, rounded up below the smallest normal."""
    s = np.float32(min(s, np.float32(np.finfo(np.float16).max)))
    h = np.float16(s)
    if np.float32(h) < s and s < np.finfo(np.float16).smallest_normal:
        h = np.nextafter(h, np.float16(np.inf))
    return h


@pytest.mark.parametrize("dtype,qmax", [(jnp.int8, 127), (jnp.float8_e4m3fn, 448)])
@pytest.mark.parametrize("amax", [1e-8, 1e-5, 1e-3, 1e7, 1e9])
def test_float16_scales_never_become_zero_or_inf(dtype, qmax, amax):
    """A float16 scale below its range became 0 (a block of NaN or of clipped codes) and one
    above it inf (the block dequantized to NaN)."""
    w = np.array([[amax, amax / 3, -amax / 7, 0.0]], np.float32)
    qt = jq.quantize(w, dtype=dtype, axis=0, scale_dtype=jnp.float16)
    want = _half_scale(np.float32(np.float32(amax) / np.float32(qmax)))
    assert qt.scale.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(qt.scale).view(np.uint16), [want.view(np.uint16)])
    y = np.asarray(qt.dequantize())
    assert np.all(np.isfinite(y)) and y[0, 3] == 0.0
    if amax < 1e6:  # in float16's range or below: the block's largest value is not clipped
        assert np.float32(want) * qmax >= np.float32(amax) * (1 - 2.0 ** -11)
        if dtype == jnp.int8:
            assert np.all(np.abs(y - w) <= np.float32(want) / 2)


def test_scale_rounding_without_power_of_two_scales_is_an_error():
    x = jnp.ones((4, 64))
    for kw in (dict(dtype="nvfp4"), dict(dtype=jnp.int8, axis=0), dict(dtype="nf4")):
        with pytest.raises(ValueError, match="scale_rounding='ceil' rounds float8_e8m0fnu"):
            jq.quantize(x, scale_rounding="ceil", **kw)
        with pytest.raises(ValueError, match="scale_rounding='ceil'"):
            jq.fake_quant(x, scale_rounding="ceil", **kw)
    assert jq.quantize(x, dtype="mxfp4", scale_rounding="ceil").scale.dtype == jnp.float8_e8m0fnu


# --- GPTQ ----------------------------------------------------------------------------------

def _problem(k=64, n=16, rows=512, seed=0):
    rng = np.random.default_rng(seed)
    mix = np.eye(k) + 0.3 * rng.standard_normal((k, k)) / np.sqrt(k)
    x = (rng.standard_normal((rows, k)) @ mix).astype(np.float32)
    return x, rng.standard_normal((k, n)).astype(np.float32)


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a.qvalue), np.asarray(b.qvalue))
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


@pytest.mark.parametrize("where", [(0, 5), (5, 0)])
def test_gptq_nan_in_either_triangle_of_the_hessian_is_an_error(where):
    """LAPACK reads one triangle: a NaN in the other was silently ignored."""
    x, w = _problem()
    h = x.T @ x
    h[where] = np.nan
    with pytest.raises(ValueError, match="not positive definite"):
        jq.gptq(w, h, dtype=jnp.int4)
    traced = jax.jit(lambda w, h: jq.gptq(w, h, dtype=jnp.int4))(w, h)
    assert np.isnan(np.asarray(traced.scale)).all()


@pytest.mark.parametrize("factor", [2.0 ** 112, 2.0 ** -110])
def test_gptq_does_not_depend_on_the_hessian_magnitude(factor):
    """"Any positive multiple" of x^T x: 2**112 * H overflowed inside the factorization."""
    x, w = _problem()
    h = x.T @ x
    _same(jq.gptq(w, (h * factor).astype(np.float32), dtype=jnp.int4),
          jq.gptq(w, h, dtype=jnp.int4))


def test_gptq_uses_the_symmetric_part_of_the_hessian():
    """||x (w - q)||^2 depends on (H + H^T) / 2 only; the result no longer depends on which
    triangle holds an asymmetry."""
    x, w = _problem()
    h = x.T @ x
    upper, lower, both = h.copy(), h.copy(), h.copy()
    d = 0.2 * np.sqrt(h[0, 0] * h[5, 5])
    upper[0, 5] += d
    lower[5, 0] += d
    both[0, 5] += d / 2
    both[5, 0] += d / 2
    ref = jq.gptq(w, both, dtype=jnp.int4, axis=0, block_size=16)
    _same(jq.gptq(w, upper, dtype=jnp.int4, axis=0, block_size=16), ref)
    _same(jq.gptq(w, lower, dtype=jnp.int4, axis=0, block_size=16), ref)


@pytest.mark.parametrize("kw", [dict(), dict(axis=0, block_size=4)])
def test_gptq_of_a_kernel_without_input_rows(kw):
    w = np.zeros((0, 4), np.float32)
    qt = jq.gptq(w, np.zeros((0, 0), np.float32), dtype=jnp.int4, **kw)
    rtn = jq.quantize(w, dtype=jnp.int4, axis=kw.get("axis", -1), block_size=kw.get("block_size"))
    assert (qt.shape, qt.axis, qt.block_size, qt.scale.shape) == \
        (rtn.shape, rtn.axis, rtn.block_size, rtn.scale.shape)


@pytest.mark.parametrize("flag", ["act_order", "symmetric"])
def test_gptq_flags_must_be_bools(flag):
    x, w = _problem(k=16, n=4)
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        jq.gptq(w, x.T @ x, **{flag: "no"})


def _gptq_reference(w, h, qmin, qmax, block_size, symmetric, damp=0.01):
    """Frantar et al. 2023, Algorithm 1 in float64 (no lazy batches): min/max scales and zero
    points per block of rows, taken from the rows as updated when the block starts."""
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64)
    k = w.shape[0]
    u = np.linalg.cholesky(np.linalg.inv(h + damp * np.mean(np.diag(h)) * np.eye(k))).T
    q = np.zeros_like(w)
    for i in range(k):
        if i % block_size == 0:
            rows = w[i:i + block_size]
            if symmetric:
                s, z = np.abs(rows).max(0) / qmax, 0.0
            else:
                lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
                s = (hi - lo) / (qmax - qmin)
                z = np.clip(qmin - np.round(lo / s), qmin, qmax)
        q[i] = (np.clip(np.round(w[i] / s) + z, qmin, qmax) - z) * s
        w[i:] -= np.outer(u[i, i:], (w[i] - q[i]) / u[i, i])
    return q


@pytest.mark.parametrize("dtype,qmin,qmax,symmetric,block", [
    (jnp.uint4, 0, 15, False, 40), (jnp.int4, -7, 7, True, 8), (jnp.int8, -127, 127, True, 200),
])
def test_gptq_blocks_across_lazy_batches_match_the_papers_algorithm(dtype, qmin, qmax,
                                                                     symmetric, block):
    """200 input rows: lazy batches of 128 (160 for blocks of 40) do not divide them."""
    x, w = _problem(k=200, n=24, rows=800, seed=3)
    ours = np.asarray(jq.gptq(w, x.T @ x, dtype=dtype, axis=0, block_size=block,
                              symmetric=symmetric).dequantize())
    ref = _gptq_reference(w, x.T @ x, qmin, qmax, block, symmetric)
    assert np.mean(np.abs(ours - ref) > 1e-5 * np.abs(ref).max()) < 0.01


# --- Hadamard and scaled_matmul ----------------------------------------------------------

@pytest.mark.parametrize("n", [256, 4096, 16384])
def test_hadamard_large_blocks_equal_the_butterfly_transform(n):
    x = np.random.default_rng(n).standard_normal((3, n))
    r = x.copy()
    h = 1
    while h < n:  # the textbook fast Walsh-Hadamard transform (Sylvester order), float64
        r = r.reshape(3, -1, 2, h)
        r = np.stack([r[:, :, 0] + r[:, :, 1], r[:, :, 0] - r[:, :, 1]], axis=2).reshape(3, n)
        h *= 2
    got = np.asarray(jq.hadamard_transform(x.astype(np.float32)))
    np.testing.assert_allclose(got, r / np.sqrt(n), atol=1e-5)


def test_scaled_matmul_partial_last_block_never_takes_the_cudnn_path(monkeypatch):
    """jax.nn.scaled_matmul infers blocks as K // scales: K = 40 with two scales per row would
    be read as blocks of 20. The default must keep such operands on the XLA path."""
    calls = []

    def documented(a, b, sa, sb, preferred_element_type=jnp.float32):
        calls.append(1)
        rep = a.shape[-1] // sa.shape[-1]
        a = a.astype(jnp.float32) * jnp.repeat(sa.astype(jnp.float32), rep, axis=-1)
        b = b.astype(jnp.float32) * jnp.repeat(sb.astype(jnp.float32), rep, axis=-1)
        return jnp.einsum("bmk,bnk->bmn", a, b, precision="highest")

    monkeypatch.setattr(jax.nn, "scaled_matmul", documented)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(9)
    a = rng.standard_normal((5, 40)).astype(np.float32)
    b = (rng.standard_normal((7, 40)) * np.exp2(np.arange(40) // 20 * 6)).astype(np.float32)
    qa, qb = jq.quantize(a, dtype="mxfp8_e4m3"), jq.quantize(b, dtype="mxfp8_e4m3")

    def values(qt):  # codes times their block's scale, in NumPy
        codes = np.asarray(qt.qvalue).astype(np.float64)
        return codes * np.repeat(np.asarray(qt.scale).astype(np.float64), 32, axis=1)[:, :40]

    y = np.asarray(jq.scaled_matmul(qa, qb))
    np.testing.assert_allclose(y, values(qa) @ values(qb).T, rtol=1e-6, atol=1e-6)
    assert not calls
    with pytest.raises(ValueError, match="multiple of the block size"):
        jq.scaled_matmul(qa, qb, implementation="cudnn")


def test_scaled_matmul_bad_output_dtype_names_the_argument():
    a = jq.quantize(jnp.ones((2, 64)), dtype="mxfp4")
    with pytest.raises(TypeError, match="preferred_element_type must be a float dtype, got 'f"):
        jq.scaled_matmul(a, a, preferred_element_type="foo")


def test_gptq_takes_a_concrete_0d_damp_and_names_unsupported_schemes():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
    h = jnp.eye(8) * 2.0
    a = jq.gptq(w, h, damp=jnp.float32(0.05))
    b = jq.gptq(w, h, damp=0.05)
    np.testing.assert_array_equal(np.asarray(a.qvalue), np.asarray(b.qvalue))
    for name in ("mxfp4", "nvfp4", "mxint8"):
        with pytest.raises(TypeError, match=f"{name!r} is a block-scaled scheme"):
            jq.gptq(w, h, dtype=name, axis=0, block_size=4)


@pytest.mark.parametrize("kw", [dict(double_quant=True), dict(scale_dtype=jnp.float8_e4m3fn),
                                dict(scale_dtype=jnp.float8_e5m2)])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8])
def test_two_level_scales_of_tiny_tensors_keep_zero_blocks_zero(kw, dtype):
    # before: a block scale (its smallest code times a second-level scale near 2**-126) fell
    # below float32's normals, XLA:CPU flushed it to 0, and zero blocks became 0 / 0 = NaN
    x = np.zeros((2, 64), np.float32)
    x[0, :16] = 1e-33
    x[1, 20:24] = -3e-36
    qt = jq.quantize(jnp.asarray(x), dtype=dtype, axis=-1, block_size=16, **kw)
    back = np.asarray(jq.dequantize(qt))
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(back[x == 0], 0)
    assert (back[x != 0] != 0).all()  # nonzero blocks not flushed
    if dtype != jnp.float8_e5m2:  # its block scales (absmax / 57344) sit at float32's normals
        np.testing.assert_allclose(back, x, rtol=0.13, atol=0)
    np.testing.assert_array_equal(np.asarray(jq.fake_quant(jnp.asarray(x), dtype=dtype, axis=-1,
                                                           block_size=16, **kw)), back)


@pytest.mark.parametrize("kw", [dict(double_quant=True), dict(scale_dtype=jnp.float8_e4m3fn),
                                dict(scale_dtype=jnp.float8_e5m2),
                                dict(scale_dtype=jnp.float8_e8m0fnu), dict()])
def test_computed_scales_stored_rounded_never_push_finite_inputs_to_nan(kw):
    # before: with saturate=False, a block scale rounded below absmax / 448 put the block's
    # largest quotients past 464, and the non-saturating cast made them NaN
    x = jax.random.normal(jax.random.key(0), (64, 64))
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        qt = jq.quantize(x, dtype=dtype, axis=-1, block_size=16, saturate=False, **kw)
        assert np.isfinite(np.asarray(jq.dequantize(qt))).all(), (dtype, kw)
        fq = jq.fake_quant(x, dtype=dtype, axis=-1, block_size=16, saturate=False, **kw)
        np.testing.assert_array_equal(np.asarray(fq), np.asarray(jq.dequantize(qt)))
    mx = jq.quantize(x, dtype="mxfp8_e4m3", saturate=False)
    assert np.isfinite(np.asarray(jq.dequantize(mx))).all()
    # explicit scales keep their meaning: past the largest value is NaN without saturation
    over = jq.quantize(jnp.array([500.0]), jnp.float32(1.0), dtype=jnp.float8_e4m3fn,
                       saturate=False)
    assert np.isnan(np.asarray(jq.dequantize(over))).all()


@pytest.mark.parametrize("dtype,value,top", [(jnp.float8_e4m3fn, 450.0, 448.0),
                                             (jnp.float8_e5m2, 58000.0, 57344.0)])
def test_stochastic_rounding_without_saturation_stays_finite_where_nearest_does(dtype, value, top):
    # before: the upper neighbour of a value between the largest code and the overflow
    # threshold was one step past the format (480): NaN or inf for 6-7% of the draws
    x = jnp.full((4096,), value)
    qt = jq.quantize(x, jnp.float32(1.0), dtype=dtype, saturate=False, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(jq.dequantize(qt)), top)
    far = jq.quantize(jnp.full((64,), 2 * top), jnp.float32(1.0), dtype=dtype, saturate=False,
                      key=jax.random.key(1))  # beyond it, as round to nearest: not finite
    assert not np.isfinite(np.asarray(jq.dequantize(far))).any()
