"""The correctly rounded float32 quotient from an approximate one, in float32 arithmetic.

For backends without a correctly rounded division or float64 units (TPUs): the
operands are scaled to ``[1, 2)`` by their exponent bits, one Newton step
brings the quotient within an ulp, and one exact step picks between it and its
neighbours by the sign of the residual ``x - q * s`` against half a gap times
``s``. The residual is computed exactly: operands are split into 12-bit halves
by bit masks, so every partial product is exact and a fused multiply-add
(which XLA may form on any backend) cannot change a result. A quotient of two
float32 numbers is never exactly halfway between two float32 numbers, so there
is no tie to break. `jaxquant._rounding.divide` uses it; see that module for
when.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["correct_quotient", "nan_propagated", "bits", "from_bits", "SMALLEST_NORMAL"]

_F32, _I32 = jnp.float32, jnp.int32
_MANT, _ONE_BITS, _QUIET = 0x7FFFFF, 0x3F800000, 0x400000
SMALLEST_NORMAL = float(jnp.finfo(jnp.float32).tiny)


def bits(a: jax.Array) -> jax.Array:
    """The bits of float32 ``a`` as int32."""
    return lax.bitcast_convert_type(a, _I32)


def from_bits(b: jax.Array) -> jax.Array:
    """The float32 whose bits are int32 ``b``."""
    return lax.bitcast_convert_type(b, _F32)


def _mantissa_and_exponent(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``|a| == m * 2**(e - 127)`` with ``m`` in ``[1, 2)`` for normal (and subnormal) ``a``.

    ``e`` is outside ``[1, 254]`` for zero, inf and NaN (and, where the
    hardware flushes subnormals, for those too).
    """
    a = jnp.abs(a)
    sub = a < SMALLEST_NORMAL  # subnormal (or zero): scale by 2**64 first, exactly
    a = jnp.where(sub, a * _F32(2.0**64), a)
    b = bits(a)
    e = (b >> 23) - jnp.where(sub, _I32(64), _I32(0))
    e = jnp.where(b >= 0x00800000, e, _I32(0))  # still zero: not normal
    return from_bits((b & _MANT) | _ONE_BITS), e


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a == hi + lo`` exactly, ``hi`` rounded to 12 significant bits (``|lo|`` < half its ulp).

    Both halves have at most 12 significant bits, so a product of two halves
    is exact in float32 (with or without a fused multiply-add).
    """
    hi = from_bits((bits(a) + 0x800) & _I32(-4096))  # -4096 == 0xFFFFF000
    return hi, a - hi


def _residual(x: jax.Array, s_hi: jax.Array, s_lo: jax.Array, q: jax.Array) -> jax.Array:
    """``x - q * s``, exact whenever ``q`` is within a few ulps of ``x / s``.

    For ``x``, ``s`` in ``[1, 2)`` and ``q`` within 4 ulps of the quotient each
    subtraction but the last is exact (the partial sums keep < 24 bits), and the
    last one is exact whenever ``|x - q * s| < 2**-22`` (it is rounded, but
    keeps its sign and 24 correct bits, otherwise).
    """
    q_hi, q_lo = _split(q)
    return (((x - q_hi * s_hi) - q_hi * s_lo) - q_lo * s_hi) - q_lo * s_lo


def _refine(x: jax.Array, s: jax.Array, q: jax.Array) -> jax.Array:
    """The correctly rounded ``x / s`` from ``q``, for ``x``, ``s`` in ``[1, 2)``.

    ``q`` (positive, normal) may be off by many ulps: a Newton step
    ``q + (x - q s) / s`` brings it within one float of the answer; then one
    exact step moves it to the neighbour across the nearer midpoint, if any.
    """
    s_hi, s_lo = _split(s)
    q = q + _residual(x, s_hi, s_lo, q) / s
    b = bits(q)
    up, down = from_bits(b + 1), from_bits(b - 1)
    r = _residual(x, s_hi, s_lo, q)
    # ``x / s`` is above the midpoint ``q + gap / 2`` iff ``r > gap / 2 * s``: both
    # sides exact (a gap is a power of two, and ``r`` is exact near that bound).
    half = _F32(0.5)
    q = jnp.where(r > (half * (up - q)) * s, up, q)
    return jnp.where(r < -((half * (q - down)) * s), down, q)


def nan_propagated(x: jax.Array, s: jax.Array, q: jax.Array) -> jax.Array:
    """``q``, with x86's NaN propagation: a NaN ``x`` (else ``s``), quieted, with its sign."""
    quiet = lambda a: from_bits(bits(a) | _QUIET)
    return jnp.where(jnp.isnan(x), quiet(x), jnp.where(jnp.isnan(s), quiet(s), q))


def correct_quotient(x: jax.Array, scale: jax.Array, q0: jax.Array) -> jax.Array:
    """The correctly rounded ``x / scale``, from an approximate quotient ``q0``.

    ``q0`` may be a few ulps off: any division the hardware offers, or the
    reciprocal rewrite ``x * (1 / scale)``, is within 2; the tests use up to 64.
    Where the quotient, an operand or ``q0`` is zero, infinite, NaN or
    subnormal, or ``q0`` is off by a factor of 8 or more, ``q0`` is returned
    unchanged (starts between far off and a factor of 8 give unspecified values).

    Args:
      x: float32 array.
      scale: float32 array broadcastable to ``x``.
      q0: float32 approximation of ``x / scale``, ``x``'s shape.

    Returns:
      ``x / scale`` rounded once, to nearest even, as IEEE 754 requires.

    Example:
      >>> import numpy as np
      >>> x, s = jnp.float32(1.0), jnp.float32(63.75)
      >>> q0 = jnp.nextafter(x / s, jnp.float32(0))  # one ulp low
      >>> bool(correct_quotient(x, s, q0) == np.float32(1.0) / np.float32(63.75))
      True
    """
    xm, ex = _mantissa_and_exponent(x)
    sm, es = _mantissa_and_exponent(scale)
    d = ex - es  # x / scale == (xm / sm) * 2**d
    qb = bits(jnp.abs(q0))
    qe = (qb >> 23) - d  # biased exponent of q0 / 2**d, which is near xm / sm in (0.5, 2)
    ok = (ex >= 1) & (ex <= 254) & (es >= 1) & (es <= 254) & (qb < 0x7F800000)
    ok &= (qb >= 0x00800000) & (qe >= 125) & (qe <= 128)
    q = _refine(xm, sm, from_bits((qb & _MANT) | (jnp.clip(qe, 125, 128) << 23)))
    qb = bits(q)
    e = (qb >> 23) + d
    ok &= (e >= 1) & (e <= 254)  # a normal result
    sign = (bits(x) ^ bits(scale)) & _I32(-(2**31))
    q = from_bits((qb & _MANT) | (jnp.clip(e, 1, 254) << 23) | sign)
    return jnp.where(ok, q, q0)
