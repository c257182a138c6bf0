"""Elementwise operations whose code depends on the platform, traced only for the one lowered.

`jax.lax.platform_dependent` traces every branch into the program (a `switch`
resolved at lowering): a program compiled for the CPU also traces the GPU's
and TPU's divisions, about a fifth of the time jaxquant's functions take to
trace and compile. `platform_op` makes a primitive instead, lowered by
`jax.interpreters.mlir.lower_fun` of the branch of the platform being lowered
(each platform its own, as JAX's own primitives; a multi-platform export
lowers each of them), so only that branch is ever traced.

The branches must be elementwise (or at least take a new leading axis of every
operand as a batch axis): `jax.vmap` binds the operation again with the batch
axes moved to the front.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax import lax
from jax.extend import core
from jax.interpreters import ad, batching, mlir

__all__ = ["platform_op"]


def platform_op(name: str, *, like: int, cpu: Callable, default: Callable,
                identity_tangent: bool = False, **per_platform: Callable) -> Callable:
    """An elementwise operation that runs ``cpu`` on CPU, ``per_platform[p]`` on ``p``, else
    ``default``, each traced only when a program is lowered for its platform.

    Args:
      name: the primitive's name, as `jax.make_jaxpr` shows it.
      like: the index of the operand whose shape and dtype the result has (the
        others broadcast to it, with the same number of dimensions).
      cpu: the CPU's branch, ``f(*operands, **params) -> array``.
      default: the branch of every platform not named.
      identity_tangent: the operation is the identity on every number of operand
        ``like``, so is its derivative; False: not differentiable (the caller
        supplies the derivative, e.g. by `jax.custom_jvp`).
      **per_platform: branches by platform name (``cuda``, ``rocm``, ``tpu``).

    Returns:
      ``op(*operands, **params)``: binds the primitive (``params`` must be hashable).

    Raises:
      ValueError: a branch for ``gpu`` (name ``cuda`` and ``rocm`` instead).

    Example:
      >>> twice = platform_op("twice", like=0, cpu=lambda x: x + x, default=lambda x: 2 * x)
      >>> jax.jit(twice)(jax.numpy.arange(3.0)).tolist()
      [0.0, 2.0, 4.0]
    """
    if "gpu" in per_platform:
        raise ValueError("platform_op: name the GPU platforms 'cuda' and 'rocm', not 'gpu'")
    prim = core.Primitive(name)
    prim.def_abstract_eval(lambda *avals, **params: avals[like])

    @functools.cache
    def jitted(params):
        return jax.jit(functools.partial(prim.bind, **dict(params)))

    prim.def_impl(lambda *args, **params: jitted(tuple(sorted(params.items())))(*args))

    def batch(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        moved = [batching.bdim_at_front(a, d, size) if i == like or d is not None
                 else lax.expand_dims(a, (0,))
                 for i, (a, d) in enumerate(zip(args, dims, strict=True))]
        return prim.bind(*moved, **params), 0

    batching.primitive_batchers[prim] = batch
    if identity_tangent:
        ad.primitive_jvps[prim] = lambda primals, tangents, **params: (
            prim.bind(*primals, **params), tangents[like])
    for platform, branch in per_platform.items():
        mlir.register_lowering(prim, mlir.lower_fun(branch, multiple_results=False), platform)
    mlir.register_lowering(prim, mlir.lower_fun(cpu, multiple_results=False), "cpu")
    mlir.register_lowering(prim, mlir.lower_fun(default, multiple_results=False))
    return prim.bind
