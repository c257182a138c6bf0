"""Calibration for the MiniLM benchmark: clip-searched scales, the calibration text
(standard-library docstrings and the language reference's prose, never the evaluation
sentences) and each Dense layer's input Gram matrix for GPTQ. Re-exported by
`benchmarks.minilm`.
"""

from __future__ import annotations

import importlib
import pydoc_data.topics
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq

RATIOS = tuple(np.round(np.linspace(0.5, 1.0, 26), 2).tolist())


@jax.jit
def _group_sum(err: jax.Array, scale: jax.Array) -> jax.Array:
    """Sums a kernel's ``(in, out)`` errors over each scale group (per-channel or blocks on axis 0)."""
    if scale.ndim == 1:
        return err.sum(axis=0)
    blocks = scale.shape[0]
    return err.reshape(blocks, err.shape[0] // blocks, err.shape[1]).sum(axis=1)


def clip_searched(spec: jq.QuantSpec, ratios=RATIOS):
    """``spec`` as a leaf function whose scales minimize each group's squared weight error.

    For a 2-D kernel quantized per channel (``axis=-1``) or in blocks along axis 0:
    each group's scale is its absmax scale times the ratio in ``ratios`` giving the
    least ``sum((dequantize(quantize(w)) - w) ** 2)`` over the group.

    Raises:
      ValueError: any other layout.
    """
    if not (spec.axis == -1 and spec.block_size is None
            or spec.axis == 0 and spec.block_size is not None):
        raise ValueError(f"spec must be per channel (axis=-1) or blocked along axis 0, got "
                         f"{spec!r}.")

    def quantize(w: jax.Array) -> jq.QTensor:
        base = jq.quantize(w, dtype=spec.dtype, axis=spec.axis, block_size=spec.block_size)
        best_err = best_scale = None
        for r in ratios:
            scale = base.scale * jnp.float32(r)
            qt = jq.quantize(w, scale, dtype=spec.dtype, axis=spec.axis,
                             block_size=spec.block_size)
            err = _group_sum(jnp.square(jq.dequantize(qt) - w), scale)
            if best_err is None:
                best_err, best_scale = err, scale
            else:
                better = err < best_err
                best_err = jnp.where(better, err, best_err)
                best_scale = jnp.where(better, scale, best_scale)
        qt = jq.quantize(w, best_scale, dtype=spec.dtype, axis=spec.axis,
                         block_size=spec.block_size)
        return jq.pack(qt) if spec.packed else qt

    return quantize


CALIBRATION_MODULES = (
    "argparse", "bisect", "collections", "csv", "datetime", "decimal", "email", "fractions",
    "functools", "heapq", "http", "itertools", "json", "logging", "os", "pathlib", "queue",
    "random", "re", "shutil", "sqlite3", "statistics", "string", "subprocess", "tempfile",
    "textwrap", "threading", "unittest", "urllib", "zipfile", "abc", "ast", "base64",
    "calendar", "codecs", "configparser", "contextlib", "copy", "dataclasses", "difflib",
    "dis", "doctest", "enum", "filecmp", "fileinput", "fnmatch", "getopt", "gettext", "glob",
    "gzip", "hashlib", "hmac", "inspect", "ipaddress", "locale", "mailbox", "mimetypes",
    "numbers", "operator", "optparse", "pickle", "platform", "plistlib", "pprint", "pstats",
    "pydoc", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex", "signal",
    "smtplib", "socketserver", "struct", "tarfile", "timeit", "tokenize", "trace",
    "traceback", "types", "typing", "uuid", "warnings", "weakref",
)
"""Standard-library modules whose docstrings give GPTQ's calibration sentences."""


def calibration_sentences(count: int | None = None) -> list[str]:
    """The sentences (30-200 characters) of `CALIBRATION_MODULES`' docstrings, the first
    ``count`` of them (None: all, 470 on Python 3.11).

    Real English every Python install carries, and none of the evaluation `SENTENCES`.
    """
    sentences = []
    for name in CALIBRATION_MODULES:
        text = " ".join((importlib.import_module(name).__doc__ or "").split())
        sentences += [s for s in re.split(r"(?<=[.!?])\s+", text) if 30 < len(s) < 200]
    return sentences[:count]


CODE_LIKE = re.compile(r"[{}\[\]=<>|*_]")


def reference_sentences() -> list[str]:
    """The sentences (30-200 characters, no code-like characters) of ``pydoc_data.topics``
    (the language reference's prose), 1358 on Python 3.11."""
    text = " ".join(" ".join(pydoc_data.topics.topics.values()).split())
    return [s for s in re.split(r"(?<=[.!?])\s+", text)
            if 30 < len(s) < 200 and not CODE_LIKE.search(s)]


def word_runs(sentences: list[str], seed: int = 0) -> list[str]:
    """Two runs of 2-10 consecutive words cut from each sentence (the whole sentence
    where it is shorter), in order: short inputs that lean on the [CLS] and [SEP]
    tokens, as short evaluation sentences do."""
    rng = np.random.default_rng(seed)
    runs = []
    for s in sentences:
        words = s.split()
        for _ in range(2):
            n = int(rng.integers(2, 11))
            start = int(rng.integers(0, max(1, len(words) - n + 1)))
            runs.append(" ".join(words[start:start + n]))
    return runs


def calibration_texts() -> list[str]:
    """GPTQ's calibration text: `calibration_sentences`, then the `word_runs` of those and
    of `reference_sentences` (4126 texts on Python 3.11).

    The short runs matter: with the sentences alone, int4 GPTQ fits the long-input
    statistics and the shortest evaluation sentences lose the most.
    """
    sentences = calibration_sentences()
    return sentences + word_runs(sentences + reference_sentences())


def input_grams(model, params: dict, batch: dict, batch_size: int = 256
                ) -> dict[str, np.ndarray]:
    """``sum x^T x`` over the real (unpadded) tokens of every ``nn.Dense`` input.

    Keys are module paths (``encoder/layer_0/attention/self/query``); runs ``model``
    eagerly on ``batch``, ``batch_size`` rows at a time (each cut to its longest row),
    with an interceptor that reads each Dense layer's input.
    """
    grams: dict[str, np.ndarray] = {}
    tokens = None

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and type(context.module) is nn.Dense:
            x = np.asarray(args[0], np.float64).reshape(-1, args[0].shape[-1])[tokens]
            path = "/".join(context.module.scope.path)
            grams[path] = grams.get(path, 0) + x.T @ x
        return next_fun(*args, **kwargs)

    mask = np.asarray(batch["attention_mask"]).astype(bool)
    for i in range(0, len(mask), batch_size):
        width = int(mask[i:i + batch_size].sum(axis=1).max())
        tokens = mask[i:i + batch_size, :width].reshape(-1)
        with nn.intercept_methods(record):
            model.apply(params, **{k: v[i:i + batch_size, :width] for k, v in batch.items()})
    return {k: v.astype(np.float32) for k, v in grams.items()}
