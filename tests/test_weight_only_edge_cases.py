"""Weight-only dots on edge inputs, against NumPy float64 references written here.

Packed sub-byte codes are multiplied phase by phase (`jaxquant._weight_only`);
these cases pin what that must not change: the rounding of half-precision
results, empty contractions, and the result dtype of two QTensor operands.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

EQ = "bk,kn->bn"


def _int4_weight(codes, scale=1.0):
    codes = np.asarray(codes)
    qt = jq.QTensor(jnp.asarray(codes.astype(ml_dtypes.int4)), jnp.float32(scale))
    return qt, codes.astype(np.float64) * scale


@pytest.mark.parametrize("dtype,big", [(jnp.bfloat16, 128.0), (jnp.float16, 1024.0)])
@pytest.mark.parametrize("pack_axis", [None, 0, 1])
@pytest.mark.parametrize("weight_first", [False, True])
def test_half_precision_rounds_once_when_packed_along_contraction(dtype, big, pack_axis,
                                                                  weight_first):
    # Elements 0 and 2 (one phase of the int4 bytes) sum to 2 big + 1, which rounds to
    # 2 big in half precision; element 1 (the other phase) cancels 2 big exactly. The true sum 1
    # is representable: a dot rounding its float32 accumulation once returns it.
    qt, w = _int4_weight([[2], [-2], [1], [0]])
    qt = qt if pack_axis is None else jq.pack(qt, pack_axis)
    x = jnp.asarray([[big, big, 1.0, 0.0]], dtype)
    expected = np.asarray(x, np.float64) @ w
    assert expected.item() == 1.0
    y = jq.qeinsum("kn,bk->bn", qt, x) if weight_first else jq.qeinsum(EQ, x, qt)
    assert y.dtype == dtype and y.shape == (1, 1)
    np.testing.assert_array_equal(np.asarray(y, np.float64), expected)


@pytest.mark.parametrize("fmt,lo,hi", [("int4", -8, 7), ("uint2", 0, 3)])
@pytest.mark.parametrize("pack_axis", [0, -1])
@pytest.mark.parametrize("shapes", [((3, 0), (0, 7)), ((3, 5), (5, 0)), ((0, 5), (5, 7))])
def test_packed_empty_dimensions(fmt, lo, hi, pack_axis, shapes):
    xshape, wshape = shapes
    rng = np.random.default_rng(0)
    codes = rng.integers(lo, hi + 1, wshape)
    zp = np.asarray(lo + 1)  # a zero point: padding codes must still contribute nothing
    npdtype = getattr(ml_dtypes, fmt)
    qt = jq.QTensor(jnp.asarray(codes.astype(npdtype)), jnp.float32(0.5),
                    jnp.asarray(zp.astype(npdtype)))
    x = rng.standard_normal(xshape).astype(np.float32)
    expected = x.astype(np.float64) @ ((codes - zp) * 0.5)
    y = jq.qeinsum(EQ, x, jq.pack(qt, pack_axis))
    assert y.shape == expected.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5)


@pytest.mark.parametrize("pack_axis", [None, 0])
def test_two_qtensors_result_dtype_does_not_depend_on_operand_order(pack_axis):
    rng = np.random.default_rng(1)
    a_codes, b_codes = rng.integers(-8, 8, (3, 5)), rng.integers(-8, 8, (5, 4))
    a = jq.QTensor(jnp.asarray(a_codes.astype(ml_dtypes.int4)), jnp.float32(0.25),
                   dtype=jnp.bfloat16)
    b = jq.QTensor(jnp.asarray(b_codes.astype(ml_dtypes.int4)), jnp.float32(1 / 3),
                   dtype=jnp.float32)
    b = b if pack_axis is None else jq.pack(b, pack_axis)
    expected = (a_codes * 0.25) @ (b_codes * np.float64(np.float32(1 / 3)))
    y1 = jq.qeinsum("ik,kn->in", a, b)
    y2 = jq.qeinsum("kn,ik->in", b, a)
    assert y1.dtype == y2.dtype == jnp.float32  # bfloat16 and float32 promote to float32
    np.testing.assert_allclose(np.asarray(y1), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y2), expected, rtol=1e-6)
