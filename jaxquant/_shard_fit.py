"""Whether blocks and packed bytes fit the shards of an explicitly sharded array.

A block of codes that shares one scale, or a byte that holds two int4 codes,
must not straddle two devices: with JAX's explicit sharding (mesh axes of type
``Explicit``) the reshape that forms the blocks would fail deep inside the
library, and with automatic sharding XLA may gather the axis and return
replicated codes. This module turns the explicit case into a ``ValueError``
that names the axis, the shard length and the block; the automatic case is
documented (the sharding is propagated by XLA, not known when tracing).
"""

from __future__ import annotations

from jaxquant._explicit_sharding import shard_ways
from jaxquant._granularity import Layout, explicit_sharding

__all__ = ["check_shards_fit"]


def _explicit_spec(x) -> tuple[tuple, dict[str, int]] | None:
    """``(partition spec, {mesh axis: size})`` of ``x``'s type, or ``None`` if not sharded."""
    sharding = explicit_sharding(x)
    return None if sharding is None else (tuple(sharding.spec), dict(sharding.mesh.shape))


def check_shards_fit(x, layout: Layout, pack_group: int | None, *, pack_axis: int = -1,
                     name: str = "x", unpacked: str = "packed=False") -> None:
    """Raises a ValueError if a block or a packed byte of ``x`` would straddle two shards.

    Args:
      x: the array to quantize (concrete or traced).
      layout: its granularity (blocks along an axis, or tiles along every axis).
      pack_group: codes per packed unit along ``pack_axis`` (2 for 4-bit codes,
        4 for 2- and 6-bit codes), or ``None`` when not packed.
      pack_axis: the axis along which codes share bytes (default: the last).
      name: what ``x`` is called in the message.
      unpacked: the way out that keeps the codes unpacked, for the message.

    Raises:
      ValueError: naming the axis, its mesh axes, the shard length and the block.

    Example:
      >>> import jax.numpy as jnp
      >>> check_shards_fit(jnp.ones((4, 6)), Layout("block", 1, 4), None)  # not sharded: fine
    """
    found = _explicit_spec(x)
    if found is None:
        return
    spec, sizes = found
    for axis, names in enumerate(spec):
        if names is None or axis >= x.ndim:
            continue
        names = names if isinstance(names, tuple) else (names,)
        ways = shard_ways(names, sizes)
        if ways == 1 or x.shape[axis] % ways:
            continue  # one shard: nothing to straddle; uneven shards: JAX's own checks apply
        per = x.shape[axis] // ways
        needs = []
        if layout.kind == "block" and layout.axis == axis:
            needs.append((layout.block_size, f"blocks of {layout.block_size}",
                          f"a block_size that divides {per}"))
        if layout.kind == "tile":
            needs.append((layout.block_size[axis], f"tiles {layout.block_size}",
                          f"tiles whose length along axis {axis} divides {per}"))
        if pack_group and axis == pack_axis % x.ndim:
            needs.append((pack_group, f"packed units of {pack_group} codes", unpacked))
        for length, what, fix in needs:
            if per % length:
                raise ValueError(
                    f"{name} is sharded {ways} ways along axis {axis} (mesh axes {names}) "
                    f"with {per} elements per shard, which {what} do not divide: one would "
                    f"straddle two devices. Use {fix}, or reshard {name} "
                    f"(jax.sharding.reshard) so that axis {axis} is not split.")
