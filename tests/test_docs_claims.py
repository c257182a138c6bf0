"""What README.md, the notebooks and the data docstrings state as fact, held to the code and
to the benchmark results they cite.

`tests/test_docs.py` checks coverage (docstrings, API pages, module tables) and the README's
set-up, command line and checkpoint format; the tests here check the rest that can regress
silently: figures quoted from ``benchmarks/results/*.json`` (a rerun that changes a result
must change the README too), constants and signatures the prose spells out, names it refers
to, the examples in docstrings of data (``jq.FORMATS``: ``--doctest-modules`` only collects
docstrings of modules, classes and functions), the fixed defaults of the public contract,
and the prose of a committed notebook against its own outputs.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import json
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

import jaxquant as jq

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = ROOT / "benchmarks" / "results"


def _results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def _row(rows: list[dict], key: str, value) -> dict:
    found = [r for r in rows if r[key] == value]
    assert len(found) == 1, f"no single row with {key} == {value!r}"
    return found[0]


def _data_docstrings() -> dict[str, tuple[str, str]]:
    """``{name: (defining module, docstring)}`` for the data names of ``jaxquant.__all__``:
    the string literal after the assignment in the private module that defines it."""
    found = {}
    for path in sorted((ROOT / "jaxquant").glob("_*.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        for stmt, nxt in zip(body, body[1:], strict=False):
            targets = (stmt.targets if isinstance(stmt, ast.Assign)
                       else [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
            for t in targets:
                if (isinstance(t, ast.Name) and t.id in jq.__all__
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                    found[t.id] = (f"jaxquant.{path.stem}", nxt.value.value)
    return found


def test_data_docstring_examples_run():
    docs = _data_docstrings()
    assert {"FORMATS", "CODEBOOKS", "SCHEMES"} <= set(docs), sorted(docs)
    parser = doctest.DocTestParser()
    for name, (module, doc) in docs.items():
        test = parser.get_doctest(doc, dict(vars(importlib.import_module(module))), name,
                                  module, 0)
        assert test.examples, f"jaxquant.{name}'s docstring has no example"
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        assert runner.failures == 0, f"jaxquant.{name}'s example fails (output above)"


def test_public_signatures_follow_the_contract():
    """The names, order and defaults that the public contract (API.md) fixes; extra keyword
    arguments after them are allowed."""
    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    pos, kw = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    common = [("x", pos, inspect.Parameter.empty), ("scale", pos, None),
              ("zero_point", pos, None), ("dtype", kw, jnp.int8), ("axis", kw, None),
              ("block_size", kw, None), ("symmetric", kw, True)]
    assert params(jq.quantize)[:8] == [*common, ("saturate", kw, True)]
    assert params(jq.fake_quant)[:7] == common
    assert params(jq.dequantize) == [("qt", pos, inspect.Parameter.empty), ("dtype", pos, None)]
    assert params(jq.quantize_tree)[:2] == [("tree", pos, inspect.Parameter.empty),
                                            ("rules", pos, None)]
    assert params(jq.QuantSpec)[:4] == [("dtype", pos, jnp.int8), ("axis", pos, -1),
                                        ("block_size", pos, None), ("symmetric", pos, True)]
    assert params(jq.QTensor)[:6] == [
        ("qvalue", pos, inspect.Parameter.empty), ("scale", pos, inspect.Parameter.empty),
        ("zero_point", pos, None), ("axis", kw, None), ("block_size", kw, None),
        ("dtype", kw, jnp.float32)]
    assert hash(jq.QuantSpec()) == hash(jq.QuantSpec())  # frozen and hashable


def test_readme_names_exist():
    """Every ``jq.NAME`` / ``jq.calibration.NAME`` the README mentions exists."""
    for name in set(re.findall(r"\bjq\.(\w+)", README)):
        assert hasattr(jq, name), f"README mentions jq.{name}, which does not exist"
    for name in set(re.findall(r"\bjq\.calibration\.(\w+)", README)):
        assert hasattr(jq.calibration, name), f"README mentions jq.calibration.{name}"
    observers = re.search(r"following PyTorch's observers: (.*?)\. `jq", README, re.DOTALL)
    for name in re.findall(r"(?<!\()`(\w+)`", observers.group(1)):  # not (`HistogramObserver`)
        assert name in jq.calibration.__all__, name


def test_readme_signatures_match_the_code():
    def spelled(f):  # the signature without annotations: "x, axis=-1, *, block_size=None"
        parts, star = [], False
        for p in inspect.signature(f).parameters.values():
            if p.kind is p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
        return ", ".join(parts)

    gptq = re.search(r"`jq\.gptq\((\w+), (\w+),", README).groups()
    assert list(inspect.signature(jq.gptq).parameters)[:2] == list(gptq)
    hadamard = re.search(r"`jq\.hadamard_transform\(([^)]*)\)`", README).group(1)
    assert spelled(jq.hadamard_transform) == hadamard


def test_readme_constants_match_the_code():
    from jaxquant import _int_dot, _weight_only

    inference = README[README.index("## Quantized inference"):README.index("## Low-bit")]
    assert f"{_int_dot.exact_length(False):,} products" in inference
    assert f"or {_int_dot.exact_length(True):,} with a zero point" in inference
    mib = 2**20
    assert f"over {_weight_only.STREAM_BYTES // mib} MiB of float32" in inference
    assert f"chunks of at most {_weight_only.STREAM_BYTES // mib} MiB" in inference
    assert (f"by {_weight_only.STREAM_MIN_ROWS} to {_weight_only.STREAM_MAX_ROWS} rows"
            in inference)
    assert f"over {_weight_only.STREAM_LARGE_BYTES // mib} MiB" in inference


def test_readme_format_lists_match_the_tables():
    row = re.search(r"^\| Formats \| (.*) \|$", README, re.MULTILINE).group(1)
    formats, rest = row.split("(`jq.FORMATS`)")
    codebooks = rest.split("(`jq.CODEBOOKS`)")[0]
    assert sorted(" ".join(re.findall(r"`([\w ]+)`", formats)).split()) == sorted(jq.FORMATS)
    assert sorted(" ".join(re.findall(r"`([\w ]+)`", codebooks)).split()) == sorted(jq.CODEBOOKS)
    mx = {n for n in jq.SCHEMES if n.startswith("mx")}
    assert mx == {"mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8"}
    assert "MXFP8/6/4, MXINT8, NVFP4 (`jq.SCHEMES`)" in row and "nvfp4" in jq.SCHEMES


# README's label of each row of the "Low-bit formats" table -> the results file's format
_SQNR_ROWS = {
    "int8 per channel": "int8 per-channel",
    "mxint8": "mxint8",
    "int8, 128 x 128 tiles": "int8 tiles 128x128",
    "float8_e4m3fn per channel": "float8_e4m3fn per-channel",
    "mxfp8_e4m3 (OCP floor scales)": "mxfp8_e4m3",
    'mxfp8_e4m3, `scale_rounding="up_on_overflow"`': "mxfp8_e4m3, scale_rounding=up_on_overflow",
    "mxfp8_e5m2": "mxfp8_e5m2",
    "mxfp6_e2m3": "mxfp6_e2m3",
    "mxfp6_e3m2": "mxfp6_e3m2",
    "nf4, block 64": "nf4",
    "nf4 + double quantization": "nf4 + double_quant",
    "nvfp4": "nvfp4",
    "int4, block 32": "int4 block 32",
    "mxfp4": "mxfp4",
    "fp4 (bitsandbytes), block 64": "fp4",
    "int4, block 128": "int4 block 128",
}


def test_readme_sqnr_table_matches_the_results():
    results = _results("formats_sqnr")
    section = README[README.index("## Low-bit formats"):README.index("## Checkpoints")]
    assert results["date"][:10] in section and f"{results['values'] / 1e6:.1f}M" in section
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", section, re.MULTILINE)
    assert {label for label, *_ in rows} == set(_SQNR_ROWS)
    for label, bits, sqnr, worst in rows:
        r = _row(results["formats"], "format", _SQNR_ROWS[label])
        expected = (f"{r['bits_per_value']:.2f}", f"{r['sqnr_db']:.2f}",
                    f"{r['worst_tensor_sqnr_db']:.2f}")
        assert (bits, sqnr, worst) == expected, label


def test_readme_highlights_match_the_results():
    benchmarks = README[README.index("## Benchmarks"):README.index("## Documentation")]
    char = _results("char_transformer")["rows"]
    for label, variant in [("PTQ int4 block 32", "PTQ int4 block 32"),
                           ("QAT int4 block 32", "QAT int4 block 32"),
                           ("QAT int8 W8A8", "QAT int8 W8A8"), ("PTQ int8", "PTQ int8 per-channel")]:
        ratio = _row(char, "variant", variant)["ppl_vs_float"]
        assert f"{label} {ratio:.3f}x" in benchmarks, label

    qat = _results("qat_mlp")["cases"]
    fake, int8, qwix = (_row(qat, "case", c)["vs_float32"] for c in (
        "fake-quant QAT (jq.fake_quant W per-channel + A per-token, float dots)",
        "int8-dot QAT (jaxquant QATDotGeneral, float backward)",
        "qwix QAT (QtProvider, int8 W+A, float backward)"))
    assert (f"fake-quant {fake:.2f}x float" in benchmarks
            and f"int8-dot QAT {int8:.2f}x" in benchmarks and f"qwix {qwix:.2f}x" in benchmarks)
    assert f"train step is {int8:.2f}x float32 against {fake:.2f}x with `fake_quant`" in README

    gemm = [r for r in _results("int8_gemm")["rows"] if r["shape"][0] == 256]
    xla, torch, ort = (_row(gemm, "case", c)["vs_own_float32"] for c in (
        "XLA int8 x int8 -> int32", "PyTorch torch._int_mm (int8 -> int32)",
        "ONNX Runtime MatMulInteger uint8 x int8"))
    assert f"| {xla:.2f}x (XLA:CPU) |" in README and f"{xla:.2f}x at 256 rows" in benchmarks
    assert f"| {torch:.2f}x (`torch._int_mm`) | {ort:.2f}x (`MatMulInteger`" in README

    minilm = _results("minilm")["rows"]
    for variant, text in [
            ("int8 per-channel, weight-only", "int8 per-channel cosine min {:.4f} / mean {:.4f}"),
            ("int8 per-channel, weight-only, GPTQ", "GPTQ {:.4f} / {:.4f}"),
            ("int8 per-channel, weight-only, GPTQ, Hadamard-rotated FFN input",
             "Hadamard-rotated **{:.4f} / {:.4f}**"),
            ("int4 block 32 packed, weight-only", "int4 block 32 min {:.3f} / mean {:.3f}"),
            ("int4 block 32 packed, weight-only, GPTQ", "(GPTQ {:.3f} / {:.3f}"),
            ("int4 block 32 packed with zero points, weight-only, QAT-distilled",
             "zero points {:.3f} / {:.3f}"),
            ("int4 block 32 packed with zero points, weight-only, GPTQ, Hadamard-rotated inputs",
             "Hadamard-rotated **{:.3f} / {:.3f}**")]:
        r = _row(minilm, "variant", variant)
        assert text.format(r["cosine_min"], r["cosine_mean"]) in benchmarks, variant

    tree = _results("quantize_tree")
    jaxquant, qwix = (_row(tree["cases"], "name", n) for n in (
        "jaxquant quantize_tree", "qwix quantize_params"))
    assert f"{tree['memory_ratio']:.4f}x the bytes" in benchmarks
    machine, short = (("Xeon", "Xeon") if "Xeon" in tree["machine"]["cpu"] else
                      ("AMD EPYC", "AMD"))
    assert (f"{jaxquant['ratio_to_same_maths']:.2f}x (2-core {machine}, {tree['date'][:10]})"
            in benchmarks)
    assert f"{jaxquant['ratio_to_plain']:.2f}x ({short})" in benchmarks
    assert f"{qwix['ratio_to_same_maths']:.2f}x ({short})" in benchmarks


def test_readme_inference_ratios_cover_the_results_file():
    """The int8 W+A and weight-only ratios quoted for the results file's runs include its
    own figures."""
    results = _results("inference_mlp")
    cases = results["cases"]
    hhmm = results["date"][11:16]
    row = re.search(r"^\| int8 W\+A inference vs float .*$", README, re.MULTILINE).group(0)
    lo, hi = map(float, re.search(rf"{hhmm}: ([\d.]+)-([\d.]+)x", row).groups())
    w8a8 = _row(cases, "case", "jaxquant int8 W+A (per-token act, per-channel weight)")
    assert lo <= round(w8a8["vs_float32"], 2) <= hi
    row = re.search(r"^\| weight-only int8 inference vs float .*$", README, re.MULTILINE).group(0)
    lo, hi = map(float, re.search(rf"{hhmm}: ([\d.]+)-([\d.]+)x", row).groups())
    int8 = _row(cases, "case", "jaxquant weight-only int8 (per-channel)")
    assert lo <= round(int8["vs_float32"], 2) <= hi


def test_notebook_02_prose_matches_its_outputs():
    """"one seed, the differences are thousandths of a bit per byte ... not as a ranking":
    the last printed deltas of the committed notebook are all below 0.01 bits per byte."""
    nb = json.loads((ROOT / "notebooks" / "02_qat_flax.ipynb").read_text(encoding="utf-8"))
    prose = "".join(s for c in nb["cells"] if c["cell_type"] == "markdown" for s in c["source"])
    assert "the differences are thousandths of a bit per byte" in prose
    text = "".join(s for c in nb["cells"] if c["cell_type"] == "code"
                   for o in c.get("outputs", []) for s in o.get("text", []))
    deltas = re.findall(r"^(linen|nnx) (\{.*\})$", text, re.MULTILINE)
    assert [m for m, _ in deltas] == ["linen", "nnx"]
    for _, d in deltas:
        delta = {k: float(v) for k, v in ast.literal_eval(d).items()}
        assert all(abs(v) < 0.01 for v in delta.values()) and delta["float32"] == 0, delta


@pytest.mark.parametrize("name", ["01_quickstart", "02_qat_flax", "03_convert_checkpoint",
                                  "04_pretrained_minilm"])
def test_notebook_markdown_is_its_source(name):
    """A committed notebook's markdown is that of its source (edited prose was rebuilt)."""
    import sys

    pytest.importorskip("nbformat")
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        import _build
    finally:
        sys.path.remove(str(ROOT / "notebooks"))
    source = (ROOT / "notebooks" / "src" / f"{name}.py").read_text(encoding="utf-8")
    built = _build.cells_from_source(source)
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))
    assert [c["cell_type"] for c in nb["cells"]] == [c.cell_type for c in built]
    for cell, want in zip(nb["cells"], built, strict=True):
        assert "".join(cell["source"]) == want.source, (name, want.source[:80])
