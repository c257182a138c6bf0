"""Choosing scales (and zero points) from the data, per group of elements.

Symmetric integer formats map ``absmax`` to ``qmax`` (0.0 stays exactly 0.0);
unsigned formats then use the mid-range zero point, as PyTorch's symmetric
``quint8``. Asymmetric integer formats map ``[min(x, 0), max(x, 0)]`` onto
``[qmin, qmax]`` with an integer zero point (PyTorch's MinMaxObserver
formula). Float formats map ``absmax`` to the largest finite value.

Groups of zeros get scale 1 (their codes are zeros, never NaN or inf), and
scales are kept at or above the smallest normal float32, because XLA:CPU
flushes subnormals to zero. A group whose largest magnitude is subnormal reads
as zeros there, so it gets scale 1 (and codes 0) on every backend. Every
division is `divide` (correctly rounded), so the scale is the same number
eagerly, under ``jit`` and on every backend (XLA would otherwise turn
``amax / 127`` into ``amax * (1 / 127)`` under ``jit``, and XLA:GPU's own
division is up to 2 ulps off). A range wider than float32's
largest value gets ``hi / n - lo / n`` where ``(hi - lo) / n`` would overflow,
and empty arrays get scale 1 for every (empty) group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant._formats import Format
from jaxquant._granularity import Layout, group_reduce
from jaxquant._rounding import SMALLEST_NORMAL, divide

__all__ = ["compute_scale", "scale_from_range", "group_absmax"]


def _safe(scale: jax.Array, amax: jax.Array) -> jax.Array:
    """Scales of at least the smallest normal where the group's largest magnitude ``amax``
    is normal (also where the quotient underflowed to 0: a group of tiny values keeps them);
    groups of zeros or subnormals 1 (XLA:CPU reads subnormals as zeros, XLA:GPU does not:
    a test ``amax > 0`` would give them 1 on one and the smallest normal on the other),
    NaN groups NaN."""
    fallback = jnp.where(jnp.isnan(scale), scale, jnp.float32(1))
    return jnp.where(amax >= SMALLEST_NORMAL, jnp.maximum(scale, SMALLEST_NORMAL), fallback)


def scale_from_range(
    lo: jax.Array, hi: jax.Array, fmt: Format, symmetric: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Scale and zero point that map the range ``[lo, hi]`` onto ``fmt``.

    Args:
      lo: per-group minima (float32).
      hi: per-group maxima (float32), same shape.
      fmt: the format.
      symmetric: symmetric around zero (``max(|lo|, |hi|)``) or affine.

    Returns:
      ``(scale, zero_point)``: float32 scales, and ``None`` or zero points of
      ``fmt.dtype``.

    Example:
      >>> from jaxquant._formats import get_format
      >>> s, z = scale_from_range(jnp.float32(-1), jnp.float32(3), get_format("uint8"), False)
      >>> float(s), int(z)
      (0.01568627543747425, 64)
    """
    if symmetric or not fmt.is_integer:
        amax = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
        if not fmt.is_integer or fmt.signed:
            return _safe(divide(amax, jnp.float32(fmt.qmax)), amax), None
        mid = (int(fmt.qmax) + 1) // 2
        scale = _safe(divide(amax, jnp.float32(fmt.qmax - mid)), amax)
        return scale, jnp.full(scale.shape, mid, fmt.dtype)
    lo = jnp.minimum(lo, 0.0)
    hi = jnp.maximum(hi, 0.0)
    n = jnp.float32(fmt.qmax - fmt.qmin)
    span = hi - lo  # overflows to inf for finite ranges wider than float32's largest value
    scale = jnp.where(jnp.isinf(span) & jnp.isfinite(lo) & jnp.isfinite(hi),
                      divide(hi, n) - divide(lo, n), divide(span, n))
    scale = _safe(scale, jnp.maximum(hi, -lo))  # not span: two subnormals add up to a normal
    zp = jnp.float32(fmt.qmin) - jnp.round(divide(lo, scale))
    return scale, jnp.clip(zp, fmt.qmin, fmt.qmax).astype(fmt.dtype)


def group_absmax(x: jax.Array, layout: Layout) -> jax.Array:
    """``max(|x|)`` of each group of float32 ``x``, NaN for a group holding one.

    One pass over memory: per tensor or axis, a reduction of ``|x|``, with several devices
    an integer maximum of its bits (a group may span devices, and XLA's float reductions
    across devices drop a NaN; integer ones are exact); over blocks and tiles,
    ``max(-min, max)`` (XLA:CPU writes ``|x|`` out to memory for a blocked reduction of
    it), whose float comparisons on CPU read subnormals as zero, so there a block of
    subnormals has maximum 0 (float scales treat it as all zeros, as they treat any
    group whose maximum is subnormal; power-of-two scales read its exponent from the
    bits: `jaxquant._scale_formats.pow2_group_scales`).
    """
    if layout.kind in ("tensor", "axis"):
        return _group_extreme(jnp.abs(x), layout, jnp.max)
    return jnp.maximum(-group_reduce(x, layout, jnp.min), group_reduce(x, layout, jnp.max))


def _several_devices() -> bool:
    """Whether a group may span devices. XLA:CPU's integer reductions are 1.5-3x slower than
    its float ones (3072 x 768, 2-core AMD EPYC, 2026-11-29), so one device keeps the float
    reduction, exact there."""
    return jax.device_count() > 1


def _flip(i: jax.Array) -> jax.Array:
    """int32 bits of float32 values to keys in the floats' order (NaN beyond +-inf, by
    sign), and back: the map is its own inverse."""
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _group_extreme(x: jax.Array, layout: Layout, reducer) -> jax.Array:
    """``group_reduce(x, layout, reducer)`` for ``jnp.min`` / ``jnp.max``, NaN kept where a
    per-tensor or per-axis group may span devices: XLA's float reductions across devices
    drop a NaN, so those reduce ordered integer keys of the bits, which they compare
    exactly."""
    if layout.kind not in ("tensor", "axis") or not _several_devices():
        return group_reduce(x, layout, reducer)
    keys = _flip(lax.bitcast_convert_type(x, jnp.int32))
    return lax.bitcast_convert_type(_flip(group_reduce(keys, layout, reducer)), jnp.float32)


def compute_scale(
    x: jax.Array, fmt: Format, layout: Layout, symmetric: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Scale and zero point chosen from ``x`` over each group of ``layout``.

    Returns:
      ``(scale, zero_point)`` of ``layout.scale_shape(x.shape)``; see
      `scale_from_range`. The scale is a constant for differentiation.
    """
    x = jax.lax.stop_gradient(x.astype(jnp.float32))
    if (symmetric or not fmt.is_integer) and layout.kind in ("tensor", "axis"):
        amax = group_absmax(x, layout)  # one pass over memory
        return scale_from_range(amax, amax, fmt, symmetric=True)
    # Blocks and tiles (and ranges): a min and a max, fused into one pass (see `group_absmax`).
    lo = _group_extreme(x, layout, jnp.min)
    hi = _group_extreme(x, layout, jnp.max)
    return scale_from_range(lo, hi, fmt, symmetric)
