"""`quantize` and `dequantize`: arrays to `QTensor` and back, as ONNX defines them.

Data flow: ``x`` -> scale (given, or chosen from ``x`` in `jaxquant._scales`)
-> exact quotient ``x / scale`` (`jaxquant._rounding.divide`) -> codes
(`round_to_codes`) -> `QTensor`. The public functions validate their
arguments (shapes, axes, dtypes: all static, so errors come at trace time) and
call one jitted kernel each, so equal shapes and metadata never retrace.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jaxquant._formats import Format, get_format
from jaxquant._granularity import Layout, apply_grouped, layout_from_args, layout_from_scale
from jaxquant._packing import PackedArray, pack_bits, pack_fields
from jaxquant._qtensor import QTensor, check_zero_point, zero_point_like_scale
from jaxquant._rounding import NAN_CODES, divide, round_to_codes
from jaxquant._scales import compute_scale

__all__ = ["quantize", "dequantize"]


def as_float_input(x: ArrayLike, argname: str = "x") -> jax.Array:
    """``x`` as a JAX array, or a TypeError if it is not floating point."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        x = jnp.asarray(x)
        dt = x.dtype
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"{argname} must be a floating-point array, got dtype {dt}; "
            f"integer arrays are codes already (wrap them in jaxquant.QTensor)."
        )
    return jnp.asarray(x)


def _as_scale(scale: ArrayLike, argname: str = "scale") -> jax.Array:
    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"{argname} must be a float array, got dtype {scale.dtype}.")
    return scale


def quantize(
    x: ArrayLike,
    scale: ArrayLike | None = None,
    zero_point: ArrayLike | None = None,
    *,
    dtype: DTypeLike = jnp.int8,
    axis: int | None = None,
    block_size: int | None = None,
    symmetric: bool = True,
    saturate: bool = True,
    packed: bool = False,
) -> QTensor:
    """Quantizes ``x`` to codes of ``dtype``, bit for bit as ONNX QuantizeLinear.

    Integer formats: ``q = clip(rint(x / scale) + zero_point, qmin, qmax)`` with
    the correctly rounded float32 quotient and round-half-to-even. Float
    formats: ``q = cast(x / scale)`` rounding to nearest even; ``saturate``
    clips to the largest finite value first (NaN stays NaN).

    Explicit mode (``scale`` given): the layout of ``scale`` picks the
    granularity: one element (per-tensor), 1-D of length ``x.shape[axis]``
    (per-axis), or ``x``'s rank with ``ceil(x.shape[axis] / block_size)``
    along ``axis`` (blocked, last block may be partial). ``zero_point`` has the
    layout of ``scale`` and the code dtype.

    Computed mode (``scale=None``): per-tensor (``axis=None``), per-axis
    (``axis``: the axis whose entries get their own scale) or blocked
    (``axis`` split into blocks of ``block_size``). Symmetric: ``absmax / qmax``
    (0.0 maps to 0.0 exactly; unsigned formats get the mid-range zero point);
    asymmetric: the range ``[min(x, 0), max(x, 0)]`` onto ``[qmin, qmax]``;
    float formats: ``absmax / max_finite``. All-zero groups get scale 1.

    Args:
      x: float array (any float dtype; the maths is float32).
      scale: ``None`` (computed mode) or float scales.
      zero_point: ``None`` or zero points of ``dtype`` (all zeros for floats).
      dtype: the format: int2, uint2, int4, uint4, int8, uint8, int16, uint16,
        int32, float8_e4m3fn, float8_e5m2 or float4_e2m1fn.
      axis: the quantized axis, may be negative.
      block_size: the block length along ``axis``.
      symmetric: computed mode only: symmetric scales, or asymmetric with a
        zero point (integer formats).
      saturate: float formats only: clip to the largest finite value instead
        of producing NaN/inf (integer codes always saturate).
      packed: 2- and 4-bit formats: store the codes packed along the last axis
        (a `PackedArray`, as `jaxquant.pack` makes), computed without a
        sub-byte intermediate, the fastest path on CPU.

    Returns:
      A `QTensor` whose ``dtype`` is ``x``'s dtype.

    Raises:
      TypeError: non-float ``x`` or ``scale``, unknown format, zero point of
        another dtype.
      ValueError: scale/zero-point shape fits no layout, ``axis`` out of range,
        ``packed`` for a format wider than 4 bits or a scalar ``x``,
        ``block_size <= 0``, non-zero zero point of a float format,
        asymmetric float formats, ``zero_point`` without ``scale``.

    Example:
      >>> import jax.numpy as jnp
      >>> qt = quantize(jnp.array([0.0, 0.25, 0.5, -1.0]), jnp.float32(0.5))
      >>> qt.qvalue  # 0.25 / 0.5 = 0.5 is a tie: rounds to even
      Array([ 0,  0,  1, -2], dtype=int8)
    """
    fmt = get_format(dtype)
    x = as_float_input(x)
    packed = bool(packed)
    if packed and (fmt.bits > 4 or x.ndim == 0):
        raise ValueError(f"packed=True needs a 2- or 4-bit format and an input of rank >= 1, "
                         f"got {fmt.name} and rank {x.ndim}.")
    if scale is None:
        if zero_point is not None:
            raise ValueError("zero_point was given without scale; pass both, or neither "
                             "to compute them from x.")
        if not symmetric and not fmt.is_integer:
            raise ValueError(f"symmetric=False needs an integer format; {fmt.name} has no "
                             f"zero point.")
        layout = layout_from_args(x.shape, axis, block_size)
        return _quantize_computed(x, fmt.dtype, layout, bool(symmetric), bool(saturate), packed)
    scale = _as_scale(scale)
    layout = layout_from_scale(x.shape, scale.shape, axis, block_size)
    if zero_point is not None:
        zero_point = jnp.asarray(zero_point)
        zero_point = zero_point_like_scale(zero_point, scale)
        check_zero_point(zero_point, fmt)
    return _quantize_explicit(x, scale, zero_point, fmt.dtype, layout, bool(saturate), packed)


def quantize_codes(x, scale, zero_point, fmt: Format, layout: Layout, saturate: bool = True,
                   wide: bool = False):
    """Codes of ``x`` for scale-shaped ``scale``/``zero_point`` (no checks; traceable).

    ``wide=True`` returns sub-byte integer codes as int8 (same values).
    """
    def codes(x, s, zp):
        return round_to_codes(divide(x.astype(jnp.float32), s), zp, fmt, saturate, wide)

    return apply_grouped(codes, x, layout, scale.astype(jnp.float32), zero_point)


def _record(x, scale, zero_point, fmt: Format, layout: Layout, saturate: bool,
            packed: bool) -> QTensor:
    wide = packed and fmt.is_integer
    codes = quantize_codes(x, scale, zero_point, fmt, layout, saturate, wide)
    if packed:
        axis = x.ndim - 1
        if wide:
            u = codes.astype(jnp.uint8) & jnp.uint8((1 << fmt.bits) - 1)
            data = pack_fields(u, fmt.bits, axis)
        else:
            data = pack_bits(codes, axis)
        codes = PackedArray(data, fmt.dtype, x.shape, axis)
    return QTensor(codes, scale, zero_point, axis=layout.axis, block_size=layout.block_size,
                   dtype=x.dtype)


@functools.partial(jax.jit, static_argnames=("dtype", "layout", "saturate", "packed"))
def _quantize_explicit(x, scale, zero_point, dtype, layout, saturate, packed):
    return _record(x, scale, zero_point, get_format(dtype), layout, saturate, packed)


@functools.partial(jax.jit, static_argnames=("dtype", "layout", "symmetric", "saturate", "packed"))
def _quantize_computed(x, dtype, layout, symmetric, saturate, packed):
    fmt = get_format(dtype)
    scale, zero_point = compute_scale(x, fmt, layout, symmetric)
    return _record(x, scale, zero_point, fmt, layout, saturate, packed)


def dequantize(qt: QTensor, dtype: DTypeLike | None = None) -> jax.Array:
    """``(qvalue - zero_point) * scale``, computed in float32, as ONNX DequantizeLinear.

    Args:
      qt: a `QTensor` (packed codes are unpacked inside the same kernel).
      dtype: the float dtype of the result; default ``qt.dtype``.

    Returns:
      An array of ``qt.shape``.

    Raises:
      TypeError: if ``qt`` is not a `QTensor` or ``dtype`` is not a float dtype.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> qt = jq.QTensor(jnp.array([0, 2, 255], jnp.uint8), jnp.float32(0.5),
      ...                 jnp.uint8(128))
      >>> dequantize(qt)
      Array([-64. , -63. ,  63.5], dtype=float32)
    """
    if not isinstance(qt, QTensor):
        raise TypeError(f"qt must be a jaxquant.QTensor, got {type(qt).__name__}.")
    dtype = qt.dtype if dtype is None else np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a float dtype, got {dtype}.")
    return _dequantize(qt, dtype)


def dequantize_values(qt: QTensor) -> jax.Array:
    """float32 values of ``qt`` (no checks; traceable)."""
    codes = qt.qvalue
    q = codes.unpack_float32() if isinstance(codes, PackedArray) else codes.astype(jnp.float32)
    zp = qt.zero_point if get_format(codes.dtype).is_integer else None

    def values(q, s, zp):
        return (q if zp is None else q - zp) * s

    return apply_grouped(values, q, qt.layout, qt.scale.astype(jnp.float32),
                         None if zp is None else zp.astype(jnp.float32))


def _signed_nan(out: jax.Array, codes: jax.Array) -> jax.Array:
    """``out``, with each NaN the quiet NaN of ``out.dtype`` with its float8 code's sign.

    ONNX (NumPy, ml_dtypes) keeps the sign of a NaN code through the float32
    arithmetic and the final cast; XLA:GPU returns one positive NaN pattern.
    Not applied on CPU (not needed there; it costs about 4%).
    """
    uint = jnp.dtype(f"uint{8 * out.dtype.itemsize}")
    nan = np.asarray(np.nan, out.dtype).view(uint)
    sign = (lax.bitcast_convert_type(codes, jnp.uint8) >> 7).astype(uint) << (uint.itemsize * 8 - 1)
    b = jnp.where(jnp.isnan(out), sign | nan, lax.bitcast_convert_type(out, uint))
    return lax.bitcast_convert_type(b, out.dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize(qt, dtype):
    out = dequantize_values(qt).astype(dtype)
    codes = qt.qvalue
    if isinstance(codes, PackedArray) or get_format(codes.dtype).name not in NAN_CODES:
        return out
    return lax.platform_dependent(out, codes, cpu=lambda out, codes: out, default=_signed_nan)
