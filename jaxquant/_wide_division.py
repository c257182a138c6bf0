"""The correctly rounded float32 quotient, computed in float64 and rounded once more.

Rounding a quotient to float64 and then to float32 gives the correctly rounded
float32 quotient: a quotient of two float32 numbers is never closer than
``2**-49`` (relative) to a float32 rounding midpoint, because ``x - m * s`` is
a non-zero multiple of a power of two that ``m * s`` exceeds by at most 49 bits
(``m``, a midpoint, has 25 significant bits; ``s`` has 24). A float64 quotient
within 7 float64 ulps (at most ``2**-52`` each) of the true one, be it
correctly rounded, XLA's ``x * (1 / s)`` rewrite or a 2-ulp hardware
division, is on the same side of every midpoint, so the final rounding to
float32 is right.

This is how `jaxquant._rounding.divide` gets the contract's quotient on GPUs
(CUDA, ROCm): one converted division per element instead of the ~40 float
and integer operations of `jaxquant._rounding.correct_quotient`, which made
XLA:GPU's compilation of a whole-tree quantization about 20x longer.

Both operands are doubled in float64 before the division (exact, and the
same quotient): XLA:GPU shrinks ``convert(divide(convert(x), convert(s)))``
back to a float32 division, which on the GPU is not correctly rounded (on an
NVIDIA H200, jaxlib 0.11.2: 32% of 4M quotients next to rounding midpoints,
22% across the exponent range, a unit in the last place off). Doubled, every
quotient was right, and a jitted 8192 x 8192 division took 0.25 ms against
0.27 ms for the float32 ``x / s`` and 0.52 ms for the correction
(`benchmarks/results/quantize_tree_h200.md` has the whole-tree figures). GPUs
with few float64 units (consumer parts run float64 at 1/32 to 1/64 of the
float32 rate) may find it slower than the correction, though not to compile.

JAX traces float64 only under ``jax_enable_x64``; the primitive here hides the
float64 inside its lowering (StableHLO ``convert``, ``add``, ``divide``, ``convert``),
so it works, and stays float32 to JAX, either way. Its result type (shape,
sharding, the mesh axes it varies over inside ``shard_map``) is that of JAX's
own ``x / scale``, which is bound as a template operand and left unused by the
lowering (XLA drops it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import batching, mlir

__all__ = ["wide_divide"]

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)

_wide_divide_p = Primitive("jaxquant_wide_divide")


def wide_divide(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` for float32 operands, divided in float64 and rounded to float32.

    Correctly rounded (IEEE 754, to nearest even) wherever the backend's
    float64 division is within a few ulps, as it is on CPUs and GPUs. NaN
    payloads and their signs are whatever the conversions make of them
    (`jaxquant._rounding.divide` fixes them up). Not differentiable by
    itself (`jaxquant._rounding.divide` supplies the derivative).

    Args:
      x: float32 array.
      scale: float32 array broadcastable to ``x``.

    Returns:
      float32 array of the broadcast shape.

    Raises:
      TypeError: if ``x`` or ``scale`` is not float32.

    Example:
      >>> import numpy as np
      >>> x, s = jnp.float32(0.3), jnp.float32(0.1)
      >>> bool(wide_divide(x, s) == np.float32(0.3) / np.float32(0.1))
      True
    """
    for name, a in (("x", x), ("scale", scale)):
        if jnp.result_type(a) != _F32:
            raise TypeError(f"wide_divide: {name} must be float32, got {jnp.result_type(a)}")
    template = x / scale
    x, scale = jnp.broadcast_arrays(x, scale)
    return _wide_divide_p.bind(template, x, scale)


def _abstract_eval(template, x, scale):
    return template


@jax.jit
def _impl(*args):  # eager calls: compiled once per shape, like any jax.numpy operation
    return _wide_divide_p.bind(*args)


def _lowering(ctx, template, x, scale):
    (aval,) = ctx.avals_out
    wide = mlir.aval_to_ir_type(ctx.module_context, aval.update(dtype=_F64))
    x, scale = stablehlo.convert(wide, x), stablehlo.convert(wide, scale)
    # Both operands doubled (exact in float64), so that no ``convert(divide(convert(x),
    # convert(s)))`` is left for a compiler to shrink into a float32 division.
    quotient = stablehlo.divide(stablehlo.add(x, x), stablehlo.add(scale, scale))
    return [stablehlo.convert(mlir.aval_to_ir_type(ctx.module_context, aval), quotient)]


def _batch(args, dims):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [jnp.broadcast_to(a, (size, *a.shape)) if d is None
            else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
    return _wide_divide_p.bind(*args), 0


_wide_divide_p.def_abstract_eval(_abstract_eval)
_wide_divide_p.def_impl(_impl)
mlir.register_lowering(_wide_divide_p, _lowering)
batching.primitive_batchers[_wide_divide_p] = _batch
