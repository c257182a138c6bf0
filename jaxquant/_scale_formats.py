"""Scales stored in other dtypes than float32: powers of two, float8, and two levels.

A computed float32 scale (``absmax / max_finite`` per group) is stored as:

* ``float32`` (the default), ``bfloat16`` or ``float16``: rounded to nearest,
  except that a scale beyond the dtype's largest finite value is stored as
  that value (never inf: its group would dequantize to NaN), and one below
  its smallest normal is rounded up to the next representable value (never
  0, and never a subnormal below the ideal scale, whose coarse spacing would
  clip the group's largest values);
* ``float8_e8m0fnu`` (OCP Microscaling): a power of two ``2**e``. The
  exponent is chosen from the group's absmax by ``scale_rounding``:

  - ``"floor"``: ``e = floor(log2(absmax)) - emax``, the OCP MX v1.0 rule;
    ``emax`` is the exponent of the largest power of two within the element
    maximum ``top``: the largest finite value, or for unsigned integer formats
    ``qmax - zero_point`` (their symmetric codes sit around the mid-range zero
    point). The largest values of a group may then clip (up to 2x ``top``).
  - ``"ceil"``: the smallest ``e`` with ``absmax / 2**e <= top``: never
    clips, at the cost of one bit of resolution in some groups.
  - ``"up_on_overflow"``: ``"floor"``, raised by one only where the group's
    largest value would round beyond the element maximum; values that round
    down to the maximum keep the finer scale.

  Neither raises the exponent of a group whose absmax is at least ``2**127``:
  its largest value could round to ``2**128``, which float32 cannot hold (a
  finite value would dequantize to inf); such a group keeps the floor scale.
  Signed integer elements reach ``-(top + 1)``, and ``-(top + 1)`` times the
  largest scale ``2**(127 - emax)`` is ``-2**128`` too: inputs are read as at
  least ``-top * 2**(127 - emax)`` (`pow2_input_floor`), which changes only the
  codes of such groups (every other group's values are above it).

  Exponents are kept in ``[-126, 127]`` (XLA:CPU flushes float32 subnormals);
  a group whose absmax is a float32 subnormal gets ``2**-126`` (read from the
  bits: XLA:CPU compares subnormals as zero), never the scale 1 of all-zero groups.
* a float8 format (``float8_e4m3fn``, as NVFP4): a `QTensor` of float8 block
  scales with one float32 scale per tensor (``max(scale) / 448``), or, with
  ``double_quant``, one float32 scale per group of 256 block scales (tiles of
  256 consecutive scales: a part of the last axis, or whole rows of it), as
  bitsandbytes' nested quantization (it uses its own 8-bit dynamic code after
  subtracting the mean, this uses float8 codes: 8 bits per
  scale either way, relative precision kept for small scales). A block scale
  too small for float8 next to the largest of its group is kept at the
  smallest positive float8 code (never 0, so never a zeroed block). Groups of
  zeros (float32 scale 1) and groups holding a NaN or an infinity are left out
  of the second level's maxima (one of them would coarsen, or turn to NaN,
  every block scale of its tile); the block scale of a non-finite group is NaN,
  so that group alone dequantizes to NaN, as with float32 scales.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.custom_batching import custom_vmap
from jax.typing import DTypeLike

from jaxquant._barriers import keep_rounding
from jaxquant._corrected_division import bits as f32_bits
from jaxquant._formats import Format, get_format
from jaxquant._granularity import Layout, group_reduce
from jaxquant._rounding import exponent, pow2
from jaxquant._scales import compute_scale, group_absmax, scale_from_range

__all__ = ["ScaleOptions", "scale_options", "store_scale", "pow2_group_scales", "computed_scale",
           "pow2_input_floor", "DOUBLE_QUANT_BLOCK"]

ScaleRounding = Literal["floor", "ceil", "up_on_overflow"]
DOUBLE_QUANT_BLOCK = 256
_PLAIN = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ScaleOptions:
    """How computed scales are stored (static; part of the jit cache key)."""

    dtype: np.dtype | None = None  # None: float32
    rounding: ScaleRounding = "floor"
    double_quant: bool = False

    @property
    def plain(self) -> bool:
        """True when the scale is stored as float32 (no rounding, no second level)."""
        return (self.dtype is None or self.dtype == np.float32) and not self.double_quant

    @property
    def pow2(self) -> bool:
        """True when the stored scale is a power of two (``float8_e8m0fnu``)."""
        return self.dtype is not None and self.dtype.name == "float8_e8m0fnu"

    @property
    def two_level(self) -> bool:
        """True when the stored scale is a `QTensor` of float8 codes."""
        return self.double_quant or (self.dtype is not None and self.dtype.name.startswith(
            "float8") and self.dtype.name != "float8_e8m0fnu")


def scale_options(scale_dtype: DTypeLike | None, scale_rounding: str, double_quant: bool,
                  symmetric: bool) -> ScaleOptions:
    """Validated `ScaleOptions`, or a TypeError/ValueError naming the argument."""
    if scale_rounding not in ("floor", "ceil", "up_on_overflow"):
        raise ValueError(f"scale_rounding must be 'floor', 'ceil' or 'up_on_overflow', got "
                         f"{scale_rounding!r}.")
    dt = None
    if scale_dtype is not None:
        try:
            dt = np.dtype(scale_dtype)
        except TypeError:
            dt = None
        ok = dt is not None and (dt.name in _PLAIN or dt.name == "float8_e8m0fnu"
                                 or dt.name in ("float8_e4m3fn", "float8_e5m2"))
        if not ok:
            raise TypeError(f"scale_dtype must be one of float32, bfloat16, float16, "
                            f"float8_e8m0fnu, float8_e4m3fn, float8_e5m2; got {scale_dtype!r}.")
    if scale_rounding != "floor" and (dt is None or dt.name != "float8_e8m0fnu"):
        raise ValueError(f"scale_rounding={scale_rounding!r} rounds float8_e8m0fnu (power of two) "
                         f"scales; it has no effect on scale_dtype="
                         f"{'float32' if dt is None else dt.name}. Leave it at 'floor'.")
    options = ScaleOptions(dt, scale_rounding, bool(double_quant))
    if double_quant and dt is not None and dt.name not in ("float32", "float8_e4m3fn",
                                                           "float8_e5m2"):
        raise ValueError(f"double_quant quantizes float32 scales to float8; it cannot be "
                         f"combined with scale_dtype={dt.name} (given, or the format's own: "
                         f"MX formats store float8_e8m0fnu scales).")
    if not options.plain and not symmetric:
        raise ValueError("scale_dtype and double_quant need symmetric=True (no zero point).")
    return options


def _top(fmt: Format) -> float:
    """The largest magnitude a symmetric code reaches: ``qmax - zero_point`` for unsigned
    integers (their mid-range zero point), else the largest finite value."""
    if fmt.is_integer and not fmt.signed:
        return float(int(fmt.qmax) - (int(fmt.qmax) + 1) // 2)
    return fmt.max_finite


def _emax(fmt: Format) -> int:
    return math.floor(math.log2(_top(fmt)))


def pow2_input_floor(fmt: Format) -> float | None:
    """For signed integer elements on power-of-two scales, the value inputs are read as at
    least: ``-top * 2**(127 - emax)``, so that no code dequantizes to ``-2**128`` (``-inf``);
    ``None`` for other formats (their codes reach ``top`` at most)."""
    if not (fmt.is_integer and fmt.signed):
        return None
    return -_top(fmt) * 2.0 ** (127 - _emax(fmt))


def _half_top_gap(fmt: Format) -> tuple[float, bool]:
    """(half the gap above the largest element, whether a tie there rounds up)."""
    if fmt.is_integer:
        return 0.5, int(_top(fmt)) % 2 == 1
    dt = getattr(ml_dtypes, fmt.name, None) if fmt.is_codebook else fmt.dtype
    if dt is None:  # NF4 / FP4 tables: any value beyond the end overflows
        return 0.0, False
    gap = 2.0 ** (_emax(fmt) - int(ml_dtypes.finfo(dt).nmant))
    return gap / 2, round(fmt.max_finite / gap) % 2 == 1


def pow2_group_scales(x: jax.Array, amax: jax.Array, layout: Layout, fmt: Format,
                      rounding: ScaleRounding):
    """`pow2_scale` of the groups of float32 ``x`` (``amax``: their
    `jaxquant._scales.group_absmax`), exact for groups of float32 subnormals.

    On CPU, where such a group's maximum reads as 0, groups that read as zero are
    reduced again over the bits (ordered as the magnitudes), only when there are
    any; a group of subnormals then gets the smallest scale ``2**-126`` and keeps
    its codes, not the scale 1 of an all-zero group. The branch hands on the
    uint8 scale codes (LLVM would fold a test of a float32's bits back into a
    float comparison, which reads subnormals as zero again).
    """
    def codes(amax):
        return jax.lax.bitcast_convert_type(pow2_scale(amax, fmt, rounding)[0], jnp.uint8)

    def exact_on_cpu(amax, x):
        def from_bits():
            magnitude = group_reduce(f32_bits(x) & 0x7FFFFFFF, layout, jnp.max)
            exact = jnp.where(amax == 0, magnitude, f32_bits(amax))
            return codes(jax.lax.bitcast_convert_type(exact, jnp.float32))
        return jax.lax.cond(_any_zero(jax.lax.stop_gradient(amax)), from_bits, lambda: codes(amax))

    bits = jax.lax.platform_dependent(amax, x, cpu=exact_on_cpu, default=lambda a, x: codes(a))
    values = jnp.where(bits == 255, jnp.float32(jnp.nan), pow2(bits.astype(jnp.int32) - 127))
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu), values


@custom_vmap
def _any_zero(a: jax.Array) -> jax.Array:
    """Whether ``a`` holds a zero: under ``vmap`` one scalar for the whole batch (both branches
    of the conditional it picks give the same codes where there is no zero), so that the
    conditional stays one (a batched predicate makes it a select, which JAX rejects on explicit
    mesh axes: a stack of sharded layers)."""
    return jnp.any(a == 0)


@_any_zero.def_vmap
def _any_zero_vmap(axis_size, in_batched, a):
    del axis_size, in_batched
    return _any_zero(a), False


def pow2_scale(amax: jax.Array, fmt: Format, rounding: ScaleRounding):
    """(``float8_e8m0fnu`` scales, their float32 values) for group maxima ``amax``."""
    e = exponent(amax) - _emax(fmt)
    if rounding != "floor":
        t = amax * pow2(jnp.clip(-e, -126, 127))  # exact: amax / 2**e
        if rounding == "ceil":
            over = t > _top(fmt)
        else:
            half, tie_up = _half_top_gap(fmt)
            limit = _top(fmt) + half
            over = (t > limit) | ((t == limit) & tie_up) if half else t > limit
        # float32's top binade: the raised scale could round the largest value to 2**128
        e = e + (over & (exponent(amax) < 127)).astype(jnp.int32)
    nonzero = (f32_bits(amax) & 0x7FFFFFFF) != 0  # `amax > 0` is False for subnormals on CPU
    e = jnp.where(nonzero, jnp.clip(e, -126, 127), 0)  # all-zero groups: scale 1
    nan = ~jnp.isfinite(amax)  # a block holding a NaN or an inf: the NaN scale 0xFF, as OCP MX
    bits = jnp.where(nan, jnp.uint8(255), (e + 127).astype(jnp.uint8))
    stored = jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)
    return stored, jnp.where(nan, jnp.float32(jnp.nan), pow2(e))


def _tiles_of(shape: tuple[int, ...], group: int) -> tuple[int, ...]:
    """Tiles of about ``group`` consecutive scales: a part of the last axis, or whole rows of
    it (across every leading axis that the tile's later axes cover whole)."""
    tiles, size = [1] * len(shape), 1
    for d in reversed(range(len(shape))):
        tiles[d] = max(1, min(shape[d], group // size))
        size *= tiles[d]
        if tiles[d] < shape[d]:  # a part of this axis: the earlier axes stay 1
            break
    return tuple(tiles)


def store_scale(scale: jax.Array, amax: jax.Array, fmt: Format, options: ScaleOptions):
    """(the stored scale: an array or a `QTensor`, float32 values to divide by).

    Args:
      scale: float32 scales ``amax / max_finite`` of each group.
      amax: float32 group maxima of ``|x|``, same shape.
      fmt: the element format.
      options: how to store them.
    """
    from jaxquant._quantize import dequantize_values, quantize_computed_values  # (circular)

    dt = options.dtype
    if options.two_level:
        inner = get_format(dt if dt is not None and dt.name != "float32" else jnp.float8_e4m3fn)
        if scale.ndim == 0:
            raise ValueError("double_quant and float8 scales need per-axis, blocked or tiled "
                             "scales; got per-tensor quantization.")
        tiles = _tiles_of(scale.shape, DOUBLE_QUANT_BLOCK) if options.double_quant else None
        # Only finite scales of groups that are not all zeros set the second level.
        finite = jnp.isfinite(amax)  # as isfinite(scale), without keeping scale to read it
        # second-level scales of at least 2**-126 / the smallest code: every block scale
        # (code times it) stays normal, which XLA:CPU would flush to 0 (0 / 0: NaN codes)
        floor = 2.0**-126 / float(ml_dtypes.finfo(inner.dtype).smallest_subnormal)
        nested, _ = quantize_computed_values(jnp.where(finite & (amax > 0), scale, 0), inner,
                                             None, tiles, floor)
        # A block scale too small for float8 next to its group's largest would be 0
        # (and its block all zeros): keep it at the smallest positive code instead. A
        # non-finite group gets the NaN code, selected as bits (a float8 select is
        # emulated per element on CPU: NVFP4 quantize took 1.3x as long).
        bits = jax.lax.bitcast_convert_type(nested.qvalue, jnp.uint8)
        nan_bits = np.array(np.nan, nested.qvalue.dtype).view(np.uint8)
        bits = jnp.where(finite, jnp.where(bits & 0x7F == 0, jnp.uint8(1), bits), nan_bits)
        codes = jax.lax.bitcast_convert_type(bits, nested.qvalue.dtype)
        nested = dataclasses.replace(nested, qvalue=codes)
        return nested, dequantize_values(nested)
    stored = _plain_scale(scale, dt) if dt is not None and dt.name != "float32" else scale
    return stored, stored.astype(jnp.float32)


def _plain_scale(scale: jax.Array, dt: np.dtype) -> jax.Array:
    """float32 scales (positive, or NaN/inf) as ``dt``: to nearest, saturating at the
    largest finite value, rounded up below the smallest normal (never to 0)."""
    info = ml_dtypes.finfo(dt)
    s = jnp.where(jnp.isfinite(scale), jnp.minimum(scale, jnp.float32(info.max)), scale)
    stored = keep_rounding(s.astype(dt))
    uint = jnp.dtype(f"uint{8 * dt.itemsize}")
    up = (stored.astype(jnp.float32) < s) & (s < jnp.float32(info.smallest_normal))
    bumped = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(stored, uint) + 1, dt)
    return jnp.where(up, bumped, stored)


def computed_scale(x: jax.Array, fmt: Format, layout: Layout, symmetric: bool,
                   options: ScaleOptions):
    """(stored scale, its float32 values, zero point) chosen from ``x`` (traceable)."""
    if options.plain:
        scale, zero_point = compute_scale(x, fmt, layout, symmetric)
        return scale, scale, zero_point
    xs = jax.lax.stop_gradient(x.astype(jnp.float32))
    amax = group_absmax(xs, layout)
    # Non-plain scales are symmetric (`scale_options`): the scale from the same maxima.
    scale, zero_point = scale_from_range(amax, amax, fmt, symmetric=True)
    if options.pow2:
        return *pow2_group_scales(xs, amax, layout, fmt, options.rounding), zero_point
    return *store_scale(scale, amax, fmt, options), zero_point
