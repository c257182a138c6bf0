"""OCP Microscaling (MX) formats and NVFP4 against NumPy/ml_dtypes references of the specs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

# scheme -> (element dtype for ml_dtypes casts, emax of the element format, OCP v1.0 Table 1)
MX = {
    "mxfp8_e4m3": (ml_dtypes.float8_e4m3fn, 8),
    "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 15),
    "mxfp6_e2m3": (ml_dtypes.float6_e2m3fn, 2),
    "mxfp6_e3m2": (ml_dtypes.float6_e3m2fn, 4),
    "mxfp4": (ml_dtypes.float4_e2m1fn, 2),
}
BITS = {"mxfp8_e4m3": 8.25, "mxfp8_e5m2": 8.25, "mxfp6_e2m3": 6.25, "mxfp6_e3m2": 6.25,
        "mxfp4": 4.25, "mxint8": 8.25, "nvfp4": 4.5}


def _weights(shape=(16, 256), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w *= np.exp(rng.uniform(-4, 4, shape[:-1] + (1,))).astype(np.float32)  # many scales
    return w


def _mx_reference(w: np.ndarray, elem, emax: int):
    """OCP MX v1.0 section 6.3: X = 2**(floor(log2(amax)) - emax), P = cast(V / X), saturating."""
    blocks = w.reshape(w.shape[0], -1, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    x = np.exp2(np.floor(np.log2(amax)) - emax)
    top = float(ml_dtypes.finfo(elem).max)
    p = np.clip(blocks / x, -top, top).astype(np.float32).astype(elem)
    return p.reshape(w.shape), x[..., 0]


@pytest.mark.parametrize("name", sorted(MX))
def test_mx_codes_and_scales_match_the_spec(name):
    elem, emax = MX[name]
    w = _weights()
    qt = jq.quantize(w, dtype=name)
    assert (qt.block_size, qt.axis) == (32, 1)
    assert qt.scale.dtype == jnp.float8_e8m0fnu and qt.scale.shape == (16, 8)
    codes, x = _mx_reference(w, elem, emax)
    np.testing.assert_array_equal(np.asarray(qt.scale).astype(np.float64), x)
    got = np.asarray(jq.unpack(qt).qvalue)
    np.testing.assert_array_equal(got.view(np.uint8), codes.view(np.uint8))
    expected = codes.astype(np.float32).reshape(16, 8, 32) * x[..., None].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), expected.reshape(16, 256))


def test_mxint8_is_int8_with_power_of_two_scales():
    """MXINT8: elements q * 2**-6 (OCP's implied scale), shared scale 2**floor(log2(amax))."""
    w = _weights()
    qt = jq.quantize(w, dtype="mxint8")
    assert qt.qvalue.dtype == jnp.int8 and qt.scale.dtype == jnp.float8_e8m0fnu
    blocks = w.reshape(16, 8, 32).astype(np.float64)
    shared = np.exp2(np.floor(np.log2(np.abs(blocks).max(-1, keepdims=True))))
    q = np.clip(np.round(blocks / shared * 64), -128, 127)  # 1.xxxxxx fixed point in int8
    np.testing.assert_array_equal(np.asarray(qt.qvalue), q.reshape(16, 256))
    np.testing.assert_array_equal(np.asarray(qt.scale).astype(np.float64), shared[..., 0] / 64)


@pytest.mark.parametrize("name", sorted(BITS))
def test_bits_per_element(name):
    qt = jq.quantize(_weights((64, 1024)), dtype=name, packed=name not in ("mxint8",) and
                     "fp8" not in name)
    extra = 32 / (64 * 1024) if name == "nvfp4" else 0.0  # NVFP4's one float32 per tensor
    assert qt.bits_per_element == pytest.approx(BITS[name] + extra)
    assert jq.format_name(qt) == name


def test_scale_rounding_trade_off_on_values_that_would_clip():
    """E2M1 (max 6): a block whose largest value is 7.5 and one whose largest is 6.5."""
    small = np.linspace(0.1, 1.0, 31, dtype=np.float32)
    w = np.stack([np.append(small, 7.5), np.append(small, 6.5)]).astype(np.float32)
    err, scale = {}, {}
    for mode in ("floor", "ceil", "up_on_overflow"):
        qt = jq.quantize(w, dtype="mxfp4", scale_rounding=mode)
        scale[mode] = np.asarray(qt.scale).astype(np.float32)[:, 0]
        err[mode] = np.abs(np.asarray(qt.dequantize()) - w)
    # floor (OCP): scale 1 for both; 7.5 clips to 6 (error 1.5), 6.5 rounds to 6 (0.5).
    np.testing.assert_array_equal(scale["floor"], [1, 1])
    assert err["floor"][0, -1] == 1.5
    # ceil: never clips, but doubles the scale of both blocks (coarser small values).
    np.testing.assert_array_equal(scale["ceil"], [2, 2])
    assert err["ceil"][:, -1].max() <= 1.0 and err["ceil"][0, -1] < err["floor"][0, -1]
    assert err["ceil"][:, :-1].mean() > err["floor"][:, :-1].mean()
    # up_on_overflow: 7.5 / 1 would round to 8 (beyond 6): scale 2; 6.5 / 1 rounds to 6: scale 1.
    np.testing.assert_array_equal(scale["up_on_overflow"], [2, 1])
    np.testing.assert_array_equal(err["up_on_overflow"][1], err["floor"][1])
    np.testing.assert_array_equal(err["up_on_overflow"][0], err["ceil"][0])


def test_scale_rounding_never_clips_with_ceil():
    w = _weights((32, 256), seed=5)
    qt = jq.quantize(w, dtype="mxfp8_e4m3", scale_rounding="ceil")
    s = np.repeat(np.asarray(qt.scale).astype(np.float32), 32, axis=1)
    assert np.all(np.abs(w) / s <= 448)


@pytest.mark.parametrize("dtype, emax", [("mxint8", 6), (jnp.int8, 6), (jnp.int4, 2),
                                         (jnp.int2, 0)])
@pytest.mark.parametrize("mode", ["floor", "ceil", "up_on_overflow"])
def test_signed_integer_codes_on_the_largest_pow2_scale_stay_finite(dtype, emax, mode):
    """Signed codes reach -(top + 1) = -2**(emax + 1); at the largest scale 2**(127 - emax)
    that is -2**128, inf. Such a block's most negative code is -top; elsewhere -(top + 1)
    stays (a block scaled by 2**-6: -1.999 is code -128, as OCP's two's complement)."""
    kw = {} if dtype == "mxint8" else dict(axis=-1, block_size=32,
                                           scale_dtype=jnp.float8_e8m0fnu)
    top = 2 ** (emax + 1) - 1
    big = np.float32(np.finfo(np.float32).max) * np.float32(0.999)
    x = np.zeros((2, 32), np.float32)
    x[0, :3] = [-big, big, -(2.0**127)]
    x[1, :2] = [-(2.0 ** (emax + 1)) * 0.9995, 1.0]  # rounds to -(top + 1) on scale 1
    qt = jq.quantize(jnp.asarray(x), dtype=dtype, scale_rounding=mode, **kw)
    codes, out = np.asarray(qt.qvalue, np.int32), np.asarray(jq.dequantize(qt))
    assert np.all(np.isfinite(out)), out[0, :3]
    assert np.asarray(qt.scale).astype(np.float32)[0].item() == 2.0 ** (127 - emax)
    assert codes[0, 0] == -top and out[0, 0] == -top * 2.0 ** (127 - emax)
    if mode == "floor":  # (ceil and up_on_overflow raise that block's scale instead)
        assert codes[1, 0] == -(top + 1)  # not in the top binade: the full range
    fq = jq.fake_quant(jnp.asarray(x), dtype=dtype, scale_rounding=mode, **kw)
    np.testing.assert_array_equal(np.asarray(fq), out)


@pytest.mark.parametrize("name", [*MX, "mxint8"])
@pytest.mark.parametrize("mode", ["floor", "ceil", "up_on_overflow"])
def test_no_rounding_mode_turns_float32s_top_binade_into_inf(name, mode):
    """A raised exponent at absmax >= 2**127 could round the block's largest value to 2**128
    (inf in float32): such blocks keep the floor scale (clipping as OCP's rule does); one
    binade lower ceil still raises it and never clips."""
    big = float(np.finfo(np.float32).max)
    x = np.stack([np.linspace(big / 2, big, 32), np.linspace(2.0**126, 1.99 * 2.0**126, 32)])
    x = x.astype(np.float32)
    for sign in (1.0, -1.0):  # MXINT8's -2.0 element at the largest scale would be -2**128
        qt = jq.quantize(jnp.asarray(sign * x), dtype=name, scale_rounding=mode)
        for out in (jq.dequantize(qt), jax.jit(jq.dequantize)(qt)):
            assert np.all(np.isfinite(np.asarray(out))), (sign, out)
        scales = np.asarray(qt.scale).astype(np.float32).ravel()
        amax = np.abs(x).max(axis=1).astype(np.float64)  # float32 log2(max) rounds to 128
        floor = 2.0 ** (np.floor(np.log2(amax)) - MX.get(name, (None, 6))[1])  # int8 codes: 6
        assert scales[0] == floor[0]
        if mode == "ceil":
            top = float(ml_dtypes.finfo(MX[name][0]).max) if name in MX else 127.0
            assert np.all(np.abs(x[1]) / scales[1] <= top)


def test_nvfp4_matches_the_two_level_recipe():
    """NVFP4: global = amax / (6 * 448); block scale = e4m3(amax_b / 6 / global);
    elements = e2m1(x / (block scale * global)), saturating at 6."""
    w = _weights((8, 128), seed=1)
    qt = jq.quantize(w, dtype="nvfp4", packed=True)
    assert (qt.block_size, qt.axis) == (16, 1)
    inner = qt.scale
    assert jq.is_qtensor(inner) and inner.qvalue.dtype == jnp.float8_e4m3fn
    assert inner.shape == (8, 8) and inner.scale.dtype == jnp.float32 and inner.scale.size == 1
    blocks = w.reshape(8, 8, 16)
    amax_b = np.abs(blocks).max(-1) / np.float32(6)  # float32 arithmetic, as the recipe
    g = np.float32(amax_b.max() / np.float32(448))
    np.testing.assert_array_equal(np.asarray(inner.scale).reshape(()), g)
    bs = (amax_b / g).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(inner.qvalue).view(np.uint8), bs.view(np.uint8))
    divisor = bs.astype(np.float32) * g
    e = np.clip(blocks / divisor[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn)
    got = np.asarray(jq.unpack(qt).qvalue).reshape(8, 8, 16)
    np.testing.assert_array_equal(got.view(np.uint8), e.view(np.uint8))
    expected = e.astype(np.float32) * divisor[..., None]
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), expected.reshape(8, 128))


GOLDEN_SQNR_DB = {  # a 256 x 512 standard-normal matrix (NumPy seed 0), measured 2026-11-23
    "nf4": 20.71, "fp4": 18.28, "mxfp8_e4m3": 30.59, "mxfp8_e5m2": 25.35, "mxfp6_e2m3": 30.93,
    "mxfp6_e3m2": 25.34, "mxfp4": 18.78, "mxint8": 41.65, "nvfp4": 20.42,
}


@pytest.mark.parametrize("name", sorted(GOLDEN_SQNR_DB))
def test_golden_round_trip_error_budget(name):
    w = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    y = np.asarray(jq.quantize(w, dtype=name).dequantize(), np.float64)
    sqnr = 10 * math.log10(np.sum(w.astype(np.float64) ** 2) / np.sum((w - y) ** 2))
    assert abs(sqnr - GOLDEN_SQNR_DB[name]) < 0.05, sqnr


# mxfp8 takes mxfp4's path (float elements, E8M0 scales); it is checked against the
# XLA product in test_cudnn_path_passes_codes_and_scales_as_jax_expects.
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "mxint8"])
def test_scaled_matmul_equals_the_dequantized_product(name):
    a = _weights((2, 8, 64), seed=2)
    b = _weights((2, 16, 64), seed=3)
    qa, qb = jq.quantize(a, dtype=name), jq.quantize(b, dtype=name)
    ref = np.einsum("bmk,bnk->bmn", np.asarray(qa.dequantize(), np.float64),
                    np.asarray(qb.dequantize(), np.float64))
    # jax.nn.scaled_matmul's definition: codes times the block scales repeated along K.
    y = jq.scaled_matmul(qa, qb)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    qa2, qb2 = jq.quantize(a[0], dtype=name), jq.quantize(b[0], dtype=name)
    ref2 = np.asarray(qa2.dequantize(), np.float64) @ np.asarray(qb2.dequantize(), np.float64).T
    np.testing.assert_allclose(np.asarray(jq.scaled_matmul(qa2, qb2)), ref2, rtol=1e-5,
                               atol=1e-5 * np.abs(ref2).max())


def test_scaled_matmul_errors():
    a = jq.quantize(jnp.ones((4, 64)), dtype="mxfp4")
    with pytest.raises(TypeError, match="lhs must be a jaxquant.QTensor"):
        jq.scaled_matmul(jnp.ones((4, 64)), a)
    with pytest.raises(ValueError, match="blocked along its last"):
        jq.scaled_matmul(jq.quantize(jnp.ones((4, 64)), axis=0), a)
    with pytest.raises(ValueError, match="one block size"):
        jq.scaled_matmul(a, jq.quantize(jnp.ones((4, 64)), dtype="nvfp4"))
    with pytest.raises(ValueError, match="shapes"):
        jq.scaled_matmul(a, jq.quantize(jnp.ones((4, 96)), dtype="mxfp4"))
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a GPU"):
            jq.scaled_matmul(a, a, implementation="cudnn")


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(dtype="mxfp4", block_size=16), ValueError, "blocks of 32"),
    (dict(dtype="nvfp4", block_size=32), ValueError, "blocks of 16"),
    (dict(dtype="mxfp4", scale_dtype=jnp.float32), ValueError, "float8_e8m0fnu"),
    (dict(dtype=jnp.float4_e2m1fn, axis=-1, block_size=32, scale_dtype=jnp.int8), TypeError,
     "scale_dtype must be"),
    (dict(dtype="mxfp4", scale_rounding="up"), ValueError, "scale_rounding"),
    (dict(dtype="nvfp4", double_quant=True), ValueError, "nvfp4 has one float32 scale per"),

    (dict(dtype="mxint8", symmetric=False), ValueError, "symmetric"),
    (dict(dtype="nf4", double_quant=True, axis=None, block_size=None), None, None),
])
def test_bad_arguments_are_rejected(kwargs, err, match):
    x = jnp.ones((4, 64))
    if err is None:  # nf4 defaults to blocks of 64 even with axis=None: valid
        assert jq.quantize(x, **kwargs).block_size == 64
        return
    with pytest.raises(err, match=match):
        jq.quantize(x, **kwargs)
    with pytest.raises(err, match=match):
        jq.fake_quant(x, **kwargs)


def test_packed_needs_a_narrow_format():
    with pytest.raises(ValueError, match="packed=True needs"):
        jq.quantize(jnp.ones((4, 64)), dtype="mxint8", packed=True)


# Packing sees 6-bit codes whatever the element format: each format once, with a full
# and a partial last group of four codes.
@pytest.mark.parametrize("name,n", [("mxfp6_e2m3", 64), ("mxfp6_e3m2", 70)])
def test_float6_codes_pack_four_per_three_bytes(name, n):
    w = _weights((4, n), seed=4)
    plain = jq.quantize(w, dtype=name)
    packed = jq.quantize(w, dtype=name, packed=True)
    assert plain.qvalue.dtype == np.uint8 and packed.qvalue.data.dtype == np.uint8
    assert packed.qvalue.data.shape == (4, 3 * -(-n // 4))
    np.testing.assert_array_equal(np.asarray(jq.unpack(packed).qvalue), np.asarray(plain.qvalue))
    np.testing.assert_array_equal(np.asarray(jq.pack(plain).qvalue.data),
                                  np.asarray(packed.qvalue.data))
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), np.asarray(plain.dequantize()))
    if n % 4 == 0:
        assert packed.bits_per_element == 6.25
    # the bit stream: code i at bits 6i..6i+5 of the little-endian bytes of its row
    row = np.asarray(packed.qvalue.data)[0].astype(np.uint64)
    stream = sum(int(b) << (8 * i) for i, b in enumerate(row))
    codes = [(stream >> (6 * i)) & 63 for i in range(n)]
    np.testing.assert_array_equal(codes, np.asarray(plain.qvalue)[0])


@pytest.mark.parametrize("fn", [jq.quantize, jq.fake_quant])
def test_explicit_scales_take_no_scale_storage_options(fn):
    with pytest.raises(ValueError, match="apply to computed scales"):
        fn(jnp.ones((4, 64)), jnp.float32(1), dtype="nf4", double_quant=True)
    with pytest.raises(ValueError, match="takes no zero_point"):
        fn(jnp.ones((4, 64)), jnp.float32(1), jnp.zeros((), jnp.uint4), dtype="nf4")


def test_double_quant_needs_grouped_scales():
    with pytest.raises(ValueError, match="per-tensor"):
        jq.quantize(jnp.ones((4, 64)), dtype=jnp.int4, double_quant=True)


def test_explicit_e8m0_scale_is_kept():
    x = jnp.array([[1.0, -3.0] * 16])
    s = jnp.array([[0.5]], jnp.float8_e8m0fnu)
    qt = jq.quantize(x, s, dtype=jnp.float4_e2m1fn, axis=1, block_size=32)
    assert qt.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), np.asarray(x))


def _documented_scaled_matmul(a, b, a_scales, b_scales, preferred_element_type=jnp.float32):
    """`jax.nn.scaled_matmul` as its docstring defines it (the cuDNN kernel computes this)."""
    a_scaled = a.astype(jnp.float32) * jnp.repeat(a_scales.astype(jnp.float32),
                                                  a.shape[-1] // a_scales.shape[-1], axis=-1)
    b_scaled = b.astype(jnp.float32) * jnp.repeat(b_scales.astype(jnp.float32),
                                                  b.shape[-1] // b_scales.shape[-1], axis=-1)
    return jnp.einsum("BMK,BNK->BMN", a_scaled, b_scaled,
                      precision="highest").astype(preferred_element_type)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4"])
def test_cudnn_path_passes_codes_and_scales_as_jax_expects(name, monkeypatch):
    """The GPU path hands `jax.nn.scaled_matmul` element codes and block scales (and applies
    NVFP4's tensor scales to the output); checked here with the function's documented maths
    in place of the cuDNN kernel, which needs a Blackwell GPU."""
    if jax.default_backend() == "gpu":
        pytest.skip("runs the real kernel path on GPUs")  # exercised by the test above
    calls = []

    def fake(*args, **kwargs):
        calls.append([a.dtype for a in args])
        return _documented_scaled_matmul(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "scaled_matmul", fake)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    a, b = _weights((3, 48, 96), seed=6), _weights((3, 40, 96), seed=7)  # shapes used once
    qa, qb = jq.quantize(a, dtype=name, packed=name == "nvfp4"), jq.quantize(b, dtype=name)
    y = jq.scaled_matmul(qa, qb)  # the default picks the cuDNN path on a "gpu"
    ref = jq.scaled_matmul(qa, qb, implementation="xla")
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(ref).max()))
    element = jnp.float8_e4m3fn if name == "mxfp8_e4m3" else jnp.float4_e2m1fn
    scale = jnp.float8_e8m0fnu if name == "mxfp8_e4m3" else jnp.float8_e4m3fn
    assert calls and calls[0] == [element, element, scale, scale]


@pytest.mark.parametrize("name", ["mxfp6_e2m3"])  # E3M2 codes take the same path
def test_scaled_matmul_takes_mxfp6(name):
    """MXFP6 is an OCP MX format: its product is the float64 product of the dequantized
    operands (a partial last block and packed codes included)."""
    a, b = _weights((2, 4, 80), seed=8), _weights((2, 3, 80), seed=9)
    qa, qb = jq.quantize(a, dtype=name), jq.quantize(b, dtype=name, packed=True)
    ref = np.einsum("bmk,bnk->bmn", np.asarray(qa.dequantize(), np.float64),
                    np.asarray(qb.dequantize(), np.float64))
    np.testing.assert_allclose(np.asarray(jq.scaled_matmul(qa, qb)), ref, rtol=1e-5,
                               atol=1e-5 * np.abs(ref).max())


def test_scaled_matmul_none_output_dtype_is_not_a_dtype():
    """``np.dtype(None)`` is float64: ``None`` must not slip through as a silent float64
    (truncated to float32 with a warning without x64)."""
    a = jq.quantize(jnp.ones((4, 64)), dtype="mxfp4")
    with pytest.raises(TypeError, match="preferred_element_type must be a float dtype, got None"):
        jq.scaled_matmul(a, a, preferred_element_type=None)
