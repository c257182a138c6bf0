"""quantization_report / format_report / `jaxquant report` against independent NumPy float64
figures: SQNR, largest error and bytes (codes packed, scales, zero points, nested scales)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import jaxquant as jq
from jaxquant import _cli
from jaxquant._report import format_report, quantization_report

QS = jq.QuantSpec


def _numpy_stats(x, qt):
    """SQNR (dB) and max |x - x_hat| in float64, x_hat the float32 dequantization."""
    x = np.asarray(x, np.float64)
    d = x - np.asarray(jq.dequantize(qt, jnp.float32), np.float64)
    err = np.sum(d * d)
    return (math.inf if err == 0 else 10 * math.log10(np.sum(x * x) / err)), np.abs(d).max(initial=0.0)


# name: (shape, spec, bytes after counted by hand: codes + scales + zero points + nested)
CASES = {
    "i8_blk_zp": ((8, 40), QS(block_size=16, symmetric=False), 320 + 8 * 3 * 4 + 8 * 3),
    "i4p_37": ((8, 37), QS(dtype=jnp.int4, block_size=16, packed=True), 8 * 19 + 8 * 3 * 4),
    "i4_37": ((8, 37), QS(dtype=jnp.int4, block_size=16), 8 * 19 + 8 * 3 * 4),  # as stored
    "i2p_ax0": ((37, 7), QS(dtype=jnp.int2, axis=0, block_size=8, packed=True), 37 * 2 + 5 * 7 * 4),
    "u4p_zp": ((8, 37), QS(dtype=jnp.uint4, block_size=16, packed=True, symmetric=False),
               8 * 19 + 8 * 3 * 4 + 8 * 2),  # uint4 zero points two per byte, per row
    "f8e5": ((8, 40), QS(dtype=jnp.float8_e5m2, axis=None), 320 + 4),
    "mxfp6p_37": ((8, 37), QS(dtype="mxfp6_e2m3", packed=True), 8 * 30 + 8 * 2),  # 4 per 3 bytes
    "mxfp4p_ax0": ((37, 8), QS(dtype="mxfp4", axis=0, packed=True), 37 * 4 + 2 * 8),
    "mxint8": ((3, 33), QS(dtype="mxint8"), 99 + 3 * 2),
    "nvfp4p": ((8, 37), QS(dtype="nvfp4", packed=True), 8 * 19 + 8 * 3 + 4),  # e4m3 + f32 outer
    "nf4p_dq": ((3, 129), QS(dtype="nf4", packed=True, double_quant=True), 3 * 65 + 3 * 3 + 4),
    "tiles": ((5, 6, 7), QS(dtype=jnp.int4, block_size=(2, 4, 3), packed=True),
              5 * 6 * 4 + 3 * 2 * 3 * 4),
    "bf16": ((8, 40), QS(), 320 + 40 * 4),
    "scalar": ((), QS(axis=None), 1 + 4),
    "empty": ((0, 8), QS(), 8 * 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_format_family_matches_numpy_and_hand_counted_bytes(name):
    shape, spec, after = CASES[name]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x = jnp.asarray(x, jnp.bfloat16) if name == "bf16" else x
    tree = {name: x, "kept": np.ones((4, 4), np.float32), "ints": np.arange(6, dtype=np.int32)}
    q = jq.quantize_tree(tree, [(f"^{name}$", spec), ("kept", None)])
    rows = quantization_report(tree, q)
    r = next(r for r in rows if r.path == name)
    sqnr, worst = _numpy_stats(np.asarray(x, np.float32), q[name])
    assert r.path == name and r.compared and r.shape == shape
    assert r.nbytes_before == math.prod(shape) * np.dtype(x.dtype).itemsize
    assert r.nbytes_after == after == jq.tree_nbytes(q[name])
    assert r.sqnr_db == pytest.approx(sqnr, abs=1e-3)
    assert r.max_abs_error == pytest.approx(worst, rel=1e-6, abs=1e-12)
    assert [(r.path, r.format) for r in rows if r.path != name] == [("ints", "-"), ("kept", "-")]
    table = format_report(rows).splitlines()
    for line, r in zip(table[2:-2], rows, strict=True):  # shape cells may hold spaces
        cells = line.split()
        assert cells[0] == r.path
        assert cells[-5:-3] == [f"{r.nbytes_before:,}", f"{r.nbytes_after:,}"]
        assert cells[-2] == ("-" if not r.compared else format(r.sqnr_db, ".1f"))
    assert table[-1].split()[1:3] == [f"{sum(r.nbytes_before for r in rows):,}",
                                      f"{jq.tree_nbytes(q):,}"]


def test_rules_first_match_none_keeps_and_unused_rules_on_nested_paths():
    tree = {"enc": {"layers": [{"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)},
                               {"kernel": jnp.ones((4, 8))}]}, "step": jnp.int32(1)}
    rules = [("layers/1/kernel", None), ("kernel", QS(dtype=jnp.int4)), ("enc", QS()),
             ("step", QS()), ("layers/0/kernel", QS()), ("typo", None)]
    got = {k: s and s.dtype for k, s in jq.match_rules(tree, rules).items()}
    assert got == {"enc/layers/0/bias": jnp.dtype(jnp.int8),
                   "enc/layers/0/kernel": jnp.dtype(jnp.int4),
                   "enc/layers/1/kernel": None, "step": None}
    assert [p for p, _ in jq.unused_rules(tree, rules)] == ["layers/0/kernel", "typo"]
    rows = quantization_report(tree, jq.quantize_tree(tree, rules))
    assert [(r.path, r.format) for r in rows] == [
        ("enc/layers/0/bias", "int8"), ("enc/layers/0/kernel", "int4"),
        ("enc/layers/1/kernel", "-"), ("step", "-")]


def test_float64_leaf_error_is_that_of_the_float64_values():
    """A NumPy float64 leaf (as `load_safetensors` returns F64 tensors with x64 off): the
    difference must not be taken from its float32 rounding, which here is exact."""
    x32 = np.arange(-64, 64, dtype=np.float32).reshape(8, 16) * np.float32(0.25)
    x = x32.astype(np.float64) + 1e-9
    qt = jq.quantize(jnp.asarray(x32), jnp.float32(0.25), dtype=jnp.int16)
    (row,) = quantization_report({"w": x}, {"w": qt})
    sqnr, worst = _numpy_stats(x, qt)
    assert np.isfinite(sqnr) and row.sqnr_db == pytest.approx(sqnr, abs=1e-3)
    assert row.max_abs_error == pytest.approx(worst, rel=1e-3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e300])
def test_float64_leaf_with_nan_inf_or_out_of_float32_range_gives_nan_statistics(bad):
    x = np.linspace(-1.0, 1.0, 32).reshape(4, 8)
    q = {"w": jq.quantize(jnp.asarray(x, jnp.float32), dtype=jnp.int8, axis=1)}
    x[1, 2] = bad
    (row,) = quantization_report({"w": x}, q)  # no RuntimeWarning (errors under pytest)
    assert row.compared and math.isnan(row.sqnr_db) and math.isnan(row.max_abs_error)


def test_float64_leaf_int32_codes_sqnr_matches_numpy():
    x = np.random.default_rng(1).standard_normal((64, 64))
    q = jq.quantize_tree({"w": x}, [("w", QS(dtype=jnp.int32))])
    (row,) = quantization_report({"w": x}, q)
    sqnr, worst = _numpy_stats(x, q["w"])
    assert row.dtype == "float64" and row.nbytes_before == 64 * 64 * 8
    assert row.sqnr_db == pytest.approx(sqnr, abs=1e-2)
    assert row.max_abs_error == pytest.approx(worst, rel=1e-3)


def test_cli_report_of_a_float64_file_matches_numpy(tmp_path, capsys):
    x = np.random.default_rng(2).standard_normal((16, 32))
    save_file({"w": x, "b": np.ones(3)}, str(tmp_path / "in.safetensors"))
    assert _cli.main(["quantize", str(tmp_path / "in.safetensors"),
                      str(tmp_path / "out.safetensors"), "--quiet", "--rules", "w=int32"]) == 0
    capsys.readouterr()
    assert _cli.main(["report", str(tmp_path / "in.safetensors"),
                      str(tmp_path / "out.safetensors")]) == 0
    cells = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("w ")).split()
    qt = jq.load_safetensors(tmp_path / "out.safetensors")["w"]
    sqnr, worst = _numpy_stats(x, qt)
    assert cells[-5:-3] == [f"{16 * 32 * 8:,}", f"{qt.nbytes:,}"]
    assert cells[-2:] == [f"{sqnr:.1f}", f"{worst:.2e}"]


def test_qtree_loaded_from_a_checkpoint_is_paired_by_path(tmp_path):
    """12 layers in a list come back from a checkpoint as a dict: layers/10 sorts before
    layers/2. The report pairs leaves by path, as documented, in the order of ``tree``."""
    params = {"layers": [jnp.arange(32.0).reshape(4, 8) * (i + 1) for i in range(12)]}
    q = jq.quantize_tree(params)
    jq.save_safetensors(tmp_path / "q.safetensors", q)
    loaded = jq.load_safetensors(tmp_path / "q.safetensors")
    want = quantization_report(params, q)
    assert quantization_report(params, loaded) == want
    assert [r.path for r in want] == [f"layers/{i}" for i in range(12)]
    with pytest.raises(ValueError, match=r"differ at \['layers/12'\]"):
        quantization_report(params, dict(loaded, layers=dict(loaded["layers"], **{
            "12": loaded["layers"]["0"]})))
    jax.block_until_ready(loaded)
