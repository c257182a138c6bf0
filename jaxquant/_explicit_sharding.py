"""Explicit mesh axes: an array's sharding when its type carries one, and reshapes that keep it.

On a mesh with ``AxisType.Explicit`` axes the sharding is part of an array's type, and JAX asks
for the output's sharding wherever a reshape splits or merges axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["explicit_sharding", "spec_of", "reshape_sharded"]


def explicit_sharding(x):
    """``x``'s sharding if its type carries one (mesh axes of type ``Explicit``), else ``None``."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return sharding if spec and any(p is not None for p in spec) else None


def spec_of(x) -> tuple:
    """``x``'s explicit mesh axes per dimension (``None`` for each where there are none)."""
    sharding = explicit_sharding(x)
    spec = () if sharding is None else tuple(sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def reshape_sharded(x: jax.Array, shape: tuple[int, ...], spec: list) -> jax.Array:
    """``x.reshape(shape)``, sharded as ``spec`` on a mesh with explicit axes: JAX asks for the
    output's sharding where a reshape splits or merges axes, also for an unsharded view inside
    ``vmap`` over a sharded axis (a stack of layers)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return x.reshape(shape)
    return jnp.reshape(x, shape, out_sharding=sharding.update(
        spec=jax.sharding.PartitionSpec(*spec)))
