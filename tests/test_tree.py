"""quantize_tree / dequantize_tree / QuantSpec / rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq


def _params():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    return {"params": {"Dense_0": {"kernel": f(8, 16), "bias": f(16)},
                       "Dense_1": {"kernel": f(16, 4), "bias": f(4)},
                       "Embed_0": {"embedding": f(10, 8)}},
            "step": jnp.int32(3)}


def test_default_rules_quantize_float_matrices_only():
    q = jq.quantize_tree(_params())
    assert jq.is_qtensor(q["params"]["Dense_0"]["kernel"])
    assert jq.is_qtensor(q["params"]["Embed_0"]["embedding"])
    assert not jq.is_qtensor(q["params"]["Dense_0"]["bias"])
    assert q["step"].dtype == jnp.int32
    k = q["params"]["Dense_0"]["kernel"]
    assert k.qvalue.dtype == jnp.int8 and k.axis == 1 and k.scale.shape == (16,)


def test_rules_first_match_wins_and_none_keeps():
    rules = [("Embed", None),
             ("Dense_1/kernel", jq.QuantSpec(dtype=jnp.int4, block_size=4, packed=True)),
             ("kernel", jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=None))]
    q = jq.quantize_tree(_params(), rules)
    assert not jq.is_qtensor(q["params"]["Embed_0"]["embedding"])
    d1 = q["params"]["Dense_1"]["kernel"]
    assert d1.packed and d1.qvalue.dtype == jnp.int4 and d1.block_size == 4
    d0 = q["params"]["Dense_0"]["kernel"]
    assert d0.qvalue.dtype == jnp.float8_e4m3fn and d0.axis is None
    assert not jq.is_qtensor(q["params"]["Dense_0"]["bias"])  # unmatched: kept


def test_match_rules_and_unused_rules():
    rules = [("Dense_0/kernel", jq.QuantSpec()), ("Conv", jq.QuantSpec()), ("bias$", None)]
    m = jq.match_rules(_params(), rules)
    assert m["params/Dense_0/kernel"] == jq.QuantSpec()
    assert m["params/Dense_1/kernel"] is None and m["step"] is None
    assert jq.unused_rules(_params(), rules) == [("Conv", jq.QuantSpec())]


def test_dequantize_tree_round_trip_error_and_structure():
    p = _params()
    back = jq.dequantize_tree(jq.quantize_tree(p))
    assert jax.tree.structure(back) == jax.tree.structure(p)
    k, kb = p["params"]["Dense_0"]["kernel"], back["params"]["Dense_0"]["kernel"]
    assert kb.dtype == k.dtype
    assert float(jnp.max(jnp.abs(k - kb))) <= float(jnp.max(jnp.abs(k))) / 127


def test_quantize_tree_under_jit_matches_eager():
    p = _params()
    eager = jq.quantize_tree(p)
    jitted = jax.jit(jq.quantize_tree)(p)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(a, b)


def test_tree_nbytes_counts_quantized_storage():
    p = {"w": jnp.ones((64, 64), jnp.float32)}
    assert jq.tree_nbytes(p) == 64 * 64 * 4
    assert jq.tree_nbytes(jq.quantize_tree(p)) == 64 * 64 + 64 * 4
    assert jq.tree_nbytes(jq.quantize_tree(p, jq.QuantSpec(dtype=jnp.int4, packed=True))) == 64 * 32 + 64 * 4


def test_spec_is_frozen_hashable_and_validated():
    s = jq.QuantSpec(dtype="int4", block_size=32)
    assert s.dtype == jnp.int4 and hash(s) == hash(jq.QuantSpec(dtype=jnp.int4, block_size=32))
    with pytest.raises(TypeError, match="dtype must be one of the quantized formats"):
        jq.QuantSpec(dtype=jnp.float32)
    with pytest.raises(ValueError, match="packed=True needs a 2-, 4- or 6-bit format, got int8"):
        jq.QuantSpec(packed=True)
    with pytest.raises(ValueError, match="block_size requires axis"):
        jq.QuantSpec(axis=None, block_size=4)
    with pytest.raises(TypeError, match=r"rules\[0\] must be a \(pattern: str, QuantSpec \| None\) pair"):
        jq.quantize_tree(_params(), [("kernel", "int8")])


@pytest.mark.parametrize("dtype", ["nf4", "fp4", "float6_e2m3fn", jnp.float8_e4m3fn,
                                   jnp.float4_e2m1fn, "mxfp4", "nvfp4", "mxfp8_e4m3"])
def test_asymmetric_spec_needs_an_integer_format(dtype):
    """Only integer formats have zero points: the spec is refused when built, not when called."""
    name = jq.get_format(dtype).name if not isinstance(dtype, str) else None
    with pytest.raises(ValueError, match=rf"symmetric=False needs an integer format \(a zero "
                                         rf"point\); {name or ''}"):
        jq.QuantSpec(dtype=dtype, symmetric=False)
    for ok in (jnp.int4, jnp.uint8, jnp.int2):
        q = jq.QuantSpec(dtype=ok, symmetric=False)(jnp.arange(8.0).reshape(2, 4))
        assert q.zero_point is not None


@pytest.mark.parametrize("dtype", ["nf4", "fp4"])
def test_codebook_schemes_take_tiles_like_other_formats(dtype):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 64)), jnp.float32)
    q = jq.QuantSpec(dtype=dtype, axis=None, block_size=(4, 16), packed=True)(x)
    assert q.block_size == (4, 16) and q.axis is None and q.scale.shape == (2, 4)
    assert q.codebook == dtype and q.packed
    # tiles of one row by 64 are the scheme's own blocks of 64 along the last axis
    rows = jq.QuantSpec(dtype=dtype, axis=None, block_size=(1, 64))(x)
    blocks = jq.QuantSpec(dtype=dtype)(x)
    np.testing.assert_array_equal(np.asarray(rows.qvalue), np.asarray(blocks.qvalue))
    np.testing.assert_array_equal(np.asarray(rows.dequantize()), np.asarray(blocks.dequantize()))
    dq = jq.quantize(x, dtype=dtype, block_size=(4, 16), double_quant=True)
    assert dq.block_size == (4, 16) and jq.is_qtensor(dq.scale)
    with pytest.raises(ValueError, match="mxfp4 has blocks of 32 by definition"):
        jq.QuantSpec(dtype="mxfp4", axis=None, block_size=(4, 16))


def test_packed_array_leaf_is_matched_and_kept_under_its_own_path():
    """A PackedArray leaf is one leaf named by its path, not by its child 'data'."""
    packed = jq.pack(jnp.asarray(np.array([1, 2, 3, 4, 5]), jnp.int4))
    packed_f4 = jq.pack(jnp.zeros((2, 4), jnp.float4_e2m1fn))
    tree = {"p": packed, "f": packed_f4, "w": jnp.ones((2, 4))}
    rules = [("^p$", jq.QuantSpec()), ("^f$", jq.QuantSpec()), ("data", jq.QuantSpec())]
    assert jq.match_rules(tree, rules) == {"f": None, "p": None, "w": None}
    assert jq.unused_rules(tree, rules) == [("data", jq.QuantSpec())]
    q = jq.quantize_tree(tree, [("", jq.QuantSpec())])
    assert q["p"] is packed and q["f"] is packed_f4 and jq.is_qtensor(q["w"])
    assert jq.quantize_tree(tree)["f"] is packed_f4


def test_spec_takes_the_contract_fields_positionally():
    """API.md's signature QuantSpec(dtype=jnp.int8, axis=-1, block_size=None, symmetric=True, ...)
    has no keyword-only marker: the fields may be given by position, in that order."""
    spec = jq.QuantSpec(jnp.int4, 0, 4, False)
    assert spec == jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=4, symmetric=False)
    x = np.arange(-8.0, 8.0, dtype=np.float32).reshape(8, 2)
    qt = spec(jnp.asarray(x))
    assert (qt.axis, qt.block_size, qt.zero_point is not None) == (0, 4, True)
    assert jq.QuantSpec() == jq.QuantSpec(jnp.int8, -1, None, True)


def test_a_malformed_pattern_or_rules_value_names_the_argument():
    w = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match=r"rules\[1\]: pattern 'ker\(nel' is not a valid regular "
                                         r"expression: missing \)"):
        jq.quantize_tree(w, [("w", None), ("ker(nel", jq.QuantSpec())])
    with pytest.raises(ValueError, match=r"rules\[0\]: pattern '\[' is not a valid"):
        jq.match_rules(w, [("[", None)])
    with pytest.raises(TypeError, match=r"rules must be None, a QuantSpec or a sequence of "
                                        r"\(pattern, QuantSpec \| None\) pairs, got int: 3"):
        jq.quantize_tree(w, 3)


def test_unused_rules_takes_rules_given_once_as_an_iterator():
    tree = {"kernel": jnp.ones((2, 2))}
    rules = [("kernel", jq.QuantSpec()), ("kernal", None)]
    assert jq.unused_rules(tree, iter(rules)) == [("kernal", None)]
    assert jq.unused_rules(tree, (r for r in rules)) == [("kernal", None)]


def test_tree_nbytes_of_python_scalar_and_string_leaves():
    """quantize_tree keeps Python numbers (and strings); their bytes are those of the NumPy
    array they convert to, as in the report's rows."""
    tree = {"lr": 0.5, "step": 3, "name": "abc", "w": np.ones((2, 3), np.float32), "n": None}
    expected = 8 + 8 + np.asarray("abc").nbytes + 2 * 3 * 4
    assert jq.tree_nbytes(tree) == expected
    assert jq.tree_nbytes(jq.quantize_tree(tree)) == 8 + 8 + np.asarray("abc").nbytes + 2 * 3 + 3 * 4
    rows = jq.quantization_report(tree)
    assert sum(r.nbytes_before for r in rows) == expected
