"""`fake_quant`: quantize-dequantize with straight-through gradients.

One module-level `jax.custom_vjp` carries both estimators:

* Clipped straight-through estimator (STE) for ``x`` (Bengio et al., 2013,
  arXiv:1308.3432): the gradient is 1 where the unclipped code
  ``rint(x / scale) + zero_point`` lies in ``[qmin, qmax]`` and 0 elsewhere,
  as ``torch.fake_quantize_per_tensor_affine``.
* LSQ / LSQ+ for ``scale`` and ``zero_point`` (Esser et al., 2020,
  arXiv:1902.08153; Bhalgat et al., 2020, arXiv:2004.09576), equal to
  PyTorch's ``_fake_quantize_learnable_per_{tensor,channel}_affine`` with
  ``grad_factor=1``: per element, with ``q = rint(x / s) + z`` unclipped,

  - ``d/ds = (fq(x) - x) / s`` inside the range, ``qmin - z`` below it and
    ``qmax - z`` above it;
  - ``d/dz = 0`` inside the range and ``-s`` outside it;

  summed over each group that shares a scale (an integer format's NaN ``x`` gets the
  zero point's code, as in `jaxquant.quantize`: a value of 0 and no gradient at all).
  The in-range term is computed as ``(q - z) - x / s`` (exact for integer codes) and
  ``d/dz`` as ``-s`` times the group's sum, so scales near float32's smallest normal
  (where ``fq - x`` and ``g * s`` are subnormal, flushed to zero by XLA:CPU) and
  subnormal scales get the formula's gradients, not zeros or NaN. The zero point is
  rounded (and clamped) in the forward pass and passed straight through in the backward
  pass. As in PyTorch, the backward pass of a per-tensor float zero point ``z`` reads it as
  ``int(clamp(z + 0.5))`` (truncated: ``-1`` becomes ``0``, ``2.5`` becomes ``3``), the
  per-channel one (and blocked ones here) as the forward's ``nearbyint(z)``.
  ``lsq_grad_scale=True`` multiplies both by ``1 / sqrt(N * qmax)``, the gradient scale of
  the LSQ paper (``N`` elements per scale).

In computed mode with float32 absmax scales of a signed integer format (the
QAT default), ``absmax / qmax`` maps every element into ``[-qmax, qmax]``:
nothing clips, the STE mask is all ones and the scale a constant, so the
backward pass returns the incoming gradient and keeps no residuals (as cheap as
a hand-written ``x + stop_gradient(q - x)``; the forward value is unchanged).

Float formats (float8, float4) and codebook formats (NF4, FP4, float6) use
the same rules with ``qmin/qmax`` the largest finite magnitude (the table's
largest entry) and no zero point. Named composite formats (MX, NVFP4) and
stored scale dtypes (``float8_e8m0fnu`` powers of two, two-level float8
scales, ``double_quant``) give the value of `jaxquant.quantize` with the same
arguments, with the scale a constant (computed mode). With ``key`` the codes
are rounded stochastically; the STE is unchanged.

For QAT with power-of-two (MX) scales prefer ``scale_rounding="ceil"``: with
OCP's ``"floor"`` the largest value of a block usually lies beyond the element
maximum, the clipped STE gives it no gradient, and training stalls
(``tests/test_lowbit_integration.py`` shows it on a least-squares fit).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jaxquant._args import as_array, as_float_input, check_float_scale
from jaxquant._barriers import keep_rounding
from jaxquant._codebooks import code_values
from jaxquant._cpu_division import scale_factors
from jaxquant._explicit_sharding import explicit_spec, reshard_like, sharding_with_spec
from jaxquant._formats import Format
from jaxquant._granularity import (
    Layout,
    expand,
    group_reduce,
    layout_from_args,
    layout_from_scale,
    squeeze_tensor_scale,
)
from jaxquant._qtensor import QTensor
from jaxquant._quantize import (
    _check_key,
    check_flags,
    check_scale_arguments,
    computed_scale,
    scale_values_of,
)
from jaxquant._rounding import (
    int32_codes,
    quotient,
    round_to_codes,
    stochastic_int,
)
from jaxquant._scale_formats import pow2_input_floor, scale_options
from jaxquant._schemes import resolve
from jaxquant._shard_fit import check_shards_fit
from jaxquant._zero_points import as_zero_point, check_zero_point, zero_point_like_scale

__all__ = ["fake_quant"]


@dataclasses.dataclass(frozen=True)
class _Config:
    fmt: Format
    layout: Layout
    saturate: bool
    grad_scale: bool
    float_zero_point: bool = False  # float4 with a (zero) zero point: added, as ONNX
    scale_kind: str = "any"  # "normal": computed float32 scales, never subnormal (`divide`)
    learned_zero_point: bool = False  # a float zero point of an integer format (LSQ+)
    input_floor: float | None = None  # computed power-of-two scales: `pow2_input_floor`


def fake_quant(
    x: ArrayLike,
    scale: ArrayLike | None = None,
    zero_point: ArrayLike | None = None,
    *,
    dtype: DTypeLike | str = jnp.int8,
    axis: int | None = None,
    block_size: int | tuple[int, ...] | None = None,
    symmetric: bool = True,
    saturate: bool = True,
    lsq_grad_scale: bool = False,
    scale_dtype: DTypeLike | None = None,
    scale_rounding: str = "floor",
    double_quant: bool = False,
    key: jax.Array | None = None,
) -> jax.Array:
    """``dequantize(quantize(x, ...))`` in ``x``'s dtype, with STE/LSQ gradients.

    Arguments and the value are those of `jaxquant.quantize` followed by
    `jaxquant.dequantize`. Gradients (see the module docstring for the rules):
    clipped STE for ``x``; LSQ/LSQ+ for ``scale`` and a float ``zero_point``
    (a zero point of the code dtype is a constant); in computed mode the scale
    is a constant of the backward pass.

    Args:
      x: float array.
      scale: ``None`` (computed mode), float scales in an ONNX layout, or a
        `QTensor` of scales (a constant).
      zero_point: ``None``, zero points of the code dtype, or float zero
        points (learnable; rounded in the forward pass). Integer formats only
        for non-zero values.
      dtype: the format: a dtype, a codebook name or a scheme name (``"mxfp4"``...).
      axis: the quantized axis.
      block_size: block length along ``axis``, or a tuple of tile lengths.
      symmetric: computed mode only, as in `quantize`.
      saturate: float formats only, as in `quantize`.
      lsq_grad_scale: multiply the scale and zero-point gradients by
        ``1 / sqrt(N * qmax)`` (LSQ's gradient scale).
      scale_dtype: computed mode: how the scale is stored, as in `quantize`.
      scale_rounding: for ``float8_e8m0fnu`` scales, as in `quantize`.
      double_quant: computed mode: float8 scales of the scales, as in `quantize`.
      key: a PRNG key for stochastic rounding, as in `quantize`.

    Returns:
      An array of ``x``'s shape and dtype.

    Raises:
      TypeError, ValueError: as `quantize`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxquant as jq
      >>> x = jnp.array([0.3, 1.0, 9.0])
      >>> jq.fake_quant(x, jnp.float32(0.5), dtype=jnp.int4)
      Array([0.5, 1. , 3.5], dtype=float32)
      >>> jax.grad(lambda x: jq.fake_quant(x, jnp.float32(0.5), dtype=jnp.int4).sum())(x)
      Array([1., 1., 0.], dtype=float32)
    """
    check_flags(symmetric=symmetric, saturate=saturate, lsq_grad_scale=lsq_grad_scale,
                double_quant=double_quant)
    r = resolve(dtype, axis, block_size, scale_dtype, explicit=scale is not None,
                double_quant=double_quant)
    fmt, axis, block_size = r.fmt, r.axis, r.block_size
    x = as_float_input(x)
    key = _check_key(key)
    check_scale_arguments(fmt, scale, zero_point, scale_dtype, double_quant, scale_rounding)
    computed, options = scale is None, None
    if scale is None and lsq_grad_scale:
        raise ValueError("lsq_grad_scale=True scales the gradients of an explicit (learned) "
                         "scale; computed scales are constants of the backward pass.")
    given_zero_point, learned_zp = zero_point is not None, False
    if scale is None:
        if zero_point is not None:
            raise ValueError("zero_point was given without scale; pass both, or neither.")
        if not symmetric and not fmt.is_integer:
            raise ValueError(f"symmetric=False needs an integer format; {fmt.name} has no "
                             f"zero point.")
        options = scale_options(r.scale_dtype, scale_rounding, double_quant, bool(symmetric))
        layout = layout_from_args(x.shape, axis, block_size)
        check_shards_fit(x, layout, None)  # before the blocks are formed, as `quantize`
    else:
        if isinstance(scale, QTensor):
            scale = jax.lax.stop_gradient(scale_values_of(scale))
        scale = as_array(scale, "scale")
        check_float_scale(scale.dtype)
        if scale.weak_type:  # a Python float: the float32 of the quotient, as in `quantize`
            scale = jax.lax.convert_element_type(scale, jnp.float32)  # (one compile for both)
        layout = layout_from_scale(x.shape, scale.shape, axis, block_size)
        scale = squeeze_tensor_scale(scale, layout)
        check_shards_fit(x, layout, None)
        if zero_point is not None:
            zero_point = zero_point_like_scale(as_zero_point(zero_point, fmt), scale)
            learned_zp = fmt.is_integer and jnp.issubdtype(zero_point.dtype, jnp.floating)
            if not learned_zp:
                check_zero_point(zero_point, fmt)
    float_zp = given_zero_point and not fmt.is_integer and fmt.bits < 8
    # float4 has no inf or NaN: it clips whatever `saturate` says, and so does the STE
    saturate = bool(saturate) or fmt.always_saturates or (computed and not options.plain)
    config = _Config(fmt, layout, saturate, bool(lsq_grad_scale),  # (as `quantize`)
                     float_zp, "normal" if computed and options.plain else "any", learned_zp,
                     pow2_input_floor(fmt) if computed and options.pow2 else None)
    return _fake_quant_program(x, scale, zero_point, key, config, options, bool(symmetric))


@functools.partial(jax.jit, static_argnames=("config", "options", "symmetric"))
def _fake_quant_program(x, scale, zero_point, key, config: _Config, options, symmetric: bool):
    """The array work of `fake_quant` (arguments checked) as one jitted program: eager calls
    run one compiled program, not one dispatch per operation (as `quantize` does)."""
    fmt = config.fmt
    if options is not None:  # computed mode: the scale (and zero point) from ``x``
        _, scale, zero_point = computed_scale(x, fmt, config.layout, symmetric, options)
        if zero_point is not None:
            zero_point = zero_point_like_scale(zero_point, scale)
    if zero_point is not None:
        if not config.learned_zero_point:
            zero_point = jax.lax.stop_gradient(zero_point)
        # int32 codes and zero points stay integers: float32 holds neither them nor their
        # sums (`_int32_fake`)
        if not (fmt.bits == 32 and jnp.issubdtype(zero_point.dtype, jnp.integer)):
            keep = fmt.is_integer or config.float_zero_point
            zero_point = zero_point.astype(jnp.float32) if keep else None
    noise = None if key is None else jax.random.uniform(key, x.shape, jnp.float32)
    if (options is not None and symmetric and fmt.is_integer and fmt.signed
            and zero_point is None and noise is None and options.plain):
        # absmax / qmax maps every element into [-qmax, qmax]: the clipped STE's mask is all
        # ones and the scale a constant, so the backward pass is the identity
        return _fake_quant_unclipped(x, scale.astype(jnp.float32), config)
    return _fake_quant(x, scale.astype(jnp.float32), zero_point, noise, config)


def _expand(v, x, layout):
    """A scale-shaped ``v`` lined up with ``x``, on ``x``'s mesh axes where its type carries
    them: a replicated block scale repeated over a data-sharded ``x`` would not mix with it."""
    return reshard_like(expand(v, x.shape, layout), x)


def _codes(x, scale, zero_point, noise, config: _Config):
    """(unclipped float codes, clipped float codes, rounded zero point or None, x / scale)."""
    fmt = config.fmt
    s = _expand(scale, x, config.layout)
    if config.input_floor is not None:  # as `quantize` reads it (no -2**128 code)
        x = jnp.maximum(x, config.input_floor)
    t = quotient(x.astype(jnp.float32), s, fmt, config.scale_kind)
    if fmt.is_codebook:
        return t, code_values(t, fmt, noise), None, t
    if not fmt.is_integer:
        zp = None if zero_point is None else _expand(zero_point, x, config.layout)  # float4's
        q = round_to_codes(t, zp, fmt, config.saturate, noise=noise).astype(jnp.float32)
        return t, q, None, t
    zp = None
    r = jnp.round(t) if noise is None else stochastic_int(t, noise)
    if zero_point is not None and zero_point.dtype == jnp.int32:
        return (*_int32_fake(r, _expand(zero_point, x, config.layout)), t)
    if zero_point is not None:
        zp = _expand(jnp.clip(jnp.round(zero_point), fmt.qmin, fmt.qmax), x, config.layout)
        r = r + zp
    q = jnp.clip(r, fmt.qmin, fmt.qmax)
    q = jnp.where(jnp.isnan(r), 0.0 if zp is None else zp, q)  # NaN: the zero point's, as quantize
    return r, jnp.where(q == 0, 0.0, q), zp, t  # an integer code has no -0.0


def _int32_fake(r: jax.Array, zp: jax.Array):
    """`_codes` of int32 with an int32 zero point ``zp``: the codes `quantize` gives
    (`int32_codes`, exact), and a ``raw`` code that says what the exact ``r + zp`` is:
    NaN, in range (0), below (-inf) or above (inf) it. ``r + zp`` is in range when
    ``code - zp`` (exactly ``A + B``, two float32 pieces) is ``r``: ``r - A`` is exact
    when it is ``B`` (``|B| < 2**16``), and cannot round to it otherwise."""
    code = int32_codes(r, zp)
    a = ((code >> 16) - (zp >> 16)).astype(jnp.float32) * jnp.float32(65536)
    b = ((code & 0xFFFF) - (zp & 0xFFFF)).astype(jnp.float32)
    side = jnp.where(code == jnp.iinfo(jnp.int32).min, -jnp.inf, jnp.inf)
    raw = jnp.where(jnp.isnan(r), r, jnp.where(r - a == b, 0.0, side))
    q = code.astype(jnp.float32)
    return raw, jnp.where(q == 0, 0.0, q), zp.astype(jnp.float32)


def _in_range(raw: jax.Array, fmt: Format, saturate: bool) -> jax.Array:
    """Whether the unclipped code lies in ``[qmin, qmax]``: the clipped STE's mask.

    Integer codes are already rounded. A float quotient is in range when it
    rounds (to nearest even, without a largest value) to at most the largest
    finite value: below the midpoint to the next binade step, or on it when the
    tie goes to the largest value (an even last mantissa bit: float8_e4m3fn's
    448; float8_e5m2's 57344, float4's 6 and float6's 7.5 and 28 round up).
    Without saturation (float8 only: float4 and float6 always saturate) nothing
    is clipped. The other codebooks (NF4, FP4) have no step beyond their largest
    value and clip above it.
    """
    if fmt.is_integer:  # rounded codes: < qmax + 1 is exact, int32's qmax is not in float32
        return (raw >= fmt.qmin) & (raw < np.float32(fmt.qmax + 1))
    if fmt.is_codebook and fmt.ties != "even":
        return (raw >= fmt.qmin) & (raw <= fmt.qmax)
    if not saturate and not fmt.is_codebook:
        return ~jnp.isnan(raw)
    top = float(fmt.max_finite)  # its code and the one below it (float6: table indices)
    if fmt.is_codebook:
        code = fmt.values.index(top)
        below = fmt.values[code - 1]
    else:
        code = int(np.array(top, fmt.dtype).view(np.uint8))
        below = float(np.array(code - 1, np.uint8).view(fmt.dtype))
    edge, a = jnp.float32(top + (top - below) / 2), jnp.abs(raw)
    return (a < edge) | ((a == edge) & (code % 2 == 0))  # the code's last bit: the mantissa's


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fake_quant(x, scale, zero_point, noise, config: _Config):
    _, q, zp, _ = _codes(x, scale, zero_point, noise, config)
    v = q if zp is None else q - zp
    if config.scale_kind == "normal":  # `scale_factors` would give the scale itself and 1
        out = (v * _expand(scale, x, config.layout)).astype(x.dtype)
    else:
        s, f = (_expand(a, x, config.layout) for a in scale_factors(scale))  # `dequantize`'s
        out = ((v * s) * f).astype(x.dtype)
    # XLA:GPU would fold a bfloat16/float16 value cast back to float32 (a layer's promotion)
    # into the unrounded float32 one: the QAT model would not be the quantized model
    return keep_rounding(out) if x.dtype.itemsize < 4 else out


def _fake_quant_fwd(x, scale, zero_point, noise, config):
    return _fake_quant(x, scale, zero_point, noise, config), (x, scale, zero_point, noise)


def _fake_quant_bwd(config: _Config, residuals, g):
    x, scale, zero_point, noise = residuals
    given_zero_point, fmt = zero_point, config.fmt
    if config.learned_zero_point and config.layout.kind == "tensor":
        # PyTorch's per-tensor backward reads the zero point as int(clamp(z + 0.5)), not as
        # its forward's nearbyint(z): they differ for negative z and for ties (2.5 -> 3)
        zero_point = jnp.trunc(jnp.clip(zero_point + 0.5, fmt.qmin, fmt.qmax))
    raw, q, zp, t = _codes(x, scale, zero_point, noise, config)
    inside = _in_range(raw, fmt, config.saturate)
    dx = jnp.where(inside, g, 0).astype(x.dtype)  # float64 x: its cotangent, not rounded
    g, lo = g.astype(jnp.float32), fmt.qmin
    zpv = 0.0 if zp is None else zp
    edge = jnp.where(raw < lo, jnp.float32(fmt.qmin) - zpv, jnp.float32(fmt.qmax) - zpv)
    # an integer NaN's value is its zero point's, 0 whatever the scale and zero point
    held = jnp.isnan(raw) if fmt.is_integer else False
    edge = jnp.where(held, 0.0, edge)
    # (fq - x) / s as (q - z) - x / s (exact for integer codes): no product with the scale,
    # whose (fq - x) is subnormal, flushed to zero by XLA:CPU, for scales near 2**-126
    dscale = g * jnp.where(inside, (q - zpv) - t, edge)
    factor = 1.0
    if config.grad_scale:  # N = elements sharing each scale (fewer in a partial last block)
        count = group_reduce(jnp.ones(x.shape, jnp.float32), config.layout, jnp.sum)
        # an empty group's gradient is a sum of nothing, 0 (not 0 * rsqrt(0), NaN)
        factor = jax.lax.rsqrt(jnp.maximum(count, 1.0) * jnp.float32(fmt.qmax))

    def to_scale(v):
        return (group_reduce(v, config.layout, jnp.sum) * factor).reshape(scale.shape)

    dzp = None
    # sum(-g) * s per group: no subnormal g * s (see `dequantize`); float4's: zeros, int32's
    # given as such: integers
    if zero_point is not None and fmt.is_integer and zero_point.dtype == jnp.float32:
        s, f = scale_factors(scale)
        dzp = _typed_like((to_scale(jnp.where(inside | held, 0.0, -g)) * s) * f,
                          given_zero_point)
    return dx, _typed_like(to_scale(dscale), scale), dzp, None


def _typed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent on its primal's sharding where that is part of the type (explicit mesh
    axes): sums over groups keep ``x``'s sharding, and a custom VJP must return the
    primal's type (a replicated learned scale of a kernel sharded along its channels)."""
    have, want = explicit_spec(ct), explicit_spec(primal)
    if have is None or have == want:
        return ct
    return jax.sharding.reshard(ct, jax.typeof(primal).sharding if want is not None
                                else sharding_with_spec(ct, (None,) * ct.ndim))


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fake_quant_unclipped(x, scale, config: _Config):
    """`_fake_quant` where no code can clip and the scale is constant: ``dx = g``."""
    return _fake_quant(x, scale, None, None, config)


def _fake_quant_unclipped_fwd(x, scale, config):
    return _fake_quant_unclipped(x, scale, config), None


def _fake_quant_unclipped_bwd(config: _Config, residuals, g):
    return g, None


_fake_quant_unclipped.defvjp(_fake_quant_unclipped_fwd, _fake_quant_unclipped_bwd)
