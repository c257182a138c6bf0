"""Correctly rounded float32 division and rounding to codes.

ONNX QuantizeLinear defines the code as ``rint(x / scale)`` with ``x / scale``
the correctly rounded (IEEE 754) float32 quotient. Three things stand between
a plain ``jnp`` expression and that definition:

* XLA's algebraic simplifier rewrites ``x / broadcast(s)`` as
  ``x * broadcast(1 / s)``: two roundings instead of one, which moves 15-55% of
  the quotients by an ulp (depending on ``s``), enough to push roughly one code
  in a million across an exact tie (``k + 0.5``) to the wrong side.
* XLA:GPU's float32 division is not correctly rounded either (it is within
  2 ulps, and about 1 ulp off on a few quotients in a hundred).
* Quantization is memory-bound: a fix must not cost a pass over memory.

`divide` therefore picks, per backend, when the program is lowered (a
`jaxquant._platform_ops.platform_op`: only the branch of the platform lowered
is traced):

* CPU: the division instruction (``divps``), already correctly rounded, with a
  divisor XLA cannot prove is a broadcast (selected per element: ``s``, or
  ``s * 2**126`` for a subnormal ``x``, `jaxquant._cpu_division`), which stops
  the reciprocal rewrite. Memory-bound, as a plain ``x / s``.
* GPUs (CUDA, ROCm): the quotient computed in float64 and rounded to float32
  (`jaxquant._wide_division`): a float64 quotient within a few float64 ulps
  is on the right side of every float32 rounding midpoint, so neither the
  reciprocal rewrite nor an approximate division can move the result. One
  converted division per element, so compile time stays that of a plain
  ``x / s``.
* Every other backend (TPUs, which have no float64 units): the hardware
  quotient corrected in float32 (`jaxquant._corrected_division`: one Newton
  step and an exact residual test), in the same fused loop. Zeros,
  infinities, NaN, subnormal and overflowing quotients keep the hardware
  result. These ~40 extra operations
  per element cost compile time: on a GPU (where this was the path until
  float64 replaced it) whole-tree quantization of GPT-2 small compiled in 14 s
  instead of 0.7 s; on CPU it would also make int8 quantization about 6x
  slower (32 ms against 5.1 ms for a 4096 x 4096 array, medians of 15 rounds
  on 2 shared cores).

Off CPU, NaN operands propagate as on x86: ``x``'s NaN (quieted, with its
sign) first, then ``scale``'s.

Float8 codes get the same care: XLA:GPU converts every NaN to one positive
pattern, where ONNX (through ml_dtypes) keeps the sign (`signed_nan_codes`).
And XLA:GPU, which by default allows "excess precision", deletes a cast to a
narrow float type that is cast back to float32 in the same program:
`jaxquant._barriers.keep_rounding` keeps the codes.

XLA:CPU reads float32 subnormals as zero and flushes subnormal results to
zero: `jaxquant._cpu_division` reads subnormal operands from their bits. GPUs
keep subnormals; TPUs flush them. Computed scales are kept at or above the
smallest normal number, ``2**-126``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
from jax import lax

from jaxquant._barriers import keep_rounding
from jaxquant._codebooks import encode
from jaxquant._corrected_division import (
    SMALLEST_NORMAL,
    bits,
    correct_quotient,
    from_bits,
    nan_propagated,
)
from jaxquant._cpu_division import CPU_DIVISIONS, _plain_division
from jaxquant._formats import Format
from jaxquant._platform_ops import platform_op
from jaxquant._wide_division import wide_divide

__all__ = ["divide", "correct_quotient", "round_to_codes", "signed_nan_codes", "NAN_CODES",
           "SMALLEST_NORMAL", "exponent", "pow2", "stochastic_float", "stochastic_int", "quotient",
           "positive_zero", "CPU_DIVISIONS", "int32_codes"]

_INT32_LO, _INT32_HI = -2147483648.0, 2147483520.0  # float32 values that fit in int32
_F32, _I32, _U32 = jnp.float32, jnp.int32, jnp.uint32
NAN_CODES = {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7E}  # ml_dtypes' quiet NaN, sign apart


def _corrected(plain):
    """The quotient of ``plain`` corrected in float32 (backends without float64)."""
    return lambda x, s: nan_propagated(x, s, correct_quotient(x, s, plain(x, s)))


_corrected_division = _corrected(_plain_division)  # what TPUs get for any scale


def _wide_division(x: jax.Array, scale: jax.Array) -> jax.Array:
    return nan_propagated(x, scale, wide_divide(x, scale))


_divide_op = platform_op(
    "jaxquant_divide", like=0,
    cpu=lambda x, s, *, scale_kind: CPU_DIVISIONS[scale_kind](x, s),
    cuda=lambda x, s, *, scale_kind: _wide_division(x, s),
    rocm=lambda x, s, *, scale_kind: _wide_division(x, s),
    default=lambda x, s, *, scale_kind: _corrected(CPU_DIVISIONS[scale_kind])(x, s))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def divide(x: jax.Array, scale: jax.Array, scale_kind: str = "any") -> jax.Array:
    """The correctly rounded float32 quotient ``x / scale``, elementwise, on every backend.

    On CPU this is the hardware division (correctly rounded); on GPUs a
    float64 division rounded to float32; elsewhere the hardware quotient
    corrected by `correct_quotient` (see the module docstring). NaN operands
    propagate as on x86 (``x``'s NaN first, with its sign). Differentiable as
    ``x / scale``.

    Args:
      x: float32 array.
      scale: float32 array broadcastable to ``x`` (typically a broadcast scale).
      scale_kind: what the caller guarantees about ``scale``, for the CPU's sake:
        ``"any"``, or ``"normal"``: no subnormal number (computed scales are at
        least ``2**-126``, 1, inf or NaN), whose rescaling is skipped.

    Returns:
      ``x / scale`` rounded once, to nearest even, as IEEE 754 requires.

    Example:
      >>> import numpy as np
      >>> x = jnp.float32(0.3); s = jnp.float32(0.1)
      >>> bool(divide(x, s) == np.float32(0.3) / np.float32(0.1))
      True
    """
    x, scale = jnp.asarray(x, _F32), jnp.asarray(scale, _F32)
    x = jnp.broadcast_to(x, jnp.broadcast_shapes(x.shape, scale.shape))
    scale = lax.expand_dims(scale, tuple(range(x.ndim - scale.ndim)))
    return _divide_op(x, scale, scale_kind=scale_kind)


@divide.defjvp
def _divide_jvp(scale_kind, primals, tangents):
    x, scale = primals
    dx, ds = tangents
    q = divide(x, scale, scale_kind)
    return q, (dx - q * ds) / scale


def signed_nan_codes(t: jax.Array, codes: jax.Array) -> jax.Array:
    """``codes`` (float8), with every NaN code ml_dtypes' quiet NaN of ``t``'s sign.

    ml_dtypes (and so ONNX's reference) converts a float32 NaN to ``0x7F`` /
    ``0xFF`` (float8_e4m3fn) or ``0x7E`` / ``0xFE`` (float8_e5m2), keeping the
    sign, as does XLA:CPU; XLA:GPU's conversion returns one positive NaN
    pattern. ``t``'s sign also decides the NaN that a non-saturating
    float8_e4m3fn overflow produces. `round_to_codes` applies it on every
    backend but CPU, where it is not needed and would make float8
    quantization about 2.7x slower.

    Args:
      t: float32 values that were converted.
      codes: ``t`` converted to float8_e4m3fn or float8_e5m2.

    Returns:
      ``codes``, NaN codes replaced, same dtype.

    Example:
      >>> import ml_dtypes, numpy as np
      >>> t = jnp.array([-jnp.nan, 1.0, -1e4], jnp.float32)
      >>> c = signed_nan_codes(t, t.astype(ml_dtypes.float8_e4m3fn))
      >>> [hex(v) for v in np.asarray(c).view(np.uint8)]
      ['0xff', '0x38', '0xff']
    """
    nan = NAN_CODES[codes.dtype.name]
    b = lax.bitcast_convert_type(codes, jnp.uint8)
    sign = (lax.bitcast_convert_type(t, _U32) >> 24).astype(jnp.uint8) & jnp.uint8(0x80)
    b = jnp.where(jnp.isnan(codes), sign | jnp.uint8(nan), b)
    return lax.bitcast_convert_type(b, codes.dtype)


_signed_nan_codes_off_cpu = platform_op("jaxquant_signed_nan_codes", like=1,
                                        identity_tangent=True, cpu=lambda t, codes: codes,
                                        default=signed_nan_codes)


def quotient(x: jax.Array, scale: jax.Array, fmt: Format, scale_kind: str = "any"
             ) -> jax.Array:
    """``x / scale`` as ``fmt`` defines it: correctly rounded (`divide`), or, for
    bitsandbytes' codebooks (NF4, FP4), ``x * (1 / scale)`` as bitsandbytes computes it
    (``vals * local_abs_max_inv``); the reciprocal is a per-group constant, so XLA fuses
    the product into the code search instead of writing the quotients out. Scales above
    ``2**100`` take the reciprocal of ``scale * 2**-64`` and ``x * 2**-64`` (both exact):
    a subnormal ``1 / scale`` would be flushed to zero on XLA:CPU. ``scale_kind``: as for
    `divide`."""
    if fmt.is_codebook and fmt.ties == "down":
        c = jnp.where(scale > _F32(2.0**100), _F32(2.0**-64), _F32(1))
        d = scale * c  # the dividend shaped (and, on explicit mesh axes, sharded) as it
        return (x * c) * divide(jnp.ones_like(d), d)
    return divide(x, scale, scale_kind)


def exponent(a: jax.Array) -> jax.Array:
    """``floor(log2(|a|))`` of float32 ``a`` from its exponent bits, as int32 (-127 for 0)."""
    return ((bits(a) >> 23) & 0xFF) - 127


def pow2(e: jax.Array) -> jax.Array:
    """``2.0 ** e`` exactly, as float32, for int32 ``e`` in ``[-126, 127]``."""
    return from_bits((e + 127) << 23)


def stochastic_int(t: jax.Array, noise: jax.Array) -> jax.Array:
    """``floor(t + noise)``, exactly: ``floor(t)``, plus one with probability ``t - floor(t)``.

    The float32 sum ``t + noise`` would round for ``|t| >= 2**22`` (an integral
    ``t`` would then move up half the time); the fraction and the comparison
    are exact.

    Example:
      >>> t = jnp.float32(1e7)  # an integer: never moves
      >>> int(stochastic_int(t, jnp.float32(0.75)))
      10000000
    """
    low = jnp.floor(t)
    return low + jnp.where(noise >= 1 - (t - low), _F32(1), _F32(0))


def stochastic_float(t: jax.Array, fmt: Format, noise: jax.Array) -> jax.Array:
    """``t`` rounded stochastically to the grid of the float format ``fmt``.

    Between the two representable neighbours ``lo <= |t| < hi`` the result is
    ``hi`` with probability ``(|t| - lo) / (hi - lo)`` (unbiased in
    expectation); the arithmetic is exact (scaling by powers of two).

    Args:
      t: float32 quotients.
      fmt: a float format (float8, float4).
      noise: uniform ``[0, 1)`` draws of ``t``'s shape.

    Returns:
      float32 values of ``t``'s shape and sign on ``fmt``'s grid (extended past
      its largest value: the caller clips); a value on the grid never moves.
    """
    info = ml_dtypes.finfo(fmt.dtype)
    a = jnp.abs(t)
    e = jnp.maximum(exponent(a), int(info.minexp))  # the binade; subnormals share the lowest
    quantum = pow2(e - int(info.nmant))
    # a / quantum is exact; `stochastic_int` avoids the float32 sum with the noise, which
    # rounds up for the largest draws and would move a value already on the grid
    r = stochastic_int(a / quantum, noise) * quantum
    return jnp.copysign(r, t)


def positive_zero(t: jax.Array) -> jax.Array:
    """Float32 ``t`` with -0.0 replaced by +0.0: ``t + 0.0``, as ONNX adds a float4 zero point.

    A test of the bits: XLA deletes an addition of a zero it knows when the
    program is compiled (a constant zero point), and under flushing of
    subnormals a comparison ``t == 0`` would also hold for subnormal ``t``,
    whose sum with 0.0 keeps its sign.

    Example:
      >>> positive_zero(jnp.array([-0.0, -1e-3, 0.0]))
      Array([ 0.   , -0.001,  0.   ], dtype=float32)
    """
    return jnp.where(bits(t) == _I32(-(2**31)), _F32(0), t)


def round_to_codes(
    t: jax.Array,
    zero_point: jax.Array | None,
    fmt: Format,
    saturate: bool = True,
    wide: bool = False,
    noise: jax.Array | None = None,
) -> jax.Array:
    """Rounds float32 quotients ``t`` to codes of ``fmt``, as ONNX QuantizeLinear.

    Integer formats: ``clip(rint(t) + zero_point, qmin, qmax)`` with
    round-half-to-even and saturation at every magnitude (also beyond int32);
    a NaN gets the zero point's code.
    Float formats: a round-to-nearest-even cast, clipped to the largest finite
    value first when ``saturate`` or the format has no inf or NaN (NaN stays
    NaN, with ``t``'s sign and ml_dtypes' bit pattern: see `signed_nan_codes`).
    Codebook formats: the nearest table entry (`jaxquant._codebooks.encode`).

    Args:
      t: float32 quotients ``x / scale``.
      zero_point: ``None`` or an array broadcastable to ``t`` holding zero points.
      fmt: the target format.
      saturate: float formats only; integer formats and float4 always saturate.
      wide: return integer codes of fewer than 8 bits as int8 (same values;
        codebook codes as uint8), skipping the slow sub-byte conversion when
        they are packed next.
      noise: ``None``, or uniform ``[0, 1)`` draws of ``t``'s shape for
        stochastic rounding: ``floor(t + noise)`` for integers (`stochastic_int`), the upper or
        lower neighbour in proportion to the distance for floats and codebooks.

    Returns:
      An array of ``fmt.dtype`` (or int8 when ``wide``) and ``t``'s shape.
    """
    if fmt.is_codebook:
        codes = encode(t, fmt, noise)
        return codes if wide or fmt.bits > 4 else codes.astype(fmt.dtype)
    if not fmt.is_integer:
        if noise is not None:
            r = stochastic_float(t, fmt, noise)
            if not (saturate or fmt.always_saturates):  # past the largest finite value only
                finite = jnp.isfinite(t.astype(fmt.dtype).astype(jnp.float32))  # where RNE is
                r = jnp.where(finite, jnp.clip(r, -fmt.max_finite, fmt.max_finite), r)
            t = r
        if zero_point is not None and fmt.bits < 8:
            # All zeros (checked by the caller). ONNX adds it for float4 only (adding it
            # for float8 would turn -0.0 into +0.0): -0.0 + 0.0 is +0.0, -0.0 + -0.0 -0.0.
            t = jnp.where(jnp.signbit(zero_point.astype(jnp.float32)), t, positive_zero(t))
        saturate = saturate or fmt.always_saturates
        codes = (jnp.clip(t, -fmt.max_finite, fmt.max_finite) if saturate else t).astype(fmt.dtype)
        codes = keep_rounding(codes)
        if fmt.name not in NAN_CODES:
            return codes
        return _signed_nan_codes_off_cpu(t, codes)
    r = jnp.round(t) if noise is None else stochastic_int(t, noise)  # round half to even
    if fmt.bits <= 16:
        # Whenever r + zero_point lands inside [qmin, qmax], |r| < 2**17 and the
        # float32 sum is exact; outside, rounding is monotone and the clip saturates.
        if zero_point is not None:
            # NaN has no code: it gets the zero point's (as `int32_codes` gives it), not the
            # 0 that the conversion of a NaN sum would give
            r = jnp.where(jnp.isnan(r), _F32(0), r) + zero_point.astype(jnp.float32)
        out = jnp.int8 if wide and fmt.bits < 8 else fmt.dtype
        return jnp.clip(r, fmt.qmin, fmt.qmax).astype(out)
    return int32_codes(r, zero_point)


def int32_codes(r: jax.Array, zero_point: jax.Array | None) -> jax.Array:
    """``clip(r + zero_point, -2**31, 2**31 - 1)`` as int32, exactly, for integral float32 ``r``.

    float32 holds neither ``2**31 - 1`` nor most sums ``r + zero_point`` near the
    ends of the range, so the sum is taken in int32, without overflow: inside
    ``[-2**31, 2**31)`` ``r`` converts exactly; above, ``r - 2**31`` (exact) plus a
    negative zero point is the offset below ``2**31`` when the sum fits (and
    symmetrically below ``-2**31``). Beyond ``2**32`` no zero point brings the sum
    back into range.
    """
    i32 = jnp.int32
    qmin, qmax, two30 = i32(-(2**31)), i32(2**31 - 1), i32(2**30)
    q = jnp.clip(r, _INT32_LO, _INT32_HI).astype(i32)
    over, under = r > _INT32_HI, r < _INT32_LO
    if zero_point is None:
        return jnp.where(over, qmax, q)
    zp = zero_point.astype(i32)
    lo = jnp.where(zp < 0, qmin - zp, qmin)
    hi = jnp.where(zp > 0, qmax - zp, qmax)
    inside = jnp.clip(q, lo, hi) + zp  # saturating add without int32 overflow
    # r in [2**31, 2**32): r + zp = (r - 2**31 + zp) + 2**31 fits iff the bracket is < 0
    d_over = (jnp.clip(r, 2.0**31, 2.0**32 - 256) - 2.0**31).astype(i32) + zp
    above = jnp.where((zp < 0) & (r < 2.0**32) & (d_over < 0), (d_over + two30) + two30, qmax)
    # r in (-2**32, -2**31): r + zp = (zp - (-2**31 - r)) - 2**31 fits iff the bracket is >= 0
    d_under = zp - (-(2.0**31) - jnp.clip(r, -(2.0**32) + 256, -(2.0**31))).astype(i32)
    below = jnp.where((zp > 0) & (r > -(2.0**32)) & (d_under >= 0),
                      (d_under - two30) - two30, qmin)
    return jnp.where(over, above, jnp.where(under, below, inside))
