"""The command line as a demanding user meets it: --version, hints for typos, OUT that is a
link or a pipe, device errors as one line, and a demo that measures what it says."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_checks import one_error as _one_error
from xla_env import full_speed_env

import jaxquant as jq
from jaxquant import _cli, _demo

safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.safetensors"
    rng = np.random.default_rng(3)
    safetensors_numpy.save_file({"w": rng.standard_normal((8, 16)).astype(np.float32)}, str(path))
    return str(path)


def test_version_in_process_and_from_python_m(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"jaxquant {jq.__version__}\n"
    env = full_speed_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")
    res = subprocess.run([sys.executable, "-m", "jaxquant", "--version"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert (res.returncode, res.stdout) == (0, f"jaxquant {jq.__version__}\n"), res.stderr


def test_help_says_how_out_is_replaced_and_what_the_exit_statuses_are(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["quantize", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "An existing OUT is replaced" in out and "temporary name" in out
    assert "Exit status: 0 done, 1 " in out and "2 bad arguments" in out


@pytest.mark.parametrize("text,message", [
    ("INT8", r"unknown format 'INT8' in 'INT8'; expected none or one of .* \(did you mean "
             r"'int8'\?\)\.$"),
    ("float8_e4m3", r"\(did you mean 'float8_e4m3fn'\?\)"),
    ("nf4:pakced", r"unknown option 'pakced' in 'nf4:pakced'; .* \(did you mean 'packed'\?\)"),
    ("int8:axs=0", r"unknown option 'axs=0' .* \(did you mean 'axis'\?\)"),
    ("int8:zzz", r"or stacked=INT\.$"),  # nothing close: no hint
    ("none:axis=0", r"'none:axis=0': 'none' \(keep the tensor\) takes no options, got 'axis=0'"),
    ("int8:axis=", r"'axis=' in 'int8:axis=' needs a value after '=', for example 'axis=0'"),
    ("int4:block=:packed", r"'block=' in 'int4:block=:packed' needs a value"),
    # a valued option with no '=' at all is not "unknown" (and no "did you mean" itself)
    ("int8:axis", r"^'axis' in 'int8:axis' needs a value, for example 'axis=0'\.$"),
    ("int4:block:packed", r"^'block' in 'int4:block:packed' needs a value, for example"),
    ("int8:scale", r"^'scale' in 'int8:scale' needs a value, for example 'scale=bfloat16'"),
])
def test_spec_errors_say_what_was_meant(text, message):
    with pytest.raises(ValueError, match=message):
        _cli.parse_spec(text)


def test_out_that_is_a_link_keeps_the_link_and_gets_the_new_file(src, tmp_path, capsys):
    store = tmp_path / "store"
    store.mkdir()
    (store / "q.safetensors").write_bytes(b"previous")
    link = tmp_path / "q.safetensors"
    link.symlink_to(os.path.join("store", "q.safetensors"))  # relative, as `ln -s` makes
    assert _cli.main(["quantize", src, str(link), "--quiet", "--rules", "w=int8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {link}"
    assert link.is_symlink() and sorted(os.listdir(store)) == ["q.safetensors"]
    assert jq.is_qtensor(jq.load_safetensors(store / "q.safetensors")["w"])


def test_out_that_links_to_in_through_a_relative_path_is_refused(src, tmp_path, capsys,
                                                                 monkeypatch):
    before = Path(src).read_bytes()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "link.safetensors").symlink_to(os.path.join("..", "in.safetensors"))
    monkeypatch.chdir(tmp_path / "sub")
    for out in ("link.safetensors", os.path.join("..", "sub", "..", "in.safetensors")):
        assert _cli.main(["quantize", "../in.safetensors", out, "--quiet"]) == 2
        _one_error(capsys, "quantize", r"is the input file IN '\.\./in\.safetensors'")
    assert Path(src).read_bytes() == before


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are a POSIX feature")
def test_pipe_as_out_or_in_is_refused_and_kept(src, tmp_path, capsys, monkeypatch):
    """os.replace would put a regular file in place of a pipe (or, for root, of /dev/null)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(_cli, "_load", lambda path: pytest.fail("read IN before checking OUT"))
    assert _cli.main(["quantize", src, str(fifo), "--quiet"]) == 1
    _one_error(capsys, "quantize", rf"{re.escape(str(fifo))}: cannot write: it exists and is not "
                                   r"a regular file")
    assert os.path.exists(fifo) and not os.path.isfile(fifo)  # still the pipe
    monkeypatch.undo()
    assert _cli.main(["report", str(fifo)]) == 1  # it exists: not "no such file"
    _one_error(capsys, "report", rf"{re.escape(str(fifo))}: is not a regular file")


def test_device_error_while_quantizing_is_a_one_line_run_error(src, tmp_path, capsys,
                                                               monkeypatch):
    """XLA's errors (out of device memory) are RuntimeErrors: one line naming the tensor."""
    def out_of_memory(x):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 64 "
                                         "bytes.\nmore lines")

    dst = tmp_path / "out.safetensors"
    monkeypatch.setattr(jax, "block_until_ready", out_of_memory)
    assert _cli.main(["quantize", src, str(dst), "--quiet"]) == 1
    _one_error(capsys, "quantize", r"cannot quantize tensor 'w' \(float32\[8, 16\]\): "
                                   r"RESOURCE_EXHAUSTED: Out of memory allocating 64 bytes\.$")
    assert not dst.exists()


def test_demo_validates_on_distinct_batches(monkeypatch):
    """The validation loss is the mean over several batches: they must not be one batch twice."""
    seen = []
    real = _demo.batches

    def recording(data, batch, seed):
        for b in real(data, batch, seed):
            seen.append((data, b))
            yield b

    monkeypatch.setattr(_demo, "batches", recording)
    shapes = jax.eval_shape(_demo.init_params, jax.random.key(0))  # nothing compiled
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape, np.float32) * 0.05),
                          shapes)
    monkeypatch.setattr(_demo, "train", lambda data, steps, **kw: params)
    # float rows only (what is measured here is the batches), under the names run() reports
    monkeypatch.setattr(_demo, "CONFIGS", [("float32", "-", None), ("int4", "block 32", None)])
    monkeypatch.setattr(_demo, "median_time", lambda fn, repeats=5: 0.0)
    monkeypatch.setattr(_demo, "load_corpus", lambda: (np.arange(5000, dtype=np.uint8),
                                                       np.arange(3000, dtype=np.uint8) % 251))
    _demo.run(steps=1, print_fn=lambda s: None)
    val = [b for data, b in seen if len(data) == 3000]
    assert len(val) == 2
    windows = [np.asarray(tokens) for tokens, _ in val]
    assert not np.array_equal(windows[0], windows[1])


def test_demo_with_too_little_source_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    for i in range(11):  # file 0 and file 10 go to validation
        (tmp_path / f"m{i:02}.py").write_text("x=1\n" if i % 10 == 0 else "y = 2\n" * 100)
    monkeypatch.setattr(_demo.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert _cli.main(["demo", "--steps", "1", "--quiet"]) == 1
    _one_error(capsys, "demo", r"too little Python source under .*: 5,?\d* train and 9 "
                               r"validation bytes, at least 18 each needed$")


def test_plain_file_with_names_a_and_a_slash_b_is_quantized_and_reported(tmp_path, capsys):
    # Tensor names are names: "a" and "a/b" are two tensors, not a leaf and a dict below it.
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((8, 16)).astype(np.float32),
               "a/b": rng.standard_normal((4, 32)).astype(np.float32)}
    src, out = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    safetensors_numpy.save_file(tensors, src)
    assert _cli.main(["quantize", src, out, "--quiet", "--rules", "a/b=int4:block=16",
                      "a=int8"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^a\s+\(8, 16\)\s+int8", table, re.M), table
    assert re.search(r"^a/b\s+\(4, 32\)\s+int4", table, re.M), table
    with pytest.raises(ValueError, match="collides"):  # nested dicts cannot hold both
        jq.load_safetensors(out)
    target = {"a": jax.eval_shape(lambda: jq.quantize(jnp.asarray(tensors["a"]), axis=-1)),
              "a/b": jax.eval_shape(lambda: jq.quantize(jnp.asarray(tensors["a/b"]),
                                                        dtype=jnp.int4, axis=-1, block_size=16))}
    loaded = jq.load_safetensors(out, target)
    for name, x in tensors.items():
        want = jq.quantize(jnp.asarray(x), **({"axis": -1} if name == "a" else
                                             {"dtype": jnp.int4, "axis": -1, "block_size": 16}))
        np.testing.assert_array_equal(loaded[name].qvalue, want.qvalue)
    assert _cli.main(["report", src, out]) == 0
    assert re.search(r"^a/b\s+\(4, 32\)\s+int4", capsys.readouterr().out, re.M)


@pytest.mark.parametrize("argv", [
    ["--rules", "w=int4", "IN", "OUT"],
    ["IN", "--rules", "w=int4", "OUT", "--quiet"],
    ["--quiet", "--rules", "x=int8", "--rules", "w=int4", "IN", "OUT"],
    ["--rules", "w=int4", "--", "IN", "OUT"],
    ["--rules=w=int4", "b=none", "IN", "OUT"],  # argparse's --opt=value form, then more rules
    ["--rul=w=int4", "IN", "OUT"],
])
def test_rules_may_come_before_in_and_out(src, tmp_path, capsys, argv):
    out = str(tmp_path / "out.safetensors")
    argv = [src if a == "IN" else out if a == "OUT" else a for a in argv]
    assert _cli.main(["quantize", *argv]) == 0, capsys.readouterr().err
    assert re.search(r"^w\s+\(8, 16\)\s+int4", capsys.readouterr().out, re.M)
    assert jq.load_safetensors(out)["w"].qvalue.dtype == jnp.int4


def test_a_path_holding_an_equals_sign_after_rules_is_read_as_a_rule(src, tmp_path, capsys):
    # The one case the reordering cannot tell apart: argparse's own usage error, exit 2.
    with pytest.raises(SystemExit) as e:
        _cli.main(["quantize", "--rules", "w=int4", src, str(tmp_path / "o=1.safetensors")])
    assert e.value.code == 2
    assert "required: OUT" in capsys.readouterr().err


def test_a_pytorch_file_warns_when_weights_get_scales_per_input_channel(tmp_path, capsys):
    # Hugging Face writes format=pt; the default axis=-1 is per input channel of (out, in).
    src, out = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    rng = np.random.default_rng(0)
    safetensors_numpy.save_file({"fc.weight": rng.standard_normal((16, 32)).astype(np.float32),
                                 "fc.bias": rng.standard_normal(16).astype(np.float32)},
                                src, metadata={"format": "pt"})
    assert _cli.main(["quantize", src, out, "--quiet"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"warning: IN was saved by PyTorch \(format: pt\): without --rules its 1 2-D "
                     r"tensor\(s\) \('fc\.weight'\.\.\.\) get one scale per last-axis entry, "
                     r"which for a Linear weight \(out, in\) is per input channel", err), err
    for rules in (["weight=int8:axis=0"], ["weight=int8:axis=1"], ["weight=none"]):  # chosen
        assert _cli.main(["quantize", src, out, "--quiet", "--rules", *rules]) == 0
        assert "PyTorch" not in capsys.readouterr().err
    safetensors_numpy.save_file({"w": np.ones((4, 4), np.float32)}, src)  # no format=pt
    assert _cli.main(["quantize", src, out, "--quiet"]) == 0
    assert "PyTorch" not in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--rule", "--rul", "--rules"])
def test_an_abbreviated_rules_option_after_in_and_out(src, tmp_path, capsys, option):
    """argparse takes --rule for --rules; the reordering read its rules as IN and OUT."""
    out = str(tmp_path / "out.safetensors")
    assert _cli.main(["quantize", src, out, "--quiet", option, "w=int4"]) == 0
    assert jq.load_safetensors(out)["w"].qvalue.dtype == jnp.int4
    assert _cli.main(["quantize", option, "w=int8", src, out, "--quiet"]) == 0
    assert jq.load_safetensors(out)["w"].qvalue.dtype == jnp.int8
