"""The CPU's float32 division, subnormal operands included.

XLA:CPU reads float32 subnormals as zero and flushes subnormal results to zero
(the x86 DAZ/FTZ modes). The division instruction itself is correctly rounded,
so `jaxquant._rounding.divide` uses it on CPU, with a subnormal ``x`` read from
its bits (``x * 2**126``, exact) and divided by ``scale * 2**126``, and a
subnormal ``scale`` scaled by ``2**64`` from its bits and the quotient
multiplied back (a quotient below ``2**-126`` becomes zero, which changes no
code of any format); `scale_factors` does the same for products with a
subnormal scale (dequantization). What a caller knows about the scales spares
work per element (`CPU_DIVISIONS`): computed scales are never subnormal (at
least ``2**-126``, 1, inf or NaN), so their rescaling is skipped.

What is left, the rescaling of subnormal inputs, makes int8 quantization of a
3072 x 768 array about a fifth slower than the same maths without it (2.1
against 1.7 ms; 2-core Xeon, 2026-11-27). Skipping it too where every scale is
at least ``2**-100`` (a subnormal input then gets a zero code anyway) is exact,
but needs a branch (``lax.cond``) that compiles the loop twice: 78 -> 144 ms of
compile time for that array against 0.6 ms saved per call, a loss for one-time
conversions; not done.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant._corrected_division import bits, from_bits

__all__ = ["CPU_DIVISIONS", "scale_factors"]

_F32, _I32 = jnp.float32, jnp.int32


def _subnormal_scaled_up(a: jax.Array, power: int = 64) -> tuple[jax.Array, jax.Array]:
    """``(a * 2**power, True)`` where ``a`` is subnormal or zero, else ``(a, False)``; exact.

    XLA:CPU flushes subnormal operands to zero, so the product is formed from
    the bits: a subnormal's bits (sign apart) are its mantissa ``m``, and
    ``a * 2**power == m * 2**(power - 149)``, a normal float32 for ``power`` in
    ``[23, 126]`` (a zero stays the same zero). The sign is or-ed back into the
    bits: fewer operations per element than a selection.
    """
    b = bits(a)
    m = b & _I32(0x7FFFFFFF)
    up = from_bits(bits(m.astype(_F32) * _F32(2.0**(power - 149))) | (b & _I32(-(2**31))))
    sub = m < 0x00800000
    return jnp.where(sub, up, a), sub


def scale_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s, f)``: ``scale == s * f`` exactly, ``s`` normal (or 0, inf, NaN), ``f`` 1 or ``2**-64``.

    ``v * scale`` computed as ``(v * s) * f`` is rounded once, as the product
    itself, even where XLA:CPU would read a subnormal ``scale`` as zero (the
    product is flushed to zero only where it is itself below ``2**-126``).
    Computed on the scale's own (small) shape, before it is broadcast.

    Example:
      >>> import numpy as np
      >>> s, f = scale_factors(jnp.float32(1e-40))
      >>> float(f)
      5.421010862427522e-20
      >>> bool(jnp.float32(3e4) * s * f == np.float32(3e4) * np.float32(1e-40))  # not 0
      True
    """
    s, sub = _subnormal_scaled_up(jnp.asarray(scale, _F32))
    return s, jnp.where(sub, _F32(2.0**-64), _F32(1))


def _plain_division(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` by the division instruction, a subnormal ``scale`` scaled up by
    ``2**64`` (the quotient multiplied back), a subnormal ``x`` as `_division_by_normal`.

    The selection in the divisor keeps XLA from rewriting ``x / broadcast(s)``
    as ``x * (1 / s)``. A quotient that ends below ``2**-126`` is flushed to
    zero, which changes no code's value in any format (the smallest nonzero code
    magnitude of every format is ``2**-17`` or more). One sign differs: with a float4
    zero point (all zeros, as ONNX allows), a negative quotient flushed to -0.0 is
    taken for an exact -0.0, which adding the zero point makes +0.0, where ONNX keeps
    the -0.0 code of its negative subnormal sum.
    """
    scale, s_sub = _subnormal_scaled_up(scale)
    return _division_by_normal(x, scale) * jnp.where(s_sub, _F32(2.0**64), _F32(1))


def _division_by_normal(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`_plain_division` for a ``scale`` that holds no subnormal, with fewer operations per
    element (XLA computes a broadcast scale's terms again for every element).

    A subnormal ``x``, ``m * 2**-149`` (``m`` its bits, sign apart), is divided as
    ``m * 2**-23`` (normal, exact) by ``scale * 2**126`` (exact where finite; it
    overflows only where ``|scale| >= 4``, whose quotient is below ``2**-126`` and
    flushed to zero anyway). The selected divisor also keeps XLA from rewriting the
    division as a product with ``1 / scale``.
    """
    x, sub = _subnormal_scaled_up(x, power=126)
    return x / jnp.where(sub, scale * _F32(2.0**126), scale)


CPU_DIVISIONS = {"any": _plain_division, "normal": _division_by_normal}
"""`divide` on CPU, by ``scale_kind`` (the tests and `benchmarks.division_routes` swap them)."""
