"""quantize_tree / dequantize_tree / quantization_report on abstract trees, rule arguments that
cannot keep "the first match wins", and leaf paths and report figures against independent
references (`jax.tree_util.keystr`, NumPy float64, the arrays' own nbytes)."""

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_mesh import host_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant._report import quantization_report

_RNG = np.random.default_rng(11)
_Pair = collections.namedtuple("_Pair", ["kernel", "bias"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Layer:
    w: jax.Array
    b: jax.Array


class _Node:  # a custom node registered without keys: FlattenedIndexKey paths
    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(_Node, lambda n: ((n.a, n.b), None), lambda _, c: _Node(*c))


def _f32(*shape):
    return jnp.asarray(_RNG.standard_normal(shape).astype(np.float32))


def _tree():
    return {"enc": {"kernel": _f32(8, 32), "bias": _f32(32)},
            "head": _Layer(_f32(32, 4).astype(jnp.bfloat16), _f32(4)),
            "step": jnp.int32(1)}


_RULES = [("enc/kernel", jq.QuantSpec(dtype=jnp.int4, block_size=16, packed=True)),
          ("head/w", jq.QuantSpec(dtype="nf4", packed=True, double_quant=True, block_size=16)),
          ("bias", jq.QuantSpec(axis=None))]


# --- abstract trees (ShapeDtypeStruct leaves) --------------------------------------------------


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _shapes(tree):
    return [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(tree)]


def test_quantize_tree_of_shape_dtype_structs_gives_abstract_qtensors():
    """Bug: a tree of ShapeDtypeStructs (an abstract model, the target of a checkpoint restore)
    failed with "float() argument must be a string or a real number, not 'ShapeDtypeStruct'"."""
    tree = _tree()
    q = jq.quantize_tree(_abstract(tree), _RULES)
    want = jax.eval_shape(lambda t: jq.quantize_tree(t, _RULES), tree)
    assert jax.tree.structure(q) == jax.tree.structure(want)
    assert _shapes(q) == _shapes(want)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(q))
    assert jq.is_qtensor(q["head"].w) and jq.is_qtensor(q["head"].w.scale)
    assert jq.tree_nbytes(q) == jq.tree_nbytes(jq.quantize_tree(tree, _RULES))


def test_abstract_sharded_leaf_keeps_its_sharding():
    mesh = host_mesh((2,), ("x",))
    sds = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))
    q = jq.quantize_tree({"w": sds})["w"]
    assert isinstance(q.qvalue, jax.ShapeDtypeStruct) and q.qvalue.sharding.spec == P(None, "x")


def test_dequantize_tree_of_abstract_qtensors_gives_shape_dtype_structs():
    """Bug: an abstract QTensor (jax.eval_shape of quantize_tree) was refused with "Argument
    'qt.qvalue' ... of type ShapeDtypeStruct is not a valid JAX type"."""
    tree = _tree()
    q = jax.eval_shape(lambda t: jq.quantize_tree(t, _RULES), tree)
    back = jq.dequantize_tree(q)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert _shapes(back) == _shapes(tree)


def test_report_of_abstract_trees_counts_bytes_and_compares_nothing():
    """Bug: quantization_report(abstract tree, abstract qtree) failed with "float() argument
    must be a string or a real number, not 'ShapeDtypeStruct'"; the bytes need no values."""
    tree = _tree()
    concrete = quantization_report(tree, jq.quantize_tree(tree, _RULES))
    abstract_q = jq.quantize_tree(_abstract(tree), _RULES)
    for ref in (_abstract(tree), tree):  # values of one side only: nothing to compare either
        rows = quantization_report(ref, abstract_q)
        assert [(r.path, r.format, r.nbytes_before, r.nbytes_after) for r in rows] == [
            (r.path, r.format, r.nbytes_before, r.nbytes_after) for r in concrete]
        assert not any(r.compared for r in rows)
        assert all(math.isnan(r.sqnr_db) and math.isnan(r.max_abs_error) for r in rows)


# --- rule arguments ---------------------------------------------------------------------------


def test_a_generator_of_rules_consumed_by_an_earlier_call_is_refused():
    """Bug: the second call with the same generator got no rules at all and silently kept
    every leaf as it was."""
    tree = {"w": _f32(4, 8)}
    rules = ((p, jq.QuantSpec()) for p in ["w"])
    assert jq.is_qtensor(jq.quantize_tree(tree, rules)["w"])
    for fn in (jq.quantize_tree, jq.match_rules, jq.unused_rules):
        with pytest.raises(ValueError, match=r"rules is a generator that an earlier call "
                                             r"consumed.*pass a list"):
            fn(tree, rules)
    fresh = ((p, None) for p in [])  # an empty generator never iterated is fine: no rules
    assert jq.quantize_tree(tree, fresh)["w"] is tree["w"]


@pytest.mark.parametrize("make", [
    lambda r: zip([p for p, _ in r], [s for _, s in r], strict=True),  # patterns, specs
    lambda r: iter(list(r)), lambda r: map(tuple, r)], ids=["zip", "iter", "map"])
def test_a_one_shot_iterator_of_rules_consumed_by_an_earlier_call_is_refused(make):
    # before: the second call saw no rules and kept every leaf as it was, silently
    tree = {"w": _f32(4, 8), "b": _f32(8)}
    rules = make([("w", jq.QuantSpec(dtype=jnp.int4)), ("kernal", None)])
    assert jq.unused_rules(tree, rules) == [("kernal", None)]
    for fn in (jq.quantize_tree, jq.match_rules, jq.unused_rules):
        with pytest.raises(ValueError, match=r"^rules is an iterator \(\w+\) that yields no "
                                             r"rules, likely consumed by an earlier call"):
            fn(tree, rules)


def test_rules_in_a_set_are_refused():
    """Bug: a set of rules was taken in its hash order (string hashes vary between runs),
    so which rule matched first, and so each leaf's format, changed from run to run."""
    spec = jq.QuantSpec()
    for rules in ({("w", spec), ("", None)}, frozenset({("w", spec)})):
        with pytest.raises(TypeError, match=r"rules must be ordered \(the first match wins\); "
                                            r"got a .*set"):
            jq.quantize_tree({"w": _f32(4, 8)}, rules)
    # ordered views are fine
    q = jq.quantize_tree({"w": _f32(4, 8)}, {"w": spec, "": None}.items())
    assert jq.is_qtensor(q["w"])


# --- paths and selection ----------------------------------------------------------------------


def test_paths_equal_keystr_for_every_key_kind():
    from flax import nnx
    from flax.core import freeze

    w = _f32(4, 8)
    tree = {"d": {1: w, 2: w}, "a/b.c": w, "t": {("x", 2): w}, "nt": _Pair(w, w),
            "dc": _Layer(w, w), "n": _Node(w, [w]), "fd": freeze({"k": {"v": w}}),
            "s": nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0))),
            "q": jq.QuantSpec()(w)}
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=jq.is_qtensor)[0]
    want = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]
    assert list(jq.match_rules(tree)) == want
    assert "n/1/0" in want and "a/b.c" in want and "t/('x', 2)" in want
    # regex metacharacters of a key are matched as the path spells them
    q = jq.quantize_tree(tree, [(r"^a/b\.c$", jq.QuantSpec()), (r"^t/\('x', 2\)$",
                                                                  jq.QuantSpec())])
    assert jq.is_qtensor(q["a/b.c"]) and jq.is_qtensor(q["t"][("x", 2)])
    assert not jq.is_qtensor(q["d"][1])


def test_default_selection_by_dtype_and_rank():
    with jax.enable_x64(True):
        tree = {"f16": jnp.ones((2, 3), jnp.float16), "bf16": jnp.ones((2, 3), jnp.bfloat16),
                "f64": jnp.ones((2, 3), jnp.float64),
                "c": jnp.ones((2, 3), jnp.complex64), "i": jnp.ones((2, 3), jnp.int8),
                "bool": jnp.ones((2, 3), bool), "v": jnp.ones(3), "s": jnp.float32(1),
                "e": jnp.ones((0, 3)), "py": 1.5}
        q = jq.quantize_tree(tree)
        back = jq.dequantize_tree(q)
    picked = sorted(k for k, v in q.items() if jq.is_qtensor(v))
    assert picked == ["bf16", "e", "f16", "f64"]
    for k in picked:
        assert (back[k].shape, np.dtype(back[k].dtype)) == (tree[k].shape, np.dtype(tree[k].dtype))
    assert all(q[k] is tree[k] for k in tree if k not in picked)


# --- report figures ---------------------------------------------------------------------------


def _numpy_row(x, qt):
    x = np.asarray(x, np.float64)
    d = x - np.asarray(jq.dequantize(qt, jnp.float32), np.float64)
    sig, err = np.sum(x * x), np.sum(d * d)
    sqnr = math.inf if err == 0 else -math.inf if sig == 0 else 10 * math.log10(sig / err)
    return sqnr, np.abs(d).max(initial=0.0)


def _stored_bytes(qt):
    """Bytes of the arrays a QTensor holds, sub-byte unpacked codes at their bit width."""
    total = 0
    for a in jax.tree.leaves(qt):
        if a is qt.qvalue and not qt.packed:
            total += -(-a.size * qt.format.bits // 8)
        else:
            total += np.asarray(a).nbytes
    return total


def test_report_figures_match_numpy_and_the_stored_arrays():
    x = _RNG.standard_normal((8, 64))
    tree = {"zeros": np.zeros((8, 64), np.float32), "const": np.full((8, 64), -3.3, np.float32),
            "tiny": (x * 1e-30).astype(np.float32), "huge": (x * 1e30).astype(np.float32),
            "i4p": x.astype(np.float32), "mx": x.astype(np.float32)}
    rules = [("zeros|const|tiny|huge", jq.QuantSpec()),
             ("i4p", jq.QuantSpec(dtype=jnp.int4, block_size=16, packed=True)),
             ("mx", jq.QuantSpec(dtype="mxfp4", packed=True))]
    q = jq.quantize_tree(tree, rules)
    rows = quantization_report(tree, q)
    for row in rows:
        x, qt = tree[row.path], q[row.path]
        sqnr, worst = _numpy_row(x, qt)
        assert row.compared and row.max_abs_error == pytest.approx(worst, rel=1e-5, abs=0)
        assert row.sqnr_db == pytest.approx(sqnr, abs=1e-3) or row.sqnr_db == sqnr
        assert row.nbytes_before == np.asarray(x).nbytes
        assert row.nbytes_after == qt.nbytes == _stored_bytes(qt)
    assert {r.path: r.sqnr_db for r in rows}["zeros"] == math.inf


def test_report_given_the_rules_instead_of_the_quantized_tree_says_so():
    """Bug: rules (or one QuantSpec) passed as qtree were refused as "tree and qtree must have
    the same leaf paths; they differ at ['0/0', '0/1', 'w']" (the rules' own positions)."""
    tree = {"w": _f32(4, 8)}
    for rules in ([("w", jq.QuantSpec())], jq.QuantSpec()):
        with pytest.raises(TypeError, match=r"qtree must be the quantized tree, "
                                            r"jaxquant.quantize_tree\(tree, rules\), not the "
                                            r"rules; got .*QuantSpec\("):
            quantization_report(tree, rules)


def test_report_of_layers_stacked_by_vmap_matches_numpy_layer_by_layer():
    """Bug: a QTensor stacked by jax.vmap (a scanned model's layers) crashed the report with
    "cannot reshape array of shape (3, 16) (size 48) into shape [1, 8, 1]"."""
    tree = {"k": _f32(3, 8, 32), "b": _f32(3, 32)}
    rules = [("k", jq.QuantSpec(dtype=jnp.int4, block_size=16, symmetric=False)), ("b", None)]
    q = jax.vmap(lambda t: jq.quantize_tree(t, rules))(tree)
    rows = {r.path: r for r in quantization_report(tree, q)}
    x = np.asarray(tree["k"], np.float64)
    x_hat = np.stack([np.asarray(jq.dequantize(jq.quantize_tree({"k": tree["k"][i]}, rules)["k"],
                                               jnp.float32), np.float64) for i in range(3)])
    d = x - x_hat
    assert rows["k"].compared and not rows["b"].compared
    assert rows["k"].sqnr_db == pytest.approx(10 * np.log10(np.sum(x * x) / np.sum(d * d)),
                                              abs=1e-3)
    assert rows["k"].max_abs_error == pytest.approx(np.abs(d).max(), rel=1e-5)
    assert rows["k"].nbytes_after == jq.tree_nbytes(q["k"])
