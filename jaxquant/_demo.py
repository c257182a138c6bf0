"""`jaxquant demo`: quantize a model trained on real text and run it quantized.

No download: the corpus is the Python standard library's own source files,
read from the running interpreter. A small byte-level MLP language model is
trained for a few seconds, then its parameter tree is quantized to several
formats and granularities. For each, the demo prints the storage, the
signal-to-quantization-noise ratio, the largest error, the time to quantize
the whole tree (compiled), and the validation loss of the jitted model run on
the quantized parameters (dequantized inside the same program).
"""

from __future__ import annotations

import math
import pathlib
import sysconfig
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq

CONTEXT = 16
EMBED = 32
HIDDEN = 512
VOCAB = 256


def load_corpus(max_bytes: int = 3_000_000) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of the standard library's ``.py`` files: (train, validation), split by file.

    Files are taken in sorted order; every tenth file goes to validation.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    train, val, total = [], [], 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        (val if i % 10 == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not train or not val:
        raise RuntimeError(f"no Python sources found under {root}")
    as_array = lambda chunks: np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    return as_array(train), as_array(val)


def init_params(key: jax.Array) -> dict:
    """Parameters of a byte-level MLP language model (Flax-like nested dict)."""
    k = jax.random.split(key, 4)
    dense = lambda key, n_in, n_out: {
        "kernel": jax.random.normal(key, (n_in, n_out), jnp.float32) / math.sqrt(n_in),
        "bias": jnp.zeros((n_out,), jnp.float32)}
    return {"embed": {"embedding": jax.random.normal(k[0], (VOCAB, EMBED), jnp.float32)},
            "dense_0": dense(k[1], CONTEXT * EMBED, HIDDEN),
            "dense_1": dense(k[2], HIDDEN, HIDDEN),
            "head": dense(k[3], HIDDEN, VOCAB)}


def _value(leaf):
    return jq.dequantize(leaf) if jq.is_qtensor(leaf) else leaf


def forward(params: dict, tokens: jax.Array) -> jax.Array:
    """Next-byte logits for ``tokens`` of shape ``(batch, CONTEXT)``; QTensor leaves welcome."""
    p = jax.tree.map(_value, params, is_leaf=jq.is_qtensor)
    h = p["embed"]["embedding"][tokens].reshape(tokens.shape[0], -1)
    for name in ("dense_0", "dense_1"):
        h = jax.nn.gelu(h @ p[name]["kernel"] + p[name]["bias"])
    return h @ p["head"]["kernel"] + p["head"]["bias"]


def loss_fn(params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean cross-entropy in bits per byte."""
    tokens, targets = batch
    logp = jax.nn.log_softmax(forward(params, tokens))
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=1).mean()
    return nll / jnp.log(2.0)


def batches(data: np.ndarray, batch: int, seed: int):
    """Endless random (context, next byte) batches."""
    rng = np.random.default_rng(seed)
    idx = np.arange(CONTEXT)
    while True:
        start = rng.integers(0, len(data) - CONTEXT - 1, batch)
        win = data[start[:, None] + idx]
        yield jnp.asarray(win, jnp.int32), jnp.asarray(data[start + CONTEXT], jnp.int32)


def train(train_data: np.ndarray, steps: int, seed: int = 0) -> dict:
    """SGD with Nesterov momentum; returns the trained parameters."""
    params = init_params(jax.random.key(seed))
    velocity = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def step(params, velocity, batch, lr):
        grads = jax.grad(loss_fn)(params, batch)
        velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
        params = jax.tree.map(lambda p, v, g: p - lr * (g + 0.9 * v), params, velocity, grads)
        return params, velocity

    data = batches(train_data, 256, seed)
    for i in range(steps):
        lr = jnp.float32(0.05 * min(1.0, 2 * (1 - i / steps)))
        params, velocity = step(params, velocity, next(data), lr)
    return params


def sqnr_db(reference: dict, approx: dict) -> tuple[float, float]:
    """(SQNR in dB, max abs error) over the leaves that differ."""
    sig = err = 0.0
    worst = 0.0
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(approx), strict=True):
        d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
        if not d.any():
            continue
        sig += float(np.sum(np.asarray(a, np.float64) ** 2))
        err += float(np.sum(d ** 2))
        worst = max(worst, float(np.abs(d).max()))
    return (math.inf if err == 0 else 10 * math.log10(sig / err)), worst


def median_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of ``fn()`` in seconds (results blocked on)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


CONFIGS: list[tuple[str, str, jq.QuantSpec | None]] = [
    ("float32", "-", None),
    ("int8", "per-tensor", jq.QuantSpec(axis=None)),
    ("int8", "per-channel", jq.QuantSpec()),
    ("uint8 (asym)", "per-channel", jq.QuantSpec(dtype=jnp.uint8, symmetric=False)),
    ("float8_e4m3fn", "per-channel", jq.QuantSpec(dtype=jnp.float8_e4m3fn)),
    ("float8_e5m2", "per-channel", jq.QuantSpec(dtype=jnp.float8_e5m2)),
    ("int4", "per-channel", jq.QuantSpec(dtype=jnp.int4, packed=True)),
    ("int4", "block 32", jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32, packed=True)),
    ("float4_e2m1fn", "block 32", jq.QuantSpec(dtype=jnp.float4_e2m1fn, axis=0, block_size=32,
                                               packed=True)),
    ("int2", "block 16", jq.QuantSpec(dtype=jnp.int2, axis=0, block_size=16, packed=True)),
]


def run(steps: int = 1500, print_fn: Callable[[str], None] = print) -> list[dict]:
    """Trains, quantizes and evaluates; prints the table and returns its rows."""
    t0 = time.perf_counter()
    train_data, val_data = load_corpus()
    print_fn(f"jaxquant {jq.__version__} on {jax.devices()[0].platform}: corpus = Python "
             f"stdlib sources, {len(train_data):,} train / {len(val_data):,} validation bytes")
    params = train(train_data, steps)
    print_fn(f"trained a byte-level MLP ({jq.tree_nbytes(params):,} bytes of float32 "
             f"parameters) for {steps} steps in {time.perf_counter() - t0:.1f} s")
    val = [next(batches(val_data, 4096, seed=1)) for _ in range(2)]
    evaluate = jax.jit(lambda p: jnp.mean(jnp.stack([loss_fn(p, b) for b in val])))
    rows = []
    for fmt, gran, spec in CONFIGS:
        rules = None if spec is None else [("embed|kernel", spec)]
        if spec is None:
            qparams, seconds = params, math.nan
        else:
            convert = jax.jit(lambda p, rules=rules: jq.quantize_tree(p, rules))
            qparams = convert(params)
            seconds = median_time(lambda convert=convert: convert(params))
        snr, worst = sqnr_db(params, jq.dequantize_tree(qparams))
        rows.append(dict(format=fmt, granularity=gran, bytes=jq.tree_nbytes(qparams),
                         sqnr_db=snr, max_error=worst, quantize_ms=1e3 * seconds,
                         val_bits_per_byte=float(evaluate(qparams))))
    print_fn(format_table(rows))
    print_fn(f"time ms: compiled quantize_tree of the whole tree (median of 5); "
             f"total {time.perf_counter() - t0:.1f} s")
    return rows


def format_table(rows: list[dict]) -> str:
    """The demo's rows as an aligned text table."""
    base = rows[0]["bytes"]
    head = (f"{'format':<14} {'granularity':<12} {'bytes':>10} {'x float':>8} {'SQNR dB':>8} "
            f"{'max err':>9} {'time ms':>8} {'val bits/byte':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        snr = "inf" if math.isinf(r["sqnr_db"]) else f"{r['sqnr_db']:.1f}"
        lines.append(f"{r['format']:<14} {r['granularity']:<12} {r['bytes']:>10,} "
                     f"{r['bytes'] / base:>8.3f} {snr:>8} {r['max_error']:>9.2e} "
                     f"{r['quantize_ms']:>8.2f} {r['val_bits_per_byte']:>14.4f}"
                     .replace(" nan", "   -"))
    return "\n".join(lines)
