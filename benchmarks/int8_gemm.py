"""The int8 GEMM kernels each runtime reaches on this CPU, against its own float32 GEMM.

Run from the repository root (either form)::

    python -m benchmarks.int8_gemm                 # 30 round-robin rounds
    python benchmarks/int8_gemm.py --rounds 50

An int8 x int8 -> int32 dot is only worth its quantize and rescale steps when
the dot itself is faster than float32. This measures, for the two shapes of
the inference and QAT benchmarks (``(32, 1024) . (1024, 1024)`` and
``(256, 1024) . (1024, 1024)``), one product in each runtime available:

* XLA (jitted ``lax.dot_general``): float32; int8 x int8 -> int32 (what
  `jaxquant.qdot` emits); int8 x int8 -> float32; uint8 x int8 -> int32
  (the operand types of x86's VNNI instructions);
* PyTorch, where installed: float32 ``a @ b`` and ``torch._int_mm`` (int8 x
  int8 -> int32);
* ONNX Runtime, where installed: ``MatMul`` (float32) and ``MatMulInteger``
  with uint8 x int8 and int8 x int8 operands.

Every row's ratio is to the same runtime's float32 product (median of per-round
ratios; one runtime's cases timed round-robin, one runtime after the other, in
one process), with the threads each runtime uses by default (here: as many as
CPUs). The
header lists the CPU's int8 dot-product instruction sets (from
``/proc/cpuinfo``).

Results go to ``<out>/int8_gemm.json`` and ``<out>/int8_gemm.md``.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # python -m benchmarks.int8_gemm
    from benchmarks._harness import machine_info, parse_rounds, run_rounds, write_report
except ImportError:  # python benchmarks/int8_gemm.py
    from _harness import machine_info, parse_rounds, run_rounds, write_report

PACKAGES = ("jax", "jaxlib", "numpy", "torch", "onnxruntime", "onnx")
SHAPES = ((32, 1024, 1024), (256, 1024, 1024))
CPU_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "avx512f", "avx2")


def cpu_flags() -> list[str]:
    """Which of `CPU_FLAGS` ``/proc/cpuinfo`` lists (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in CPU_FLAGS if f in flags]


def operands(m: int, k: int, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random int8 codes in [-127, 127] (and their float32 and uint8 views) for one shape."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-127, 128, (m, k)).astype(np.int8)
    b = rng.integers(-127, 128, (k, n)).astype(np.int8)
    return {"a": a, "b": b, "af": a.astype(np.float32), "bf": b.astype(np.float32),
            "au": (a.astype(np.int16) + 128).astype(np.uint8)}


def xla_cases(ops: dict) -> dict[str, Callable[[], object]]:
    """Jitted XLA products; each callable returns when its result is ready."""
    def dot(out):
        return jax.jit(lambda x, y: lax.dot_general(x, y, (((1,), (0,)), ((), ())),
                                                    preferred_element_type=out))

    a, b, af, bf, au = (jnp.asarray(ops[k]) for k in ("a", "b", "af", "bf", "au"))
    cases = {"XLA float32": (dot(jnp.float32), af, bf),
             "XLA int8 x int8 -> int32": (dot(jnp.int32), a, b),
             "XLA int8 x int8 -> float32": (dot(jnp.float32), a, b),
             "XLA uint8 x int8 -> int32": (dot(jnp.int32), au, b)}
    return {name: (lambda f=f, x=x, y=y: jax.block_until_ready(f(x, y)))
            for name, (f, x, y) in cases.items()}


def torch_cases(ops: dict) -> dict[str, Callable[[], object]]:
    """PyTorch's float32 ``@`` and ``torch._int_mm``; empty without torch."""
    try:
        import torch
    except ImportError:
        return {}
    a, b, af, bf = (torch.from_numpy(ops[k]) for k in ("a", "b", "af", "bf"))
    return {"PyTorch float32": lambda: af @ bf,
            "PyTorch torch._int_mm (int8 -> int32)": lambda: torch._int_mm(a, b)}


def onnxruntime_cases(ops: dict) -> dict[str, Callable[[], object]]:
    """ONNX Runtime ``MatMul`` and ``MatMulInteger`` sessions; empty without onnxruntime."""
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return {}
    (m, k), n = ops["a"].shape, ops["b"].shape[1]

    def session(op: str, a_type: int, b_type: int, y_type: int):
        node = helper.make_node(op, ["A", "B"], ["Y"])
        graph = helper.make_graph(
            [node], op, [helper.make_tensor_value_info("A", a_type, [m, k]),
                         helper.make_tensor_value_info("B", b_type, [k, n])],
            [helper.make_tensor_value_info("Y", y_type, [m, n])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        model.ir_version = 10
        onnx.checker.check_model(model)
        options = ort.SessionOptions()  # threads that sleep between runs, as XLA's do
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])

    f32, i8, u8, i32 = TensorProto.FLOAT, TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32
    cases = {"ONNX Runtime float32 MatMul": (session("MatMul", f32, f32, f32), "af", "bf"),
             "ONNX Runtime MatMulInteger uint8 x int8": (
                 session("MatMulInteger", u8, i8, i32), "au", "b"),
             "ONNX Runtime MatMulInteger int8 x int8": (
                 session("MatMulInteger", i8, i8, i32), "a", "b")}
    return {name: (lambda s=s, x=ops[x], y=ops[y]: s.run(None, {"A": x, "B": y})[0])
            for name, (s, x, y) in cases.items()}


BASELINES = {"XLA": "XLA float32", "PyTorch": "PyTorch float32",
             "ONNX Runtime": "ONNX Runtime float32 MatMul"}
"""Each runtime's float32 row, the baseline of its other rows."""


def check_products(ops: dict) -> dict[str, int]:
    """Each int8 product against NumPy's exact int64 one: the number of entries that differ.

    XLA's products must be exact (AssertionError otherwise): they are what jaxquant
    runs. A peer's may not be: ONNX Runtime's uint8 x int8 kernel on x86 without VNNI
    (AVX2's ``vpmaddubsw``) adds pairs of products in int16 and saturates with
    full-range operands (ONNX Runtime's own quantizer offers ``reduce_range``, 7-bit
    weights, for such CPUs); the table says so rather than timing it unmarked.
    """
    want = ops["a"].astype(np.int64) @ ops["b"].astype(np.int64)
    got = {name: np.asarray(fn()) for name, fn in
           {**xla_cases(ops), **torch_cases(ops), **onnxruntime_cases(ops)}.items()
           if "int8" in name}
    shift = 128 * ops["b"].astype(np.int64).sum(axis=0)  # (a + 128) @ b = a @ b + 128 sum(b)
    wrong = {}
    for name, value in got.items():
        expect = want + shift if "uint8" in name else want
        if name.startswith("XLA"):
            np.testing.assert_array_equal(value.astype(np.int64), expect, err_msg=name)
        wrong[name] = int(np.sum(value.astype(np.int64) != expect))
    return wrong


def run(rounds: int) -> dict:
    """Times every case of every shape; returns the results dict."""
    load_before = os.getloadavg()[0]
    rows = []
    for m, k, n in SHAPES:
        ops = operands(m, k, n)
        wrong = check_products(ops)
        secs = {}
        for cases in (xla_cases(ops), torch_cases(ops), onnxruntime_cases(ops)):
            # One runtime at a time: the thread pools of the others stay idle.
            for fn in cases.values():  # compile and warm up
                fn()
                fn()
            secs.update({name: [s for s, _ in t] for name, t in run_rounds(cases, rounds).items()})
        for name, s in secs.items():
            base = next(b for r, b in BASELINES.items() if name.startswith(r))
            rows.append({"shape": [m, k, n], "case": name, "median_ms": 1e3 * statistics.median(s),
                         "min_ms": 1e3 * min(s), "baseline": base,
                         "wrong_entries": wrong.get(name, 0), "entries": m * n,
                         "vs_own_float32": statistics.median(
                             a / b for a, b in zip(s, secs[base], strict=True))})
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(PACKAGES),
        "cpu_flags": cpu_flags(),
        "rounds": rounds,
        "load_average": [load_before, os.getloadavg()[0]],
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """The results as a Markdown table with a header naming date, machine and command."""
    m = result["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    flags = ", ".join(result["cpu_flags"]) or "none found"
    lines = [
        f"{result['date']} · {m['cpu']}, {m['cpu_count']} CPUs (int8 dot instructions: "
        f"{flags}) · {versions} · `{result['command']}` · median of {result['rounds']} "
        f"round-robin rounds · 1-min load average {result['load_average'][0]:.2f} before, "
        f"{result['load_average'][1]:.2f} after",
        "",
        "Every int8 product was compared with NumPy's exact int64 product before timing "
        "(XLA's must be equal); the last column counts the entries that differ.",
        "",
        "| shape (m, k, n) | case | median ms | min ms | vs the same runtime's float32 "
        "| entries not equal to NumPy's |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        wrong = f"{r['wrong_entries']} of {r['entries']}" if "int8" in r["case"] else ""
        lines.append(f"| {tuple(r['shape'])} | {r['case']} | {r['median_ms']:.3f} "
                     f"| {r['min_ms']:.3f} | {r['vs_own_float32']:.2f} | {wrong} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``--rounds`` and ``--out``, runs, writes JSON and Markdown."""
    args = parse_rounds(__doc__, argv, default=30)
    wall = time.perf_counter()
    result = run(args.rounds)
    result["command"] = "python -m benchmarks.int8_gemm " + " ".join(
        sys.argv[1:] if argv is None else argv)
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    write_report(args.out, "int8_gemm", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
