"""float32 arithmetic rounded once, as PyTorch's kernels round it.

PyTorch mixes float32 tensors, float64 scalars and float64 accumulators
(``torch.cumsum``, ``torch.linspace``'s FMA): a result rounded once to float32.
These helpers get the same single rounding from float32 pieces that multiply
and add exactly (x64 off), for `jaxquant._histogram`'s emulation of
``HistogramObserver``; `no_fma` keeps XLA:CPU from fusing a product that
PyTorch rounds before the add.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant._rounding import exponent, pow2

__all__ = ["no_fma", "split", "pieces8", "exact_sum", "cumsum", "fma_int", "power_of_two"]

_F32 = jnp.float32


def no_fma(p: jax.Array) -> jax.Array:
    """``p`` (NaN included), hidden by a select from XLA:CPU's FMA contraction of a following
    add: PyTorch's separate tensor ops round the product first."""
    return jnp.where(p == p, p, _F32(jnp.nan))


def split(a: jax.Array, mask: int) -> tuple[jax.Array, jax.Array]:
    """``a == hi + lo`` exactly, ``hi`` keeping the bits under ``mask``."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(mask), _F32)
    return hi, a - hi


def pieces8(a: jax.Array) -> tuple[jax.Array, ...]:
    """Three floats of at most 8 significant bits summing exactly to ``a``."""
    a1, r = split(a, 0xFFFF0000)
    a2, a3 = split(r, 0xFFFF0000)
    return a1, a2, a3


def exact_sum(*terms: jax.Array) -> jax.Array:
    """``sum(terms)`` rounded once (cascaded TwoSum; exact for the few-bit terms used here)."""
    s, err = terms[0], _F32(0)
    for t in terms[1:]:
        new = s + t
        bb = new - s
        err = err + ((s - (new - bb)) + (t - bb))
        s = new
    return s + err


def cumsum(x: jax.Array) -> jax.Array:
    """``cumsum`` of a 1-D ``x``, each prefix rounded once to float32, as ``torch.cumsum``
    (which accumulates in float64): a sequential scan carrying ``hi + lo`` exactly."""
    def add(carry, v):
        hi, lo = carry
        s = hi + v
        bb = s - hi
        lo = lo + ((hi - (s - bb)) + (v - bb))
        out = s + lo
        return (out, lo - (out - s)), out

    return lax.scan(add, (_F32(0), _F32(0)), x)[1]


def fma_int(a: jax.Array, n: jax.Array, c: jax.Array) -> jax.Array:
    """``round(a * n + c)`` with one rounding, for integer-valued ``0 <= n < 2**16``."""
    return exact_sum(c, *(p * n for p in pieces8(a)))


def power_of_two(m: jax.Array, low: int = -126) -> jax.Array:
    """``2**k`` taking ``|m|`` into ``[1, 2)``, ``k`` in ``[low, 126]`` (``2**low``: inf, NaN).

    Scaling by it is exact and keeps every rounding (nothing becomes subnormal, which
    XLA:CPU flushes to zero, or overflows).
    """
    k = -exponent(m)
    return pow2(jnp.where(jnp.isfinite(m), jnp.clip(k, low, 126), low))
