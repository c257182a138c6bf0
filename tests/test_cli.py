"""The command line: `quantize` writes what `quantize_tree` makes, `report`, `demo`."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_env import full_speed_env

import jaxquant as jq
from jaxquant import _cli, _demo
from jaxquant._report import quantization_report

# A child process must not wait for GPU memory that this test process preallocated.
ENV = full_speed_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")


def test_demo_table_runs_quantized_model():
    out = subprocess.run([sys.executable, "-m", "jaxquant", "demo", "--steps", "150"],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    out = out.stdout
    names = {(fmt, gran) for fmt, gran, _ in _demo.CONFIGS}
    rows = {}
    for line in out.splitlines():
        key = (line[:14].strip(), line[15:27].strip())
        if key in names:
            rows[key] = line[27:].split()
    assert set(rows) == names, out
    loss = {k: float(v[-2]) for k, v in rows.items()}
    acc = {k: float(v[-1]) for k, v in rows.items()}
    ratio = {k: float(v[1]) for k, v in rows.items()}
    base = loss[("float32", "-")]
    assert abs(loss[("int8", "per-channel")] - base) < 0.01 * base
    assert abs(loss[("int8 W8A8", "per-channel")] - base) < 0.01 * base
    assert loss[("int2", "block 16")] > loss[("int4", "block 32")] > base
    assert acc[("int2", "block 16")] < acc[("float32", "-")] - 5 and acc[("float32", "-")] > 30
    # GPTQ: the same int2 codes' bytes, rounding errors compensated on training inputs
    assert ratio[("int2 GPTQ", "block 16")] == ratio[("int2", "block 16")]
    assert base < loss[("int2 GPTQ", "block 16")] < loss[("int2", "block 16")] - 0.1
    assert 0.25 < ratio[("int8", "per-channel")] < 0.26
    assert ratio[("int8 W8A8", "per-channel")] == ratio[("int8", "per-channel")]
    assert 0.12 < ratio[("int4", "per-channel")] < 0.135
    for low_bit in (("nf4", "block 64"), ("nvfp4", "block 16"), ("mxfp4", "block 32")):
        assert ratio[low_bit] < 0.16 and loss[low_bit] < loss[("int2", "block 16")]
    # the per-leaf report of the int4 tree
    report = out[out.index("per-leaf report"):].splitlines()
    kernel = next(ln for ln in report if ln.startswith("dense_0/kernel")).split()
    assert kernel[3:6] == ["int4(packed)", "axis=0", "block=32"]
    assert next(ln for ln in report if ln.startswith("total")).split()[-1] == \
        f"{ratio[('int4', 'block 32')]:.3f}"


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["demo", "--steps", "0"])
    assert e.value.code == 2
    assert "--steps must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli.main([])


# --- quantize / report ------------------------------------------------------------------


def _write_plain(path):
    """A small plain safetensors file, as a PyTorch / Hugging Face checkpoint would be."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    tensors = {"h.0.attn.c_attn.weight": rng.standard_normal((32, 96)).astype(np.float32),
               "h.0.attn.c_attn.bias": rng.standard_normal(96).astype(np.float32),
               "h.0.mlp.c_fc.weight": rng.standard_normal((32, 64)).astype(np.float16),
               "wte.weight": rng.standard_normal((50, 32)).astype(np.float32),
               "position_ids": np.arange(8, dtype=np.int32)}
    safetensors_numpy.save_file(tensors, str(path))
    return tensors


RULES = ["c_fc=int4:axis=0:block=16:packed", "wte=none", "weight=uint8:axis=0:asym"]


def _assert_bit_equal(a, b):
    la, lb = (jax.tree_util.tree_leaves_with_path(t, is_leaf=jq.is_qtensor) for t in (a, b))
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        assert type(x) is type(y), path
        if jq.is_qtensor(x):
            assert (x.axis, x.block_size, x.dtype, x.packed) == (y.axis, y.block_size, y.dtype,
                                                                  y.packed)
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape, path
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_quantize_file_to_low_bit_formats(tmp_path, capsys):
    _write_plain(tmp_path / "in.safetensors")
    rules = ["c_fc=nf4:packed:dq", "c_proj=nvfp4:packed", "c_attn=mxfp4:packed"]
    assert _cli.main(["quantize", str(tmp_path / "in.safetensors"),
                      str(tmp_path / "out.safetensors"), "--quiet", "--rules", *rules]) == 0
    out, _ = capsys.readouterr()
    tree = jq.load_safetensors(tmp_path / "in.safetensors", allow_plain=True)
    want = jq.quantize_tree(tree, [_cli.parse_rule(r) for r in rules])
    _assert_bit_equal(jq.load_safetensors(tmp_path / "out.safetensors"), want)
    table = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:-3]}
    assert table["h.0.mlp.c_fc.weight"][3] == "nf4(packed)"
    assert table["h.0.attn.c_attn.weight"][3] == "mxfp4(packed)"


@pytest.mark.parametrize("rules", [RULES, None], ids=["rules", "default"])
def test_quantize_file_equals_quantize_tree(tmp_path, capsys, rules):
    _write_plain(tmp_path / "in.safetensors")
    args = ["quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
            "--quiet"]
    assert _cli.main(args + (["--rules", *rules] if rules else [])) == 0
    out, err = capsys.readouterr()
    assert err == ""  # --quiet: no progress bar
    tree = jq.load_safetensors(tmp_path / "in.safetensors", allow_plain=True)
    want = jq.quantize_tree(tree, rules and [_cli.parse_rule(r) for r in rules])
    got = jq.load_safetensors(tmp_path / "out.safetensors")
    _assert_bit_equal(got, want)
    table = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:-3]}
    assert set(table) == set(tree)
    if rules:
        assert table["h.0.mlp.c_fc.weight"][3:6] == ["int4(packed)", "axis=0", "block=16"]
        assert table["h.0.attn.c_attn.weight"][3:5] == ["uint8", "axis=0"]
        assert got["h.0.attn.c_attn.weight"].zero_point is not None
        assert table["wte.weight"][3] == "-"
    else:
        assert table["wte.weight"][3:5] == ["int8", "axis=1"]
    assert out.splitlines()[-1] == f"wrote {tmp_path / 'out.safetensors'}"
    total = out.splitlines()[-2].split()
    assert total[:3] == ["total", f"{jq.tree_nbytes(tree):,}", f"{jq.tree_nbytes(want):,}"]


def test_report_of_a_file_and_of_in_vs_out(tmp_path, capsys):
    _write_plain(tmp_path / "in.safetensors")
    assert _cli.main(["quantize", str(tmp_path / "in.safetensors"),
                      str(tmp_path / "out.safetensors"), "--quiet", "--rules", *RULES]) == 0
    capsys.readouterr()
    assert _cli.main(["report", str(tmp_path / "out.safetensors")]) == 0
    alone = capsys.readouterr().out.splitlines()
    row = next(ln for ln in alone if ln.startswith("h.0.mlp.c_fc.weight")).split()
    assert row[-2:] == ["-", "-"] and row[-5] == f"{32 * 64 * 2:,}"  # float16 before
    assert _cli.main(["report", str(tmp_path / "in.safetensors"),
                      str(tmp_path / "out.safetensors")]) == 0
    both = capsys.readouterr().out.splitlines()
    tree = jq.load_safetensors(tmp_path / "in.safetensors", allow_plain=True)
    rows = quantization_report(tree, jq.load_safetensors(tmp_path / "out.safetensors"))
    for r in rows:
        cells = next(ln for ln in both if ln.startswith(r.path + " ")).split()
        assert cells[-2] == ("-" if not r.quantized else f"{r.sqnr_db:.1f}")
        if r.quantized:
            assert 15 < r.sqnr_db < 60
    assert both[-1].split()[0] == "total"


def test_quantize_and_report_errors_are_one_line(tmp_path, capsys):
    _write_plain(tmp_path / "in.safetensors")
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    cases = [
        (["quantize", str(tmp_path / "nope.safetensors"), dst], 1, "nope.safetensors: no such file"),
        (["quantize", src, dst, "--rules", "kernel"], 2, "must be REGEX=SPEC"),
        (["quantize", src, dst, "--rules", "w=int9"], 2, "unknown format 'int9'"),
        (["quantize", src, dst, "--rules", "w=int8:block=x"], 2, "'block=x' in 'int8:block=x' needs an integer"),
        (["quantize", src, dst, "--rules", "w=int8:block=1_6"], 2, "'block=1_6' in 'int8:block=1_6' needs an integer"),
        (["quantize", src, dst, "--rules", "w=int8:axis=\u0663"], 2, "needs an integer, got '\u0663'"),
        (["quantize", src, dst, "--rules", "w=int8:packed"], 2, "packed=True needs a 2-, 4- or 6-bit format"),
        (["quantize", src, dst, "--rules", "(=int8"], 2, "invalid regular expression '\\('"),
        (["quantize", src, str(tmp_path / "no" / "dir.safetensors")], 1, "cannot write"),
        (["report", str(tmp_path / "bad.safetensors")], 1, "not a valid safetensors file"),
        (["report", src, str(tmp_path / "other.safetensors")], 1, "same leaf paths"),
    ]
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    jq.save_safetensors(tmp_path / "other.safetensors", {"w": np.ones((2, 2), np.float32)})
    for argv, status, message in cases:
        assert _cli.main(argv) == status, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, (argv, err)
        assert err.startswith(f"jaxquant {argv[0]}: error: ") and re.search(message, err), err
    assert not (tmp_path / "out.safetensors").exists()


def test_rule_that_does_not_fit_a_tensor_is_a_one_line_usage_error(tmp_path, capsys):
    """A rule that parses but fails on the tensor it matches names that tensor, exit 2."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    _write_plain(tmp_path / "in.safetensors")
    safetensors_numpy.save_file({"s": np.full((), 2.0, np.float32)},
                                str(tmp_path / "scalar.safetensors"))
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    cases = [
        (src, "c_attn.weight=int8:axis=5",
         r"cannot quantize tensor 'h.0.attn.c_attn.weight' \(float32\[32, 96\]\) as its "
         r"rule says: axis must be in"),
        (src, ".*=int8:tile=2x2", r"tensor 'h.0.attn.c_attn.bias' \(float32\[96\]\) as its "
                                  r"rule says: block_size must have one tile length per axis"),
        (str(tmp_path / "scalar.safetensors"), ".=int8",
         r"tensor 's' \(float32\[\]\) as its rule says: axis must be in \[0, 0\)"),
        (src, "weight=nf4:asym", r"symmetric=False needs an integer format .a zero point.; nf4 "),
    ]
    for file, rule, message in cases:
        assert _cli.main(["quantize", file, dst, "--quiet", "--rules", rule]) == 2, rule
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, (rule, err)
        assert err.startswith("jaxquant quantize: error: ") and re.search(message, err), err
    assert not os.path.exists(dst)


def test_quantize_refuses_to_overwrite_its_input(tmp_path, capsys):
    _write_plain(tmp_path / "in.safetensors")
    src = str(tmp_path / "in.safetensors")
    before = (tmp_path / "in.safetensors").read_bytes()
    os.link(src, tmp_path / "link.safetensors")
    for out_path in (src, os.path.join(str(tmp_path), ".", "in.safetensors"),
                     str(tmp_path / "link.safetensors")):
        assert _cli.main(["quantize", src, out_path, "--quiet"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert "is the input file IN" in err and "give OUT another path" in err, err
    assert (tmp_path / "in.safetensors").read_bytes() == before


def test_malformed_header_is_a_one_line_error(tmp_path, capsys):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from jaxquant._serialization import encode, header_metadata

    header, tensors = encode({"w": jq.quantize(jnp.ones((2, 4)), axis=1)}, to_host=True)
    del header["leaves"]["w"]["axis"]
    path = str(tmp_path / "q.safetensors")
    safetensors_numpy.save_file(tensors, path, metadata=header_metadata(header, None))
    for argv in (["report", path], ["quantize", path, str(tmp_path / "o.safetensors"), "--quiet"]):
        assert _cli.main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert "malformed jaxquant header: the QTensor entry 'w' lacks 'axis'" in err, err


def test_damaged_header_key_is_a_corrupted_file_not_a_plain_one(tmp_path, capsys):
    """The command line reads plain files too; a jaxquant file whose 'jaxquant' metadata key
    lost a bit is refused, not read as the plain tensors w/qvalue and w/scale."""
    path = str(tmp_path / "q.safetensors")
    jq.save_safetensors(path, {"w": jq.quantize(jnp.ones((2, 4)), dtype=jnp.int4, axis=1)})
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[raw.index(b'"jaxquant":') + 1] ^= 0x01
    with open(path, "wb") as f:
        f.write(raw)
    for argv in (["report", path], ["quantize", path, str(tmp_path / "o.safetensors"), "--quiet"]):
        assert _cli.main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert "corrupted jaxquant metadata" in err, err
    assert not os.path.exists(tmp_path / "o.safetensors")


@pytest.mark.parametrize("text,spec", [
    ("int8", jq.QuantSpec()),
    ("int8:axis=0", jq.QuantSpec(axis=0)),
    ("int8:axis=none", jq.QuantSpec(axis=None)),
    ("int4:block=32:packed", jq.QuantSpec(dtype=jnp.int4, block_size=32, packed=True)),
    ("uint8:asym", jq.QuantSpec(dtype=jnp.uint8, symmetric=False)),
    ("float8_e4m3fn:nosaturate", jq.QuantSpec(dtype=jnp.float8_e4m3fn, saturate=False)),
    ("float4_e2m1fn:axis=0:block=32:packed",
     jq.QuantSpec(dtype=jnp.float4_e2m1fn, axis=0, block_size=32, packed=True)),
    ("nf4:packed:dq", jq.QuantSpec(dtype="nf4", packed=True, double_quant=True)),
    ("mxfp4:packed:round=ceil", jq.QuantSpec(dtype="mxfp4", packed=True, scale_rounding="ceil")),
    ("nvfp4", jq.QuantSpec(dtype="nvfp4")),
    ("int8:tile=128x64", jq.QuantSpec(axis=None, block_size=(128, 64))),
    ("nf4:tile=4x64:packed", jq.QuantSpec(dtype="nf4", axis=None, block_size=(4, 64), packed=True)),
    ("int8:scale=bfloat16", jq.QuantSpec(scale_dtype=jnp.bfloat16)),
    ("none", None),
])
def test_parse_spec(text, spec):
    assert _cli.parse_spec(text) == spec


@pytest.mark.parametrize("text,message", [
    ("int9", r"unknown format 'int9' in 'int9'; expected none or one of int2, "),
    ("none:axis=0", r"'none:axis=0': 'none' \(keep the tensor\) takes no options"),
    ("int8:axis=", r"'axis=' in 'int8:axis=' needs a value"),
    ("int8:axis=one", r"'axis=one' in 'int8:axis=one' needs an integer, got 'one'"),
    ("int8:block=0", r"'int8:block=0': block_size must be a positive integer, got 0"),
    ("int8:axis=none:block=4", r"block_size requires axis"),
    ("mxfp4:block=16", r"mxfp4 has blocks of 32"),
    ("mxfp4:round=up", r"scale_rounding must be"),
    ("int8:scale=int8", r"scale_dtype must be one of"),
    ("nf4:asym", r"'nf4:asym': symmetric=False needs an integer format .a zero point.; nf4 is a "
                 r"codebook format"),
    ("float8_e4m3fn:asym", r"symmetric=False needs an integer format"),
    ("mxfp4:tile=4x8", r"mxfp4 has blocks of 32"),
])
def test_parse_spec_errors(text, message):
    with pytest.raises(ValueError, match=message):
        _cli.parse_spec(text)


def test_parse_rule_splits_at_first_equals():
    assert _cli.parse_rule("a|b=int8:axis=0") == ("a|b", jq.QuantSpec(axis=0))
    with pytest.raises(ValueError, match=r"rule 'kernel' must be REGEX=SPEC"):
        _cli.parse_rule("kernel")
    with pytest.raises(ValueError, match=r"rule '\[=int8': invalid regular expression '\['"):
        _cli.parse_rule("[=int8")


def test_help_documents_the_rule_grammar(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["quantize", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for text in ("REGEX=SPEC", "int4:block=32:packed", "axis=none", "nosaturate", "asym",
                 "float8_e4m3fn", "--quiet"):
        assert text in out


def test_quantize_subprocess_with_progress_bar(tmp_path):
    tensors = _write_plain(tmp_path / "in.safetensors")
    res = subprocess.run([sys.executable, "-m", "jaxquant", "quantize",
                          str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
                          "--rules", *RULES], capture_output=True, text=True, timeout=120,
                         env=ENV)
    assert res.returncode == 0, res.stderr
    assert "quantize: 100%" in res.stderr and "2/2" in res.stderr  # tqdm, over two tensors
    got = jq.load_safetensors(tmp_path / "out.safetensors")
    _assert_bit_equal(got, jq.quantize_tree({k: jnp.asarray(v) for k, v in tensors.items()},
                                            [_cli.parse_rule(r) for r in RULES]))
    bad = subprocess.run([sys.executable, "-m", "jaxquant", "report",
                          str(tmp_path / "missing.safetensors")],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        f"jaxquant report: error: {tmp_path / 'missing.safetensors'}: no such file"]


def test_rules_that_quantize_nothing_are_warned_about(tmp_path, capsys):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    safetensors_numpy.save_file({"ids": np.arange(8, dtype=np.int32).reshape(2, 4),
                                 "w": np.ones((4, 4), np.float32)}, src)
    assert _cli.main(["quantize", src, dst, "--quiet", "--rules", "ids=int8", "wq=int8",
                      "w=int8"]) == 0
    _, err = capsys.readouterr()
    assert err.splitlines() == [
        "jaxquant: warning: rule 'wq' matches no tensor",
        "jaxquant: warning: rule 'ids' matches only tensors that are not float (kept as they are)"]
    assert jq.is_qtensor(jq.load_safetensors(dst)["w"])


def test_out_of_range_numbers_in_rules_are_usage_errors(tmp_path, capsys):
    _write_plain(tmp_path / "in.safetensors")
    args = ["quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
            "--quiet", "--rules", "weight=int8:block=99999999999999999999"]
    assert _cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "99999999999999999999 is out of range" in err
