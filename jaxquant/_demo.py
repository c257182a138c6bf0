"""`jaxquant demo`: quantize a model trained on real text and run it quantized.

No download: the corpus is the Python standard library's own source files,
read from the running interpreter. A small byte-level MLP language model is
trained for a few seconds, then its parameter tree is quantized to several
formats and granularities. For each, the demo prints the storage, the
signal-to-quantization-noise ratio, the largest error, the time to quantize
the whole tree (compiled; "GPTQ": `jaxquant.gptq` of the dense kernels with
their inputs' Gram matrices over training windows), and the validation loss
and next-byte accuracy of the jitted model run on the quantized parameters: every dense layer is a
`jaxquant.qdot_general` (weight-only: the codes are dequantized inside the
same program; "W8A8": int8 x int8 -> int32 with activations quantized on the
fly). The per-leaf report of one quantized tree follows the table. With
``progress`` (the command line's default; ``jaxquant demo --quiet`` turns it
off) tqdm bars on stderr follow the training steps and the formats.
"""

from __future__ import annotations

import functools
import math
import pathlib
import sysconfig
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
from jaxquant._progress import progress_bar
from jaxquant._report import format_report, quantization_report

CONTEXT = 16
EMBED = 32
HIDDEN = 512
VOCAB = 256


def load_corpus(max_bytes: int = 3_000_000) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of the standard library's ``.py`` files: (train, validation), split by file.

    Files are taken in sorted order; every tenth file goes to validation.

    Raises:
      RuntimeError: no ``.py`` file in the standard library's folder, or too few
        bytes for one (context, next byte) window in either part.
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
    train_bytes, val_bytes = (np.frombuffer(b"\n".join(c), dtype=np.uint8) for c in (train, val))
    if min(len(train_bytes), len(val_bytes)) <= CONTEXT + 1:  # no window of CONTEXT + 1 bytes
        raise RuntimeError(f"too little Python source under {root}: {len(train_bytes)} train and "
                           f"{len(val_bytes)} validation bytes, at least {CONTEXT + 2} each needed")
    return train_bytes, val_bytes


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


def forward(params: dict, tokens: jax.Array, act_quant: jq.ActQuant | None = None) -> jax.Array:
    """Next-byte logits for ``tokens`` of shape ``(batch, CONTEXT)``; QTensor leaves welcome.

    Dense layers run through `jaxquant.qdot_general` (``act_quant``: int8 x int8
    -> int32 for QTensor kernels; ``None``: weight-only); a quantized embedding
    table is dequantized.
    """
    table = params["embed"]["embedding"]
    table = jq.dequantize(table) if jq.is_qtensor(table) else table
    h = table[tokens].reshape(tokens.shape[0], -1)

    def dense(h, p):
        dims = (((1,), (0,)), ((), ()))
        return jq.qdot_general(h, p["kernel"], dims, act_quant=act_quant) + p["bias"][None, :]

    for name in ("dense_0", "dense_1"):
        h = jax.nn.gelu(dense(h, params[name]))
    return dense(h, params["head"])


def loss_fn(params: dict, batch: tuple[jax.Array, jax.Array],
            act_quant: jq.ActQuant | None = None) -> jax.Array:
    """Mean cross-entropy in bits per byte."""
    return _metrics(params, batch, act_quant)[0]


def _metrics(params, batch, act_quant=None) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy in bits per byte, next-byte top-1 accuracy)."""
    tokens, targets = batch
    logits = forward(params, tokens, act_quant)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=1).mean()
    return nll / jnp.log(2.0), jnp.mean(jnp.argmax(logits, axis=1) == targets)


def batches(data: np.ndarray, batch: int, seed: int):
    """Endless random (context, next byte) batches."""
    rng = np.random.default_rng(seed)
    idx = np.arange(CONTEXT)
    while True:
        start = rng.integers(0, len(data) - CONTEXT - 1, batch)
        win = data[start[:, None] + idx]
        yield jnp.asarray(win, jnp.int32), jnp.asarray(data[start + CONTEXT], jnp.int32)


def validation_batches(data: np.ndarray, count: int = 2, size: int = 4096,
                       seed: int = 1) -> list[tuple[jax.Array, jax.Array]]:
    """``count`` distinct random batches of ``size`` (context, next byte) windows of ``data``."""
    stream = batches(data, size, seed)
    return [next(stream) for _ in range(count)]


def train(train_data: np.ndarray, steps: int, seed: int = 0, progress: bool = False) -> dict:
    """SGD with Nesterov momentum; returns the trained parameters.

    With ``progress``, a bar over the steps on stderr, advanced every 50 steps once
    they have run (not merely been dispatched).
    """
    params = init_params(jax.random.key(seed))
    velocity = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def step(params, velocity, batch, lr):
        grads = jax.grad(loss_fn)(params, batch)
        velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
        params = jax.tree.map(lambda p, v, g: p - lr * (g + 0.9 * v), params, velocity, grads)
        return params, velocity

    data = batches(train_data, 256, seed)
    with progress_bar(total=steps, enabled=progress, desc="training", unit="step") as bar:
        done = 0
        for i in range(steps):
            lr = jnp.float32(0.05 * min(1.0, 2 * (1 - i / steps)))
            params, velocity = step(params, velocity, next(data), lr)
            if progress and (i + 1 - done >= 50 or i + 1 == steps):
                jax.block_until_ready(params)
                bar.update(i + 1 - done)
                done = i + 1
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


def input_grams(params: dict, tokens: jax.Array) -> dict[str, jax.Array]:
    """``x^T x`` of each dense layer's input when the float model reads ``tokens``."""
    h = params["embed"]["embedding"][tokens].reshape(tokens.shape[0], -1)
    grams = {}
    for name in ("dense_0", "dense_1"):
        grams[name] = h.T @ h
        h = jax.nn.gelu(h @ params[name]["kernel"] + params[name]["bias"][None, :])
    grams["head"] = h.T @ h
    return grams


def gptq_tree(params: dict, grams: dict, spec: jq.QuantSpec) -> dict:
    """``params`` with the dense kernels quantized by `jaxquant.gptq`, the table by ``spec``."""
    out = jq.quantize_tree(params, [("embed", spec)])
    for name, gram in grams.items():
        qt = jq.gptq(params[name]["kernel"], gram, dtype=spec.dtype, axis=spec.axis,
                     block_size=spec.block_size)
        out[name] = {**out[name], "kernel": jq.pack(qt) if spec.packed else qt}
    return out


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
    ("int8 W8A8", "per-channel", jq.QuantSpec()),
    ("uint8 (asym)", "per-channel", jq.QuantSpec(dtype=jnp.uint8, symmetric=False)),
    ("float8_e4m3fn", "per-channel", jq.QuantSpec(dtype=jnp.float8_e4m3fn)),
    ("float8_e5m2", "per-channel", jq.QuantSpec(dtype=jnp.float8_e5m2)),
    ("int4", "per-channel", jq.QuantSpec(dtype=jnp.int4, packed=True)),
    ("int4", "block 32", jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32, packed=True)),
    ("float4_e2m1fn", "block 32", jq.QuantSpec(dtype=jnp.float4_e2m1fn, axis=0, block_size=32,
                                               packed=True)),
    ("nf4", "block 64", jq.QuantSpec(dtype="nf4", axis=0, packed=True)),
    ("mxfp4", "block 32", jq.QuantSpec(dtype="mxfp4", axis=0, packed=True)),
    ("nvfp4", "block 16", jq.QuantSpec(dtype="nvfp4", axis=0, packed=True)),
    ("int2", "block 16", jq.QuantSpec(dtype=jnp.int2, axis=0, block_size=16, packed=True)),
    ("int2 GPTQ", "block 16", jq.QuantSpec(dtype=jnp.int2, axis=0, block_size=16, packed=True)),
]


def run(steps: int = 1500, print_fn: Callable[[str], None] = print,
        progress: bool = False) -> list[dict]:
    """Trains, quantizes and evaluates; prints the table and returns its rows.

    ``progress``: tqdm bars on stderr over the training steps and over the formats
    (when tqdm is installed); what ``print_fn`` gets is the same either way.
    """
    t0 = time.perf_counter()
    train_data, val_data = load_corpus()
    print_fn(f"jaxquant {jq.__version__} on {jax.devices()[0].platform}: corpus = Python "
             f"stdlib sources, {len(train_data):,} train / {len(val_data):,} validation bytes")
    params = train(train_data, steps, progress=progress)
    print_fn(f"trained a byte-level MLP ({jq.tree_nbytes(params):,} bytes of float32 "
             f"parameters) for {steps} steps in {time.perf_counter() - t0:.1f} s")
    val = validation_batches(val_data)
    grams = jax.jit(input_grams)(params, next(batches(train_data, 4096, seed=2))[0])

    @functools.partial(jax.jit, static_argnums=1)
    def evaluate(p, act_quant):
        return jnp.mean(jnp.stack([jnp.stack(_metrics(p, b, act_quant)) for b in val]), axis=0)

    rows, reports = [], {}
    with progress_bar(CONFIGS, enabled=progress, desc="quantizing", unit="format") as bar:
        for fmt, gran, spec in bar:
            bar.set_postfix_str(f"{fmt}, {gran}")
            rules = None if spec is None else [("embed|kernel", spec)]
            if spec is None:
                qparams, seconds = params, math.nan
            else:
                if "GPTQ" in fmt:  # calibrated on 4096 training windows
                    # the Gram matrices as arguments: constants would be folded at compile time
                    gptq = jax.jit(lambda p, g, spec=spec: gptq_tree(p, g, spec))
                    convert = lambda p, gptq=gptq: gptq(p, grams)  # noqa: E731
                else:
                    convert = jax.jit(lambda p, rules=rules: jq.quantize_tree(p, rules))
                qparams = convert(params)
                seconds = median_time(lambda convert=convert: convert(params))
            snr, worst = sqnr_db(params, jq.dequantize_tree(qparams))
            loss, acc = (float(v) for v in evaluate(qparams, jq.ActQuant() if "W8A8" in fmt
                                                     else None))
            rows.append(dict(format=fmt, granularity=gran, bytes=jq.tree_nbytes(qparams),
                             sqnr_db=snr, max_error=worst, quantize_ms=1e3 * seconds,
                             val_bits_per_byte=loss, val_accuracy=acc))
            reports[fmt, gran] = qparams
    print_fn(format_table(rows))
    print_fn("time ms: compiled quantize_tree of the whole tree (median of 5); dense layers "
             "run as jq.qdot_general: weight-only, or int8 x int8 -> int32 (W8A8); GPTQ: "
             "jq.gptq with each dense layer's input Gram matrix over 4096 training windows")
    print_fn("\nper-leaf report, int4 blocks of 32 along the input axis:")
    print_fn(format_report(quantization_report(params, reports["int4", "block 32"])))
    print_fn(f"total {time.perf_counter() - t0:.1f} s")
    return rows


def format_table(rows: list[dict]) -> str:
    """The demo's rows as an aligned text table."""
    base = rows[0]["bytes"]
    head = (f"{'format':<14} {'granularity':<12} {'bytes':>10} {'x float':>8} {'SQNR dB':>8} "
            f"{'max err':>9} {'time ms':>8} {'val bits/byte':>14} {'acc %':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        snr = "inf" if math.isinf(r["sqnr_db"]) else f"{r['sqnr_db']:.1f}"
        lines.append(f"{r['format']:<14} {r['granularity']:<12} {r['bytes']:>10,} "
                     f"{r['bytes'] / base:>8.3f} {snr:>8} {r['max_error']:>9.2e} "
                     f"{r['quantize_ms']:>8.2f} {r['val_bits_per_byte']:>14.4f} "
                     f"{100 * r['val_accuracy']:>6.2f}"
                     .replace(" nan", "   -"))
    return "\n".join(lines)
