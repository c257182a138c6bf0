"""Optimization barriers that keep XLA:GPU from rewrites that change results.

Three XLA:GPU behaviours (seen with jax/jaxlib 0.11.2 on an NVIDIA H100 / H200) would
make a jitted program disagree with the same operations run one by one:

* With its default ``--xla_allow_excess_precision=true`` the simplifier folds
  ``convert(convert(x, float4_e2m1fn), float32)`` into ``x`` (float8 alike):
  the rounding to the narrow format vanishes from a fake quantization. The
  same happens to a bfloat16 fake-quantized kernel that a layer promotes to
  float32 (H200), so `jaxquant.fake_quant` keeps bfloat16/float16 values too.
* Its Triton GEMM fusions, which pull the producers of a dot's operands into
  the matrix-multiply kernel, returned wrong int8 x int8 -> int32 products
  when the int8 codes were computed from floats in the same fusion (the
  autotuner's own cross-check reports "WRONG RESULTS" for those configs), and
  wrong float products from ``int4`` codes read straight from memory.

* Its int8 x int8 -> int32 dots whose contracted length is not a multiple of
  4 returned twice the sums (jaxlib 0.11.2 on an NVIDIA H200, plain
  ``lax.dot_general`` of int8 arrays: every such length from 2 to 15, and up
  to 127 for small outputs; multiples of 4 from 4 to 1024 were right), or
  failed to compile ("No candidates could be compiled"). `int_dot_general`
  pads such a contraction with zero codes to a multiple of 4 (on every
  backend; the padded operands go behind the barrier, so that no fusion
  reaches the padding), and `int_conv` a convolution's input features per
  group. Its Triton GEMM fusions also doubled a padded product whose ``rhs``
  was contracted on its last axis (5 x 9 by 70 x 9: SwitchBack's backward), in
  one program with the forward dot (H200, 2026-11-27; right with Triton GEMMs
  off, or alone). Off CPU `int_dot_general` therefore lays ``rhs`` out as
  batch, contracting, free axes (a no-op for the usual ``(in, out)`` kernel).
* cuDNN has no integer convolution with int32 output: XLA:GPU refuses to
  compile one. On CUDA and ROCm `int_conv` sums the codes' products in
  float32 convolutions, exactly (`float_conv_sums`).

An optimization barrier hides an array's producer from the consumer: the
narrow codes are written to memory and read back (a small buffer: one or two
bytes per element). For weight-only dots that means unpacked sub-byte weights
are widened to int8 in memory on each call there; packed weights (how int4 is
stored for inference) and int8 or float8 weights keep their fused
dequantization. XLA:CPU has none of these behaviours, so there the arrays pass
straight through and fusion is untouched (`jaxquant._platform_ops` picks the
branch when the program is lowered).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant._platform_ops import platform_op

__all__ = ["keep_rounding", "gemm_operand", "int_dot_general", "contraction_first_dot", "int_conv",
           "float_conv_sums"]

_SUB_BYTE = tuple(jnp.dtype(t) for t in (jnp.int4, jnp.uint4, jnp.int2, jnp.uint2))


_barrier_off_cpu = platform_op("jaxquant_barrier_off_cpu", like=0, identity_tangent=True,
                               cpu=lambda v: v, default=lax.optimization_barrier)


def keep_rounding(codes: jax.Array) -> jax.Array:
    """``codes`` unchanged, where XLA cannot fold a cast back to a wider float into them.

    Args:
      codes: an array of any dtype, typically a narrow float one.

    Returns:
      ``codes``, bit for bit.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = jax.jit(lambda x: keep_rounding(x.astype(jnp.float4_e2m1fn)).astype(jnp.float32))
      >>> f(jnp.array([0.3, 2.6, 5.1]))
      Array([0.5, 3. , 6. ], dtype=float32)
    """
    return _barrier_off_cpu(codes)


def gemm_operand(codes: jax.Array) -> jax.Array:
    """Integer codes as a dot operand that a GEMM fusion cannot reach behind.

    Sub-byte integer codes (``int4``, ``uint4``, ``int2``, ``uint2``) are
    widened to 8 bits first (same values), the form whose products were right.

    Args:
      codes: an integer array.

    Returns:
      ``codes`` (int8/uint8 when they were narrower), with the same values.

    Example:
      >>> import jax.numpy as jnp
      >>> gemm_operand(jnp.array([-8, 7], jnp.int4))
      Array([-8,  7], dtype=int8)
    """
    return _barrier_off_cpu(_widen(codes))


def _widen(codes: jax.Array) -> jax.Array:
    if codes.dtype in _SUB_BYTE:
        return codes.astype(jnp.int8 if jnp.issubdtype(codes.dtype, jnp.signedinteger)
                            else jnp.uint8)
    return codes


def _pad_to_four(a: jax.Array, axis: int) -> jax.Array:
    return jnp.pad(a, [(0, -a.shape[axis] % 4 if d == axis else 0) for d in range(a.ndim)])


def int_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, *,
                    out_sharding=None) -> jax.Array:
    """``lax.dot_general`` of integer codes to exact int32 sums, on every backend.

    Off CPU, ``rhs`` is first transposed to its batch, contracting and free
    axes, in that order (where it is not so already; on XLA:CPU that transpose
    made SwitchBack's backward 1.8x slower, and XLA:CPU needs none). A
    contraction whose length is not a multiple of 4 is padded with zero codes
    to one (the last contracting axis of each operand), which adds nothing to
    the sums, and both operands pass through `gemm_operand`. The padding is done
    on every backend (one program everywhere, tested on CPU); real models'
    contractions are multiples of 4 and pass untouched.

    Args:
      lhs: integer codes.
      rhs: integer codes.
      dimension_numbers: as ``lax.dot_general``'s.
      out_sharding: as ``lax.dot_general``'s.

    Returns:
      The int32 ``lax.dot_general`` of the codes.

    Example:
      >>> import jax.numpy as jnp
      >>> a = jnp.full((2, 6), 3, jnp.int8); b = jnp.full((6, 1), -2, jnp.int8)
      >>> int_dot_general(a, b, (((1,), (0,)), ((), ())))
      Array([[-36],
             [-36]], dtype=int32)
    """
    lhs, rhs = _widen(lhs), _widen(rhs)
    kw = dict(dimension_numbers=dimension_numbers, out_sharding=out_sharding)
    if _rhs_order(rhs.ndim, dimension_numbers) == tuple(range(rhs.ndim)):
        return _padded_dot(lhs, rhs, **kw)
    return lax.platform_dependent(lhs, rhs, cpu=functools.partial(_padded_dot, **kw),
                                  default=functools.partial(contraction_first_dot, **kw))


def _rhs_order(ndim: int, dimension_numbers) -> tuple[int, ...]:
    (_, rc), (_, rb) = dimension_numbers
    return (*rb, *rc, *(d for d in range(ndim) if d not in rc and d not in rb))


def contraction_first_dot(lhs, rhs, dimension_numbers, *, out_sharding=None):
    """`int_dot_general`'s branch off CPU: ``rhs`` transposed to its batch, contracting and
    free axes first, then the padded dot (the same sums in the same output layout)."""
    (lc, rc), (lb, rb) = dimension_numbers
    nb = len(rb)
    first = ((lc, tuple(range(nb, nb + len(rc)))), (lb, tuple(range(nb))))
    return _padded_dot(lhs, jnp.transpose(rhs, _rhs_order(rhs.ndim, dimension_numbers)), first,
                       out_sharding=out_sharding)


def _padded_dot(lhs, rhs, dimension_numbers, *, out_sharding):
    (lc, rc), _ = dimension_numbers
    if lc and math.prod(lhs.shape[d] for d in lc) % 4:
        lhs, rhs = _pad_to_four(lhs, lc[-1]), _pad_to_four(rhs, rc[-1])
    # the barrier after the padding: no GEMM fusion reaches the padded operands
    lhs, rhs = gemm_operand(lhs), gemm_operand(rhs)
    return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.int32,
                           out_sharding=out_sharding)


def int_conv(conv: Callable[..., jax.Array], lhs: jax.Array, rhs: jax.Array,
             dimension_numbers: lax.ConvDimensionNumbers, feature_group_count: int
             ) -> jax.Array:
    """``conv(lhs, rhs)`` of integer codes to exact int32 sums, on every backend.

    Input features per group that are not a multiple of 4 are padded with
    zero codes to one (in ``lhs`` group by group, in ``rhs``'s input-feature
    axis), as `int_dot_general` pads a contraction, and both operands pass
    through `gemm_operand`. On CUDA and ROCm (no integer convolution there)
    the sums come from float32 convolutions instead (`float_conv_sums`), up
    to `_FLOAT_CONV_TERMS` products per output.

    Args:
      conv: ``conv(lhs, rhs, preferred_element_type=...)``, a
        ``lax.conv_general_dilated`` with every other argument bound.
      lhs: integer codes of the input.
      rhs: integer codes of the kernel.
      dimension_numbers: the convolution's, as ``lax.conv_dimension_numbers`` gives.
      feature_group_count: the convolution's.

    Returns:
      The int32 convolution of the codes.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax import lax
      >>> x = jnp.ones((1, 3, 2), jnp.int8); w = jnp.full((1, 2, 1), 5, jnp.int8)
      >>> dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NWC", "WIO", "NWC"))
      >>> conv = lambda a, b, **kw: lax.conv_general_dilated(a, b, (1,), "VALID",
      ...                                                    dimension_numbers=dn, **kw)
      >>> int_conv(conv, x, w, dn, 1)[..., 0]
      Array([[10, 10, 10]], dtype=int32)
    """
    lhs, rhs = _widen(lhs), _widen(rhs)
    o_axis, i_axis = dimension_numbers.rhs_spec[:2]
    c_axis = dimension_numbers.lhs_spec[1]

    def integer(lhs, rhs):
        if rhs.shape[i_axis] % 4:
            groups = lhs.shape[:c_axis] + (feature_group_count, -1) + lhs.shape[c_axis + 1:]
            lhs = _pad_to_four(lhs.reshape(groups), c_axis + 1)
            lhs = lhs.reshape(lhs.shape[:c_axis] + (-1,) + lhs.shape[c_axis + 2:])
            rhs = _pad_to_four(rhs, i_axis)
        lhs, rhs = gemm_operand(lhs), gemm_operand(rhs)
        return conv(lhs, rhs, preferred_element_type=jnp.int32)

    terms = rhs.size // max(rhs.shape[o_axis], 1)  # products summed into each output
    if terms > _FLOAT_CONV_TERMS:
        return integer(lhs, rhs)
    return lax.platform_dependent(
        lhs, rhs, default=integer,
        cuda=lambda a, b: float_conv_sums(conv, a, b, terms),
        rocm=lambda a, b: float_conv_sums(conv, a, b, terms))


# a float32 sum of integers is exact while every partial sum stays below 2**24
_FLOAT_CONV_TERMS = 2**24 // 15**2  # products of two 4-bit halves: at most 15 * 15


def float_conv_sums(conv: Callable[..., jax.Array], lhs: jax.Array, rhs: jax.Array,
                    terms: int) -> jax.Array:
    """The int32 convolution of 8-bit codes from float32 convolutions, exactly.

    cuDNN has no integer convolution with int32 output (XLA:GPU refuses one).
    Products of 8-bit codes are at most ``2**14``: with at most ``2**10``
    products per output, one float32 convolution sums them exactly. With
    more, each code is split into 4-bit halves, ``x = 16 * (x >> 4) + (x & 15)``
    (products at most ``15 * 15``), and four float32 convolutions are combined
    in int32, exact up to `_FLOAT_CONV_TERMS` products per output.

    Args:
      conv: as for `int_conv` (it takes ``preferred_element_type``).
      lhs: int8 or uint8 codes of the input.
      rhs: int8 or uint8 codes of the kernel.
      terms: the number of products summed into each output (at most
        ``_FLOAT_CONV_TERMS``).

    Returns:
      The int32 convolution of the codes.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax import lax
      >>> x = jnp.full((1, 3, 2), 100, jnp.int8); w = jnp.full((1, 2, 1), -128, jnp.int8)
      >>> dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NWC", "WIO", "NWC"))
      >>> conv = lambda a, b, **kw: lax.conv_general_dilated(a, b, (1,), "VALID",
      ...                                                    dimension_numbers=dn, **kw)
      >>> float_conv_sums(conv, x, w, 2)[..., 0]
      Array([[-25600, -25600, -25600]], dtype=int32)
    """
    def sums(a, b):
        # behind a barrier: XLA:GPU rewrites a float32 convolution of converted int8 arrays
        # into cuDNN's int8 one (a float32 output idiom), which summed grouped ones wrongly
        a, b = lax.optimization_barrier((a.astype(jnp.float32), b.astype(jnp.float32)))
        return conv(a, b, preferred_element_type=jnp.float32).astype(jnp.int32)

    if terms <= 2**10:
        return sums(lhs, rhs)
    (lh, ll), (rh, rl) = ((v >> 4, v & 15) for v in (lhs, rhs))
    return 256 * sums(lh, rh) + 16 * (sums(lh, rl) + sums(ll, rh)) + sums(ll, rl)
