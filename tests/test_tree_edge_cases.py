"""Edge cases of quantize_tree / dequantize_tree / QuantSpec rules and the per-leaf report.

Expected values come from NumPy (float64) or from counting bytes by hand, never
from the code under test.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant._report import format_report, quantization_report

_RNG = np.random.default_rng(7)


def _f32(*shape):
    return jnp.asarray(_RNG.standard_normal(shape).astype(np.float32))


_Pair = collections.namedtuple("_Pair", ["kernel", "bias"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Layer:
    kernel: jax.Array
    bias: jax.Array


# --- pytree kinds and leaf kinds -------------------------------------------------------------


def test_paths_of_namedtuples_dataclasses_lists_and_frozendicts():
    from flax.core import freeze

    k, b = _f32(4, 8), _f32(8)
    tree = {"nt": _Pair(k, b), "dc": _Layer(k, b), "seq": [(k, None), {}], "fd": freeze({"k": k})}
    spec = jq.QuantSpec(dtype=jnp.int4)
    m = jq.match_rules(tree, [("kernel$", spec), ("^seq/0/0$", spec), ("^fd/k$", spec)])
    assert m == {"dc/bias": None, "dc/kernel": spec, "fd/k": spec, "nt/bias": None,
                 "nt/kernel": spec, "seq/0/0": spec}
    q = jq.quantize_tree(tree, [("kernel$", spec), ("^seq/0/0$", spec), ("^fd/k$", spec)])
    assert isinstance(q["nt"], _Pair) and isinstance(q["dc"], _Layer)
    assert q["seq"][0][1] is None and q["seq"][1] == {}
    assert type(q["fd"]) is type(tree["fd"])
    for leaf in (q["nt"].kernel, q["dc"].kernel, q["seq"][0][0], q["fd"]["k"]):
        assert jq.is_qtensor(leaf) and leaf.qvalue.dtype == jnp.int4
    back = jq.dequantize_tree(q)
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_nnx_state_is_quantized_and_restored_in_place():
    from flax import nnx

    state = nnx.state(nnx.Linear(8, 16, rngs=nnx.Rngs(0)))
    q = jq.quantize_tree(state, [("kernel", jq.QuantSpec())])
    assert jq.is_qtensor(q["kernel"].get_value()) and not jq.is_qtensor(q["bias"].get_value())
    back = jq.dequantize_tree(q)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    w = np.asarray(state["kernel"].get_value(), np.float64)
    err = np.abs(np.asarray(back["kernel"].get_value(), np.float64) - w).max(axis=0)
    assert (err <= np.abs(w).max(axis=0) / 127 / 2 * (1 + 1e-6)).all()


def test_non_float_scalar_and_empty_leaves_are_kept_even_when_a_rule_matches():
    tree = {"i": jnp.ones((4, 4), jnp.int32), "b": jnp.ones((4, 4), bool),
            "c": jnp.ones((4, 4), jnp.complex64), "n": 3, "none": None,
            "key": jax.random.key(0), "e8m0": jnp.ones((4, 1), jnp.float8_e8m0fnu),
            "f6": np.ones((4, 4), ml_dtypes.float6_e2m3fn)}
    q = jq.quantize_tree(tree, [("", jq.QuantSpec())])
    for name in ("i", "b", "c", "n", "key", "e8m0", "f6"):
        assert q[name] is tree[name]
    assert q["none"] is None
    # a rule that met only non-float leaves did meet a path: not listed as unused
    assert jq.unused_rules(tree, [("^i$", jq.QuantSpec()), ("^zz$", None)]) == [("^zz$", None)]


def test_default_rules_keep_scale_format_and_float6_leaves():
    # quantize refuses both; a tree holding MX scales must still convert its float leaves
    tree = {"w": jnp.ones((4, 32)), "w_scale": jnp.ones((4, 1), jnp.float8_e8m0fnu),
            "f6": np.ones((4, 4), ml_dtypes.float6_e3m2fn)}
    q = jq.quantize_tree(tree)
    assert jq.is_qtensor(q["w"])
    assert q["w_scale"] is tree["w_scale"] and q["f6"] is tree["f6"]
    assert jq.match_rules(tree)["w_scale"] is None


@pytest.mark.parametrize("spec", [jq.QuantSpec(axis=None), jq.QuantSpec()])
def test_a_python_float_leaf_is_treated_eagerly_as_under_jit(spec):
    # under jit a Python float is a float32 scalar: eager calls must not decide otherwise
    tree, rules = {"lr": 1.5, "w": jnp.ones((2, 2))}, [("", spec)]

    def outcome(fn):
        try:
            return jax.tree.structure(fn(tree), is_leaf=jq.is_qtensor)
        except ValueError as e:
            assert "leaf 'lr' (float32[])" in str(e)
            return "ValueError"

    eager = outcome(lambda t: jq.quantize_tree(t, rules))
    assert eager == outcome(jax.jit(lambda t: jq.quantize_tree(t, rules)))
    assert (eager == "ValueError") == (spec.axis is not None)  # a rank-0 leaf has no axis -1
    if spec.axis is None:
        assert jq.is_qtensor(jq.quantize_tree(tree, rules)["lr"])
        assert jq.match_rules(tree, rules)["lr"] == spec


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, np.float32])
def test_round_trip_restores_the_dtype_and_equals_quantize_then_dequantize(dtype):
    specs = {"a": jq.QuantSpec(), "b": jq.QuantSpec(dtype=jnp.int4, block_size=24, packed=True),
             "c": jq.QuantSpec(dtype=jnp.uint8, symmetric=False, axis=0),
             "d": jq.QuantSpec(dtype="nf4", packed=True, double_quant=True),
             "e": jq.QuantSpec(dtype="mxfp4"), "f": jq.QuantSpec(axis=None, block_size=(4, 16))}
    raw = {k: _RNG.standard_normal((8, 64)).astype(np.float32) for k in specs}
    tree = {k: (v.astype(dtype) if dtype is np.float32 else jnp.asarray(v, dtype))
            for k, v in raw.items()}
    rules = [(f"^{k}$", s) for k, s in specs.items()]
    back = jq.dequantize_tree(jq.quantize_tree(tree, rules))
    back_jit = jax.jit(lambda t: jq.dequantize_tree(jq.quantize_tree(t, rules)))(tree)
    for k, s in specs.items():
        ref = jq.dequantize(jq.quantize(tree[k], packed=s.packed, **s.computed_kwargs()))
        assert back[k].dtype == back_jit[k].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(back[k], np.float32), np.asarray(ref, np.float32))
        np.testing.assert_array_equal(np.asarray(back_jit[k], np.float32),
                                      np.asarray(ref, np.float32))


def test_empty_and_odd_length_leaves_round_trip():
    tree = {"empty": jnp.ones((0, 8)), "odd": _f32(3, 7)}
    q = jq.quantize_tree(tree, [("odd", jq.QuantSpec(dtype=jnp.int4, packed=True)),
                                ("empty", jq.QuantSpec())])
    assert q["odd"].shape == (3, 7) and q["odd"].packed
    assert q["odd"].nbytes == 3 * 4 + 7 * 4  # each row of 7 codes in 4 bytes; 7 scales
    back = jq.dequantize_tree(q)
    assert back["empty"].shape == (0, 8)
    x = np.asarray(tree["odd"], np.float64)
    assert np.abs(np.asarray(back["odd"]) - x).max() <= np.abs(x).max(axis=0).max() / 7 / 2 + 1e-6


def test_existing_qtensor_leaves_are_kept_and_dequantized_once():
    w = _f32(4, 8)
    inner = jq.quantize(w, dtype=jnp.int4, axis=1)
    tree = {"q": inner, "w": w}
    for q in (jq.quantize_tree(tree, [("", jq.QuantSpec())]), jax.jit(jq.quantize_tree)(tree)):
        assert jq.is_qtensor(q["q"]) and q["q"].qvalue.dtype == jnp.int4
    back = jq.dequantize_tree(jq.quantize_tree(tree))
    expected = np.asarray(inner.qvalue, np.float64) * np.asarray(inner.scale, np.float64)
    np.testing.assert_allclose(np.asarray(back["q"]), expected, rtol=1e-6)


def test_eval_shape_gives_abstract_qtensors_and_float_leaves():
    tree = {"k": jnp.ones((16, 32), jnp.bfloat16), "b": jnp.ones(32)}
    spec = jq.QuantSpec(dtype=jnp.int4, block_size=8, packed=True)
    q = jax.eval_shape(lambda t: jq.quantize_tree(t, [("k", spec)]), tree)
    assert jq.is_qtensor(q["k"]) and q["k"].shape == (16, 32) and q["k"].block_size == 8
    back = jax.eval_shape(lambda t: jq.dequantize_tree(jq.quantize_tree(t, [("k", spec)])), tree)
    assert (back["k"].shape, back["k"].dtype) == ((16, 32), jnp.bfloat16)
    assert (back["b"].shape, back["b"].dtype) == ((32,), jnp.float32)


# --- rules ------------------------------------------------------------------------------------


def test_first_match_wins_none_keeps_and_search_is_unanchored():
    tree = {"enc": {"kernel": _f32(4, 8), "kernel_1": _f32(4, 8)}, "dec": {"kernel": _f32(4, 8)}}
    int4 = jq.QuantSpec(dtype=jnp.int4)
    rules = [("^dec", None), ("kernel$", int4), ("kernel", jq.QuantSpec())]
    m = jq.match_rules(tree, rules)
    assert m == {"dec/kernel": None, "enc/kernel": int4, "enc/kernel_1": jq.QuantSpec()}
    q = jq.quantize_tree(tree, rules)
    assert q["dec"]["kernel"] is tree["dec"]["kernel"]
    assert q["enc"]["kernel"].qvalue.dtype == jnp.int4
    assert q["enc"]["kernel_1"].qvalue.dtype == jnp.int8
    # "^kernel" never finds a path (each starts with enc/ or dec/); "kernel" after
    # "kernel$" and "kernel" only takes enc/kernel_1
    assert jq.unused_rules(tree, [("^kernel", int4), *rules]) == [("^kernel", int4)]


def test_a_single_rule_pair_not_in_a_list_says_to_wrap_it():
    """Bug: ("kernel", spec) passed alone was read as a sequence of two rules and refused
    with "rules[0] must be a ... pair, got 'kernel'", hiding the missing list."""
    spec = jq.QuantSpec()
    with pytest.raises(TypeError, match=re.escape(
            f"got one pair ('kernel', {spec!r}); wrap it in a list: [('kernel', {spec!r})]")):
        jq.quantize_tree({"kernel": _f32(2, 2)}, ("kernel", spec))
    with pytest.raises(TypeError, match=r"wrap it in a list"):
        jq.unused_rules({"kernel": _f32(2, 2)}, ("kernel", None))


def test_rule_pairs_may_be_lists():
    """Rules read from JSON/YAML arrive as lists of lists; they were refused as "not a pair"."""
    tree = {"enc": {"kernel": _f32(4, 8)}, "head": {"kernel": _f32(8, 2)}}
    spec = jq.QuantSpec(dtype=jnp.int4)
    q = jq.quantize_tree(tree, [["head", None], ["kernel", spec]])
    assert not jq.is_qtensor(q["head"]["kernel"]) and q["enc"]["kernel"].qvalue.dtype == jnp.int4
    assert jq.unused_rules(tree, [["dec", spec], ["", None]]) == [("dec", spec)]
    with pytest.raises(TypeError, match=r"wrap it in a list"):
        jq.quantize_tree(tree, ["kernel", spec])


def test_invalid_pattern_is_named_with_its_index():
    with pytest.raises(ValueError, match=r"rules\[2\]: pattern '\*kernel' is not a valid regular "
                                         r"expression"):
        jq.quantize_tree({"k": _f32(2, 2)}, [("a", None), ("b", None), ("*kernel", None)])


@pytest.mark.parametrize("pattern", ["w{99999999999}", "(" * 2000 + ")" * 2000],
                         ids=["OverflowError", "RecursionError"])
def test_patterns_re_cannot_compile_are_value_errors(pattern):
    for call in (jq.quantize_tree, jq.match_rules, jq.unused_rules):
        with pytest.raises(ValueError, match=r"rules\[0\]: pattern .* is not a valid regular"):
            call({"k": _f32(2, 2)}, [(pattern, None)])


@pytest.mark.parametrize(("spec", "leaf", "message"), [
    (jq.QuantSpec(axis=2), (4, 8), r"leaf 'blk/0/w' \(float32\[4, 8\]\): axis must be in \[-2, 2\)"
                                   r" for an input of rank 2, got 2"),
    (jq.QuantSpec(), (), r"leaf 'blk/0/w' \(float32\[\]\): axis must be in \[0, 0\)"),
    (jq.QuantSpec(axis=None, block_size=(2, 2)), (4, 8, 2),
     r"leaf 'blk/0/w' \(float32\[4, 8, 2\]\): block_size must have one tile length per axis"),
])
def test_a_spec_that_cannot_apply_names_the_leaf(spec, leaf, message):
    tree = {"blk": [{"w": jnp.ones(leaf)}]}
    with pytest.raises(ValueError, match=message):
        jq.quantize_tree(tree, [("w", spec)])
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda t: jq.quantize_tree(t, [("w", spec)]))(tree)


def test_spec_axis_must_be_an_int_or_none_when_built():
    """Bug: QuantSpec(axis="1"), axis=1.0, axis=True or axis=[0] built fine (an unhashable
    spec for a list) and failed only on the first leaf it met, if any."""
    for bad in ("1", 1.0, True, [0], (0, 1)):
        with pytest.raises(TypeError, match=re.escape(f"axis must be an int or None, got "
                                                      f"{bad!r}.")):
            jq.QuantSpec(axis=bad)
    spec = jq.QuantSpec(axis=np.int64(0))
    assert type(spec.axis) is int and spec == jq.QuantSpec(axis=0)


def test_spec_takes_numpy_integer_block_sizes_as_quantize_does():
    """Bug: QuantSpec(block_size=np.int64(32)) was refused ("must be a positive integer, got
    np.int64(32)") although jaxquant.quantize takes NumPy integers; block lengths computed
    with NumPy (x.shape[1] // 4) are NumPy integers."""
    x = _f32(4, 64)
    spec = jq.QuantSpec(dtype=jnp.int4, block_size=np.int64(16))
    assert spec == jq.QuantSpec(dtype=jnp.int4, block_size=16) and type(spec.block_size) is int
    tiles = jq.QuantSpec(axis=None, block_size=(np.int32(2), 32))
    assert tiles.block_size == (2, 32) and all(type(b) is int for b in tiles.block_size)
    qt = jq.quantize_tree({"w": x}, [("w", spec)])["w"]
    assert qt.block_size == 16 and qt.scale.shape == (4, 4)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        jq.QuantSpec(block_size=np.int64(0))


@pytest.mark.parametrize("block_size, error", [(2.0, TypeError), (True, TypeError), ("8", TypeError),
                                               (0, ValueError), ((4, 2.5), TypeError),
                                               ((4, 0), ValueError)])
def test_quantspec_block_size_errors_are_quantizes(block_size, error):
    """QuantSpec said ValueError where quantize says TypeError for a non-integer block size."""
    axis = None if isinstance(block_size, tuple) else -1
    with pytest.raises(error, match="block_size must be a positive") as spec_error:
        jq.QuantSpec(axis=axis, block_size=block_size)
    with pytest.raises(error) as quantize_error:
        jq.quantize(_f32(4, 64), axis=axis, block_size=block_size)
    assert str(spec_error.value) == str(quantize_error.value)


# --- report -----------------------------------------------------------------------------------


def test_prng_key_leaves_count_their_key_data():
    """Bug: tree_nbytes and quantization_report raised "Cannot interpret 'key<fry>' as a data
    type" on a tree holding a typed PRNG key (an nnx.Rngs / Dropout state, a train state)."""
    from flax import nnx

    keys = jax.random.split(jax.random.key(0), 3)
    tree = {"keys": keys, "w": _f32(4, 8)}
    key_bytes = np.asarray(jax.random.key_data(keys)).nbytes  # 3 keys of 2 uint32
    assert key_bytes == 24
    assert jq.tree_nbytes(tree) == key_bytes + 4 * 8 * 4
    q = jq.quantize_tree(tree)
    assert jq.tree_nbytes(q) == key_bytes + 4 * 8 + 8 * 4
    rows = {r.path: r for r in quantization_report(tree, q)}
    k = rows["keys"]
    assert (k.dtype, k.nbytes_before, k.nbytes_after, k.compared) == ("key<fry>", 24, 24, False)
    assert format_report(list(rows.values())).splitlines()[2].split()[:7] == [
        "keys", "(3,)", "-", "-", "key<fry>", "24", "24"]
    state = nnx.state(nnx.Dropout(0.5, rngs=nnx.Rngs(0)))
    assert jq.tree_nbytes(state) == 4 + 8  # a uint32 count and one key
    assert [r.dtype for r in quantization_report(state)] == ["uint32", "key<fry>"]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_report_of_half_precision_leaves_matches_numpy(dtype):
    x = jnp.asarray(_RNG.standard_normal((16, 64)) * 3, dtype)
    spec = jq.QuantSpec(dtype=jnp.int4, block_size=16, packed=True)
    qt = jq.quantize_tree({"w": x}, [("w", spec)])["w"]
    (row,) = quantization_report({"w": x}, {"w": qt})
    xs = np.asarray(x, np.float64)
    codes = np.asarray(qt.qvalue.unpack() if hasattr(qt.qvalue, "unpack") else qt.qvalue,
                       np.float64)
    x_hat = codes * np.repeat(np.asarray(qt.scale, np.float64), 16, axis=1)
    d = xs - x_hat
    assert row.sqnr_db == pytest.approx(10 * np.log10(np.sum(xs**2) / np.sum(d**2)), abs=1e-3)
    assert row.max_abs_error == pytest.approx(np.abs(d).max(), rel=1e-5)
    assert row.nbytes_before == 16 * 64 * 2
    assert row.nbytes_after == qt.nbytes == 16 * 64 // 2 + 16 * 4 * 4
    assert (row.dtype, row.format, row.granularity) == (jnp.dtype(dtype).name, "int4(packed)",
                                                        "axis=1 block=16")


def test_table_aligns_long_paths_and_totals_the_bytes():
    long = "encoder/" + "layer_with_a_very_long_name/" * 4 + "kernel"
    tree = {"a": _f32(8), long: _f32(32, 16)}
    rows = quantization_report(tree, jq.quantize_tree(tree))
    lines = format_report(rows).splitlines()
    assert len(lines) == 6 and len({len(lines[1]), len(lines[4])}) == 1
    assert lines[3].startswith(long + "  ")
    # every column starts where the header's does: the shape column after the longest path
    assert lines[0].index("shape") == lines[2].index("(8,)") == len(long) + 2
    total = lines[5].split()
    assert total[:3] == ["total", f"{8 * 4 + 32 * 16 * 4:,}", f"{8 * 4 + 32 * 16 + 16 * 4:,}"]


def test_report_refuses_a_qtree_of_another_structure():
    tree = {"a": _f32(4, 4), "b": [_f32(4, 4), _f32(2)]}
    q = jq.quantize_tree(tree)
    with pytest.raises(ValueError, match=r"same leaf paths; they differ at \['b/1'\]"):
        quantization_report(tree, {"a": q["a"], "b": [q["b"][0]]})
    with pytest.raises(ValueError, match=r"'b/0': shape mismatch: tree has \(4, 4\), qtree has "
                                         r"\(2, 8\)"):
        quantization_report(tree, {"a": q["a"], "b": [jnp.ones((2, 8)), q["b"][1]]})


def test_row_dtype_is_the_original_leafs_when_quantizing_changed_it():
    """Bug: a NumPy float64 leaf (quantized to a float32 QTensor: JAX runs without x64) was
    reported as "float32" with the 8 bytes an element of float64 as its size before."""
    x = _RNG.standard_normal((4, 8))
    tree = {"w": x}
    q = jq.quantize_tree(tree)
    assert np.dtype(q["w"].dtype) == np.float32
    (row,) = quantization_report(tree, q)
    assert (row.dtype, row.nbytes_before) == ("float64", 4 * 8 * 8)
    assert format_report([row]).splitlines()[2].split()[5:7] == ["float64", "256"]  # "(4, 8)": 2
    (alone,) = quantization_report(q)  # no original: the dtype it dequantizes to
    assert (alone.dtype, alone.nbytes_before) == ("float32", 4 * 8 * 4)


def test_nnx_state_paths_end_in_value_as_the_readme_says():
    nnx = pytest.importorskip("flax.nnx")
    state = nnx.state(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
    anchored = [("kernel$", jq.QuantSpec())]
    assert jq.unused_rules(state, anchored) == anchored
    q = jq.quantize_tree(state, [("kernel/value$", jq.QuantSpec())])
    assert jq.is_qtensor(q["kernel"].get_value()) and not jq.is_qtensor(q["bias"].get_value())


def test_tree_nbytes_refuses_a_leaf_without_array_bytes():
    """An object() leaf counted 8 bytes (its NumPy object array's pointer)."""
    with pytest.raises(TypeError, match=r"^leaf 'b/c': a leaf of type object has no array bytes"):
        jq.tree_nbytes({"a": jnp.ones(2), "b": {"c": object()}})
    assert jq.tree_nbytes({"a": jnp.ones(2), "n": 1.0}) == 16


def test_rules_passed_through_jit_as_an_argument_say_they_are_static():
    tree = {"a": _f32(4, 8)}
    with pytest.raises(TypeError, match=r"^rules is a traced value: rules are static"):
        jax.jit(jq.quantize_tree)(tree, jq.QuantSpec())
    q = jax.jit(jq.quantize_tree, static_argnames="rules")(tree, rules=jq.QuantSpec())
    np.testing.assert_array_equal(q["a"].qvalue, jq.quantize_tree(tree)["a"].qvalue)
