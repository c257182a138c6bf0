"""The command line on hostile input: one-line errors, no traceback, nothing lost or mislabelled."""

import errno
import io
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from cli_checks import one_error as _one_error

import jaxquant as jq
from jaxquant import _cli, _demo

safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.safetensors"
    rng = np.random.default_rng(1)
    safetensors_numpy.save_file({"w": rng.standard_normal((8, 16)).astype(np.float32),
                                 "ids": np.arange(6, dtype=np.int64).reshape(2, 3)}, str(path))
    return str(path)


def test_regex_that_re_cannot_compile_is_a_usage_error(src, tmp_path, capsys):
    """`re` raises OverflowError, not re.error, for a repetition count over 2**32."""
    with pytest.raises(ValueError, match=r"invalid regular expression 'a\{99999999999\}'"):
        _cli.parse_rule("a{99999999999}=int8")
    dst = str(tmp_path / "out.safetensors")
    assert _cli.main(["quantize", src, dst, "--quiet", "--rules", "w{1,99999999999}=int8"]) == 2
    _one_error(capsys, "quantize", r"--rules: rule 'w\{1,99999999999\}=int8': invalid regular "
                                   r"expression 'w\{1,99999999999\}': .")
    assert not os.path.exists(dst)


def test_input_that_cannot_be_read_is_a_one_line_error(src, tmp_path, capsys, monkeypatch):
    dst = str(tmp_path / "out.safetensors")
    assert _cli.main(["report", str(tmp_path)]) == 1
    _one_error(capsys, "report", rf"{re.escape(str(tmp_path))}: is a directory, not a file")
    assert _cli.main(["quantize", str(tmp_path), dst]) == 1
    _one_error(capsys, "quantize", "is a directory, not a file")

    import safetensors

    def denied(path, *args, **kwargs):  # what an unreadable file gives (tests may run as root)
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(safetensors, "safe_open", denied)
    assert _cli.main(["quantize", src, dst, "--quiet"]) == 1
    _one_error(capsys, "quantize", rf"{re.escape(src)}: cannot read: Permission denied$")
    assert _cli.main(["report", src]) == 1
    _one_error(capsys, "report", rf"{re.escape(src)}: cannot read: Permission denied$")
    assert not os.path.exists(dst)


def test_out_that_is_a_directory_is_refused_before_any_work(src, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_cli, "_load", lambda path: pytest.fail("read IN before checking OUT"))
    (tmp_path / "d").mkdir()
    for out in (str(tmp_path / "d"), str(tmp_path / "d") + os.sep, str(tmp_path / "new") + os.sep,
                ""):
        assert _cli.main(["quantize", src, out, "--quiet"]) == 1, out
        _one_error(capsys, "quantize", r"cannot write: .*(is a directory|not a file name)")
    assert os.listdir(tmp_path / "d") == [] and not os.path.exists(tmp_path / "new")


def test_failed_run_keeps_an_existing_out_and_leaves_no_temporary(src, tmp_path, capsys,
                                                                  monkeypatch):
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"previous")
    assert _cli.main(["quantize", src, str(dst), "--quiet", "--rules", "w=int8:axis=2"]) == 2
    _one_error(capsys, "quantize", r"cannot quantize tensor 'w'")

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_cli, "_apply", interrupt)
    assert _cli.main(["quantize", src, str(dst)]) == 130  # 128 + SIGINT, as a shell reports
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == "jaxquant quantize: interrupted", err
    assert "Traceback" not in err
    assert dst.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors", "out.safetensors"]


def test_closed_pipe_on_stdout_ends_quietly(src, tmp_path, capsys, monkeypatch):
    """``jaxquant report big.safetensors | head -1``: no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    pipe = open(write_end, "w")  # noqa: SIM115 - closed below
    monkeypatch.setattr(sys, "stdout", pipe)
    try:
        assert _cli.main(["report", src]) == 1
    finally:
        pipe.close()  # the pipe's descriptor now points at /dev/null: closing cannot fail
    assert capsys.readouterr().err == ""


def test_stdout_that_cannot_be_written_is_a_one_line_error(src, capsys, monkeypatch):
    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    assert _cli.main(["report", src]) == 1
    err = capsys.readouterr().err
    assert err == "jaxquant report: error: cannot write to standard output: " \
                  "No space left on device\n", err


def test_rule_warnings_say_why_a_rule_took_nothing(tmp_path, capsys):
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    q = str(tmp_path / "q.safetensors")
    safetensors_numpy.save_file({"a.weight": np.ones((4, 4), np.float32),
                                 "b.weight": np.ones((4, 4), np.float32)}, src)
    # 'a.weight' matches, but the rule before it took every tensor it matches
    assert _cli.main(["quantize", src, q, "--quiet", "--rules", "weight=int8", "a.weight=int4",
                      "bias=none"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "jaxquant: warning: rule 'a.weight' matches only tensors that an earlier rule takes",
        "jaxquant: warning: rule 'bias' matches no tensor"]
    # tensors that are already QTensors are kept, and the warning says so
    assert _cli.main(["quantize", q, dst, "--quiet", "--rules", "a=int4", "b=none"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "jaxquant: warning: rule 'a' matches only tensors that are already quantized "
        "(kept as they are)"]
    assert jq.load_safetensors(dst)["a.weight"].dtype == jnp.float32
    assert jq.load_safetensors(dst)["a.weight"].qvalue.dtype == jnp.int8


def test_a_per_axis_rule_that_takes_1d_tensors_warns_that_they_grow(tmp_path, capsys):
    """'weight=int8:axis=0' (the README's rule) also took LayerNorm weights, one scale per
    element, 1.25x their float bytes, silently; an earlier 'ln_=none' rule exempts them."""
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    safetensors_numpy.save_file({"h.0.mlp.weight": np.ones((8, 32), np.float32),
                                 "h.0.ln_1.weight": np.ones(32, np.float32)}, src)
    assert _cli.main(["quantize", src, dst, "--quiet", "--rules", "weight=int8:axis=0"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "jaxquant: warning: rule 'weight' gives 1 1-D tensor(s) ('h.0.ln_1.weight'...) one "
        "scale per element (axis=0), larger than they were: exempt them with an earlier rule "
        "(e.g. 'ln_|norm=none') or use axis=none"]
    assert jq.load_safetensors(dst)["h.0.ln_1.weight"].nbytes > 32 * 4  # the warning is true
    for i, rules in enumerate((["ln_=none", "weight=int8:axis=0"],
                               ["weight=int8:axis=0:block=8"], ["weight=int8:axis=none"],
                               # formats with blocks of their own: no scale per element
                               ["weight=nvfp4"], ["weight=nf4"], ["weight=mxfp4"])):
        assert _cli.main(["quantize", src, str(tmp_path / f"o{i}"), "--quiet",
                          "--rules", *rules]) == 0, rules
        assert capsys.readouterr().err == "", rules


@pytest.mark.parametrize("spec", ["int8:scale=bfloat16", "int8:scale=float8_e8m0fnu",
                                  "int4:packed:dq", "float8_e4m3fn:scale=float8_e4m3fn"])
def test_a_per_axis_rule_whose_1d_tensors_shrink_does_not_warn(tmp_path, capsys, spec):
    """The "larger than they were" warning fired for any per-axis rule on a 1-D tensor,
    also where narrow scales make it smaller (int8 with bfloat16 scales: 0.75x)."""
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    safetensors_numpy.save_file({"ln.weight": np.linspace(-1, 1, 384, dtype=np.float32)}, src)
    assert _cli.main(["quantize", src, dst, "--quiet", "--rules", f"weight={spec}"]) == 0
    assert capsys.readouterr().err == ""
    assert jq.tree_nbytes(jq.load_safetensors(dst)) < 384 * 4  # no warning: it did shrink


def test_report_numbers_match_numpy(tmp_path, capsys):
    """Bytes, SQNR and largest error of every dtype and shape, recomputed in float64."""
    rng = np.random.default_rng(2)
    tensors = {"f32": rng.standard_normal((8, 32)).astype(np.float32) * 1e-3,
               "bf16": rng.standard_normal((4, 32)).astype(jnp.bfloat16),
               "f16": (rng.standard_normal((16, 8)) * 100).astype(np.float16),
               "empty": np.zeros((0, 8), np.float32), "scalar": np.array(3.0, np.float32),
               "mask": np.ones((3, 3), bool), "ids": np.arange(12, dtype=np.int32).reshape(3, 4)}
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    safetensors_numpy.save_file(tensors, src)
    rules = ["scalar=none", "f32=int4:axis=0:block=8:packed", "bf16=float8_e4m3fn", "f16=nf4:packed", ".=int8"]
    assert _cli.main(["quantize", src, dst, "--quiet", "--rules", *rules]) == 0
    quantized = capsys.readouterr().out.splitlines()[:-1]  # less "wrote OUT"
    assert _cli.main(["report", src, dst]) == 0
    reported = capsys.readouterr().out.splitlines()
    assert reported == quantized
    rows = {ln.split()[0]: ln for ln in reported[2:-2]}
    assert set(rows) == set(tensors)
    q = jq.load_safetensors(dst)
    for name, x in tensors.items():
        cells = rows[name].split()
        before, after = x.nbytes, (q[name].nbytes if jq.is_qtensor(q[name]) else x.nbytes)
        assert cells[-5:-3] == [f"{before:,}", f"{after:,}"], rows[name]
        if not jq.is_qtensor(q[name]) or x.size == 0:
            continue
        ref = x.astype(np.float64)
        err = ref - np.asarray(jq.dequantize(q[name], jnp.float32), np.float64)
        sqnr = 10 * np.log10(np.sum(ref ** 2) / np.sum(err ** 2))
        assert float(cells[-2]) == pytest.approx(sqnr, abs=0.051), rows[name]
        assert float(cells[-1]) == pytest.approx(np.abs(err).max(), rel=5e-3), rows[name]
    assert rows["f32"].split()[3:6] == ["int4(packed)", "axis=0", "block=8"]
    assert rows["scalar"].split()[2:4] == ["-", "-"] and rows["empty"].split()[3] == "int8"
    total = reported[-1].split()
    assert total[1:3] == [f"{sum(x.nbytes for x in tensors.values()):,}",
                          f"{jq.tree_nbytes(q):,}"]


def test_help_of_every_command(capsys):
    for argv, words in ((["--help"], ("quantize", "report", "demo")),
                        (["report", "--help"], ("IN", "OUT", "quantized")),
                        (["demo", "--help"], ("--steps", "--quiet"))):
        with pytest.raises(SystemExit) as e:
            _cli.main(argv)
        assert e.value.code == 0
        out, err = capsys.readouterr()
        assert err == "" and all(w in out for w in words), (argv, out)


def test_demo_without_a_corpus_is_a_one_line_error(monkeypatch, capsys):
    def no_corpus(*args, **kwargs):
        raise RuntimeError("no Python sources found under /nowhere")

    monkeypatch.setattr(_demo, "load_corpus", no_corpus)
    assert _cli.main(["demo", "--steps", "1", "--quiet"]) == 1
    _one_error(capsys, "demo", r"no Python sources found under /nowhere$")


def test_progress_bar_is_not_redrawn_for_every_tensor(tmp_path, capsys):
    """A checkpoint of thousands of tensors must not write thousands of bars to a log: the
    tensor's name rides along with tqdm's rate-limited redraws (every 0.1 s at most)."""
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    n = 40
    safetensors_numpy.save_file({f"t{i:02}": np.full((2, 4), i, np.float32) for i in range(n)},
                                src)
    assert _cli.main(["quantize", src, dst]) == 0
    out, err = capsys.readouterr()
    bars = err[:err.index("saving:")]
    assert re.search(rf"quantize: 100%\|[^\r\n|]*\| {n}/{n} .*t{n - 1}\]", bars), bars
    assert bars.count("quantize:") < n // 2, bars  # one per tensor before
    assert "%|" not in out and out.splitlines()[-1] == f"wrote {dst}"


@pytest.mark.parametrize("text,message", [
    ("int8:axis=0:axis=1", r"'axis=1' in 'int8:axis=0:axis=1' repeats an option"),
    ("int8:block=32:tile=4x4", r"'tile=4x4' in 'int8:block=32:tile=4x4': block= and tile= "
                               r"exclude each other"),
    ("int8:tile=4x4:block=32", r"block= and tile= exclude each other"),
    ("int8:tile=2x2:axis=0", r"'axis=0' in 'int8:tile=2x2:axis=0': tile= takes no axis="),
    ("int8:axis=none:tile=2x2", r"tile= takes no axis="),
    ("mxfp4:scale=float16:scale=bfloat16", r"'scale=bfloat16' .* repeats an option"),
    ("nf4:packed:dq:packed", r"'packed' in 'nf4:packed:dq:packed' repeats an option"),
])
def test_repeated_or_conflicting_options_are_refused(text, message):
    """The last of two values must not silently win, nor tile= silently drop block= or axis=."""
    with pytest.raises(ValueError, match=message):
        _cli.parse_spec(text)


def test_closed_stderr_neither_crashes_nor_leaks_into_stdout(src, tmp_path, capsys, monkeypatch):
    """``jaxquant quantize IN OUT 2>&-`` (Python sets sys.stderr to None): no bars, no
    warnings on stdout, the file written."""
    dst = str(tmp_path / "out.safetensors")
    monkeypatch.setattr(sys, "stderr", None)
    assert _cli.main(["quantize", src, dst, "--rules", "w=int8", "typo=int4"]) == 0
    assert _cli.main(["report", str(tmp_path / "missing.safetensors")]) == 1
    monkeypatch.undo()
    out, err = capsys.readouterr()
    assert "warning" not in out and "error" not in out and "%|" not in out, out
    assert out.splitlines()[-1] == f"wrote {dst}" and err == ""
    assert jq.is_qtensor(jq.load_safetensors(dst)["w"])


def test_quantize_keeps_the_input_files_metadata(tmp_path):
    """A checkpoint's own __metadata__ (a torch file's "format", a model name) goes into OUT
    beside jaxquant's header; re-quantizing a jaxquant file keeps its user entries too."""
    sn = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open

    src, dst, again = (str(tmp_path / n) for n in ("in.safetensors", "q.safetensors",
                                                    "q2.safetensors"))
    sn.save_file({"w": np.ones((4, 8), np.float32)}, src, metadata={"format": "pt", "m": "x"})
    assert _cli.main(["quantize", src, dst, "--quiet"]) == 0
    with safe_open(dst, "np") as f:
        meta = f.metadata()
    assert {k: meta[k] for k in ("format", "m")} == {"format": "pt", "m": "x"}
    assert jq.is_qtensor(jq.load_safetensors(dst)["w"])
    assert _cli.main(["quantize", dst, again, "--quiet", "--rules", "w=int4"]) == 0
    with safe_open(again, "np") as f:
        assert {k: f.metadata()[k] for k in ("format", "m")} == {"format": "pt", "m": "x"}


def test_an_output_with_a_long_file_name_is_written(tmp_path):
    """The temporary file beside OUT has a short name of its own (OUT's name plus a suffix
    passed the file system's 255-byte limit)."""
    sn = pytest.importorskip("safetensors.numpy")
    src = str(tmp_path / "in.safetensors")
    sn.save_file({"w": np.ones((4, 8), np.float32)}, src)
    dst = str(tmp_path / ("o" * 235 + ".safetensors"))  # 247 bytes: a valid name
    assert _cli.main(["quantize", src, dst, "--quiet"]) == 0
    assert jq.is_qtensor(jq.load_safetensors(dst)["w"])
    assert sorted(os.listdir(tmp_path)) == sorted(["in.safetensors", os.path.basename(dst)])
