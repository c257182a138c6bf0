"""Progress bars: tqdm on stderr for checkpoints, `jaxquant quantize` and the demo; silenced.

tqdm is optional: `progress_bar` falls back to a silent stand-in without it.
"""

import importlib.util
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _cli, _demo
from jaxquant._progress import progress_bar

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from test_checkpoint import _every_format_tree, assert_identical  # noqa: E402

needs_tqdm = pytest.mark.skipif(importlib.util.find_spec("tqdm") is None,
                                reason="tqdm (optional, the io extra) is not installed")


def _small_tree():
    """Four stored tensors: a QTensor's qvalue, scale and zero point, and a bias."""
    w = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(4, 8)
    return {"dense": {"kernel": jq.quantize(w, dtype=jnp.uint4, axis=0, symmetric=False),
                      "bias": jnp.zeros(8, jnp.bfloat16)}}


def _contents(path) -> tuple[dict, dict]:
    """(``__metadata__``, tensors by name) of a safetensors file: what its bytes hold, up to
    the order of the metadata keys (safetensors writes them in hash-map order)."""
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    return meta, dict(safetensors.deserialize(path.read_bytes()))


def _bar_done(err: str, desc: str, n: int) -> bool:
    """Whether tqdm's final line ``desc: 100%|...| n/n`` is in ``err``."""
    return re.search(rf"{desc}: 100%\|[^\r\n|]*\| {n}/{n} ", err) is not None


# --- the helper -------------------------------------------------------------------------


@needs_tqdm
def test_progress_bar_uses_tqdm_on_stderr(capsys):
    assert list(progress_bar(range(3), desc="counting", unit="thing")) == [0, 1, 2]
    with progress_bar(total=2, desc="by hand") as bar:
        bar.update()
        bar.set_postfix_str("half")
        bar.update()
    out, err = capsys.readouterr()
    assert out == ""
    assert _bar_done(err, "counting", 3) and "thing/s" in err
    assert _bar_done(err, "by hand", 2)
    assert list(progress_bar([4, 5], enabled=False, desc="quiet")) == [4, 5]
    assert capsys.readouterr() == ("", "")


def test_progress_bar_is_silent_without_tqdm(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` raises ImportError
    with pytest.raises(ImportError):
        import tqdm  # noqa: F401
    bar = progress_bar(iter("ab"), desc="letters")
    assert list(bar) == ["a", "b"]
    with progress_bar(total=3, desc="by hand") as bar:
        bar.update(2)
        bar.set_postfix_str("x")
        bar.update()
    assert list(progress_bar(desc="nothing")) == []
    # the callers go on as they would with tqdm
    tree = _small_tree()
    jq.save_safetensors(tmp_path / "t.safetensors", tree, progress=True)
    assert_identical(jq.load_safetensors(tmp_path / "t.safetensors", progress=True), tree)
    assert capsys.readouterr() == ("", "")


# --- checkpoints ------------------------------------------------------------------------


@needs_tqdm
def test_safetensors_bar_over_tensors_and_silent_by_default(tmp_path, capsys):
    tree = _small_tree()
    jq.save_safetensors(tmp_path / "quiet.safetensors", tree)
    back = jq.load_safetensors(tmp_path / "quiet.safetensors")
    assert capsys.readouterr() == ("", "")  # library calls are silent by default
    assert_identical(back, tree)

    jq.save_safetensors(tmp_path / "bar.safetensors", tree, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and _bar_done(err, "saving", 4) and "writing" in err
    assert_identical(jq.load_safetensors(tmp_path / "bar.safetensors", progress=True), tree)
    out, err = capsys.readouterr()
    assert out == "" and _bar_done(err, "loading", 4)
    assert _contents(tmp_path / "bar.safetensors") == _contents(tmp_path / "quiet.safetensors")


@needs_tqdm
def test_safetensors_progress_writes_the_same_file_for_every_format(tmp_path, capsys):
    """Saving leaf by leaf (to advance the bar) makes the file that one `encode` makes."""
    tree = _every_format_tree()
    jq.save_safetensors(tmp_path / "a.safetensors", tree)
    jq.save_safetensors(tmp_path / "b.safetensors", tree, progress=True)
    assert _contents(tmp_path / "a.safetensors") == _contents(tmp_path / "b.safetensors")
    n = len(_contents(tmp_path / "a.safetensors")[1])
    assert _bar_done(capsys.readouterr().err, "saving", n)
    assert_identical(jq.load_safetensors(tmp_path / "b.safetensors", tree, progress=True), tree)
    assert _bar_done(capsys.readouterr().err, "loading", n)


@needs_tqdm
def test_save_bar_counts_the_tensors_of_two_level_scales(tmp_path, capsys):
    w = jnp.linspace(-1.0, 1.0, 256, dtype=jnp.float32).reshape(4, 64)
    try:
        tree = {"dq": jq.quantize(w, dtype=jnp.int4, axis=1, block_size=16, double_quant=True),
                "nf4": jq.quantize(w, dtype="nf4")}
    except (TypeError, ValueError):
        pytest.skip("this jaxquant has no QTensor scales or codebook formats")
    jq.save_safetensors(tmp_path / "t.safetensors", tree, progress=True)
    n = len(_contents(tmp_path / "t.safetensors")[1])  # dq: qvalue, scale/qvalue, scale/scale
    assert _bar_done(capsys.readouterr().err, "saving", n)
    assert_identical(jq.load_safetensors(tmp_path / "t.safetensors", progress=True), tree)
    assert _bar_done(capsys.readouterr().err, "loading", n)


@pytest.mark.parametrize("tree,message", [
    ({"a/b": jnp.zeros(2), "a": {"b": jnp.ones(2)}}, "two leaves have the same path 'a/b'"),
    ({"a": jq.quantize(jnp.ones((2, 2)), dtype=jnp.int8), "a/qvalue": jnp.zeros(2)},
     "two tensors would be stored under the name 'a/qvalue'"),
    ({"w": "not an array"}, "leaf 'w' is a str"),
])
def test_safetensors_progress_keeps_the_errors(tmp_path, tree, message, capsys):
    for progress in (False, True):
        with pytest.raises((ValueError, TypeError), match=re.escape(message)):
            jq.save_safetensors(tmp_path / "x.safetensors", tree, progress=progress)
    assert not list(tmp_path.iterdir())


@needs_tqdm
def test_orbax_bar(tmp_path, capsys):
    pytest.importorskip("orbax.checkpoint")
    tree = _small_tree()
    jq.save_orbax(tmp_path / "quiet", tree)
    back = jq.load_orbax(tmp_path / "quiet")
    assert "%|" not in capsys.readouterr().err
    assert_identical(back, tree)
    jq.save_orbax(tmp_path / "bar", tree, progress=True)
    assert _bar_done(capsys.readouterr().err, "saving", 4)
    assert_identical(jq.load_orbax(tmp_path / "bar", progress=True), tree)
    assert _bar_done(capsys.readouterr().err, "loading", 4)


# --- command line -----------------------------------------------------------------------


@needs_tqdm
def test_cli_quantize_bars_and_quiet(tmp_path, capsys):
    rng = np.random.default_rng(0)
    safetensors_numpy.save_file({"w": rng.standard_normal((8, 4)).astype(np.float32),
                                 "b": rng.standard_normal(4).astype(np.float32)},
                                str(tmp_path / "in.safetensors"))
    args = ["quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")]
    assert _cli.main(args) == 0
    out, err = capsys.readouterr()
    assert _bar_done(err, "quantize", 1)  # only the rank-2 "w" is quantized
    assert _bar_done(err, "saving", 3)  # w's qvalue and scale, b
    assert "%|" not in out and "wrote" in out
    assert _cli.main([*args, "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "wrote" in out


@needs_tqdm
def test_cli_demo_bars_and_quiet(monkeypatch, capsys):
    """The demo, cut to two formats and 60 steps: bars on stderr, none with --quiet."""
    keep = {("float32", "-"), ("int4", "block 32")}  # the per-leaf report needs int4 block 32
    monkeypatch.setattr(_demo, "CONFIGS", [c for c in _demo.CONFIGS if c[:2] in keep])
    with pytest.raises(SystemExit):
        _cli.main(["demo", "--help"])
    assert "--quiet" in capsys.readouterr().out

    assert _cli.main(["demo", "--steps", "60", "--quiet"]) == 0
    quiet_out, err = capsys.readouterr()
    assert err == ""
    assert _cli.main(["demo", "--steps", "60"]) == 0
    out, err = capsys.readouterr()
    assert _bar_done(err, "training", 60) and "50/60" in err
    assert _bar_done(err, "quantizing", 2) and "int4, block 32" in err
    # stdout is the same table either way (up to timings)
    assert "%|" not in out
    numbers = re.compile(r"\d[\d.,e+-]*")
    table = lambda text: [numbers.sub("#", line).split() for line in text.splitlines()]
    assert table(out) == table(quiet_out)
    assert "per-leaf report" in out and "int4" in out


def test_quantize_tree_bar_over_quantized_leaves(capsys):
    tree = {"a": jnp.ones((4, 8)), "b": jnp.ones((8, 8)), "bias": jnp.ones(8)}
    quiet = jq.quantize_tree(tree)
    assert capsys.readouterr().err == ""
    loud = jq.quantize_tree(tree, progress=True)
    err = capsys.readouterr().err
    assert "quantize" in err and "2/2" in err
    for k in tree:
        assert jax.tree.structure(quiet[k]) == jax.tree.structure(loud[k])
    jax.jit(lambda t: jq.quantize_tree(t, progress=True))(tree)  # traced: nothing to show
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("call", ["quantize_tree", "save_safetensors", "load_safetensors",
                                  "calibrate"])
def test_progress_that_is_not_a_bool_is_a_type_error(call, tmp_path):
    # progress="no" is truthy: it would draw a bar the caller asked not to see
    tree = {"w": jnp.ones((4, 4))}
    path = tmp_path / "t.safetensors"
    jq.save_safetensors(path, tree)
    run = {"quantize_tree": lambda p: jq.quantize_tree(tree, progress=p),
           "save_safetensors": lambda p: jq.save_safetensors(tmp_path / "u.safetensors", tree,
                                                             progress=p),
           "load_safetensors": lambda p: jq.load_safetensors(path, progress=p),
           "calibrate": lambda p: jq.calibration.calibrate(jq.calibration.minmax(),
                                                           [jnp.ones(3)], progress=p)}[call]
    with pytest.raises(TypeError, match="progress must be a bool.*'no'"):
        run("no")
    run(False)  # the quiet call still works
