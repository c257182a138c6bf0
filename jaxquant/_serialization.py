"""The checkpoint layout: a tree with `QTensor` leaves as flat tensors plus a JSON header.

`encode` names every stored tensor by its leaf's ``/``-joined path (a QTensor's
by ``<path>/qvalue``, ``/scale``, ``/zero_point``), packs 2- and 4-bit codes in
uint8 with ONNX's layout, bitcasts the dtypes safetensors lacks to unsigned
integers, and writes a header (leaf kinds, QTensor metadata, the logical dtype,
shape and CRC-32 of each tensor) that makes the checkpoint self-describing; the
README's "Checkpoint format" documents it. `jaxquant._header` reads and checks
a checkpoint's header (checksum and version, the set of tensors, their dtypes
and shapes; paths, kinds, dtypes, shapes and QTensor metadata against a target
tree); `jaxquant._decoding` verifies the stored tensors and rebuilds the tree on
the target's shardings. `_checkpoint` moves tensors and header to and from
safetensors files and orbax.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._args import as_array
from jaxquant._bits import pack_bits, pack_fields
from jaxquant._formats import FORMATS
from jaxquant._leaves import stacked_axes, unbox_record, unbox_records
from jaxquant._packing import PackedArray
from jaxquant._qtensor import QTensor, is_qtensor
from jaxquant._tree import is_record, path_str

__all__ = ["encode", "header_metadata", "crc32", "block_size_of", "join", "padding_bits",
           "rebox_records", "unbox_records", "ST_CODES", "HEADER_KEY"]

FORMAT_NAME = "jaxquant.checkpoint"
FORMAT_VERSION = 2  # 2: codebook QTensors and QTensor scales (two-level); reads 1 and 2
_READABLE = (1, 2)
HEADER_KEY = "jaxquant"
HEADER_CRC_KEY = "jaxquant.crc32"

# NumPy dtype name -> safetensors dtype code, for the dtypes stored as they are.
ST_CODES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
    "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64", "float16": "F16",
    "bfloat16": "BF16", "float32": "F32", "float64": "F64", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
}
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_KINDS = {"array": "an array", "packed": "a PackedArray", "qtensor": "a QTensor"}
_QTENSOR_FIELDS = ("axis", "block_size", "dtype", "packed", "zero_point")  # codebook: optional


def _is_arraylike(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def join(path: str, child: str) -> str:
    return f"{path}/{child}" if path else child


def _subbyte_bits(dtype: np.dtype) -> int | None:
    fmt = FORMATS.get(dtype.name)
    return fmt.bits if fmt is not None and fmt.bits < 8 else None


def crc32(a) -> int:
    """CRC-32 of an array's little-endian bytes (or of a bytes-like object)."""
    if isinstance(a, (bytes, bytearray, memoryview)):
        return zlib.crc32(a)
    return zlib.crc32(host(a).reshape(-1).view(np.uint8))


def host(a) -> np.ndarray:
    """``a`` as a contiguous little-endian NumPy array (gathers a sharded jax.Array)."""
    if isinstance(a, jax.Array) and not a.size:  # np.asarray fails on jit's sharded empties
        return np.zeros(a.shape, a.dtype)
    a = np.asarray(a, order="C")  # not ascontiguousarray: it makes scalars 1-D
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a


def padding_bits(spec: dict, stored: np.ndarray) -> np.ndarray:
    """The padding bits of a packed tensor's last byte (or 6-bit group of three bytes).

    Args:
      spec: the tensor's header entry (``"encoding": "packed"``).
      stored: its stored bytes, a uint8 NumPy array.

    Returns:
      The bits past the last code along the packed axis, one entry per last byte (or
      group); all zero in what `encode` writes, and empty when no byte is partial.
    """
    axis, bits = spec["axis"], spec.get("bits") or _subbyte_bits(np.dtype(spec["dtype"]))
    per = 4 if bits == 6 else 8 // bits  # codes per group: 3 bytes (6 bits), or 1 byte
    used = (spec["shape"] or [1])[axis] % per
    if not used:
        return np.zeros(0, np.uint32)
    width = 3 if bits == 6 else 1
    group = np.moveaxis(stored, axis, 0)[-width:].astype(np.uint32)
    value = sum(group[i] << (8 * i) for i in range(width))
    return value >> (bits * used)


# --- boxed records -----------------------------------------------------------------------


def rebox_records(target: Any, tree: Any) -> Any:
    """``tree``, loaded into ``unbox_records(target)``, with the wrappers of ``target``'s
    QTensor and PackedArray leaves put back around their arrays."""
    if target is None:
        return tree

    def rebox(t, x):
        if not is_record(t) or unbox_record(t) is t:
            return x
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(t),
                                            jax.tree_util.tree_leaves(x))

    return jax.tree_util.tree_map(rebox, target, tree, is_leaf=is_record)


# --- tree -> tensors + header ------------------------------------------------------------


_pack_last_axis = jax.jit(lambda codes: pack_bits(codes, -1))
_pack_fields = jax.jit(pack_fields, static_argnums=(1, 2))


def _one_device(codes):
    """``codes``, gathered to the host if sharded (and so packed on the default device): a
    shard may hold part of a byte, and a mesh with explicit axes refuses packing's reshape."""
    if isinstance(codes, jax.Array) and len(codes.sharding.device_set) > 1:
        return host(codes)
    return codes


# ml_dtypes' dtypes that XLA has no arrays of: jaxlib 0.10 refuses them with an error,
# jaxlib 0.11.2 aborts the process (so they are named here, not probed).
_NOT_IN_XLA = frozenset({"float6_e2m3fn", "float6_e3m2fn"})


def _foreign_array(x, key: str) -> np.ndarray | jax.Array:
    """Another library's tensor as a NumPy array of its own dtype (an int64 or float64
    tensor stays 64-bit whatever ``jax_enable_x64`` says), else through DLPack as a JAX
    array (torch's bfloat16, which NumPy cannot view)."""
    for to_numpy in (np.asarray, np.from_dlpack):
        try:
            return to_numpy(x)
        except (TypeError, ValueError, RuntimeError, BufferError, AttributeError):
            pass
    return as_array(x, repr(key))


def _concrete(key: str, x) -> None:
    """A TypeError naming ``key`` unless ``x`` is a concrete array (not a placeholder or a
    tracer: a checkpoint holds values)."""
    if not isinstance(x, (jax.Array, np.ndarray)) or isinstance(x, jax.core.Tracer):
        raise TypeError(f"{key!r}: only concrete arrays can be saved, got {type(x).__name__}.")


def _encode_array(key: str, x) -> tuple[dict, Any]:
    """The header entry of the tensor ``key`` and the array to store.

    Raises:
      TypeError: ``x`` is abstract, a PRNG key array, or of a dtype no safetensors dtype fits.
    """
    if isinstance(x, np.generic):
        x = np.asarray(x)
    if not isinstance(x, PackedArray | jax.Array | np.ndarray) and \
            (hasattr(x, "__array__") or hasattr(x, "__dlpack__")):  # a torch tensor, say
        x = _foreign_array(x, key)
    _concrete(key, x.data if isinstance(x, PackedArray) else x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        raise TypeError(f"{key!r}: cannot store a PRNG key array ({x.dtype}); save "
                        f"jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data.")
    dtype, shape = np.dtype(x.dtype), tuple(x.shape)
    spec: dict[str, Any] = {"dtype": dtype.name, "shape": list(shape)}
    if isinstance(x, PackedArray):
        extra = {"bits": x.bits} if x.bits else {}
        if stacked := x.data.ndim - len(shape):  # the bytes of layers stacked by vmap / scan
            spec["shape"] = list(x.data.shape[:stacked]) + spec["shape"]
            extra["stacked"] = stacked
        return spec | {"encoding": "packed", "axis": x.axis + stacked} | extra, x.data
    if _subbyte_bits(dtype):
        codes = _one_device(jnp.reshape(x, (1,)) if not shape else x)
        return spec | {"encoding": "packed", "axis": codes.ndim - 1}, _pack_last_axis(codes)
    if dtype.name in ST_CODES:
        return spec | {"encoding": "raw"}, x
    if dtype.name in _NOT_IN_XLA:
        raise TypeError(f"{key!r}: cannot store dtype {dtype.name}: JAX has no arrays of it, so "
                        f"it could not be loaded back; store its codes as a QTensor with a "
                        f"codebook (e.g. codebook={dtype.name!r}) or as uint8.")
    if dtype.itemsize in _UINTS:
        uint = _UINTS[dtype.itemsize]
        data = x.view(uint) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, uint)
        return spec | {"encoding": "bitcast"}, data
    raise TypeError(f"{key!r}: cannot store dtype {dtype.name}: no safetensors dtype of its "
                    f"width.")


def _encode_qtensor(path: str, qt: QTensor, add) -> dict:
    """Adds a QTensor's tensors (a QTensor scale recursively) and returns its header entry.

    Raises:
      ValueError: unpacked 6-bit codebook codes of 64 or more (they do not fit 6 bits).
    """
    codes = qt.qvalue
    if qt.format.bits == 6 and not qt.packed and qt.ndim:  # 4 codes in 3 bytes
        _concrete(join(path, "qvalue"), codes)
        top = int(jnp.max(codes)) if qt.size else 0
        if top >= 64:  # its high bits would land in the next code's field
            raise ValueError(f"{join(path, 'qvalue')!r}: {qt.codebook} codes are 6-bit indices "
                             f"(0 to 63), got a code {top}; stored four in three bytes it would "
                             f"change its neighbour's code.")
        axis = qt.ndim - 1
        codes = PackedArray(_pack_fields(_one_device(codes), 6, axis), np.dtype(codes.dtype),
                            qt.shape, axis, 6)
    add(join(path, "qvalue"), codes)
    stacked = stacked_axes(qt, path)  # layers stacked by vmap / scan (nn.scan, nnx.vmap)
    entry = {"kind": "qtensor", "axis": qt.axis,
             "block_size": list(qt.block_size) if isinstance(qt.block_size, tuple)
             else qt.block_size,
             "dtype": np.dtype(qt.dtype).name, "packed": qt.packed,
             "zero_point": qt.zero_point is not None}
    if is_qtensor(qt.scale):
        entry["scale"] = _encode_qtensor(join(path, "scale"), qt.scale, add)
    else:
        add(join(path, "scale"), qt.scale)
    if qt.zero_point is not None:
        add(join(path, "zero_point"), qt.zero_point)
    if qt.codebook is not None:
        entry["codebook"] = qt.codebook
    if stacked:
        entry["stacked"] = stacked
    return entry


def block_size_of(entry: dict):
    b = entry["block_size"]
    return tuple(b) if isinstance(b, list) else b


def encode(tree: Any, *, to_host: bool,
           on_tensor: Callable[[], Any] | None = None) -> tuple[dict, dict[str, Any]]:
    """Flattens ``tree`` into ``(header, tensors by name)``.

    With ``to_host`` the tensors are NumPy arrays; otherwise they stay where they
    are (sharded jax.Arrays for orbax). Checksums are taken of the host bytes.
    ``on_tensor`` is called after each tensor (a progress bar's ``update``).

    Raises:
      TypeError: a leaf that is not an array, QTensor or PackedArray, or one that cannot
        be stored (abstract, a PRNG key, a dtype without a safetensors dtype of its width).
      ValueError: two leaves or tensors under one name; packed codes whose last byte has
        nonzero padding bits; 6-bit codebook codes of 64 or more.
    """
    leaves: dict[str, dict] = {}
    specs: dict[str, dict] = {}
    tensors: dict[str, Any] = {}

    def add(key: str, x) -> None:
        if key in specs:
            raise ValueError(f"two tensors would be stored under the name {key!r}; rename one "
                             f"of the tree keys so that their '/'-joined paths differ.")
        spec, data = _encode_array(key, x)
        h = host(data)
        if spec["encoding"] == "packed" and padding_bits(spec, h).any():
            raise ValueError(f"{key!r}: packed codes with nonzero bits past their "
                             f"{(spec['shape'] or [1])[spec['axis']]} codes along axis "
                             f"{spec['axis']} (the padding of the last byte), which loading "
                             f"would refuse; repack them: jq.pack(jq.unpack(x)).")
        specs[key], tensors[key] = spec | {"crc32": crc32(h)}, (h if to_host else data)
        if on_tensor is not None:
            on_tensor()

    flat, _ = jax.tree_util.tree_flatten_with_path(unbox_records(tree), is_leaf=is_record)
    for p, leaf in flat:
        path = path_str(p)
        if path in leaves:
            raise ValueError(f"two leaves have the same path {path!r}; rename one of the keys.")
        if is_qtensor(leaf):
            leaves[path] = _encode_qtensor(path, leaf, add)
        elif isinstance(leaf, PackedArray) or _is_arraylike(leaf):
            add(path, leaf)
            leaves[path] = {"kind": "packed" if isinstance(leaf, PackedArray) else "array"}
        else:
            raise TypeError(f"leaf {path!r} is a {type(leaf).__name__}; checkpoints hold arrays, "
                            f"QTensors and PackedArrays (convert it with jnp.asarray).")
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "leaves": leaves,
              "tensors": specs}
    return header, tensors


def header_metadata(header: dict, metadata: dict[str, str] | None) -> dict[str, str]:
    """The ``__metadata__`` strings: the user's, the header JSON, and a CRC-32 of both."""
    if not isinstance(metadata, dict | None):
        raise TypeError(f"metadata must be a dict of str to str or None, got "
                        f"{type(metadata).__name__}.")
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise TypeError(f"metadata must map str to str, got {k!r}: {type(v).__name__}.")
        if k.startswith(HEADER_KEY):
            raise ValueError(f"metadata key {k!r} is reserved: keys starting with "
                             f"{HEADER_KEY!r} hold jaxquant's header.")
    text = json.dumps(header, separators=(",", ":"))
    meta[HEADER_KEY] = text
    return meta | {HEADER_CRC_KEY: _metadata_crc(meta)}


def _metadata_crc(meta: dict[str, str]) -> str:
    """CRC-32 of every ``__metadata__`` entry but the checksum, as canonical JSON."""
    rest = {k: v for k, v in meta.items() if k != HEADER_CRC_KEY}
    return str(zlib.crc32(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()))


# --- header -> checked plan ---------------------------------------------------------------
