"""MX (OCP Microscaling v1.0), NVFP4 and `scaled_matmul` against float64 NumPy references.

The references are written from the specifications, not from jaxquant: MX
shared exponent ``floor(log2(amax)) - emax_elem`` (kept in ``[-126, 127]``,
jaxquant's documented E8M0 range), elements ``V / X`` rounded to nearest even
into the element format with saturation (ml_dtypes casts), MXINT8 elements in
1.6 fixed point; NVFP4 as NVIDIA's recipe: a float32 tensor scale
``amax / (6 * 448)`` and float8_e4m3fn block scales ``amax_b / 6`` relative to it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

ELEMENT = {"mxfp8_e4m3": ml_dtypes.float8_e4m3fn, "mxfp8_e5m2": ml_dtypes.float8_e5m2,
           "mxfp6_e2m3": ml_dtypes.float6_e2m3fn, "mxfp6_e3m2": ml_dtypes.float6_e3m2fn,
           "mxfp4": ml_dtypes.float4_e2m1fn, "mxint8": None}
EMAX_ELEM = {"mxfp8_e4m3": 8, "mxfp8_e5m2": 15, "mxfp6_e2m3": 2, "mxfp6_e3m2": 4, "mxfp4": 2,
             "mxint8": 0}  # OCP MX v1.0, Tables 2-4 (INT8: 1.6 fixed point, emax 0)


def _blocks(x: np.ndarray, k: int) -> np.ndarray:
    """``x`` (last axis blocked by ``k``, zero-padded) as ``(..., n_blocks, k)`` float64."""
    x = np.asarray(x, np.float64)
    pad = -x.shape[-1] % k
    x = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,))], -1)
    return x.reshape(x.shape[:-1] + (-1, k))


def _element_top(name: str) -> float:
    return 127 / 64 if name == "mxint8" else float(ml_dtypes.finfo(ELEMENT[name]).max)


def _to_element(v: np.ndarray, name: str) -> np.ndarray:
    """``v`` rounded to nearest even into the element format (float64 values), saturating."""
    top = _element_top(name)
    if name == "mxint8":
        return np.clip(np.rint(v * 64), -128, 127) / 64
    return np.clip(v, -top, top).astype(ELEMENT[name]).astype(np.float64)


def _mx_reference(x: np.ndarray, name: str):
    """(shared exponents along the last axis: NaN for a block holding a NaN or an inf, -inf for an
    all-zero block (any scale will do); element values)."""
    b = _blocks(x, 32)
    with np.errstate(all="ignore"):
        amax = np.abs(b).max(-1)
        e = np.clip(np.floor(np.log2(np.where(amax > 0, amax, 1))) - EMAX_ELEM[name], -126, 127)
        p = _to_element(b / np.exp2(e)[..., None], name)
    p = p.reshape(b.shape[:-2] + (-1,))[..., :x.shape[-1]]
    return np.where(~np.isfinite(amax), np.nan, np.where(amax == 0, -np.inf, e)), p


def _jq_mx(qt, name: str):
    """(shared exponents, element values) of an MX `QTensor` blocked along its last axis."""
    s = np.asarray(qt.scale)
    e = np.where(s.view(np.uint8) == 0xFF, np.nan, s.view(np.uint8).astype(np.float64) - 127)
    codes = np.asarray(jq.unpack(qt).qvalue)
    if name == "mxint8":
        return e + 6, codes.astype(np.float64) / 64  # stored scale: X * 2**-6
    if name.startswith("mxfp6"):
        codes = codes.view(ELEMENT[name])  # float6 codes are held as their bit patterns
    return e, codes.astype(np.float64)


def _edge_rows() -> np.ndarray:
    """Rows of 80 (two full blocks and a ragged one of 16) of awkward blocks."""
    rng = np.random.default_rng(0)
    r = rng.standard_normal((8, 80))
    r[0] = 0.0  # all zeros (scale 1, codes 0)
    r[1] = -np.abs(r[1])  # negative only
    r[2, :32] = np.linspace(-0.3, 0.3, 32)
    r[2, 5] = 4.0  # amax exactly a power of two
    r[2, 32:] = 2.0 ** np.arange(-20, 28)  # a power of two in every element
    r[3] *= 3.0e38 / np.abs(r[3]).max()  # near float32's largest value
    r[3, 7] = np.finfo(np.float32).max
    r[4] *= 1e-35  # tiny normal values: the exponent clamps at -126
    r[5] *= np.exp(rng.uniform(-30, 30, 80))  # wide dynamic range
    r[6, 40] = np.nan  # one NaN: its block only
    r[7, 64:] = 0.0  # a ragged last block of zeros
    return r.astype(np.float32)


@pytest.mark.parametrize("name", sorted(ELEMENT))
def test_mx_codes_and_exponents_match_the_spec_on_edge_blocks(name):
    x = _edge_rows()
    x16 = jnp.asarray(np.delete(x[:, :64], 3, 0), jnp.bfloat16)  # row 3 would be inf
    cases = [(jq.quantize(x, dtype=name), x)]  # a ragged last block
    if name in ("mxfp8_e4m3", "mxfp6_e3m2", "mxint8"):
        cases += [(jq.quantize(x.T, dtype=name, axis=0), x),  # block axis not last
                  (jq.quantize(x16, dtype=name), np.asarray(x16.astype(jnp.float32)))]
    for qt, ref_in in cases:
        want_e, want_p = _mx_reference(ref_in, name)
        if qt.axis == 0:  # the same blocks, read along the last axis
            qt = dataclasses.replace(qt, qvalue=jq.unpack(qt).qvalue.T, scale=qt.scale.T, axis=1)
        got_e, got_p = _jq_mx(qt, name)
        np.testing.assert_array_equal(np.where(want_e == -np.inf, -np.inf, got_e), want_e)
        finite = np.repeat(np.isfinite(want_e), 32, axis=-1)[:, :want_p.shape[-1]]
        np.testing.assert_array_equal(np.where(finite, got_p, 0), np.where(finite, want_p, 0))
    # a NaN's block dequantizes to NaN, and nothing else does
    d = np.asarray(cases[0][0].dequantize())
    np.testing.assert_array_equal(np.isnan(d).nonzero(), (np.full(32, 6), np.arange(32, 64)))


def _round_over(t: np.ndarray, name: str) -> np.ndarray:
    """Whether ``t > 0`` rounds (to nearest even, unbounded exponent) above the element max."""
    if name == "mxint8":
        return np.rint(t * 64) > 127
    nmant = ml_dtypes.finfo(ELEMENT[name]).nmant
    ulp = np.exp2(np.floor(np.log2(t)) - nmant)
    return np.rint(t / ulp) * ulp > _element_top(name)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxint8"])
def test_scale_rounding_modes_match_their_definitions(name):
    """floor: OCP; ceil: the smallest exponent that never clips; up_on_overflow: floor, plus
    one where the largest value rounds beyond the element maximum (ties included)."""
    top = _element_top(name)
    nmant = 6 if name == "mxint8" else ml_dtypes.finfo(ELEMENT[name]).nmant
    half_gap = 2.0 ** (np.floor(np.log2(top)) - nmant - 1)
    peaks = np.array([[p * 2.0**k for p in (top, top + half_gap, top + 2 * half_gap, 1.5 * top,
                                             2 * top * 0.999, 1.0)] for k in (-9, 0, 7)]).ravel()
    x = np.random.default_rng(1).uniform(-0.1, 0.1, (peaks.size, 32))
    x[:, 13] = peaks * np.resize([1, -1], peaks.size)
    x = x.astype(np.float32)
    amax = np.abs(x.astype(np.float64)).max(-1)
    floor = np.floor(np.log2(amax)) - EMAX_ELEM[name]
    t = amax / np.exp2(floor)
    want = {"floor": floor, "ceil": floor + (t > top), "up_on_overflow": floor + _round_over(t, name)}
    for mode, e in want.items():
        got, _ = _jq_mx(jq.quantize(x, dtype=name, scale_rounding=mode), name)
        np.testing.assert_array_equal(got[:, 0], e, err_msg=mode)


def test_mx_block_of_subnormals_gets_the_smallest_scale():
    """A block whose largest magnitude is a float32 subnormal is not an all-zero block: its
    exponent clamps at -126 and its elements keep their codes (XLA:CPU read the subnormal
    maximum as 0 and gave the block scale 1 and zero codes)."""
    x = (np.random.default_rng(2).standard_normal((2, 64)) * 1e-39).astype(np.float32)
    assert np.all(np.abs(x).max(-1) < np.finfo(np.float32).smallest_normal)
    for name in ("mxfp8_e4m3", "mxfp6_e2m3"):
        want_e, want_p = _mx_reference(x, name)
        got_e, got_p = _jq_mx(jq.quantize(x, dtype=name), name)
        np.testing.assert_array_equal(got_e, want_e)
        np.testing.assert_array_equal(got_p, want_p)
        assert np.count_nonzero(want_p) > 32


def _nvfp4_reference(x: np.ndarray):
    """NVFP4 (float32 arithmetic, as NVIDIA's recipe): dequantized values, block scale codes.

    The tensor scale comes from the finite blocks; a block holding NaN or inf has no
    finite scale and dequantizes to NaN.
    """
    b = _blocks(x, 16).astype(np.float32)
    scale_b = np.abs(b).max(-1) / np.float32(6)
    ok = np.isfinite(scale_b)
    g = np.float32(np.where(ok, scale_b, 0).max() / np.float32(448))
    with np.errstate(all="ignore"):
        codes = np.where(ok, scale_b / g, np.nan).astype(ml_dtypes.float8_e4m3fn)
        d = codes.astype(np.float32) * g
        e = np.clip(np.where(d[..., None] > 0, b / d[..., None], 0), -6, 6)
        y = e.astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * d[..., None]
    return y.reshape(x.shape[:-1] + (-1,))[..., :x.shape[-1]], codes, g


def test_nvfp4_all_zero_block_keeps_the_tensor_scale():
    """An all-zero block (whose float32 scale is 1) must not set NVFP4's tensor scale: it
    made it 1 / 448 and rounded every block scale of small weights to the smallest code."""
    x = (np.random.default_rng(3).standard_normal((4, 64)) * 1e-6).astype(np.float32)
    x[1, 16:32] = 0.0
    qt = jq.quantize(x, dtype="nvfp4", packed=True)
    want, codes, g = _nvfp4_reference(x)
    assert float(np.asarray(qt.scale.scale)) == g
    nonzero = np.abs(_blocks(x, 16)).max(-1) > 0
    np.testing.assert_array_equal(np.asarray(qt.scale.qvalue).view(np.uint8)[nonzero],
                                  codes.view(np.uint8)[nonzero])
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), want)


def test_double_quant_all_zero_block_keeps_its_tiles_scale():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 256)) * 1e-5).astype(np.float32)
    x[0, :64] = 0.0
    qt = jq.quantize(x, dtype="nf4", double_quant=True)
    absmax = np.abs(x.reshape(2, 4, 64)).max(-1)  # nf4 scales: absmax / 1 per block of 64
    np.testing.assert_array_equal(np.asarray(qt.scale.scale).ravel(),
                                  [absmax.max() / np.float32(448)])
    y = np.asarray(qt.dequantize(), np.float64)
    assert np.abs(y - x).max() < 0.2 * np.abs(x).max()  # NF4's largest gap is 0.32 of absmax


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_nvfp4_non_finite_value_stays_in_its_block(bad):
    """One NaN (or inf) made the tensor scale NaN, and every value of the tensor NaN."""
    x = np.random.default_rng(5).standard_normal((4, 48)).astype(np.float32)
    x[2, 20] = bad
    want, _, _ = _nvfp4_reference(x)
    got = np.asarray(jq.quantize(x, dtype="nvfp4").dequantize())
    np.testing.assert_array_equal(np.isnan(got).nonzero(), (np.full(16, 2), np.arange(16, 32)))
    np.testing.assert_array_equal(got, want)


def test_scale_bytes_are_one_per_block():
    x = np.ones((3, 80), np.float32)  # 3 blocks of 32 per row (the last ragged), 5 of 16
    for name, codes in (("mxfp6_e2m3", 180), ("mxint8", 240)):
        qt = jq.quantize(x, dtype=name)
        assert qt.scale.dtype == jnp.float8_e8m0fnu and qt.nbytes == codes + 9, name
    qt = jq.quantize(x, dtype="nvfp4")
    assert qt.nbytes == 120 + 15 + 4  # e2m1 codes, e4m3 block scales, one float32


def _product64(qa, qb) -> np.ndarray:
    a, b = (np.asarray(q.dequantize(jnp.float32), np.float64) for q in (qa, qb))
    return np.einsum("...mk,...nk->...mn", a, b)


def test_scaled_matmul_is_the_float64_product_of_the_dequantized_operands():
    rng = np.random.default_rng(6)
    a = (rng.standard_normal((2, 5, 80)) * np.exp(rng.uniform(-5, 5, (2, 5, 1)))).astype(np.float32)
    b = rng.standard_normal((2, 3, 80)).astype(np.float32)  # K = 80: a ragged last block
    qa, qb = jq.quantize(a, dtype="mxfp8_e4m3"), jq.quantize(b, dtype="mxfp4", packed=True)
    ref = _product64(qa, qb)
    y = np.asarray(jq.scaled_matmul(qa, qb))
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(jax.jit(jq.scaled_matmul)(qa, qb)), y)
    half = jq.scaled_matmul(qa, qb, preferred_element_type=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(half), y.astype(jnp.bfloat16))


def test_scaled_matmul_gradient_with_respect_to_float32_block_scales():
    """d/ds of sum(lhs @ rhs.T), lhs = codes * s per block: the block sums of codes times
    the column sums of the dequantized rhs."""
    rng = np.random.default_rng(7)
    qa = jq.quantize(rng.standard_normal((4, 64)).astype(np.float32), dtype=jnp.int8, axis=1,
                     block_size=32)
    qb = jq.quantize(rng.standard_normal((3, 64)).astype(np.float32), dtype="mxfp8_e4m3")
    grad = jax.grad(lambda s: jq.scaled_matmul(dataclasses.replace(qa, scale=s), qb).sum())
    got = np.asarray(grad(qa.scale), np.float64)
    codes = np.asarray(qa.qvalue, np.float64)
    colsum = np.asarray(qb.dequantize(), np.float64).sum(0)
    want = (codes * colsum).reshape(4, 2, 32).sum(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_scaled_matmul_rejects_operands_it_cannot_multiply():
    a = jq.quantize(jnp.ones((4, 64)), dtype="mxfp8_e4m3")
    cases = [
        (jq.quantize(jnp.ones((4, 64)), dtype="nvfp4"), "one block size, got 32 and 16"),
        (jq.quantize(jnp.ones((4, 96)), dtype="mxfp8_e4m3"), r"shapes \(4, 64\) and \(4, 96\)"),
        (jq.quantize(jnp.ones((64, 4)), dtype="mxfp8_e4m3", axis=0), "blocked along its last"),
    ]
    for rhs, match in cases:
        with pytest.raises(ValueError, match=match):
            jq.scaled_matmul(a, rhs)
    with pytest.raises(ValueError, match="float dtype, got int32"):
        jq.scaled_matmul(a, a, preferred_element_type=jnp.int32)
