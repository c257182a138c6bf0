"""Codebook formats: NF4 and FP4 against bitsandbytes' own tables and decision trees,
float6 against ml_dtypes' E2M3/E3M2 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from reference_tables import BNB_FP4, BNB_NF4

import jaxquant as jq


def _gt(x, literal: float) -> bool:
    return bool(np.float32(x) > np.float32(literal))


def bnb_quantize_nf4(x: float) -> int:
    """bitsandbytes' dQuantizeNF4 (csrc/kernels.cu), transcribed branch for branch.

    Its thresholds are float literals (``0.8614784181118011f``): compared in float32.
    """
    if _gt(x, 0.03979014977812767):
        if _gt(x, 0.3893125355243683):
            if _gt(x, 0.6427869200706482):
                return 0b1111 if _gt(x, 0.8614784181118011) else 0b1110
            return 0b1101 if _gt(x, 0.5016634166240692) else 0b1100
        if _gt(x, 0.2035212516784668):
            return 0b1011 if _gt(x, 0.2920137718319893) else 0b1010
        return 0b1001 if _gt(x, 0.1202552504837513) else 0b1000
    if _gt(x, -0.33967943489551544):
        if _gt(x, -0.13791173323988914):
            return 0b0111 if _gt(x, -0.045525018125772476) else 0b0110
        return 0b0101 if _gt(x, -0.23460740596055984) else 0b0100
    if _gt(x, -0.6106329262256622):
        return 0b0011 if _gt(x, -0.4599952697753906) else 0b0010
    return 0b0001 if _gt(x, -0.8480964004993439) else 0b0000


def bnb_quantize_fp4(x: float) -> int:
    """bitsandbytes' dQuantizeFP4 (csrc/kernels.cu), transcribed branch for branch."""
    sign = 0b1000 if x < 0 else 0
    x = abs(np.float32(x))
    if _gt(x, 0.29166667):
        if _gt(x, 0.583333):
            return (0b0011 if _gt(x, 0.8333333) else 0b0010) + sign
        return (0b101 if _gt(x, 0.4166667) else 0b100) + sign
    if _gt(x, 0.0859375):
        return (0b0111 if _gt(x, 0.20833333) else 0b0110) + sign
    return (0b0001 if _gt(x, 0.00260417) else 0b0000) + sign


def _codes(qt) -> np.ndarray:
    return np.asarray(jq.unpack(qt).qvalue).astype(np.int32)


def test_code_tables_are_bitsandbytes():
    assert jq.CODEBOOKS["nf4"].values == tuple(BNB_NF4)
    fp4 = np.float32(BNB_FP4) / np.float32(12)  # bitsandbytes normalizes in float32
    np.testing.assert_array_equal(np.float32(jq.CODEBOOKS["fp4"].values), fp4)
    for name in ("nf4", "fp4"):
        f = jq.CODEBOOKS[name]
        assert (f.bits, f.dtype, f.max_finite) == (4, np.dtype(jnp.uint4), 1.0)


@pytest.mark.parametrize("name,dt", [("float6_e2m3fn", ml_dtypes.float6_e2m3fn),
                                     ("float6_e3m2fn", ml_dtypes.float6_e3m2fn)])
def test_float6_tables_are_ml_dtypes(name, dt):
    values = np.arange(64, dtype=np.uint8).view(dt).astype(np.float32)
    np.testing.assert_array_equal(np.float32(jq.CODEBOOKS[name].values), values)
    assert jq.CODEBOOKS[name].max_finite == float(ml_dtypes.finfo(dt).max)


def _nf4_probe() -> np.ndarray:
    """Random values, every table entry and every bitsandbytes threshold (exact ties)."""
    rng = np.random.default_rng(0)
    mids = (np.float64(BNB_NF4[:-1]) + np.float64(BNB_NF4[1:])) / 2
    probe = [rng.uniform(-1.2, 1.2, 4000), BNB_NF4, mids, np.nextafter(mids.astype(np.float32),
                                                                       np.float32(2))]
    return np.concatenate([np.asarray(p, np.float32) for p in probe])


def test_nf4_codes_match_bitsandbytes_decision_tree():
    t = _nf4_probe()
    qt = jq.quantize(t, jnp.float32(1.0), dtype="nf4")
    expected = np.array([bnb_quantize_nf4(float(v)) for v in t])
    np.testing.assert_array_equal(_codes(qt), expected)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), np.float32(BNB_NF4)[expected])


def test_fp4_codes_match_bitsandbytes_decision_tree():
    # bitsandbytes' FP4 thresholds are 7-digit literals of the midpoints (0.583333 for
    # 7/12); values within 1e-6 of a midpoint may differ and are left out.
    rng = np.random.default_rng(1)
    t = rng.uniform(-1.2, 1.2, 6000).astype(np.float32)
    mags = np.sort(np.abs(np.float64(BNB_FP4[:8])) / 12)
    mids = (mags[:-1] + mags[1:]) / 2
    t = t[np.min(np.abs(np.abs(t)[:, None] - mids[None]), axis=1) > 1e-6]
    t = np.concatenate([t, np.float32(BNB_FP4) / 12])
    qt = jq.quantize(t, jnp.float32(1.0), dtype="fp4")
    expected = np.array([bnb_quantize_fp4(float(v)) for v in t])
    # bitsandbytes gives -0.0 the code of +0.0 (x < 0 is false); IEEE-style, jaxquant keeps
    # the sign bit of -0.0. Both decode to zero.
    got = _codes(qt)
    minus_zero = (t == 0) & np.signbit(t)
    np.testing.assert_array_equal(got[~minus_zero], expected[~minus_zero])
    np.testing.assert_array_equal(np.asarray(qt.dequantize())[~minus_zero],
                                  (np.float32(BNB_FP4) / np.float32(12))[expected[~minus_zero]])


def test_nf4_blockwise_matches_bitsandbytes_algorithm():
    """absmax per block of 64, x * (1 / absmax) in float32 (bitsandbytes' kQuantizeBlockwise:
    ``vals * local_abs_max_inv``), nearest code; dequantize = table * absmax."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    qt = jq.quantize(w, dtype="nf4", packed=True)
    assert qt.block_size == 64 and qt.axis == 1 and qt.packed
    blocks = w.reshape(8, 4, 64)
    absmax = np.abs(blocks).max(axis=-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(qt.scale), absmax[..., 0])
    normed = (blocks * (np.float32(1) / absmax)).reshape(-1)
    expected = np.array([bnb_quantize_nf4(float(v)) for v in normed]).reshape(8, 256)
    np.testing.assert_array_equal(_codes(qt), expected)
    deq = (np.float32(BNB_NF4)[expected].reshape(8, 4, 64) * absmax).reshape(8, 256)
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), deq)


@pytest.mark.parametrize("name,dt", [("float6_e2m3fn", ml_dtypes.float6_e2m3fn),
                                     ("float6_e3m2fn", ml_dtypes.float6_e3m2fn)])
def test_float6_codes_match_ml_dtypes_round_to_nearest_even(name, dt):
    table = np.arange(64, dtype=np.uint8).view(dt).astype(np.float64)
    pos = np.unique(table[table > 0])
    mids = (pos[:-1] + pos[1:]) / 2  # exact ties: round half to even
    rng = np.random.default_rng(3)
    top = float(ml_dtypes.finfo(dt).max)
    t = np.concatenate([rng.uniform(-1.5 * top, 1.5 * top, 3000), rng.uniform(-1, 1, 1000),
                        mids, -mids, table]).astype(np.float32)
    qt = jq.quantize(t, jnp.float32(1.0), dtype=name)
    assert qt.qvalue.dtype == np.uint8 and qt.format.bits == 6
    expected = np.clip(t, -top, top).astype(dt).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(qt.qvalue), expected)


def test_nan_goes_to_zero_code_and_saturation():
    t = jnp.array([jnp.nan, 5.0, -5.0])
    np.testing.assert_array_equal(np.asarray(jq.quantize(t, jnp.float32(1), dtype="nf4")
                                             .dequantize()), [0.0, 1.0, -1.0])


def test_codebook_qtensor_checks():
    codes = jnp.zeros((2, 4), jnp.uint4)
    qt = jq.QTensor(codes, jnp.ones((2, 1)), axis=1, block_size=4, codebook="nf4")
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), np.full((2, 4), -1.0))
    with pytest.raises(TypeError, match="uint4 indices"):
        jq.QTensor(jnp.zeros((2, 4), jnp.int8), jnp.ones(()), codebook="nf4")
    with pytest.raises(ValueError, match="no zero_point"):
        jq.QTensor(codes, jnp.ones(()), jnp.zeros((), jnp.uint4), codebook="nf4")
    with pytest.raises(TypeError, match="codebook"):
        jq.QTensor(codes, jnp.ones(()), codebook="nf5")


@pytest.mark.parametrize("name,bits", [("nf4", 4.5), ("fp4", 4.5)])
def test_packed_storage_bits(name, bits):
    qt = jq.quantize(jnp.ones((16, 1024)), dtype=name, packed=True)
    assert qt.qvalue.data.dtype == np.uint8 and qt.qvalue.data.shape == (16, 512)
    assert qt.bits_per_element == bits  # 4 bits + one float32 per 64


def test_double_quant_saves_scale_bytes_within_error_budget():
    w = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    plain = jq.quantize(w, dtype="nf4", packed=True)
    nested = jq.quantize(w, dtype="nf4", packed=True, double_quant=True)
    assert jq.is_qtensor(nested.scale)
    assert nested.scale.qvalue.dtype == jnp.float8_e4m3fn
    assert nested.scale.block_size == (32, 8)  # 256 scales per float32 second-level scale
    # 4 bits + (8 bits + 32 bits / 256) per 64 values: 4.127 bits (bitsandbytes: 4.127)
    assert nested.bits_per_element == pytest.approx(4 + (8 + 32 / 256) / 64)
    assert plain.bits_per_element == 4.5

    def sqnr(qt):
        e = w - np.asarray(qt.dequantize())
        return 10 * np.log10(np.sum(w.astype(np.float64) ** 2) / np.sum(e.astype(np.float64) ** 2))

    assert sqnr(plain) - sqnr(nested) < 0.1  # measured 20.71 vs 20.68 dB


@pytest.mark.parametrize("shape,tiles", [((4, 2, 640), (4, 2, 10)),  # 80 scales: one tile
                                         ((8, 4, 640), (6, 4, 10)),  # 320: tiles of 240
                                         ((2, 3, 4, 640), (2, 3, 4, 10))])
def test_double_quant_tiles_span_leading_axes(shape, tiles):
    """One float32 scale per group of (about) 256 block scales on inputs of any rank: a tile
    of whole rows continues across the leading axes; each tile's float8 codes are its block
    scales divided by the tile's largest / 448 (bitsandbytes' nested quantization)."""
    w = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    qt = jq.quantize(w, dtype="nf4", double_quant=True)
    assert qt.scale.block_size == tiles
    absmax = np.abs(w.reshape(*shape[:-1], -1, 64)).max(-1)  # NF4: the scale is the absmax
    n = [-(-a // t) for a, t in zip(absmax.shape, tiles, strict=True)]
    assert qt.scale.scale.shape == tuple(n)
    for idx in np.ndindex(*n):
        sl = tuple(slice(i * t, (i + 1) * t) for i, t in zip(idx, tiles, strict=True))
        s2 = np.float32(absmax[sl].max() / np.float32(448))
        np.testing.assert_array_equal(np.asarray(qt.scale.scale)[idx], s2)
        want = (absmax[sl] / s2).astype(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(np.asarray(qt.scale.qvalue)[sl].view(np.uint8),
                                      want.view(np.uint8))


def test_double_quant_never_zeroes_a_block():
    w = np.ones((2, 256), np.float32)
    w[0, :64] = 1e-30  # a block scale far below float8's range next to scales of 1
    qt = jq.quantize(w, dtype="nf4", double_quant=True)
    y = np.asarray(qt.dequantize())
    assert np.all(np.isfinite(y)) and np.all(y[1] == 1.0)
    assert np.all(jax.device_get(qt.scale.dequantize()) > 0)


@pytest.mark.parametrize("name", ["nf4", "fp4"])
def test_huge_block_absmax_keeps_the_block(name):
    """1 / absmax is subnormal above 2**126, which XLA:CPU flushes to zero: the codes must
    be those of the same block scaled down."""
    v = np.ones(64, np.float32)
    v[3] = 1.5e38
    huge = jq.quantize(jnp.asarray(v), dtype=name, axis=0, block_size=64)
    small = jq.quantize(jnp.asarray(v / np.float32(2.0**100)), dtype=name, axis=0, block_size=64)
    np.testing.assert_array_equal(np.asarray(huge.qvalue), np.asarray(small.qvalue))
    assert np.asarray(huge.dequantize())[3] == np.float32(1.5e38)


@pytest.mark.parametrize("shape", [(4, 0), (0, 64)])
def test_double_quant_of_an_empty_tensor(shape):
    qt = jq.quantize(jnp.zeros(shape), dtype="nf4", double_quant=True)
    assert qt.dequantize().shape == shape


def test_float6_codebook_codes_of_64_or_more_are_refused_by_the_constructor():
    """A uint8 index of 200 was masked to its low six bits (8) and dequantized silently."""
    with pytest.raises(ValueError, match=r"qvalue: float6_e2m3fn codes are 6-bit indices "
                                         r"\(0 to 63\), got a code 200"):
        jq.QTensor(jnp.array([8, 200], jnp.uint8), jnp.float32(1), codebook="float6_e2m3fn")
    ok = jq.QTensor(jnp.array([8, 63], jnp.uint8), jnp.float32(1), codebook="float6_e2m3fn")
    assert ok.dequantize().shape == (2,)
