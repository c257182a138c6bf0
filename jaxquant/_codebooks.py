"""Codes of codebook formats (NF4, FP4, float6): nearest table entry and table lookup.

The value compared is ``x * (1 / scale)`` for NF4 and FP4, as bitsandbytes
computes it (a float32 reciprocal of the block's absmax, then a product), and
the correctly rounded ``x / scale`` for float6. Encoding compares each value
with the midpoints between neighbouring table entries (sorted by value, or
by magnitude for sign-magnitude tables), exactly as bitsandbytes'
``dQuantizeNF4`` / ``dQuantizeFP4`` decision trees do: the
number of midpoints below a value is its rank. Midpoints are computed in
float64 and rounded to float32, which reproduces bitsandbytes' NF4 threshold
constants; its FP4 constants are 7-digit literals (``0.583333`` for 7/12), so
the 20 float32 magnitudes between three of them and the midpoints take the
nearer entry here, the other one in bitsandbytes. A value exactly on a
midpoint goes down (bitsandbytes:
``x > threshold``; toward zero for FP4) or, for the IEEE-style float6 tables,
to the code with the even bit pattern (round half to even). Values beyond the
table saturate to its ends; NaN becomes the code of 0 (no code holds NaN).

Decoding is a lookup in the table, written as a chain of selects (16 for
NF4/FP4) or, for the float6 tables, as the minifloat's own arithmetic (sign,
exponent and mantissa fields): no gather, so it vectorizes on CPU and keeps
the codes' sharding on a mesh with explicit axes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxquant._formats import Format

__all__ = ["encode", "decode", "code_values"]


@functools.cache
def _tables(fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sorted values, their codes, midpoints, tie-goes-up flags), as NumPy constants."""
    values = np.asarray(fmt.values, np.float64)
    codes = np.arange(len(values))
    if fmt.sign_magnitude:  # rank magnitudes only: the sign bit is set apart
        half = len(values) // 2
        values, codes = values[:half], codes[:half]
    order = np.argsort(values, kind="stable")
    values, codes = values[order], codes[order]
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    up = (codes[1:] % 2 == 0) if fmt.ties == "even" else np.zeros(len(mids), bool)
    return values.astype(np.float32), codes.astype(np.uint8), mids, up


def _rank(a: jax.Array, mids: np.ndarray, up: np.ndarray) -> jax.Array:
    """Number of midpoints below ``a`` (ties counted where ``up``), as int32."""
    k = jnp.zeros(a.shape, jnp.int32)
    for m, u in zip(mids.tolist(), up.tolist(), strict=True):
        k = k + ((a >= m) if u else (a > m)).astype(jnp.int32)
    return k


def _lookup(table: np.ndarray, idx: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``table[idx]`` for a small constant table: a tree of selects on the bits of ``idx``."""
    values = table.tolist()
    values += values[-1:] * ((1 << max(len(values) - 1, 1).bit_length()) - len(values))
    out = [jnp.asarray(v, dtype) for v in values]
    bit = 0
    while len(out) > 1:
        on = ((idx >> bit) & 1) == 1
        out = [jnp.where(on, out[j + 1], out[j]) for j in range(0, len(out), 2)]
        bit += 1
    return jnp.broadcast_to(out[0], idx.shape)


def _stochastic_rank(a: jax.Array, values: np.ndarray, u: jax.Array) -> jax.Array:
    """Lower neighbour's rank, plus one with probability (a - lower) / (upper - lower)."""
    k = jnp.zeros(a.shape, jnp.int32)
    for v in values[1:].tolist():
        k = k + (a >= v).astype(jnp.int32)
    lo = _lookup(values, k)
    hi = _lookup(values, jnp.minimum(k + 1, len(values) - 1))
    gap = hi - lo
    p = jnp.where(gap > 0, (a - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    return k + (u < p).astype(jnp.int32)


def encode(t: jax.Array, fmt: Format, noise: jax.Array | None = None) -> jax.Array:
    """Codes (uint8 holding ``fmt.bits`` bits) of the table entries nearest to ``t``.

    Args:
      t: float32 quotients ``x / scale``.
      fmt: a codebook format.
      noise: ``None`` (round to nearest) or uniform ``[0, 1)`` draws of ``t``'s
        shape (stochastic rounding between the two neighbouring entries).

    Returns:
      uint8 codes of ``t``'s shape.
    """
    values, codes, mids, up = _tables(fmt)
    t = jnp.where(jnp.isnan(t), 0.0, t.astype(jnp.float32))
    a = jnp.abs(t) if fmt.sign_magnitude else t
    a = jnp.clip(a, values[0], values[-1])
    k = _rank(a, mids, up) if noise is None else _stochastic_rank(a, values, noise)
    identity = np.array_equal(codes, np.arange(len(codes)))
    c = k.astype(jnp.uint8) if identity else _lookup(codes, k, jnp.uint8)
    if fmt.sign_magnitude:
        c = c | (jnp.signbit(t).astype(jnp.uint8) << np.uint8(fmt.bits - 1))
    return c


def decode(codes: jax.Array, fmt: Format) -> jax.Array:
    """float32 table values of integer ``codes`` of a codebook format."""
    dt = getattr(ml_dtypes, fmt.name, None)
    if dt is None:
        return _lookup(np.asarray(fmt.values, np.float32), codes.astype(jnp.uint8))
    from jaxquant._rounding import pow2  # (imports this module)

    info = ml_dtypes.finfo(dt)
    m, emin = int(info.nmant), int(info.minexp)
    c = codes.astype(jnp.int32)
    mag = c & ((1 << (fmt.bits - 1)) - 1)
    e, mant = mag >> m, (mag & ((1 << m) - 1)).astype(jnp.float32)
    # subnormal (e == 0): mant * 2**(emin - m); normal: (2**m + mant) * 2**(emin + e - 1 - m)
    v = jnp.where(e == 0, mant, mant + (1 << m)) * pow2(jnp.maximum(e, 1) + emin - 1 - m)
    return jnp.where((c >> (fmt.bits - 1)) == 1, -v, v)


def code_values(t: jax.Array, fmt: Format, noise: jax.Array | None = None) -> jax.Array:
    """float32 values of the codes `encode` picks (for fake quantization)."""
    return decode(encode(t, fmt, noise), fmt)
