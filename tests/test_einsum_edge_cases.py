"""`qeinsum` over many equations against ``np.einsum`` in float64 of codes and scales
dequantized with NumPy, and its argument errors."""

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

# (subscripts with the QTensor second, float operand shape, QTensor shape)
EQUATIONS = [
    ("bk,kn->bn", (3, 5), (5, 7)),
    ("bk,nk->nb", (3, 5), (7, 5)),
    ("gbk,kgn->bgn", (2, 3, 5), (5, 2, 7)),  # a batch dim in different positions
    ("bkl,lnk->nb", (3, 5, 3), (3, 7, 5)),  # two contracted axes, transposed
    ("bk,nkm->mbn", (3, 5), (7, 5, 3)),
    ("ij,ij->ji", (3, 4), (3, 4)),  # all batch
    ("ij,ij->", (3, 4), (3, 4)),  # full contraction to a scalar
    ("b,n->nb", (3,), (7,)),  # outer product
    ("Bk,kA", (3, 5), (5, 2)),  # implicit output: sorted, upper case first ("AB")
    (",ij->ji", (), (3, 4)),  # a scalar operand
    ("bk,kn->bn", (0, 5), (5, 7)),  # empty free dim
    ("bk,kn->bn", (3, 0), (0, 7)),  # empty contraction
]


def _qtensor(shape, pack_axis, seed):
    """int4 codes per-axis along the last axis with a zero point, and their float64 values."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-8, 8, shape)
    scale = rng.uniform(0.5, 2.0, shape[-1:]).astype(np.float32)
    zp = rng.integers(-8, 8, shape[-1:])
    qt = jq.QTensor(jnp.asarray(codes.astype(ml_dtypes.int4)), jnp.asarray(scale),
                    jnp.asarray(zp.astype(ml_dtypes.int4)), axis=-1)
    values = (codes - zp) * scale.astype(np.float64)
    return (qt if pack_axis is None else jq.pack(qt, pack_axis)), values


def _swap(subscripts):
    """The same einsum with its operands swapped."""
    ins, arrow, out = subscripts.partition("->")
    a, b = ins.split(",")
    return f"{b},{a}{arrow}{out}"


@pytest.mark.parametrize("subscripts,xshape,wshape", EQUATIONS)
@pytest.mark.parametrize("pack", [False, True])
def test_qeinsum_matches_numpy_einsum(subscripts, xshape, wshape, pack):
    if pack and not wshape:
        pytest.skip("scalars are not packed")
    for pack_axis in range(-len(wshape), 0) if pack else [None]:
        qt, w = _qtensor(wshape, pack_axis, seed=len(subscripts))
        x = np.random.default_rng(1).standard_normal(xshape).astype(np.float32)
        x64 = x.astype(np.float64)
        for subs, ops, ref_ops in [(subscripts, (x, qt), (x64, w)),
                                   (_swap(subscripts), (qt, x), (w, x64))]:
            expected = np.einsum(subs, *ref_ops)
            y = jq.qeinsum(subs, *ops)
            assert y.shape == expected.shape and y.dtype == jnp.float32, subs
            np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=1e-5, atol=1e-4,
                                       err_msg=f"{subs} packed along {pack_axis}")


def test_subscripts_must_be_a_string():
    x, qt = np.ones((2, 3), np.float32), jq.quantize(jnp.ones((3, 4)))
    with pytest.raises(TypeError, match="subscripts must be a str like 'ab,bc->ac', got int"):
        jq.qeinsum(12, x, qt)


def test_size_mismatch_names_the_letter():
    x, qt = np.ones((2, 3), np.float32), jq.quantize(jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=re.escape("'k' has size 3 in lhs but 4 in rhs")):
        jq.qeinsum("bk,kn->bn", x, qt)
    with pytest.raises(ValueError, match=re.escape("'j' has size 2 in lhs but 4 in rhs")):
        jq.qeinsum("jk,jn->jkn", x, qt)


@pytest.mark.parametrize("subscripts", ["b k,kn->bn", "bk,kn->b n", " b k , k n -> n b ", "bk,\tkn"])
def test_spaces_anywhere_as_numpy(subscripts):
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    qt = jq.quantize(jnp.arange(12.0).reshape(3, 4), axis=1)
    expected = np.einsum(subscripts.replace("\t", ""), x, np.asarray(qt.dequantize()))
    np.testing.assert_allclose(jq.qeinsum(subscripts, x, qt), expected, rtol=1e-6)


@pytest.mark.parametrize("subscripts,match", [
    ("bk,kn->b", "'n' occurs in rhs only and is not in the output"),
    ("bk,kn->n", "'b' occurs in lhs only and is not in the output"),
    ("bk,kn->bnz", "output letter 'z' occurs in neither operand"),
])
def test_unsupported_letters_are_named(subscripts, match):
    x, qt = np.ones((2, 3), np.float32), jq.quantize(jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=re.escape(match)):
        jq.qeinsum(subscripts, x, qt)
