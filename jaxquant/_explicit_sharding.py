"""Explicit mesh axes: an array's sharding when its type carries one, and reshapes that keep it.

On a mesh with ``AxisType.Explicit`` axes the sharding is part of an array's type, and JAX asks
for the output's sharding wherever a reshape splits or merges axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

__all__ = ["explicit_sharding", "explicit_spec", "spec_of", "reshape_sharded", "replicated_along",
           "reshard_like", "sharding_with_spec", "shard_ways"]


def explicit_sharding(x):
    """``x``'s sharding if its type carries one (mesh axes of type ``Explicit``), else ``None``."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return sharding if spec and any(p is not None for p in spec) else None


def shard_ways(names, sizes) -> int:
    """How many shards the mesh axes ``names`` (one name, a tuple of names or ``None``) split
    an array axis into, with ``sizes`` the mesh's axis sizes by name."""
    if names is None:
        return 1
    return math.prod(sizes[n] for n in (names if isinstance(names, tuple) else (names,)))


def spec_of(x) -> tuple:
    """``x``'s explicit mesh axes per dimension (``None`` for each where there are none)."""
    return explicit_spec(x) or (None,) * x.ndim


def reshape_sharded(x: jax.Array, shape: tuple[int, ...], spec: list) -> jax.Array:
    """``x.reshape(shape)``, sharded as ``spec`` on a mesh with explicit axes: JAX asks for the
    output's sharding where a reshape splits or merges axes, also for an unsharded view inside
    ``vmap`` over a sharded axis (a stack of layers)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return x.reshape(shape)
    return jnp.reshape(x, shape, out_sharding=sharding.update(spec=P(*spec)))


def explicit_spec(v) -> tuple | None:
    """``v``'s partition spec (one entry per axis) when its sharding is part of its type
    (a mesh with explicit axes), else ``None``."""
    sharding = jax.typeof(v).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (v.ndim - len(spec))


def sharding_with_spec(v, spec) -> jax.sharding.NamedSharding:
    """``v``'s own sharding (its mesh) with ``spec``: a bare ``PartitionSpec`` needs
    ``jax.set_mesh``, which arrays placed with a ``NamedSharding`` do not."""
    return jax.typeof(v).sharding.update(spec=P(*spec))


def replicated_along(v: jax.Array, axis: int) -> jax.Array:
    """``v`` resharded with ``axis`` whole on every device (a mesh with explicit axes)."""
    spec = explicit_spec(v)
    if spec is None or spec[axis] is None:
        return v
    want = tuple(None if d == axis else a for d, a in enumerate(spec))
    return jax.sharding.reshard(v, sharding_with_spec(v, want))


def reshard_like(v: jax.Array, acc: jax.Array) -> jax.Array:
    """``v`` (broadcastable to ``acc``) resharded as ``acc`` on a mesh with explicit axes:
    a scale's axis may be sharded where ``acc``'s is not (blocks of the weight sharded on
    the mesh axis of the activation's rows), and JAX rejects their product."""
    spec, target = explicit_spec(v), explicit_spec(acc)
    if spec is None or target is None or v.ndim != acc.ndim:  # a scalar: on every device
        return v
    want = tuple(t if n == m else None for t, n, m in zip(target, v.shape, acc.shape,
                                                          strict=True))
    return v if want == spec else jax.sharding.reshard(v, sharding_with_spec(v, want))
