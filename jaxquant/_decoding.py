"""Stored tensors back to a tree: verified, decoded and placed on the target's shardings.

The second half of the checkpoint layout of `jaxquant._serialization`: `verify`
checks each stored tensor's dtype, shape and CRC-32 against its header entry,
`build` decodes them (unpacking 2-, 4- and 6-bit codes, undoing bitcasts) into
the planned tree, QTensor scales that are QTensors themselves included, and
`nest` rebuilds nested dicts from ``/``-joined paths when there is no target;
`placements` and `sharding_of` say where each stored tensor of a target goes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jaxquant._bits import unpack_bits, unpack_fields
from jaxquant._header import storage
from jaxquant._packing import PackedArray, layers_of_packed
from jaxquant._qtensor import QTensor, is_qtensor
from jaxquant._serialization import block_size_of, crc32, host, join, padding_bits

__all__ = ["verify", "build", "nest", "placements", "sharding_of"]


def verify(where: str, key: str, spec: dict, stored_dtype: str, stored_shape, data) -> None:
    """Checks a stored tensor's dtype, shape and CRC-32 against its header entry, and that
    packed codes leave the padding bits of their last byte (or 6-bit group) zero.

    Args:
      where: the file, for messages.
      key: the tensor's name.
      spec: its header entry.
      stored_dtype: the name of the dtype it is stored with.
      stored_shape: the shape it is stored with.
      data: its stored array (NumPy or jax), or its bytes.

    Raises:
      ValueError: another stored dtype or shape, a CRC-32 mismatch, or nonzero bits past
        the header's length along the packed axis (a header whose shape was edited to
        fewer codes that still fit the same bytes).
    """
    dtype, shape = storage(spec)
    if stored_dtype != dtype.name or tuple(stored_shape) != shape:
        raise ValueError(f"{where}: tensor {key!r} is stored as {stored_dtype}"
                         f"{list(stored_shape)}, its header entry says {dtype.name}"
                         f"{list(shape)}: corrupted file.")
    if "crc32" in spec and crc32(data) != spec["crc32"]:
        raise ValueError(f"{where}: checksum mismatch in tensor {key!r}: CRC-32 {crc32(data)}, "
                         f"the header records {spec['crc32']}: corrupted file.")
    if spec["encoding"] != "packed":
        return
    raw = isinstance(data, (bytes, bytearray, memoryview))  # safetensors' bytes
    stored = np.frombuffer(data, dtype).reshape(shape) if raw else host(data)
    if padding_bits(spec, stored).any():
        n = (spec["shape"] or [1])[spec["axis"]]
        raise ValueError(f"{where}: tensor {key!r} holds nonzero bits past its {n} codes along "
                         f"axis {spec['axis']}: its header's shape {spec['shape']} does not fit "
                         f"the stored bytes (corrupted or edited file).")


def _put(where: str, key: str, x, sharding):
    """``x`` on ``sharding`` (or the default device); never changes the dtype."""
    want = np.dtype(x.dtype)
    if sharding is None and jax.dtypes.canonicalize_dtype(want) != want:
        return np.asarray(x)  # e.g. int64 without jax_enable_x64: exact as NumPy
    y = jax.device_put(x, sharding)
    if y.dtype != want:
        raise TypeError(f"{where}: {key!r}: {want.name} would become {y.dtype} on the device; "
                        f"enable jax_enable_x64 to load it.")
    return y


def _decode(where: str, key: str, spec: dict, data, sharding, keep_packed: bool):
    """The array (or PackedArray) a stored tensor holds, placed on ``sharding``."""
    dtype, shape, encoding = np.dtype(spec["dtype"]), tuple(spec["shape"]), spec["encoding"]
    if encoding == "raw":
        return _put(where, key, data, sharding)
    if encoding == "bitcast":
        data = np.asarray(data).view(dtype) if sharding is None or isinstance(data, np.ndarray) \
            else jax.lax.bitcast_convert_type(data, dtype)
        return _put(where, key, data, sharding)
    axis, bits = spec["axis"], spec.get("bits")
    if keep_packed:  # the bytes of stacked layers: one layer's shape and axis
        k = spec.get("stacked", 0)
        return layers_of_packed(_put(where, key, data, sharding), dtype, shape[k:], axis - k, bits)
    if sharding is not None and isinstance(data, jax.Array):
        data = np.asarray(data)  # committed elsewhere (orbax): let jit place the input
    return _unpacker(sharding)(data, dtype, shape, axis, bits)


def _unpack(data: jax.Array, dtype: np.dtype, shape: tuple[int, ...], axis: int,
            bits: int | None) -> jax.Array:
    n = (shape or (1,))[axis]
    if bits:
        return unpack_fields(data, bits, n, axis).astype(dtype).reshape(shape)
    return unpack_bits(data, dtype, n, axis).reshape(shape)


@functools.lru_cache(maxsize=64)
def _unpacker(sharding):
    """`_unpack`, jitted once per output sharding (so that equal shapes compile once)."""
    out = {} if sharding is None else {"out_shardings": sharding}
    return jax.jit(_unpack, static_argnums=(1, 2, 3, 4), **out)


def build(where: str, header: dict, items: list, treedef, get, flat: bool = False) -> Any:
    """The tree from a checked plan; ``get(name)`` returns a verified stored tensor.

    Without a target (``treedef`` None) the leaves are nested dicts of their paths, or with
    ``flat`` one dict from each ``/``-joined path to its leaf (which cannot collide)."""
    specs, out = header["tensors"], []
    for path, entry, t in items:
        where_to = {k: sharding_of(v, where, k) for k, v in placements(path, entry, t).items()}

        def load(name, keep_packed=False, path=path, where_to=where_to):
            key = path if name is None else join(path, name)
            return _decode(where, key, specs[key], get(key), where_to.get(key), keep_packed)

        if entry["kind"] != "qtensor":
            out.append(load(None, keep_packed=entry["kind"] == "packed"))
            continue
        out.append(_build_qtensor(where, path, entry, t, load))
    if treedef is not None:
        return jax.tree_util.tree_unflatten(treedef, out)
    leaves = dict(zip([p for p, _, _ in items], out, strict=True))
    return leaves if flat else nest(where, leaves)


def _build_qtensor(where: str, path: str, entry: dict, t, load, prefix: str = "") -> QTensor:
    """A QTensor from its stored tensors (``prefix``: the path below the leaf, for scales)."""
    packed = entry["packed"] if t is None else t.packed
    qvalue = load(join(prefix, "qvalue") if prefix else "qvalue", packed)
    if "scale" in entry:
        inner = join(prefix, "scale") if prefix else "scale"
        scale = _build_qtensor(where, path, entry["scale"], None if t is None else t.scale, load,
                               inner)
    else:
        scale = load(join(prefix, "scale") if prefix else "scale")
    zp = load(join(prefix, "zero_point") if prefix else "zero_point") \
        if entry["zero_point"] else None
    kw = dict(axis=entry["axis"], block_size=block_size_of(entry), dtype=entry["dtype"],
              codebook=entry.get("codebook"))
    try:
        return _stacked_qtensor((qvalue, scale, zp), entry.get("stacked", 0), kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {path!r}: the stored QTensor is inconsistent: {e}") from e


def _stacked_qtensor(parts: tuple, k: int, kw: dict) -> QTensor:
    """``QTensor(*parts, **kw)``; with ``k`` leading axes of stacked layers (as ``jax.vmap``
    and ``lax.scan`` stack QTensors), one layer's view is checked and the arrays put in it."""
    if not k:
        return QTensor(*parts, **kw)
    arrays = jax.tree_util.tree_leaves(parts)
    if len({tuple(a.shape[:k]) for a in arrays}) != 1 or min(a.ndim for a in arrays) < k:
        raise ValueError(f"its arrays do not share {k} leading axes of stacked layers: shapes "
                         f"{[tuple(a.shape) for a in arrays]}.")
    layer = QTensor(*jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[k:], a.dtype), parts),
                    **kw)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(layer), arrays)


def nest(where: str, flat: dict[str, Any]) -> Any:
    """Nested dicts from ``/``-joined paths (a single ``""`` path is the tree itself)."""
    if list(flat) == [""]:
        return flat[""]
    root: dict = {}
    for path, value in flat.items():
        *parents, last = path.split("/")
        node = root
        for k in parents:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                break
        if not isinstance(node, dict) or last in node:
            raise ValueError(f"{where}: cannot rebuild nested dicts: {path!r} collides with "
                             f"another leaf's path; pass target= with the tree's structure.")
        node[last] = value
    return root


def placements(path: str, entry: dict, t) -> dict[str, Any]:
    """Stored tensor name -> the target array (or PackedArray) that says where it goes."""
    if t is None:
        return {}
    if entry["kind"] != "qtensor":
        return {path: t}
    out = {}
    for n in ("qvalue", "scale", "zero_point"):
        v = getattr(t, n)
        if is_qtensor(v):
            out |= placements(join(path, n), entry[n], v)
        elif v is not None:
            out[join(path, n)] = v
    return out


def sharding_of(t, where: str = "", key: str = ""):
    """The sharding a target array asks for (``None``: the default device).

    A ``NamedSharding`` on an ``AbstractMesh`` (what ``jax.eval_shape`` gives on
    explicit mesh axes) is put on the concrete mesh that ``jax.set_mesh`` set.

    Args:
      t: a target leaf: an array, `jax.ShapeDtypeStruct` or `PackedArray`.
      where: the file, for the message.
      key: the stored tensor, for the message.

    Returns:
      A sharding with devices, or ``None``.

    Raises:
      ValueError: an abstract mesh without a concrete mesh of its shape and axes set; a
        sharding that splits an axis of the target (of a `PackedArray`: of its bytes)
        into unequal shards.
    """
    array = t.data if isinstance(t, PackedArray) else t
    sharding = getattr(array, "sharding", None)
    shape = tuple(getattr(array, "shape", ()))
    try:
        if hasattr(sharding, "shard_shape"):
            sharding.shard_shape(shape)
    except ValueError as e:
        what, fix = f"shape {shape}", ""
        if isinstance(t, PackedArray):
            what = f"packed bytes {shape} (codes {tuple(t.shape)} packed along axis {t.axis})"
            fix = (" (or give the codes unpacked, as a ShapeDtypeStruct of their own dtype "
                   "and shape: they are unpacked onto its sharding)")
        raise ValueError(f"{where}: {key!r}: the target's sharding {sharding.spec} does not "
                         f"split its {what} into equal shards; shard axes whose length the "
                         f"mesh axes divide{fix}.") from e
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return sharding
    concrete = jax.sharding.get_mesh()
    if concrete.empty or concrete.abstract_mesh != mesh:
        raise ValueError(f"{where}: {key!r}: the target's sharding is on an abstract mesh "
                         f"{mesh} (no devices; jax.eval_shape gives those, for instance, "
                         f"on explicit mesh axes): load under `with jax.set_mesh(mesh):` "
                         f"with a concrete mesh of that shape and axes, got {concrete}.")
    return sharding.update(mesh=concrete)
