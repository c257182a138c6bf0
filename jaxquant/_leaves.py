"""What tree functions need to know of one leaf: kept whole, abstract, its dtype and bytes."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxquant._args import known_dtype
from jaxquant._packing import PackedArray
from jaxquant._qtensor import QTensor, check_consistent

__all__ = ["is_record", "is_abstract", "eval_shape_sharded", "leaf_dtype", "leaf_nbytes",
           "stacked_axes", "layer_by_layer", "unbox_record", "unbox_records"]


def is_record(x) -> bool:
    """Whether ``x`` is a leaf that tree functions keep whole: a `QTensor` or a `PackedArray`.

    Example:
      >>> from jaxquant._packing import pack
      >>> import jax.numpy as jnp
      >>> is_record(pack(jnp.array([1, 2, 3], jnp.int4))), is_record(jnp.ones(3))
      (True, False)
    """
    return isinstance(x, (QTensor, PackedArray))


def is_abstract(x) -> bool:
    """Whether ``x`` (an array or a record) holds `jax.ShapeDtypeStruct` placeholders, as
    `jax.eval_shape` returns them: shapes, dtypes and shardings without values.

    Example:
      >>> import jax.numpy as jnp
      >>> is_abstract(jax.ShapeDtypeStruct((2, 2), jnp.float32)), is_abstract(jnp.ones(2))
      (True, False)
    """
    return any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(x))


def eval_shape_sharded(fn, *args):
    """`jax.eval_shape` that keeps placeholders' shardings on any mesh.

    `jax.eval_shape` gives output shardings on meshes of Explicit axes only; on Auto axes
    (``jax.sharding.Mesh``'s default) a sharded placeholder's outputs would come back with
    none, and a checkpoint loaded into them would land on one device. There the shardings
    are those XLA gives the compiled ``fn`` (as it would concrete arrays). On Explicit axes
    they keep the placeholders' concrete mesh (`jax.eval_shape` gives its abstract one).

    Example:
      >>> import jax.numpy as jnp
      >>> eval_shape_sharded(jnp.sin, jax.ShapeDtypeStruct((2,), jnp.float32)).shape
      (2,)
    """
    out = jax.eval_shape(fn, *args)
    given = [getattr(a, "sharding", None) for a in jax.tree.leaves(args)]
    if all(s is None for s in given):
        return out
    if all(o.sharding is not None for o in jax.tree.leaves(out)):  # Explicit axes
        meshes = {m.abstract_mesh: m for m in (getattr(s, "mesh", None) for s in given)
                  if isinstance(m, jax.sharding.Mesh)}  # the devices, not only the axes

        def concrete(o):
            mesh = getattr(o.sharding, "mesh", None)
            return o.update(sharding=o.sharding.update(mesh=meshes[mesh])) \
                if mesh in meshes else o

        return jax.tree.map(concrete, out)
    shardings = jax.jit(fn).lower(*args).compile().output_shardings
    return jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s,
                                                          weak_type=o.weak_type),
                        out, shardings)


def leaf_nbytes(leaf) -> int:
    """Storage bytes of one leaf: `QTensor.nbytes` / `PackedArray.nbytes` for a record,
    else ``size * itemsize`` of the leaf as a NumPy array (a Python float: 8; a PRNG key
    array: its key data)."""
    if is_record(leaf):  # its arrays in Flax boxes (nn.Partitioned): counted unboxed
        return unbox_record(leaf).nbytes
    dtype = leaf_dtype(leaf)
    if dtype == np.dtype(object):  # np.asarray(object()): the 8 bytes of a pointer, not of the leaf
        raise TypeError(f"a leaf of type {type(leaf).__name__} has no array bytes: {leaf!r:.80}")
    return math.prod(np.shape(leaf)) * dtype.itemsize


def leaf_dtype(leaf):
    """A leaf's dtype: a NumPy one (a torch tensor's by name), or JAX's own for a PRNG key
    array (no NumPy dtype)."""
    if not hasattr(leaf, "dtype"):
        return np.asarray(leaf).dtype
    known = known_dtype(leaf.dtype)
    if known is not None:
        return known
    try:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
            return leaf.dtype
        return np.asarray(leaf).dtype
    except (TypeError, RuntimeError):  # torch.quint8: no NumPy or JAX dtype
        raise TypeError(f"a leaf of dtype {leaf.dtype} has no NumPy or JAX dtype") from None


def stacked_axes(qt: QTensor, where: str) -> int:
    """How many leading axes ``qt`` was stacked along by ``jax.vmap`` / ``lax.scan`` (the
    layers of a scanned model), ``0`` for a plain QTensor: the fewest whose removal leaves
    codes, scales and zero points that fit the metadata.

    Raises:
      ValueError, TypeError: no such number (`check_consistent`'s error, naming ``where``).
    """
    try:  # the common case, a plain QTensor: no views to build
        check_consistent(qt)
        return 0
    except (TypeError, ValueError):
        pass
    for k in range(1, qt.ndim + 1):
        view = jax.tree.map(lambda a, k=k: jax.ShapeDtypeStruct(a.shape[k:], a.dtype), qt)
        try:
            check_consistent(view)
            return k
        except (TypeError, ValueError):
            continue
    check_consistent(qt, where)  # raises
    return 0


def layer_by_layer(fn, qt: QTensor):
    """``fn(qt)``, or for a `QTensor` of layers stacked by ``jax.vmap`` / ``lax.scan`` its
    ``fn`` of each layer (``jax.vmap`` over the leading axes `stacked_axes` finds), for
    functions that rebuild one layer's record (`pack`, `unpack`, `transpose`)."""
    for _ in range(stacked_axes(qt, "x")):
        fn = jax.vmap(fn)
    return fn(qt)


def _arraylike(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def unbox_record(x):
    """A `QTensor` or `PackedArray` with each array taken out of the one-leaf pytree that
    wraps it (Flax's ``nn.Partitioned``, which ``quantize_params`` of a partitioned linen
    kernel puts around each array of its QTensor); ``x`` itself when nothing is wrapped."""
    if is_record(x):  # a PackedArray has a shape and a dtype too
        children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
        plain = [unbox_record(c) for c in children]
        changed = any(p is not c for p, c in zip(plain, children, strict=True))
        return treedef.unflatten(plain) if changed else x
    if x is None or _arraylike(x):
        return x
    leaves = jax.tree_util.tree_leaves(x)
    return leaves[0] if len(leaves) == 1 and _arraylike(leaves[0]) else x


def unbox_records(tree: Any) -> Any:
    """``tree`` with the arrays of its QTensor and PackedArray leaves unwrapped (`unbox_record`):
    what is saved of a boxed QTensor, and the target a boxed target is loaded as."""
    return jax.tree_util.tree_map(unbox_record, tree, is_leaf=is_record)
