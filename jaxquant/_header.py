"""Reading a checkpoint's header: its checksum, version and entries, and its fit to a target.

`read_header` parses and checks the JSON header that `jaxquant._serialization.encode`
wrote (checksum and version, the set of tensors, their dtypes and shapes); `plan`
checks it against a target tree (paths, kinds, dtypes, shapes and QTensor
metadata); `storage` gives the dtype and shape each tensor is stored with;
`layout_problem` names the tensor of a safetensors file that safetensors refused.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._bits import packed_length
from jaxquant._packing import PackedArray
from jaxquant._qtensor import is_qtensor
from jaxquant._serialization import (
    _KINDS,
    _NOT_IN_XLA,
    _QTENSOR_FIELDS,
    _READABLE,
    _UINTS,
    FORMAT_NAME,
    HEADER_CRC_KEY,
    HEADER_KEY,
    ST_CODES,
    _is_arraylike,
    _metadata_crc,
    _subbyte_bits,
    block_size_of,
    join,
)
from jaxquant._tree import is_record, path_str

__all__ = ["is_jaxquant", "read_header", "plan", "storage", "layout_problem"]

# safetensors dtype code -> bits per element (the codes jaxquant writes, and the sub-byte
# float codes other writers use)
_ST_BITS = {code: 8 * jnp.dtype(name).itemsize for name, code in ST_CODES.items()} | {
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def layout_problem(path: str) -> str:
    """Which tensor of the safetensors file ``path`` does not fit the file's data area.

    Read only to explain a file that safetensors refused (its own message names no tensor):
    the first tensor, in the order of its data, whose bytes overlap the previous tensor's or
    leave a gap, do not hold its dtype and shape, or run past the end of the file; or bytes
    after the last tensor.

    Args:
      path: the safetensors file.

    Returns:
      ``"; tensor 'name': ..."`` (or ``"; ... after the last tensor"``), or ``""`` when the
      header cannot be read or nothing is found.
    """
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > (rest := os.path.getsize(path) - 8):
                return f"; its header length field says {n} bytes, {rest} follow it"
            entries = json.loads(f.read(n))
        size = rest - n
        entries = sorted((tuple(e["data_offsets"]), k, e["dtype"], e["shape"])
                         for k, e in entries.items() if k != "__metadata__")
        end = 0
        for (start, stop), key, code, shape in entries:
            if code not in _ST_BITS or any(type(i) is not int or i < 0
                                           for i in (start, stop, *shape)):
                return ""  # safetensors' own message names the bad value
            span, need = stop - start, math.prod(shape) * _ST_BITS[code]
            if start != end:
                return (f"; tensor {key!r}: its data_offsets [{start}, {stop}] start at byte "
                        f"{start}, the previous tensor's data ends at byte {end}")
            if 8 * span != need:
                return (f"; tensor {key!r}: {code}{list(shape)} is {need / 8:g} bytes, its "
                        f"data_offsets [{start}, {stop}] hold {span}")
            if stop > size:
                return (f"; tensor {key!r}: its data_offsets [{start}, {stop}] run past the "
                        f"{size} bytes of data in the file (truncated file?)")
            end = stop
        return f"; {size - end} bytes after the last tensor's data" if size > end else ""
    except (OSError, struct.error, ValueError, TypeError, KeyError, AttributeError):
        return ""


def storage(spec: dict) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape a tensor is stored with, from its header entry (ValueError for
    one `encode` never writes: a bad shape, packed axis, or encoding for the dtype, or a
    dtype JAX has no arrays of)."""
    dtype, shape, encoding = np.dtype(spec["dtype"]), spec["shape"], spec["encoding"]
    if dtype.name in _NOT_IN_XLA:
        raise ValueError(f"dtype {dtype.name} has no JAX arrays, so encode never stores it")
    if not isinstance(shape, (list, tuple)) or any(type(n) is not int or n < 0 for n in shape):
        raise ValueError(f"shape {shape!r} is not a list of non-negative integers")
    shape = tuple(shape)
    if encoding == "raw" and dtype.name in ST_CODES:
        return dtype, shape
    if (encoding == "bitcast" and dtype.name not in ST_CODES and not _subbyte_bits(dtype)
            and dtype.itemsize in _UINTS and jnp.issubdtype(dtype, jnp.number)):
        return np.dtype(_UINTS[dtype.itemsize]), shape
    bits = spec.get("bits")  # 6 for float6 codes (uint8); 2- and 4-bit formats have none
    if encoding == "packed" and (bits == 6 and type(bits) is int and dtype == np.uint8
                                 or bits is None and _subbyte_bits(dtype)):
        bits = bits or _subbyte_bits(dtype)
        stored = list(shape) or [1]
        axis = spec["axis"]
        if type(axis) is not int or not 0 <= axis < len(stored):
            raise ValueError(f"packed axis {axis!r} is out of range for shape {list(shape)}")
        stacked = spec.get("stacked", 0)
        if type(stacked) is not int or not 0 <= stacked <= axis:
            raise ValueError(f"stacked={stacked!r} is not a number of axes before the packed "
                             f"axis {axis}")
        stored[axis] = packed_length(stored[axis], bits)
        return np.dtype(np.uint8), tuple(stored)
    raise ValueError(f"no {encoding!r} storage for dtype {dtype.name}")


def _leaf_keys(path: str, entry: dict) -> list[str]:
    """The names of the tensors a leaf's header entry stores; checks its required fields."""
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind in ("array", "packed"):
        return [path]
    if kind != "qtensor":
        raise ValueError(f"leaf {path!r} has kind {kind!r}; expected one of {sorted(_KINDS)}")
    missing = [name for name in _QTENSOR_FIELDS if name not in entry]
    if missing:
        raise ValueError(f"the QTensor entry {path!r} lacks {', '.join(map(repr, missing))}; "
                         f"a QTensor entry holds {', '.join(map(repr, _QTENSOR_FIELDS))}")
    for name, kinds in (("dtype", str), ("packed", bool), ("zero_point", bool)):
        if not isinstance(entry[name], kinds):
            raise ValueError(f"the QTensor entry {path!r} has {name}={entry[name]!r}; expected "
                             f"a {kinds.__name__}")
    if type(stacked := entry.get("stacked", 0)) is not int or stacked < 0:
        raise ValueError(f"the QTensor entry {path!r} has stacked={stacked!r}; expected a "
                         f"non-negative int")
    if np.dtype(entry["dtype"]).name in _NOT_IN_XLA:  # it could not be dequantized
        raise ValueError(f"the QTensor entry {path!r} has dtype={entry['dtype']!r}, which JAX "
                         f"has no arrays of")
    keys = [join(path, "qvalue")]
    if "scale" in entry:
        keys += _leaf_keys(join(path, "scale"), entry["scale"])
    else:
        keys.append(join(path, "scale"))
    return keys + ([join(path, "zero_point")] if entry["zero_point"] else [])


def is_jaxquant(meta: dict[str, str] | None) -> bool:
    """Whether ``__metadata__`` marks a jaxquant file: its header or its checksum entry (a file
    whose header key is damaged is still a jaxquant file, and a corrupted one)."""
    return bool(meta) and (HEADER_KEY in meta or HEADER_CRC_KEY in meta)


def _added_entries(meta: dict[str, str], others: list[str]) -> tuple[str, ...] | None:
    """The fewest of ``others`` (the non-jaxquant ``__metadata__`` entries) without which
    the checksum matches: entries a tool added after saving (Hugging Face's ``{"format":
    "pt"}``), which the checksum never covered; ``None`` when no such set (of up to 4 of at
    most 12) exists."""
    if len(others) > 12:
        return None
    for n in range(1, min(4, len(others)) + 1):
        for dropped in itertools.combinations(others, n):
            kept = {k: v for k, v in meta.items() if k not in dropped}
            if _metadata_crc(kept) == meta.get(HEADER_CRC_KEY):
                return dropped
    return None


def read_header(meta: dict[str, str] | None, where: str) -> dict:
    """Parses and checks jaxquant's header from a file's ``__metadata__``.

    Raises:
      ValueError: no header, corrupted header (a checksum entry without its header,
        bad JSON, bad CRC-32, malformed entries) or an unknown format version.
    """
    if meta and HEADER_KEY not in meta and HEADER_CRC_KEY in meta:
        raise ValueError(f"{where}: corrupted jaxquant metadata: a {HEADER_CRC_KEY!r} checksum "
                         f"but no {HEADER_KEY!r} header entry (keys: {sorted(meta)}).")
    if not meta or HEADER_KEY not in meta:
        raise ValueError(f"{where}: no {HEADER_KEY!r} entry in the metadata: not a jaxquant "
                         f"checkpoint (load_safetensors(..., allow_plain=True) reads a plain "
                         f"safetensors file's tensors as arrays).")
    text = meta[HEADER_KEY]
    try:
        header = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: corrupted jaxquant header: invalid JSON ({e}).") from None
    got = header.get("format") if isinstance(header, dict) else header
    if got != FORMAT_NAME:
        raise ValueError(f"{where}: corrupted jaxquant header: expected format "
                         f"{FORMAT_NAME!r}, got {got!r}.")
    version, crc = header.get("version"), _metadata_crc(meta)
    newer = type(version) is int and version > max(_READABLE)  # may checksum otherwise
    others = sorted(k for k in meta if not k.startswith(HEADER_KEY))
    if meta.get(HEADER_CRC_KEY) != crc and not newer and _added_entries(meta, others) is None:
        raise ValueError(f"{where}: corrupted jaxquant metadata: its CRC-32 is {crc}, the file "
                         f"records {meta.get(HEADER_CRC_KEY)!r} (it covers the header and "
                         f"the metadata entries saved with it, one of which changed or was "
                         f"removed; the file's other entries: {others}).")
    if type(version) is not int or version not in _READABLE:
        readable = ", ".join(map(str, _READABLE))
        raise ValueError(f"{where}: unknown jaxquant checkpoint version {version!r}; "
                         f"this jaxquant reads versions {readable} (a newer file needs a "
                         f"newer jaxquant).")
    try:
        used = []
        for path, entry in header["leaves"].items():
            used += _leaf_keys(path, entry)
        for key, spec in header["tensors"].items():
            storage(spec)
            if type(spec.get("crc32")) is not int:
                raise ValueError(f"tensor {key!r} has no integer crc32 (got {spec.get('crc32')!r})")
        if sorted(used) != sorted(header["tensors"]):
            unused = sorted(set(header["tensors"]) - set(used))
            missing = sorted(set(used) - set(header["tensors"])) or sorted(
                k for k in set(used) if used.count(k) > 1)
            raise ValueError(f"its leaves and tensors do not match (tensors no leaf uses: "
                             f"{unused}; tensors the leaves name that are missing or named "
                             f"twice: {missing})")
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ValueError(f"{where}: malformed jaxquant header: {e}.") from None
    return header


def _same(where: str, key: str, expected, spec: dict) -> None:
    shape, axis = tuple(expected.shape), getattr(expected, "axis", None)
    if isinstance(expected, PackedArray):  # stacked layers' bytes: their leading axes too
        k = len(expected.data.shape) - len(shape)
        shape, axis = tuple(expected.data.shape[:k]) + shape, axis + k
    if np.dtype(expected.dtype).name != spec["dtype"]:
        raise TypeError(f"{where}: {key!r}: dtype mismatch: the target expects "
                        f"{np.dtype(expected.dtype).name}, the file holds {spec['dtype']}.")
    if shape != tuple(spec["shape"]):
        raise ValueError(f"{where}: {key!r}: shape mismatch: the target expects "
                         f"{shape}, the file holds {tuple(spec['shape'])}.")
    if isinstance(expected, PackedArray) and axis != spec.get("axis"):
        raise ValueError(f"{where}: {key!r}: packed axis mismatch: the target expects "
                         f"{axis}, the file holds {spec.get('axis')}.")


def _check_leaf(where: str, path: str, entry: dict, specs: dict, t) -> None:
    """Checks a file leaf against its target leaf, before any data is read."""
    kind = "qtensor" if is_qtensor(t) else "packed" if isinstance(t, PackedArray) else "array"
    if kind == "array" and not _is_arraylike(t):
        raise TypeError(f"{where}: {path!r}: target leaves must be arrays, ShapeDtypeStructs, "
                        f"QTensors or PackedArrays, got {type(t).__name__}.")
    if kind == "array" and jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key):
        raise TypeError(f"{where}: {path!r}: the target holds a PRNG key array ({t.dtype}), "
                        f"which checkpoints do not store: save jax.random.key_data(key), load it "
                        f"into a uint32 target and rebuild it with jax.random.wrap_key_data.")
    if entry["kind"] != kind:
        raise TypeError(f"{where}: {path!r}: the target holds {_KINDS[kind]}, the file "
                        f"{_KINDS[entry['kind']]}.")
    if kind != "qtensor":
        _same(where, path, t, specs[path])
        return
    stored = {"axis": entry["axis"], "block_size": block_size_of(entry),
              "codebook": entry.get("codebook")}
    for name, value in stored.items():
        if getattr(t, name) != value:
            raise ValueError(f"{where}: {path!r}: QTensor {name} mismatch: the target expects "
                             f"{getattr(t, name)!r}, the file holds {value!r}.")
    if np.dtype(t.dtype).name != entry["dtype"]:
        raise TypeError(f"{where}: {path!r}: QTensor dtype mismatch: the target expects "
                        f"{np.dtype(t.dtype).name}, the file holds {entry['dtype']}.")
    # the codes first: int4 against uint4 is a dtype mismatch, not a missing zero point
    _same(where, join(path, "qvalue"), t.qvalue, specs[join(path, "qvalue")])
    if (t.zero_point is not None) != entry["zero_point"]:
        has = {True: "a zero point", False: "no zero point"}
        raise ValueError(f"{where}: {path!r}: the target expects {has[t.zero_point is not None]}, "
                         f"the file holds {has[entry['zero_point']]}.")
    if is_qtensor(t.scale) != ("scale" in entry):
        has = {True: "a QTensor scale", False: "an array scale"}
        raise TypeError(f"{where}: {path!r}: the target has {has[is_qtensor(t.scale)]}, the "
                        f"file {has['scale' in entry]}.")
    if is_qtensor(t.scale):
        _check_leaf(where, join(path, "scale"), entry["scale"], specs, t.scale)
    for name in ("scale", "zero_point"):
        v = getattr(t, name)
        if v is not None and not is_qtensor(v):
            _same(where, join(path, name), v, specs[join(path, name)])


def plan(header: dict, target: Any, where: str) -> tuple[list, Any]:
    """``([(path, entry, target leaf or None)], treedef or None)``, checked against ``target``.

    Raises:
      ValueError: a target key missing from the file, an extra key in the file,
        a shape or metadata mismatch.
      TypeError: a dtype or leaf kind mismatch.
    """
    leaves = header["leaves"]
    if target is None:
        return [(p, e, None) for p, e in leaves.items()], None
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_record)
    paths = [path_str(p) for p, _ in flat]
    seen: set[str] = set()
    if twice := [p for p in paths if p in seen or seen.add(p)]:
        raise ValueError(f"{where}: the target has two leaves with the same path {twice[0]!r}; "
                         f"rename one of the keys.")
    known = ", ".join(repr(p) for p in list(leaves)[:5]) + (", ..." if len(leaves) > 5 else "")
    missing = [p for p in paths if p not in leaves]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: key {missing[0]!r} of the target is missing from the "
                         f"file{more}; the file holds {known or 'no leaves'}.")
    extra = [p for p in leaves if p not in set(paths)]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"{where}: unexpected key {extra[0]!r} in the file{more}: the target "
                         f"has no leaf at that path.")
    for path, (_, t) in zip(paths, flat, strict=True):
        _check_leaf(where, path, leaves[path], header["tensors"], t)
    return [(p, leaves[p], t) for p, (_, t) in zip(paths, flat, strict=True)], treedef
