"""The benchmark harness measures what it claims: same work, real bytes, waited-for results.

`tests/test_benchmarks.py` runs every benchmark end to end; these check, cheaply and
without timing anything, the properties the published ratios rest on: that a peer is
given the same granularity as the jaxquant row it is compared with, that the bytes a
row's GB/s is computed from are the bytes of its arrays, that ratios only compare
cases run on the same device, that the hand-written baseline of `quantize_tree`
computes jaxquant's codes and scales bit for bit, and that timed calls are waited for.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # `benchmarks` is a folder of the repository, not an installed package
    sys.path.append(ROOT)
from benchmarks import _harness, _peers, core_cases, quantize_tree, run  # noqa: E402
from benchmarks import _plain as plain  # noqa: E402


def _nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def built_cases():
    """Every JAX row of the core benchmark at 512 x 512: name -> (case, args, output)."""
    recorded = {}

    def spy(fn, *args):
        recorded["args"] = args
        return jax_call(fn, *args)

    jax_call = core_cases.jax_call
    inputs, out = core_cases.Inputs(512), {}
    # the benchmarks run with JAX's default rank promotion (the plain NF4 spelling uses it)
    with pytest.MonkeyPatch.context() as mp, jax.numpy_rank_promotion("allow"):
        mp.setattr(core_cases, "jax_call", spy)
        for case in core_cases.cases():
            if case.requires in core_cases.HOST_PACKAGES or case.name == core_cases.LIMIT_CASE:
                continue
            if case.requires == "qwix" and importlib.util.find_spec("qwix") is None:
                continue  # a peer not installed here: its rows only
            recorded.clear()
            call = case.build(inputs)
            if "args" in recorded:  # the donated rows keep their own state
                out[case.name] = (case, recorded["args"], call())
    return out


def test_qwix_rows_get_the_granularity_of_their_jaxquant_rows(built_cases):
    pytest.importorskip("qwix")  # the peer (not a test extra)
    # qwix.quantize(x, int4, tiled_axes={1: 128}) alone shares one scale over every row of a
    # 128-column stripe: 4 scales here where jaxquant's blocks of 128 along the rows have 2048
    peers = [name for name, (case, _, _) in built_cases.items() if case.requires == "qwix"]
    assert len(peers) == 2
    for peer in peers:
        case, _, theirs = built_cases[peer]
        ours = [out for c, _, out in built_cases.values() if c.requires is None
                and c.baseline == case.baseline and jq.is_qtensor(out)
                and out.qvalue.dtype == theirs.qvalue.dtype]
        assert ours, peer
        for mine in ours:
            assert theirs.qvalue.shape == mine.qvalue.shape, peer
            assert theirs.scale.size == mine.scale.size, (peer, theirs.scale.shape,
                                                          mine.scale.shape)


def test_bytes_moved_are_the_bytes_of_the_arrays(built_cases):
    # input read plus output written, from the arrays' own nbytes; one extra float32 read
    # where a tensor-wide scale must be known before the first code (computed per-tensor
    # int8, NVFP4's tensor scale). Per-row scales (8 bytes a row here) are not counted.
    elements = 512 * 512
    for name, (case, args, output) in built_cases.items():
        extra = 4 if "computed, per-tensor" in name or "nvfp4 quantize" in name or (
            name == "jaxquant quantize nvfp4 packed=True") else 0
        measured = (_nbytes(args) + _nbytes(output)) / elements
        assert case.bytes_per_element - extra == pytest.approx(measured, abs=0.02), name


def test_ratios_only_compare_cases_on_the_same_device():
    noop = lambda i: None  # noqa: E731
    selected = [core_cases.Case(core_cases.LIMIT_CASE, "memory copy", 8, noop),
                core_cases.Case(core_cases.DEVICE_LIMIT_CASE, "memory copy", 8, noop),
                core_cases.Case("plain jnp quantize", "int8", 5, noop),
                core_cases.Case("jaxquant quantize", "int8", 5, noop, "plain jnp quantize"),
                core_cases.Case("torch quantize_per_tensor", "int8", 5, noop,
                                "plain jnp quantize", "torch")]
    seconds = {core_cases.LIMIT_CASE: 1.0, core_cases.DEVICE_LIMIT_CASE: 0.1,
               "plain jnp quantize": 0.05, "jaxquant quantize": 0.1,
               "torch quantize_per_tensor": 0.5}
    times = {name: [(s, 0)] for name, s in seconds.items()}
    on_gpu = {r["name"]: r for r in run.summarize(selected, {}, times, 4, backend="gpu")}
    assert on_gpu["jaxquant quantize"]["ratio_to_plain_jnp"] == pytest.approx(2.0)
    # the device copy moves 8 B an element in 0.1 s: 5 B take 0.0625 s
    assert on_gpu["jaxquant quantize"]["ratio_to_copy_limit"] == pytest.approx(0.1 / 0.0625)
    assert on_gpu["torch quantize_per_tensor"]["device"] == "host cpu"
    assert on_gpu["torch quantize_per_tensor"]["ratio_to_plain_jnp"] is None
    assert on_gpu["torch quantize_per_tensor"]["ratio_to_copy_limit"] is None
    on_cpu = {r["name"]: r for r in run.summarize(selected, {}, times, 4)}
    assert on_cpu["torch quantize_per_tensor"]["ratio_to_plain_jnp"] == pytest.approx(10.0)
    assert on_cpu["jaxquant quantize"]["ratio_to_copy_limit"] == pytest.approx(0.1 / 0.625)


def test_plain_format_baselines_compute_jaxquant_codes():
    # the plain jnp rows are compared with jaxquant's as the same work: the same codes (but at
    # a rounding tie of XLA's x * (1 / s)) and scales within an ulp of the exact ones
    x = jnp.asarray(np.random.default_rng(1).standard_normal((256, 256), np.float32))
    with jax.numpy_rank_promotion("allow"):
        for fmt, kwargs in core_cases.FORMATS.items():
            kwargs = {k: v for k, v in kwargs.items() if k != "packed"}
            qt = jax.jit(functools.partial(jq.quantize, **kwargs))(x)
            quantize, dequantize = plain.FORMATS[fmt]
            stored = jax.jit(quantize)(x)
            ours = np.asarray(qt.qvalue.astype(jnp.float32))
            theirs = np.asarray(stored[0].astype(jnp.float32))
            same = ours == theirs
            assert same.mean() > 0.999, fmt
            diff = np.abs(np.asarray(jq.dequantize(qt)) - np.asarray(dequantize(*stored)))
            assert diff[same].max() <= 1e-6 * float(jnp.max(jnp.abs(x))), fmt


def _small_tree():
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((64, 96), np.float32)
    kernel[:, 3] = 0.0  # an all-zero channel: scale 1, codes 0
    kernel[:, 5] = np.float32(1e-39) * np.sign(kernel[:, 5])  # subnormal values
    kernel[::7, 8] *= 1e4  # an outlier setting one channel's scale
    return {"dense": {"kernel": jnp.asarray(kernel), "bias": jnp.zeros(96)},
            "conv": jnp.asarray(rng.standard_normal((3, 40, 24), np.float32)),
            "grid": jnp.asarray(np.arange(-127, 129, dtype=np.float32).reshape(16, 16) / 2)}


def test_quantize_tree_baseline_is_the_same_maths_bit_for_bit():
    tree = _small_tree()
    q = jax.jit(jq.quantize_tree)(tree)
    # the hand-written maths on the CPU, whose float32 division is IEEE's (XLA:GPU's is not
    # correctly rounded: there the plain jit is not the same maths; jaxquant's is exact)
    same = jax.jit(functools.partial(quantize_tree.plain_quantize_tree, exact=True))(
        jax.device_put(tree, jax.devices("cpu")[0]))
    same = jax.device_put(same, jax.devices()[0])  # beside jaxquant's tree
    assert quantize_tree.differing(q, same) == (0, 0)
    # an independent float64 reference of the same codes
    for name in ("conv", "grid"):
        x = np.asarray(tree[name])
        s = (np.abs(x).reshape(-1, x.shape[-1]).max(0) / np.float32(127)).astype(np.float32)
        codes = np.clip(np.round(x.astype(np.float64) / s), -127, 127)
        np.testing.assert_array_equal(np.asarray(q[name].qvalue), codes, err_msg=name)
    # and the count sees a changed code and a changed scale
    codes, scales = same["conv"]
    same["conv"] = (codes.at[0, 0, 0].add(1), scales.at[3].set(-scales[3]))
    assert quantize_tree.differing(q, same) == (1, 1)


def test_timed_calls_wait_for_every_leaf_of_every_result():
    waited = []

    class Leaf:
        def block_until_ready(self):
            waited.append(self)
            return self

    results = [{"a": Leaf(), "b": (Leaf(), Leaf())} for _ in range(3)]
    calls = iter(results)
    _harness.call_repeatedly(lambda: next(calls), 3)
    assert len(waited) == 9 and len({id(w) for w in waited}) == 9


def test_rounds_start_one_case_later_each_round():
    order = []
    fns = {name: functools.partial(order.append, name) for name in "abc"}
    times = _harness.run_rounds(fns, 4)
    assert "".join(order) == "abc" + "bca" + "cab" + "abc"
    assert all(len(t) == 4 for t in times.values())
    assert _harness.run_rounds({}, 2) == {}  # a peer that is not installed has no cases


def test_reports_record_command_device_and_peer_threads():
    info = _harness.machine_info(["jax", "surely-not-an-installed-package"])
    assert info["jax_devices"] == f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    assert info["versions"]["jax"] == jax.__version__
    assert info["versions"]["surely-not-an-installed-package"] is None
    assert _harness.command("run", ["--size", "256"]) == "python -m benchmarks.run --size 256"
    # the host peers get the cores XLA:CPU's thread pool gets, not a fixed 2
    assert _peers.THREADS == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("module,flags", [
    ("inference_mlp", ["--rounds", "0"]), ("inference_mlp", ["--calls", "0"]),
    ("qat_mlp", ["--rounds", "0"]), ("qat_mlp", ["--steps", "-1"]),
    ("flax_integration", ["--calls", "0"]), ("minilm", ["--rounds", "0"]),
    ("weight_streaming", ["--rounds", "0"]), ("weight_streaming", ["--calls", "0"]),
])
def test_no_rounds_or_calls_is_a_usage_error_before_any_work(module, flags, capsys):
    """--rounds 0 ran the whole setup, then died on `statistics.median([])` (--calls 0 on a
    division by zero); argparse refuses it now, exit status 2, naming the flag."""
    main = importlib.import_module(f"benchmarks.{module}").main
    with pytest.raises(SystemExit) as stop:
        main([*flags, "--out", "/nonexistent"])
    assert stop.value.code == 2
    assert f"{flags[0]} must be at least 1, got {flags[1]}" in capsys.readouterr().err
