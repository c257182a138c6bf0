"""`quantize` and `dequantize`: arrays to `QTensor` and back, as ONNX defines them.

Data flow: ``x`` -> scale (given, or chosen from ``x`` in `jaxquant._scales`)
-> exact quotient ``x / scale`` (`jaxquant._rounding.divide`) -> codes
(`round_to_codes`) -> `QTensor`. The public functions validate their
arguments (shapes, axes, dtypes: all static, so errors come at trace time) and
call one jitted kernel each, so equal shapes and metadata never retrace.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jaxquant._args import as_array, as_float_input, check_float_scale
from jaxquant._barriers import keep_rounding
from jaxquant._bits import pack_bits, pack_fields
from jaxquant._codebooks import decode
from jaxquant._cpu_division import scale_factors
from jaxquant._formats import Format, value_dtype
from jaxquant._granularity import (
    Layout,
    apply_grouped,
    layout_from_args,
    layout_from_scale,
    squeeze_tensor_scale,
)
from jaxquant._packing import PackedArray
from jaxquant._platform_ops import platform_op
from jaxquant._qtensor import QTensor, check_consistent
from jaxquant._rounding import NAN_CODES, quotient, round_to_codes
from jaxquant._scale_formats import ScaleOptions, computed_scale, pow2_input_floor, scale_options
from jaxquant._schemes import resolve
from jaxquant._shard_fit import check_shards_fit
from jaxquant._zero_points import as_zero_point, check_zero_point, zero_point_like_scale

__all__ = ["quantize", "dequantize"]


def _as_scale(scale: ArrayLike, argname: str = "scale") -> jax.Array:
    if isinstance(scale, QTensor):
        return scale
    scale = as_array(scale, argname)
    check_float_scale(scale.dtype, argname)
    # A Python float is weakly typed (float64 under x64): stored as the float32 the quotient
    # uses, a weak scale would make every jit the QTensor reaches trace again for it
    return lax.convert_element_type(scale, jnp.float32) if scale.weak_type else scale


def quantize(
    x: ArrayLike,
    scale: ArrayLike | QTensor | None = None,
    zero_point: ArrayLike | None = None,
    *,
    dtype: DTypeLike | str = jnp.int8,
    axis: int | None = None,
    block_size: int | tuple[int, ...] | None = None,
    symmetric: bool = True,
    saturate: bool = True,
    packed: bool = False,
    scale_dtype: DTypeLike | None = None,
    scale_rounding: str = "floor",
    double_quant: bool = False,
    key: jax.Array | None = None,
) -> QTensor:
    """Quantizes ``x`` to codes of ``dtype``, bit for bit as ONNX QuantizeLinear.

    Integer formats: ``q = clip(rint(x / scale) + zero_point, qmin, qmax)`` with
    the correctly rounded float32 quotient and round-half-to-even. Float
    formats: ``q = cast(x / scale)`` rounding to nearest even; ``saturate``
    clips to the largest finite value first (NaN stays NaN). Codebook formats
    (``"nf4"``, ``"fp4"``, ``"float6_e2m3fn"``, ``"float6_e3m2fn"``): the index
    of the nearest table entry (`jaxquant.CODEBOOKS`). A NaN has no integer or
    codebook code: with an explicit scale it gets the zero point's code (the
    references differ: ONNX gives ``qmin``, PyTorch ``qmin`` or ``qmax``); a
    computed scale of a group holding a NaN is NaN (as PyTorch's observers; the
    NaN scale ``0xFF`` for ``float8_e8m0fnu``, also given to a block holding an
    infinity, as OCP MX), so the group dequantizes to NaN.

    Explicit mode (``scale`` given): the layout of ``scale`` picks the
    granularity: one element (per-tensor, whatever ``axis`` and ``block_size``
    say, as ONNX's reference reads it), 1-D of length ``x.shape[axis]``
    (per-axis), or ``x``'s rank with ``ceil(x.shape[axis] / block_size)``
    along ``axis`` (blocked, last block may be partial), or with a tuple
    ``block_size`` ``ceil(x.shape[i] / block_size[i])`` along every axis
    (tiles). ``zero_point`` has the layout of ``scale`` and the code dtype.
    ``scale`` may be of any float dtype (kept; a weakly typed one, a Python float, is
    stored as float32), or a `QTensor` of scales. Its values are used as given, as
    ONNX and PyTorch use them: a zero scale saturates every nonzero value, a negative
    one flips the codes' signs, NaN or inf dequantizes to NaN.

    Computed mode (``scale=None``): per-tensor (``axis=None``), per-axis
    (``axis``: the axis whose entries get their own scale), blocked (``axis``
    split into blocks of ``block_size``) or tiled (``block_size`` a tuple, one
    tile length per axis, ``axis=None``). Symmetric: ``absmax / qmax``
    (0.0 maps to 0.0 exactly; unsigned formats get the mid-range zero point);
    asymmetric: the range ``[min(x, 0), max(x, 0)]`` onto ``[qmin, qmax]``;
    float and codebook formats: ``absmax / max_finite``. All-zero groups get
    scale 1. ``scale_dtype``/``double_quant`` choose how the scale is stored:
    ``float8_e8m0fnu`` powers of two rounded
    by ``scale_rounding``, or a two-level `QTensor` of float8 scales.

    Named composite formats (``dtype="mxfp4"``, ``"mxfp8_e4m3"``,
    ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxint8"``,
    ``"nvfp4"``, ``"nf4"``, ``"fp4"``: `jaxquant.SCHEMES`) fill in the element
    format, ``block_size``, ``scale_dtype`` and ``axis=-1`` when not given.

    Args:
      x: float array (any float dtype; the maths is float32).
      scale: ``None`` (computed mode), float scales, or a `QTensor` of scales.
      zero_point: ``None`` or zero points of ``dtype`` (all zeros for floats).
      dtype: the format: int2, uint2, int4, uint4, int8, uint8, int16, uint16,
        int32, float8_e4m3fn, float8_e5m2, float4_e2m1fn, a codebook name or a
        scheme name.
      axis: the quantized axis, may be negative.
      block_size: the block length along ``axis``, or a tuple of tile lengths.
      symmetric: computed mode only: symmetric scales, or asymmetric with a
        zero point (integer formats).
      saturate: float formats only: clip to the largest finite value instead
        of producing NaN/inf (integer and codebook codes always saturate; so do
        finite values in computed mode with a scale stored rounded, ``scale_dtype``
        or ``double_quant``, which can sit a little below ``absmax / max``).
      packed: 2-, 4- and 6-bit formats: store the codes packed along the last
        axis (a `PackedArray`, as `jaxquant.pack` makes; float6 four codes per
        three bytes), computed without a sub-byte intermediate, the fastest
        path on CPU.
      scale_dtype: computed mode: the stored scale dtype (float32, bfloat16,
        float16, float8_e8m0fnu, or float8_e4m3fn/float8_e5m2 for two levels).
      scale_rounding: for ``float8_e8m0fnu`` scales: ``"floor"`` (OCP MX),
        ``"ceil"`` (never clips, below ``2**127``) or ``"up_on_overflow"``.
      double_quant: computed mode: quantize the float32 scales themselves to
        float8 with a float32 scale per 256 of them (bitsandbytes' nested
        quantization).
      key: a PRNG key: round stochastically (unbiased: ``E[dequantize] = x``
        inside the range) instead of to nearest.

    Returns:
      A `QTensor` whose ``dtype`` is ``x``'s dtype. Its codes are constants of
      differentiation, in every format (`jaxquant.fake_quant` has the STE gradients).

    Raises:
      TypeError: non-float ``x`` or ``scale`` (float6 and ``float8_e8m0fnu`` ``x``
        too), an argument that is not an array (``None``, a string), unknown format
        or scale dtype, zero point of another dtype, a ``key`` that is not one PRNG
        key, a non-int ``axis`` or ``block_size``, a non-bool flag (``symmetric``,
        ``saturate``, ``packed``, ``double_quant``).
      ValueError: scale/zero-point shape fits no layout, ``axis`` out of range,
        ``packed`` for an 8-bit or wider format or a scalar ``x``,
        ``block_size <= 0`` or without ``axis``, a tile tuple of the wrong length, a
        block length that contradicts a named format, non-zero zero point of a float
        format, a Python int zero point outside the codes, asymmetric float formats,
        ``zero_point`` without ``scale``, ``scale_dtype`` / ``double_quant`` /
        ``scale_rounding`` with an explicit scale, an unknown ``scale_rounding`` or one
        without ``float8_e8m0fnu`` scales, ``double_quant`` with per-tensor scales or
        with ``scale_dtype``, blocks or packed bytes of an explicitly sharded ``x``
        that would straddle two devices.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> qt = jq.quantize(jnp.array([0.0, 0.25, 0.5, -1.0]), jnp.float32(0.5))
      >>> qt.qvalue  # 0.25 / 0.5 = 0.5 is a tie: rounds to even
      Array([ 0,  0,  1, -2], dtype=int8)
      >>> jq.quantize(jnp.ones((4, 64)), dtype="mxfp4").bits_per_element
      4.25
    """
    check_flags(symmetric=symmetric, saturate=saturate, packed=packed, double_quant=double_quant)
    r = resolve(dtype, axis, block_size, scale_dtype, explicit=scale is not None,
                double_quant=double_quant)
    fmt, axis, block_size = r.fmt, r.axis, r.block_size
    x = as_float_input(x)
    packed = bool(packed)
    if packed and (fmt.bits not in (2, 4, 6) or x.ndim == 0):
        raise ValueError(f"packed=True needs a 2-, 4- or 6-bit format and an input of rank >= 1, "
                         f"got {fmt.name} and rank {x.ndim}.")
    key = _check_key(key)
    check_scale_arguments(fmt, scale, zero_point, scale_dtype, double_quant, scale_rounding)
    if scale is None:
        if zero_point is not None:
            raise ValueError("zero_point was given without scale; pass both, or neither "
                             "to compute them from x.")
        if not symmetric and not fmt.is_integer:
            raise ValueError(f"symmetric=False needs an integer format; {fmt.name} has no "
                             f"zero point.")
        options = scale_options(r.scale_dtype, scale_rounding, double_quant, bool(symmetric))
        layout = layout_from_args(x.shape, axis, block_size)
        check_shards_fit(x, layout, 8 // math.gcd(8, fmt.bits) if packed else None)
        return _quantize_computed(x, fmt, layout, bool(symmetric), bool(saturate), packed,
                                  options, key)
    scale = _as_scale(scale)
    layout = layout_from_scale(x.shape, scale.shape, axis, block_size)
    scale = squeeze_tensor_scale(scale, layout)
    if zero_point is not None:
        zero_point = zero_point_like_scale(as_zero_point(zero_point, fmt), scale)
        check_zero_point(zero_point, fmt)
    check_shards_fit(x, layout, 8 // math.gcd(8, fmt.bits) if packed else None)
    return _quantize_explicit(x, scale, zero_point, fmt, layout, bool(saturate), packed, key)


def check_scale_arguments(fmt: Format, scale, zero_point, scale_dtype, double_quant,
                          scale_rounding) -> None:
    """ValueErrors for arguments that do not go together (shared with `fake_quant`)."""
    if fmt.is_codebook and zero_point is not None:
        raise ValueError(f"codebook format {fmt.name} takes no zero_point.")
    if scale is not None and (scale_dtype is not None or double_quant
                              or scale_rounding != "floor"):
        raise ValueError(f"scale_dtype, double_quant and scale_rounding apply to computed "
                         f"scales; an explicit scale is stored as given (got scale_dtype="
                         f"{scale_dtype!r}, double_quant={double_quant!r}, scale_rounding="
                         f"{scale_rounding!r}).")


def check_flags(**flags) -> None:
    """A TypeError naming the first flag that is not a bool (``"no"`` would read as True)."""
    for name, value in flags.items():
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"{name} must be a bool (True or False), got {value!r} "
                            f"({type(value).__name__}).")


def _check_key(key):
    """``key`` unchanged when it is ``None`` or one PRNG key (shared with `fake_quant`).

    Raises:
      TypeError: not a key array, or a batch of keys.
    """
    if key is None:
        return None
    dtype = getattr(key, "dtype", None)
    if dtype is None or not (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
                             or dtype == jnp.uint32):
        raise TypeError(f"key must be a PRNG key (jax.random.key or jax.random.PRNGKey), got "
                        f"{dtype or type(key).__name__}.")
    raw = _raw_key_shape(jax.config.jax_default_prng_impl)
    if key.shape != (() if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else raw):
        raise TypeError(f"key must be a single PRNG key (jax.random.key: shape (), "
                        f"jax.random.PRNGKey: uint32 of shape {raw}), got {dtype} of shape "
                        f"{key.shape}; vmap over a batch of keys.")
    return key


@functools.lru_cache
def _raw_key_shape(impl: str) -> tuple[int, ...]:
    """The shape of a ``jax.random.PRNGKey`` under the default PRNG ``impl`` ((2,) for
    threefry, (4,) for rbg)."""
    return jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape


def quantize_codes(x, scale, zero_point, fmt: Format, layout: Layout, saturate: bool = True,
                   wide: bool = False, key: jax.Array | None = None, scale_kind: str = "any"):
    """Codes of ``x`` for scale-shaped float32 ``scale``/``zero_point`` (no checks; traceable).

    ``wide=True`` returns sub-byte integer codes as int8 (same values), and
    codebook codes as uint8. ``key`` draws the noise of stochastic rounding. The codes
    of every format are constants of differentiation (as integer codes are), not a float
    cast's identity with its cotangent rounded to float8/float4 (`fake_quant` has the STE).
    ``scale_kind``: what ``scale`` is known to hold (see `jaxquant._rounding.divide`).
    """
    def codes(x, noise, s, zp):
        return round_to_codes(quotient(x.astype(jnp.float32), s, fmt, scale_kind), zp, fmt,
                              saturate, wide, noise)

    # drawn at x's shape (as `fake_quant` draws it), not at the padded shape of the blocks
    noise = None if key is None else jax.random.uniform(key, x.shape, jnp.float32)
    return lax.stop_gradient(apply_grouped(codes, x, layout, scale.astype(jnp.float32),
                                           zero_point, elementwise=(noise,)))


def _record(x, stored_scale, divisor, zero_point, fmt: Format, layout: Layout, saturate: bool,
            packed: bool, key, scale_kind: str = "any") -> QTensor:
    wide = packed and fmt.kind != "float"
    codes = quantize_codes(x, divisor, zero_point, fmt, layout, saturate, wide, key, scale_kind)
    if packed:
        axis = x.ndim - 1
        if wide:
            u = codes.astype(jnp.uint8) & jnp.uint8((1 << fmt.bits) - 1)
            data = pack_fields(u, fmt.bits, axis)
        else:
            data = pack_bits(codes, axis)
        codes = PackedArray(data, fmt.dtype, x.shape, axis, 6 if fmt.bits == 6 else None)
    return QTensor(codes, stored_scale, zero_point, axis=layout.axis, block_size=layout.block_size,
                   dtype=x.dtype, codebook=fmt.label)


@functools.partial(jax.jit, static_argnames=("fmt", "layout", "saturate", "packed"))
def _quantize_explicit(x, scale, zero_point, fmt, layout, saturate, packed, key):
    divisor = scale_values_of(scale)
    return _record(x, scale, divisor, zero_point, fmt, layout, saturate, packed, key)


def scale_values_of(scale) -> jax.Array:
    """float32 values of a scale array or of a `QTensor` of scales."""
    return dequantize_values(scale) if isinstance(scale, QTensor) else scale.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("fmt", "layout", "symmetric", "saturate", "packed",
                                             "options"))
def _quantize_computed(x, fmt, layout, symmetric, saturate, packed, options, key):
    stored, divisor, zero_point = computed_scale(x, fmt, layout, symmetric, options)
    if options.pow2 and (floor := pow2_input_floor(fmt)) is not None:
        x = jnp.maximum(x, floor)  # no code -(top + 1) at the largest scale: -2**128
    # float32 scales computed from x are never subnormal (at least 2**-126, 1, inf or NaN);
    # a stored scale rounded below absmax / max (float8, e8m0, two-level) moves the group's
    # largest finite values past the format's: they saturate, whatever `saturate` says
    saturate = saturate or not options.plain
    return _record(x, stored, divisor, zero_point, fmt, layout, saturate, packed, key,
                   "normal" if options.plain else "any")


def quantize_computed_values(x: jax.Array, fmt: Format, axis, block_size, floor: float = 0.0):
    """(`QTensor` of ``x`` with float32 scales computed per group, at least ``floor``, its
    float32 values).

    Used for the second level of two-level scales (traceable, no checks).
    """
    layout = layout_from_args(x.shape, axis, block_size)
    scale = jnp.maximum(computed_scale(x, fmt, layout, True, ScaleOptions())[0], floor)
    qt = _record(x, scale, scale, None, fmt, layout, True, False, None)
    return qt, dequantize_values(qt)


def dequantize(qt: QTensor, dtype: DTypeLike | None = None) -> jax.Array:
    """``(qvalue - zero_point) * scale``, computed in float32, as ONNX DequantizeLinear.

    Args:
      qt: a `QTensor` (packed codes are unpacked inside the same kernel).
      dtype: the float dtype of the result; default ``qt.dtype``.

    Returns:
      An array of ``qt.shape``.

    Raises:
      TypeError: if ``qt`` is not a `QTensor` (or holds no codes) or ``dtype`` is not a
        float dtype XLA computes in (not float6).
      ValueError: leaves that no longer fit the metadata (a stacked QTensor outside
        ``vmap``/``scan``: dequantize it with ``jax.vmap(jq.dequantize)(qt)``).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> qt = jq.QTensor(jnp.array([0, 2, 255], jnp.uint8), jnp.float32(0.5),
      ...                 jnp.uint8(128))
      >>> jq.dequantize(qt)
      Array([-64. , -63. ,  63.5], dtype=float32)
    """
    if not isinstance(qt, QTensor):
        raise TypeError(f"qt must be a jaxquant.QTensor, got {type(qt).__name__}.")
    check_consistent(qt)
    return _dequantize(qt, qt.dtype if dtype is None else value_dtype(dtype))


def code_values(qt: QTensor) -> jax.Array:
    """float32 values of ``qt``'s codes, before zero point and scale (no checks; traceable)."""
    codes, fmt = qt.qvalue, qt.format
    if fmt.is_codebook:
        return decode(codes.unpack() if isinstance(codes, PackedArray) else codes, fmt)
    return codes.unpack_float32() if isinstance(codes, PackedArray) else codes.astype(jnp.float32)


def dequantize_values(qt: QTensor) -> jax.Array:
    """float32 values of ``qt`` (no checks; traceable)."""
    q = code_values(qt)
    zp = qt.zero_point if qt.format.is_integer else None

    def values(q, s, f, zp):
        return ((q if zp is None else q - zp) * s) * f

    s, f = scale_factors(scale_values_of(qt.scale))  # exact for subnormal scales on CPU
    return apply_grouped(values, q, qt.layout, s, f, None if zp is None else zp.astype(jnp.float32))


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


_signed_nan_off_cpu = platform_op("jaxquant_signed_nan", like=0, identity_tangent=True,
                                  cpu=lambda out, codes: out, default=_signed_nan)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize(qt, dtype):
    out = dequantize_values(qt).astype(dtype)
    codes = qt.qvalue
    if not isinstance(codes, PackedArray) and qt.format.name in NAN_CODES:
        out = _signed_nan_off_cpu(out, codes)
    # XLA:GPU would fold a bfloat16/float16 result cast back to float32 (a layer's promotion)
    # into the unrounded float32 one, as it would a fake-quantized value
    return keep_rounding(out) if out.dtype.itemsize < 4 else out
