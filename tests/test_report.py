"""quantization_report / format_report: per-leaf rows checked against NumPy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant import _report
from jaxquant._report import LeafReport, format_report, quantization_report


def _params():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    return {"dense": {"kernel": f(16, 32), "bias": f(32)},
            "embed": {"embedding": f(24, 8) * 3},
            "head": {"kernel": f(32, 8).astype(jnp.bfloat16)},
            "zeros": jnp.zeros((4, 8), jnp.float32),
            "step": jnp.int32(3)}


RULES = [("dense/kernel", jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=8, packed=True)),
         ("embed", jq.QuantSpec(dtype=jnp.uint8, symmetric=False)),
         ("head", jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=None)),
         ("zeros", jq.QuantSpec())]


def _numpy_stats(x, x_hat):
    x, d = np.asarray(x, np.float64), np.asarray(x, np.float64) - np.asarray(x_hat, np.float64)
    err = np.sum(d * d)
    return (math.inf if err == 0 else 10 * np.log10(np.sum(x * x) / err)), np.abs(d).max()


def test_rows_match_numpy_sqnr_max_error_and_bytes():
    p = _params()
    q = jq.quantize_tree(p, RULES)
    rows = {r.path: r for r in quantization_report(p, q)}
    assert list(rows) == ["dense/bias", "dense/kernel", "embed/embedding", "head/kernel", "step",
                          "zeros"]
    for path in ("dense/kernel", "embed/embedding", "head/kernel"):
        *keys, = path.split("/")
        x, qt = p[keys[0]][keys[1]], q[keys[0]][keys[1]]
        sqnr, worst = _numpy_stats(x, jq.dequantize(qt, jnp.float32))
        assert rows[path].sqnr_db == pytest.approx(sqnr, abs=1e-3)
        assert rows[path].max_abs_error == pytest.approx(worst, abs=1e-6)  # float32 x - x_hat
        assert rows[path].nbytes_after == qt.nbytes
        assert rows[path].nbytes_before == x.size * x.dtype.itemsize
    k = rows["dense/kernel"]
    assert (k.format, k.granularity, k.shape, k.dtype) == ("int4(packed)", "axis=0 block=8",
                                                          (16, 32), "float32")
    assert k.nbytes_after == 16 * 32 // 2 + 2 * 32 * 4  # codes two per byte + (2, 32) scales
    assert rows["embed/embedding"].granularity == "axis=1"
    assert rows["head/kernel"].granularity == "per-tensor"
    assert rows["head/kernel"].dtype == "bfloat16"
    assert rows["zeros"].sqnr_db == math.inf and rows["zeros"].max_abs_error == 0.0
    for kept in ("dense/bias", "step"):
        r = rows[kept]
        assert not r.quantized and r.format == r.granularity == "-"
        assert r.nbytes_before == r.nbytes_after and math.isnan(r.sqnr_db)
    assert rows["step"].dtype == "int32" and rows["step"].shape == ()
    assert sum(r.nbytes_before for r in rows.values()) == jq.tree_nbytes(p)
    assert sum(r.nbytes_after for r in rows.values()) == jq.tree_nbytes(q)


def test_int8_per_channel_against_codes_times_scale():
    x = np.random.default_rng(1).standard_normal((8, 5)).astype(np.float32)
    qt = jq.quantize(jnp.asarray(x), dtype=jnp.int8, axis=1)
    x_hat = np.asarray(qt.qvalue, np.float64) * np.asarray(qt.scale, np.float64)[None, :]
    (row,) = quantization_report({"w": x}, {"w": qt})
    sqnr, worst = _numpy_stats(x, x_hat)
    assert row.sqnr_db == pytest.approx(sqnr, abs=1e-3)
    assert row.max_abs_error == pytest.approx(worst, rel=1e-5)
    assert 35 < row.sqnr_db < 50  # int8 on Gaussian data: about 40 dB


def test_quantized_tree_alone_lists_formats_and_bytes():
    q = jq.quantize_tree(_params(), RULES)
    rows = {r.path: r for r in quantization_report(q)}
    assert rows["dense/kernel"].nbytes_before == 16 * 32 * 4
    assert rows["head/kernel"].nbytes_before == 32 * 8 * 2  # bfloat16
    assert rows["embed/embedding"].format == "uint8"
    assert all(math.isnan(r.sqnr_db) for r in rows.values())
    assert sum(r.nbytes_after for r in rows.values()) == jq.tree_nbytes(q)


def test_errors_compile_once_per_leaf_signature_not_per_leaf():
    layers = {f"layer_{i}": {"kernel": jnp.full((16, 8), i + 1.0) * jnp.arange(8.0)[None, :]}
              for i in range(12)}
    q = jq.quantize_tree(layers)
    size = _report._errors._cache_size()
    rows = quantization_report(layers, q)
    assert _report._errors._cache_size() <= size + 1  # twelve leaves, one signature
    assert len(rows) == 12 and all(r.compared and r.sqnr_db > 40 for r in rows)


def test_errors_are_not_retraced_for_a_tree_of_the_same_shapes():
    p = _params()
    q = jq.quantize_tree(p, RULES)
    quantization_report(p, q)
    size = _report._errors._cache_size()
    p2 = jax.tree.map(lambda v: v + 1 if jnp.issubdtype(v.dtype, jnp.floating) else v, p)
    rows = quantization_report(p2, jq.quantize_tree(p2, RULES))
    assert _report._errors._cache_size() == size  # same shapes: no retrace
    assert rows[1].sqnr_db != quantization_report(p, q)[1].sqnr_db


def test_sharded_tree_gives_the_same_rows():
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices("cpu")[:8])
    p = jax.device_put(_params(), jax.devices("cpu")[0])
    q = jq.quantize_tree(p, RULES)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    ps = dict(jax.tree.map(lambda v: put(v, P()), p),
              dense={"kernel": put(p["dense"]["kernel"], P("data", "model")),
                     "bias": put(p["dense"]["bias"], P("model"))},
              embed={"embedding": put(p["embed"]["embedding"], P(None, "model"))})
    qs = jax.jit(lambda t: jq.quantize_tree(t, RULES))(ps)
    assert qs["dense"]["kernel"].qvalue.data.sharding.spec == P("data", "model")
    for a, b in zip(quantization_report(p, q), quantization_report(ps, qs), strict=True):
        assert a.path == b.path and a.nbytes_after == b.nbytes_after
        assert a.sqnr_db == pytest.approx(b.sqnr_db, abs=1e-4, nan_ok=True)
        assert a.max_abs_error == pytest.approx(b.max_abs_error, nan_ok=True)


def test_format_report_table_and_total():
    p = _params()
    rows = quantization_report(p, jq.quantize_tree(p, RULES))
    lines = format_report(rows).splitlines()
    assert lines[0].split() == ["path", "shape", "format", "granularity", "dtype", "before",
                                "after", "ratio", "SQNR", "dB", "max", "err"]
    assert set(lines[1]) == {"-"} and lines[1] == lines[-2] and len(lines) == len(rows) + 4
    kernel = next(ln for ln in lines if ln.startswith("dense/kernel")).split()
    assert kernel[3:6] == ["int4(packed)", "axis=0", "block=8"]
    assert kernel[-2] == f"{rows[1].sqnr_db:.1f}"
    bias = next(ln for ln in lines if ln.startswith("dense/bias")).split()
    assert bias[-3:] == ["1.000", "-", "-"]
    total = lines[-1].split()
    before, after = jq.tree_nbytes(p), jq.tree_nbytes(jq.quantize_tree(p, RULES))
    assert total == ["total", f"{before:,}", f"{after:,}", f"{after / before:.3f}"]
    # numbers are right-aligned: every "after" cell ends in the same column
    end = lines[0].index("after") + len("after")
    assert all(ln[:end].endswith(str(f"{r.nbytes_after:,}")) for ln, r in zip(lines[2:-2], rows, strict=True))


def test_leaf_report_is_frozen():
    r = LeafReport(path="w", shape=(2,), format="-", granularity="-", dtype="float32",
                   nbytes_before=8, nbytes_after=8)
    with pytest.raises(AttributeError):
        r.path = "v"
    assert math.isnan(r.sqnr_db) and not r.quantized


def test_mismatched_trees_raise():
    p = _params()
    q = jq.quantize_tree(p, RULES)
    with pytest.raises(ValueError, match=r"same leaf paths; they differ at \['other'\]"):
        quantization_report(p, dict(q, other=jnp.ones(2)))
    with pytest.raises(ValueError, match=r"'zeros': shape mismatch: tree has \(4, 8\), qtree has "
                                         r"\(8, 4\)"):
        quantization_report(p, dict(q, zeros=jnp.zeros((8, 4))))
    with pytest.raises(TypeError, match="'zeros': tree holds a QTensor but qtree does not"):
        quantization_report(dict(p, zeros=q["zeros"]), dict(q, zeros=p["zeros"]))
    with pytest.raises(TypeError, match="'zeros': the reference leaf must be a float array, got "
                                        "dtype int32"):
        quantization_report(dict(p, zeros=jnp.zeros((4, 8), jnp.int32)), q)


def test_packed_array_leaf_is_one_row_under_its_own_path():
    """A plain PackedArray leaf reads as the checkpoint names it: p (5,) int4, not p/data."""
    packed = jq.pack(jnp.asarray(np.array([1, 2, 3, 4, 5]), jnp.int4))
    tree = {"p": packed, "w": jnp.ones((2, 4))}
    for rows in (quantization_report(tree), quantization_report(tree, jq.quantize_tree(tree))):
        p = rows[0]
        assert (p.path, p.shape, p.dtype, p.format) == ("p", (5,), "int4", "-")
        assert p.nbytes_before == p.nbytes_after == packed.nbytes == 3
        assert not p.compared
    line = format_report(quantization_report(tree)).splitlines()[2].split()
    assert line[:5] == ["p", "(5,)", "-", "-", "int4"]


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_nan_statistic_prints_apart_from_an_uncompared_leaf(bad):
    x = jnp.arange(1.0, 9.0).reshape(2, 4).at[0, 0].set(bad)
    tree = {"b": jnp.ones(4), "w": x}
    rows = quantization_report(tree, jq.quantize_tree(tree))
    assert rows[1].compared and math.isnan(rows[1].sqnr_db) and math.isnan(rows[1].max_abs_error)
    assert not rows[0].compared
    lines = format_report(rows).splitlines()
    assert lines[2].split()[-2:] == ["-", "-"]  # b: kept, nothing compared
    assert lines[3].split()[-2:] == ["nan", "nan"]  # w: compared, NaN statistics
    alone = format_report(quantization_report(jq.quantize_tree(tree))).splitlines()
    assert alone[3].split()[-2:] == ["-", "-"]  # a quantized tree alone: nothing compared


@pytest.mark.parametrize("magnitude", [1e25, 1e-25, 3e38, 1e-30])
def test_statistics_of_very_large_and_very_small_leaves_match_numpy(magnitude):
    """Squares of finite float32 values can overflow (x ~ 1e25) or underflow to zero
    (x ~ 1e-25, an error still far from zero); the SQNR is that of NumPy in float64."""
    x = np.random.default_rng(3).standard_normal((16, 32)).astype(np.float32)
    x = (x / np.abs(x).max() * np.float32(magnitude)).astype(np.float32)
    assert np.isfinite(x).all()
    qt = jq.quantize(jnp.asarray(x), dtype=jnp.int8, axis=1)
    x_hat = np.asarray(qt.qvalue, np.float64) * np.asarray(qt.scale, np.float64)[None, :]
    (row,) = quantization_report({"w": x}, {"w": qt})
    sqnr, worst = _numpy_stats(x, x_hat)
    assert 35 < sqnr < 50
    assert row.sqnr_db == pytest.approx(sqnr, abs=1e-3)
    assert row.max_abs_error == pytest.approx(worst, rel=1e-5)


def test_a_leaf_already_quantized_counts_its_stored_bytes_eagerly_and_under_jit():
    """A QTensor already in ``tree`` (kept by quantize_tree) stored 4*8 int8 codes and 8
    float32 scales before and after; the figure must not depend on whether quantize_tree
    handed back the same object (eager) or a rebuilt one (jit)."""
    w = jnp.ones((4, 8))
    tree = {"q": jq.quantize(w, axis=1), "w": w}
    stored = 4 * 8 * 1 + 8 * 4
    for qtree in (jq.quantize_tree(tree), jax.jit(jq.quantize_tree)(tree)):
        rows = {r.path: r for r in quantization_report(tree, qtree)}
        assert rows["q"].nbytes_before == rows["q"].nbytes_after == stored
        assert rows["w"].nbytes_before == 4 * 8 * 4
        assert sum(r.nbytes_before for r in rows.values()) == stored + 4 * 8 * 4
    alone = {r.path: r for r in quantization_report(tree)}
    assert alone["q"].nbytes_before == 4 * 8 * 4  # described alone: its float size
