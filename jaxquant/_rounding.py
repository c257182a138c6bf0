"""Exact float32 division and rounding to codes.

ONNX QuantizeLinear defines the code as ``rint(x / scale)`` with ``x / scale``
the correctly rounded (IEEE 754) float32 quotient. Two things stand between a
plain ``jnp`` expression and that definition:

* XLA's algebraic simplifier rewrites ``x / broadcast(s)`` as
  ``x * broadcast(1 / s)``. That is two roundings instead of one, and it moves
  about one quotient in 500 by an ulp: enough to push roughly one code in a
  million across an exact tie (``k + 0.5``) to the wrong side.
* A correct fix must not cost a pass over memory: quantization is
  memory-bound, so any extra full-size array would double its time.

`divide` keeps a true elementwise division by giving XLA a divisor it cannot
prove is a broadcast: ``where(x == x, s, 1)``. The selection never changes a
value (for NaN ``x`` the quotient is NaN either way), it fuses into the same
loop, and the division instruction (IEEE ``divps`` on CPU, ``div.rn.f32`` on
GPU) is correctly rounded. The tests check the codes bit for bit against the
ONNX reference on tens of millions of random values and on exact ties.

One limit is the hardware's, not ours: XLA:CPU flushes float32 subnormals to
zero, so scales below ``2**-126`` (about ``1.2e-38``) are not supported;
computed scales are clamped to that smallest normal number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant._formats import Format

__all__ = ["divide", "round_to_codes", "SMALLEST_NORMAL"]

SMALLEST_NORMAL = float(jnp.finfo(jnp.float32).tiny)
_INT32_LO, _INT32_HI = -2147483648.0, 2147483520.0  # float32 values that fit in int32


def divide(x: jax.Array, scale: jax.Array) -> jax.Array:
    """The correctly rounded float32 quotient ``x / scale``, elementwise.

    Args:
      x: float32 array.
      scale: float32 array broadcastable to ``x`` (typically a broadcast scale).

    Returns:
      ``x / scale`` rounded once, to nearest even, as IEEE 754 requires.

    Example:
      >>> import numpy as np
      >>> x = jnp.float32(0.3); s = jnp.float32(0.1)
      >>> bool(divide(x, s) == np.float32(0.3) / np.float32(0.1))
      True
    """
    return x / jnp.where(x == x, scale, jnp.float32(1))


def round_to_codes(
    t: jax.Array,
    zero_point: jax.Array | None,
    fmt: Format,
    saturate: bool = True,
    wide: bool = False,
) -> jax.Array:
    """Rounds float32 quotients ``t`` to codes of ``fmt``, as ONNX QuantizeLinear.

    Integer formats: ``clip(rint(t) + zero_point, qmin, qmax)`` with
    round-half-to-even and saturation at every magnitude (also beyond int32).
    Float formats: a round-to-nearest-even cast, clipped to the largest finite
    value first when ``saturate`` (NaN stays NaN).

    Args:
      t: float32 quotients ``x / scale``.
      zero_point: ``None`` or an array broadcastable to ``t`` holding zero points.
      fmt: the target format.
      saturate: float formats only; integer formats always saturate.
      wide: return integer codes of fewer than 8 bits as int8 (same values),
        skipping the slow sub-byte conversion when they are packed next.

    Returns:
      An array of ``fmt.dtype`` (or int8 when ``wide``) and ``t``'s shape.
    """
    if not fmt.is_integer:
        if zero_point is not None and fmt.bits < 8:
            # All zeros (checked by the caller). ONNX adds it for float4 only; adding it
            # for float8 would turn -0.0 into +0.0.
            t = t + zero_point.astype(jnp.float32)
        if saturate:
            t = jnp.clip(t, -fmt.max_finite, fmt.max_finite)
        return t.astype(fmt.dtype)
    r = jnp.round(t)  # round half to even
    if fmt.bits <= 16:
        # Whenever r + zero_point lands inside [qmin, qmax], |r| < 2**17 and the
        # float32 sum is exact; outside, rounding is monotone and the clip saturates.
        if zero_point is not None:
            r = r + zero_point.astype(jnp.float32)
        out = jnp.int8 if wide and fmt.bits < 8 else fmt.dtype
        return jnp.clip(r, fmt.qmin, fmt.qmax).astype(out)
    q = jnp.clip(r, _INT32_LO, _INT32_HI).astype(jnp.int32)
    if zero_point is None:
        return q
    zp = zero_point.astype(jnp.int32)
    lo = jnp.where(zp < 0, jnp.int32(fmt.qmin) - zp, jnp.int32(fmt.qmin))
    hi = jnp.where(zp > 0, jnp.int32(fmt.qmax) - zp, jnp.int32(fmt.qmax))
    return jnp.clip(q, lo, hi) + zp  # saturating add without int32 overflow
