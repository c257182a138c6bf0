"""Optimization barriers that keep XLA:GPU from rewrites that change results.

Two XLA:GPU behaviours (seen with jax/jaxlib 0.11.2 on an NVIDIA H100) would
make a jitted program disagree with the same operations run one by one:

* With its default ``--xla_allow_excess_precision=true`` the simplifier folds
  ``convert(convert(x, float4_e2m1fn), float32)`` into ``x`` (float8 alike):
  the rounding to the narrow format vanishes from a fake quantization.
* Its Triton GEMM fusions, which pull the producers of a dot's operands into
  the matrix-multiply kernel, returned wrong int8 x int8 -> int32 products
  when the int8 codes were computed from floats in the same fusion (the
  autotuner's own cross-check reports "WRONG RESULTS" for those configs), and
  wrong float products from ``int4`` codes read straight from memory.

An optimization barrier hides an array's producer from the consumer: the
narrow codes are written to memory and read back (a small buffer: one or two
bytes per element). For weight-only dots that means unpacked sub-byte weights
are widened to int8 in memory on each call there; packed weights (how int4 is
stored for inference) and int8 or float8 weights keep their fused
dequantization. XLA:CPU has neither behaviour, so there the arrays pass
straight through and fusion is untouched (``jax.lax.platform_dependent``
picks the branch when the program is lowered).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["keep_rounding", "gemm_operand"]

_SUB_BYTE = tuple(jnp.dtype(t) for t in (jnp.int4, jnp.uint4, jnp.int2, jnp.uint2))


def _barrier_off_cpu(x: jax.Array) -> jax.Array:
    return lax.platform_dependent(x, cpu=lambda v: v, default=lax.optimization_barrier)


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
    if codes.dtype in _SUB_BYTE:
        codes = codes.astype(jnp.int8 if jnp.issubdtype(codes.dtype, jnp.signedinteger)
                             else jnp.uint8)
    return _barrier_off_cpu(codes)
