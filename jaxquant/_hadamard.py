"""The orthonormal Walsh-Hadamard transform, for rotating outliers out of a kernel's scales.

One large weight makes its whole scale group coarse: a per-channel int8 scale
is ``absmax / 127`` of the channel, so a channel holding one weight 35 standard
deviations from zero rounds all its other weights on a grid ~8x coarser than
its neighbours'. Rotating the contracting axis spreads that weight over a block
of rows (incoherence processing: QuIP, Chee et al. 2023; QuaRot, Ashkboos et al.
2024): with ``H`` orthonormal and symmetric, ``x @ w == (x @ H) @ (H @ w)``, so a
model that transforms a layer's input can store ``H @ w``, whose columns have no
single dominant entry, and quantize that instead. `hadamard_transform` is ``H``
along one axis, in blocks: ``x @ H`` for the activations and ``H @ w`` for the
kernel are the same call on different axes, and it is its own inverse.

``H`` is the Sylvester Hadamard matrix of the block size (``scipy.linalg.hadamard``),
scaled by ``block_size ** -0.5``. Blocks of up to 128 entries are one matrix product
with ``H`` (``block_size`` multiply-adds per entry: on a CPU this beat the
``O(log n)`` butterflies, which XLA does not fuse); larger blocks factor
``H = H_r (x) ... (x) H_128 (x) H_128`` (Kronecker, factors of at most 128) into one
product per factor: ``128 + block_size / 128`` multiply-adds per entry up to blocks
of ``2**14``, and constants of at most ``128 x 128`` for any block (one ``H`` of the
whole block would need ``block_size ** 2`` entries). Small blocks are cheap and spread
outliers nearly as well (all-MiniLM-L6-v2's down-projections: blocks of 32 did as
well as 512).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxquant._args import as_array
from jaxquant._explicit_sharding import (
    replicated_along,
    reshape_sharded,
    shard_ways,
    spec_of,
)
from jaxquant._qtensor import is_qtensor

__all__ = ["hadamard_transform"]


@functools.cache
def _sylvester(size: int) -> np.ndarray:
    """The ``size x size`` Sylvester Hadamard matrix of +-1 (``size`` a power of two)."""
    h = np.ones((1, 1), np.int8)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h


_DENSE_BLOCK = 128  # blocks up to this size: one product with H; larger: Kronecker factors


def _factors(block_size: int) -> list[int]:
    """Powers of two of at most ``_DENSE_BLOCK`` whose product is ``block_size``, the
    smallest first (``[4, 128]`` for 512, ``[2, 128, 128, 128]`` for ``2**22``)."""
    factors = []
    while block_size > 1:
        factors.insert(0, min(block_size, _DENSE_BLOCK))
        block_size //= factors[0]
    return factors


def _along(h: jax.Array, out: jax.Array, axis: int) -> jax.Array:
    """The symmetric ``h`` applied along ``axis`` of ``out`` (one product, ``HIGHEST``)."""
    names = "abcdefghijklmnopqrstuvwxy"[:out.ndim]
    spec = f"z{names[axis]},{names}->{names.replace(names[axis], 'z')}"
    return jnp.einsum(spec, h, out, precision=lax.Precision.HIGHEST)


def _largest_power_of_two_dividing(n: int) -> int:
    return n & -n


def _is_int(v) -> bool:
    """A Python or NumPy integer (not a bool)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def hadamard_transform(x: ArrayLike, axis: int = -1, *, block_size: int | None = None
                       ) -> jax.Array:
    """The orthonormal Walsh-Hadamard transform of ``x`` along ``axis``, in blocks.

    Each run of ``block_size`` consecutive entries along ``axis`` is multiplied by
    ``H / sqrt(block_size)``, ``H`` the Sylvester Hadamard matrix (entry
    ``(i, j)`` is ``(-1) ** popcount(i & j)``). The matrix is symmetric and
    orthogonal, so the transform preserves norms and applying it twice gives
    ``x`` back (up to float rounding); ``hadamard_transform(x, -1) @
    hadamard_transform(w, 0) == x @ w`` for a kernel ``w`` of shape ``(in, out)``.

    Args:
      x: a float array.
      axis: the axis to transform.
      block_size: a power of two dividing ``x.shape[axis]``; None: the largest
        power of two dividing it (the whole axis when its length is a power of
        two; an empty axis is returned as it is; an odd length is an error,
        ``block_size=1`` being the identity).
        Each entry costs about the sum of the Kronecker factors' sizes in
        multiply-adds: ``block_size`` up to 128, ``128 + block_size / 128`` up
        to ``2**14``, ``256 + block_size / 2**14`` up to ``2**21``...

    Returns:
      An array of ``x``'s shape and dtype. The products run at
      ``lax.Precision.HIGHEST`` and accumulate in at least float32.

    Raises:
      TypeError: ``x`` is not a float array (a `QTensor`, ``None`` included), or
        ``axis`` is not an int.
      ValueError: ``axis`` out of range, ``block_size`` not a power of two
        dividing the axis length, or not given for an axis of odd length.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxquant as jq
      >>> jq.hadamard_transform(jnp.array([1.0, 0.0, 0.0, 0.0]))
      Array([0.5, 0.5, 0.5, 0.5], dtype=float32)
      >>> x, w = jnp.ones((2, 8)), jnp.arange(24.0).reshape(8, 3)
      >>> bool(jnp.allclose(jq.hadamard_transform(x) @ jq.hadamard_transform(w, 0), x @ w))
      True
    """
    if is_qtensor(x):
        raise TypeError("x must be a float array, got a jaxquant.QTensor; rotate the float "
                        "weights, then quantize them (or dequantize it first).")
    x = as_array(x, "x")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a float array, got dtype {x.dtype}.")
    if not _is_int(axis):
        raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}.")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must be an int in [{-x.ndim}, {x.ndim}) for x of shape "
                         f"{x.shape}, got {axis!r}.")
    axis = int(axis) % x.ndim
    n = x.shape[axis]
    if block_size is None:  # an empty axis: nothing to transform
        block_size = _largest_power_of_two_dividing(n) or 1
        if block_size == 1 and n:
            raise ValueError(f"x.shape[{axis}] = {n} is odd: no Hadamard block larger than 1 "
                             f"divides it, so the transform would leave x as it is; pad the "
                             f"axis to an even length, or pass block_size=1 for the identity.")
    if (not _is_int(block_size) or block_size < 1 or block_size & (block_size - 1)
            or n % block_size):
        raise ValueError(f"block_size must be a power of two dividing x.shape[{axis}] = {n}, "
                         f"got {block_size!r}.")
    block_size = int(block_size)
    if block_size == 1 or x.size == 0:
        return x
    compute = x.dtype if x.dtype.itemsize >= 4 else jnp.dtype(jnp.float32)
    given = jnp.moveaxis(x, axis, -1).astype(compute)
    moved = _blocks_on_devices(given, n // block_size)
    *outer, inner = _factors(block_size)  # H = H_outer[0] (x) ... (x) H_inner
    # only the rotated axis is split (explicit mesh axes: the others keep theirs, and the
    # block count takes the axis's own)
    lead, spec = moved.ndim - 1, spec_of(moved)
    blocks = reshape_sharded(moved, (*moved.shape[:-1], n // block_size, *outer, inner),
                             [*spec, *(None,) * (len(outer) + 1)])
    dot = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)
    out = dot(blocks, jnp.asarray(_sylvester(inner), compute))  # (I (x) H_inner) per block
    for i, size in enumerate(outer):  # each further factor mixes one axis of the block's view
        out = _along(jnp.asarray(_sylvester(size), compute), out, lead + 1 + i)
    out = reshape_sharded(out * (block_size ** -0.5), moved.shape, list(spec))
    if moved is not given:  # gathered for the blocks: back onto the input's devices
        out = jax.sharding.reshard(out, jax.typeof(given).sharding)
    return jnp.moveaxis(out, -1, axis).astype(x.dtype)


def _blocks_on_devices(moved: jax.Array, count: int) -> jax.Array:
    """``moved`` with its last axis whole on every device if its ``count`` blocks do not
    split evenly over that axis's explicit mesh axes (a block would straddle two devices)."""
    spec = spec_of(moved)
    if spec[-1] is None:
        return moved
    mesh = jax.typeof(moved).sharding.mesh
    if count % shard_ways(spec[-1], dict(mesh.shape)) == 0:
        return moved
    return replicated_along(moved, moved.ndim - 1)
