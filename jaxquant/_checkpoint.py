"""Checkpoints of trees with `QTensor` leaves: safetensors files and orbax checkpoints.

Both write the layout of `_serialization`: every leaf under its ``/``-joined
tree path, a `QTensor` as ``<path>/qvalue``, ``<path>/scale`` and
``<path>/zero_point``, 2- and 4-bit codes packed in uint8, and a JSON header
(QTensor metadata, a CRC-32 per tensor) that makes the checkpoint
self-describing. In a safetensors file the header is ``__metadata__["jaxquant"]``.
An orbax checkpoint holds the same tensors as a list of arrays saved with orbax's
`StandardCheckpointer` (which also covers the uint4/uint2 that its TensorStore
cannot store) and the header as its ``custom_metadata``; stored arrays keep their
sharding through the save (but for sharded sub-byte codes, gathered to be packed),
and on load those whose target leaf has a sharding are restored straight onto it,
the rest onto one device and then placed. Orbax
refuses empty arrays: those are not stored (the header says what they were).
safetensors and orbax are optional dependencies (``pip install 'jaxquant[io]'``,
``'jaxquant[orbax]'``), imported only when used. With ``progress=True`` every save and
load shows a tqdm bar over the stored tensors on stderr (tqdm, from the ``io`` extra,
is optional too: without it nothing is shown).
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import jax
import numpy as np

from jaxquant._decoding import build, placements, sharding_of, verify
from jaxquant._header import is_jaxquant, layout_problem, plan, read_header, storage
from jaxquant._packing import PackedArray
from jaxquant._progress import progress_bar
from jaxquant._serialization import (
    HEADER_KEY,
    ST_CODES,
    encode,
    header_metadata,
    rebox_records,
    unbox_records,
)

__all__ = ["save_safetensors", "load_safetensors", "save_orbax", "load_orbax"]

_RESERVED = "__metadata__"  # the safetensors header's key for the metadata, no tensor's name


def _save_bar(tree: Any, progress: bool):
    """The bar of a save, over the tensors that `encode` stores: one per array, `PackedArray`
    and QTensor field (qvalue, scale, zero point; those of a QTensor scale too)."""
    if progress is not True:
        return progress_bar(enabled=progress)  # silent, or a TypeError naming progress
    total = len(jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, PackedArray)))
    return progress_bar(total=total, desc="saving", unit="tensor")


# --- safetensors ----------------------------------------------------------------------


def _path(path, argname: str = "path") -> str:
    """``path`` as a ``str`` (a ``bytes`` path decoded), or a TypeError naming ``argname``."""
    if not isinstance(path, str | bytes | os.PathLike):
        raise TypeError(f"{argname} must be a str or os.PathLike, got {type(path).__name__}.")
    if not (path := os.fsdecode(os.fspath(path))):  # abspath(""): the working directory
        raise ValueError(f"{argname} must name a file or directory, got an empty string.")
    return path


def _safetensors():
    """Imports safetensors, or says how to install it."""
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("safetensors checkpoints need the 'safetensors' package: "
                          "pip install 'jaxquant[io]'") from e
    return safetensors


def save_safetensors(path: str | os.PathLike, tree: Any, *,
                     metadata: dict[str, str] | None = None, progress: bool = False) -> None:
    """Saves a tree of arrays and `QTensor` leaves to a safetensors file.

    Every leaf is stored under its ``/``-joined tree path; a `QTensor` as
    ``<path>/qvalue``, ``<path>/scale`` and, if it has one, ``<path>/zero_point``;
    2- and 4-bit codes packed two (or four) per byte, 6-bit codes four in three
    bytes. The header that describes the tree,
    with a CRC-32 of every tensor, is the JSON string ``__metadata__["jaxquant"]``
    (see the README's "Checkpoint format"). The file is written to a temporary
    name and then renamed, so ``path`` never holds half a checkpoint; a symbolic link
    at ``path`` stays one, and the file it names gets the checkpoint.

    Args:
      path: the file to write.
      tree: a pytree of arrays (jax or NumPy), `QTensor` and `PackedArray` leaves.
      metadata: extra ``str -> str`` entries for ``__metadata__`` (keys must not
        start with ``"jaxquant"``).
      progress: show a ``tqdm`` progress bar over the tensors on stderr while
        they are encoded and moved to host, then written, when tqdm is installed
        (it is optional; without it nothing is shown). Default: silent.

    Raises:
      FileNotFoundError, IsADirectoryError: the directory of ``path`` does not exist, or
        ``path`` is a directory.
      TypeError: ``path`` not a path, a leaf that is not an array, or bad ``metadata``.
      ValueError: an empty ``path``; two leaves whose paths (or tensor names) coincide;
        an array leaf at the path ``"__metadata__"`` (safetensors' name for the metadata;
        a `QTensor` there is stored as ``__metadata__/qvalue``...); a reserved metadata key;
        packed codes with nonzero padding bits in their last byte; 6-bit codebook codes
        of 64 or more.

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxquant as jq
      >>> tree = {"dense": {"kernel": jq.quantize(jnp.ones((4, 8)), dtype=jnp.int4),
      ...                   "bias": jnp.zeros(8, jnp.bfloat16)}}
      >>> with tempfile.TemporaryDirectory() as d:
      ...     jq.save_safetensors(f"{d}/model.safetensors", tree, metadata={"model": "demo"})
      ...     back = jq.load_safetensors(f"{d}/model.safetensors")
      >>> back["dense"]["kernel"], back["dense"]["bias"].dtype
      (QTensor(int4[4, 8], per-tensor, scale[], dtype=float32), dtype(bfloat16))
    """
    safetensors = _safetensors()
    path = _path(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory; save_safetensors writes a file "
                                f"(save_orbax writes a checkpoint directory).")
    target = os.path.realpath(path)  # a link keeps linking: the file it names is replaced
    if not os.path.isdir(parent := os.path.dirname(target)):
        raise FileNotFoundError(f"{path}: no directory {parent!r} to write the file into.")
    with _save_bar(tree, progress) as bar:
        header, tensors = encode(tree, to_host=True, on_tensor=bar.update)
        if _RESERVED in tensors:  # its entry in the file's JSON would be the metadata's
            raise ValueError(f"tree key {_RESERVED!r}: safetensors reserves that tensor name for "
                             f"the file's metadata, so the file could not be read; rename it.")
        meta = header_metadata(header, metadata)
        # beside the file (os.replace stays in one file system), a short name: a long
        # file name plus a suffix could pass the file system's limit
        tmp = os.path.join(parent, f".jaxquant-{os.getpid()}-{threading.get_ident()}.tmp")
        bar.set_postfix_str("writing")
        try:
            safetensors.numpy.save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def load_safetensors(path: str | os.PathLike, target: Any = None, *,
                     allow_plain: bool = False, progress: bool = False) -> Any:
    """Loads a tree saved by `save_safetensors`, bit for bit.

    Args:
      path: the file to read.
      target: ``None``: the tree is rebuilt as nested dicts from the paths, with
        `QTensor` codes packed or not as they were saved. Otherwise a tree whose
        leaf paths must be exactly the file's: arrays, `jax.ShapeDtypeStruct`
        (their ``sharding`` is used), `QTensor` or `PackedArray` leaves (concrete
        or abstract, as `quantize_tree` of placeholders makes);
        dtypes, shapes and QTensor metadata are checked against it, loaded
        arrays are placed with `jax.device_put` on its shardings, and its
        QTensors say whether codes come back packed.
      allow_plain: also load a safetensors file that jaxquant did not write (no
        ``jaxquant`` or ``jaxquant.crc32`` metadata entry): every tensor becomes an
        array leaf, with no checksums to verify.
      progress: show a ``tqdm`` progress bar over the tensors on stderr while
        they are verified, decoded and placed, when tqdm is installed (it is
        optional; without it nothing is shown). Default: silent.

    Returns:
      The tree: jax arrays (NumPy for 64-bit dtypes while ``jax_enable_x64`` is
      off and no target places them), `QTensor` and `PackedArray` leaves.

    Raises:
      FileNotFoundError, IsADirectoryError: ``path`` is missing, or a directory.
      ValueError: a truncated or corrupted file (bad header, tensor, or CRC-32),
        an unknown format version, a file without jaxquant's header (unless
        ``allow_plain``), a key of the target missing from the file, an extra key in
        the file, a shape or QTensor metadata mismatch; an empty ``path``.
      TypeError: a dtype or leaf kind mismatch against ``target``; ``path`` not a path.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, jaxquant as jq
      >>> tree = {"w": jnp.arange(6.0).reshape(2, 3)}
      >>> with tempfile.TemporaryDirectory() as d:
      ...     jq.save_safetensors(f"{d}/w.safetensors", tree)
      ...     jq.load_safetensors(f"{d}/w.safetensors",  # doctest: +ELLIPSIS
      ...                         {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32)})
      Traceback (most recent call last):
      ...
      ValueError: ...: 'w': shape mismatch: the target expects (3, 2), the file holds (2, 3).
    """
    return read_safetensors(path, target, allow_plain=allow_plain, progress=progress)


def read_safetensors(path: str | os.PathLike, target: Any = None, *, allow_plain: bool = False,
                     progress: bool = False, flat: bool = False) -> Any:
    """`load_safetensors`; with ``flat`` (and no target) a dict from each stored leaf's
    ``/``-joined path to the leaf, for files whose paths do not nest (``a`` and ``a/b``)."""
    safetensors = _safetensors()
    where = _path(path)
    if not isinstance(allow_plain, bool | np.bool_):  # "no" would read as True
        raise TypeError(f"allow_plain must be a bool (True or False), got {allow_plain!r}.")
    if os.path.isdir(where):
        raise IsADirectoryError(f"{where}: is a directory, not a safetensors file (load_orbax "
                                f"reads an orbax checkpoint directory).")
    try:
        with safetensors.safe_open(where, framework="np") as f:
            meta = f.metadata() or {}
        with open(where, "rb") as f:
            stored = dict(safetensors.deserialize(f.read()))
    except safetensors.SafetensorError as e:
        raise ValueError(f"{where}: not a valid safetensors file (truncated or corrupted): "
                         f"{e}{layout_problem(where)}") from e
    if allow_plain and not is_jaxquant(meta):
        header = _plain_header(where, {k: (v["dtype"], v["shape"]) for k, v in stored.items()})
    else:
        header = read_header(meta, where)
    for key in stored:
        if key not in header["tensors"]:
            raise ValueError(f"{where}: tensor {key!r} in the file is not in its jaxquant header: "
                             f"corrupted or edited file.")
    for key in header["tensors"]:
        if key not in stored:
            raise ValueError(f"{where}: tensor {key!r} of the header is missing from the file: "
                             f"corrupted or edited file.")
    items, treedef = plan(header, unbox_records(target), where)
    codes = {c: name for name, c in ST_CODES.items()}

    def get(key):
        v, spec = stored[key], header["tensors"][key]
        verify(where, key, spec, codes.get(v["dtype"], v["dtype"]), v["shape"], v["data"])
        bar.update()
        return np.frombuffer(v["data"], storage(spec)[0]).reshape(storage(spec)[1])

    with progress_bar(total=len(stored), enabled=progress, desc="loading", unit="tensor") as bar:
        return rebox_records(target, build(where, header, items, treedef, get, flat))


def _plain_header(where: str, stored: dict[str, tuple[str, list[int]]]) -> dict:
    """A header for a safetensors file jaxquant did not write: every tensor an array leaf."""
    codes = {c: name for name, c in ST_CODES.items()}
    for k, (c, _) in stored.items():
        if c not in codes:
            raise TypeError(f"{where}: tensor {k!r} has the safetensors dtype {c}, which has no "
                            f"NumPy dtype; expected one of {sorted(codes)}.")
    specs = {k: {"dtype": codes[c], "shape": s, "encoding": "raw"} for k, (c, s) in stored.items()}
    return {"leaves": {k: {"kind": "array"} for k in stored}, "tensors": specs}


# --- orbax ----------------------------------------------------------------------------


def save_orbax(directory: str | os.PathLike, tree: Any, *,
               metadata: dict[str, str] | None = None, progress: bool = False) -> None:
    """Saves a tree of arrays and `QTensor` leaves as an orbax checkpoint.

    Args:
      directory: the checkpoint directory (must not exist yet).
      tree: a pytree of arrays (sharded or not), `QTensor` and `PackedArray` leaves.
      metadata: extra ``str -> str`` entries for the checkpoint's custom metadata
        (keys must not start with ``"jaxquant"``).
      progress: show a ``tqdm`` progress bar over the tensors on stderr while
        they are encoded and checksummed, then written, when tqdm is installed
        (it is optional; without it nothing is shown). Default: silent.

    Raises:
      TypeError: a leaf that is not an array, or bad ``metadata``.
      ValueError: two leaves whose paths coincide; a reserved metadata key; packed codes
        with nonzero padding bits in their last byte; 6-bit codebook codes of 64 or more.
      FileExistsError: ``directory`` exists already (checked before any work).

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxquant as jq
      >>> tree = {"w": jq.quantize(jnp.ones((2, 4)), dtype=jnp.uint4, symmetric=False)}
      >>> with tempfile.TemporaryDirectory() as d:
      ...     jq.save_orbax(f"{d}/ckpt", tree)
      ...     jq.load_orbax(f"{d}/ckpt")["w"]
      QTensor(uint4[2, 4], per-tensor, scale[], zero_point, dtype=float32)
    """
    import orbax.checkpoint as ocp

    if os.path.exists(directory := os.path.abspath(_path(directory, "directory"))):
        raise FileExistsError(f"{directory}: already exists; save_orbax writes a new "
                              f"checkpoint directory and never overwrites one.")
    with _save_bar(tree, progress) as bar:
        header, tensors = encode(tree, to_host=False, on_tensor=bar.update)
        meta = header_metadata(header, metadata)
        # Orbax refuses empty arrays and empty trees: a tree without data stores one
        # placeholder byte, which load_orbax (with nothing to restore) never reads.
        stored = [x for x in tensors.values() if x.size] or [np.zeros(1, np.uint8)]
        bar.set_postfix_str("writing")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(directory, stored, custom_metadata=meta)
            ckptr.wait_until_finished()


def _orbax_header(ckptr, where: str) -> dict:
    """The checked jaxquant header of the orbax checkpoint ``where``.

    Raises:
      FileNotFoundError, NotADirectoryError: no such directory, or a file.
      ValueError: not an orbax checkpoint, damaged orbax metadata, no jaxquant header,
        a corrupted header.
    """
    if os.path.isfile(where):
        raise NotADirectoryError(f"{where}: is a file, not an orbax checkpoint directory "
                                 f"(load_safetensors reads a safetensors file).")
    if not os.path.isdir(where):
        raise FileNotFoundError(f"{where}: no such directory: expected an orbax checkpoint "
                                f"directory written by save_orbax.")
    try:
        meta = ckptr.metadata(where)
    except Exception as e:  # orbax raises KeyError, JSON errors... for damaged metadata files
        raise ValueError(f"{where}: cannot read the checkpoint's metadata (corrupted): "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if HEADER_KEY not in (meta.custom_metadata or {}):
        what = ("not an orbax checkpoint (no checkpoint metadata)" if meta.item_metadata is None
                else f"an orbax checkpoint without a jaxquant header (no {HEADER_KEY!r} entry in "
                     f"its custom metadata: not written by save_orbax, or its "
                     f"_CHECKPOINT_METADATA is lost)")
        raise ValueError(f"{where}: {what}.")
    return read_header(meta.custom_metadata, where)


def _restore_target(spec: dict, sharding):
    """What orbax restores a stored tensor as: an array on ``sharding``, or, for a 64-bit
    dtype that jax would narrow (``jax_enable_x64`` off), an exact NumPy array on host."""
    dtype, shape = storage(spec)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        return np.empty(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def load_orbax(directory: str | os.PathLike, target: Any = None, *,
               progress: bool = False) -> Any:
    """Loads a tree saved by `save_orbax`, bit for bit.

    Args:
      directory: the checkpoint directory.
      target: as for `load_safetensors`: ``None`` (nested dicts from the paths)
        or a tree of arrays, `jax.ShapeDtypeStruct` (with shardings), `QTensor`
        or `PackedArray` leaves that the checkpoint must match.
      progress: show a ``tqdm`` progress bar over the tensors on stderr while
        they are verified, decoded and placed (after orbax has restored them),
        when tqdm is installed (it is optional; without it nothing is shown).
        Default: silent.

    Returns:
      The tree, its leaves placed on ``target``'s shardings (NumPy for 64-bit
      dtypes while ``jax_enable_x64`` is off and no target places them).

    Raises:
      FileNotFoundError, NotADirectoryError: no such directory, or a file.
      ValueError: not an orbax checkpoint, damaged orbax metadata, no jaxquant
        header, a corrupted header or tensor (CRC-32), a missing or unreadable
        data file, an unknown format version, a missing or extra key, a shape or
        metadata mismatch.
      TypeError: a dtype or leaf kind mismatch against ``target``.

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxquant as jq
      >>> with tempfile.TemporaryDirectory() as d:
      ...     jq.save_orbax(f"{d}/ckpt", {"step": jnp.array(7)})
      ...     jq.load_orbax(f"{d}/ckpt")
      {'step': Array(7, dtype=int32)}
    """
    import orbax.checkpoint as ocp

    where = os.path.abspath(_path(directory, "directory"))
    with ocp.StandardCheckpointer() as ckptr:
        header = _orbax_header(ckptr, where)
        items, treedef = plan(header, unbox_records(target), where)
        specs = header["tensors"]
        hints = {}
        for path, entry, t in items:
            for key, child in placements(path, entry, t).items():
                # raw and bitcast tensors have the target's shape (a bitcast's codes on
                # another device than the mesh set by jax.set_mesh could not be cast there)
                stored_as_is = (specs[key]["encoding"] in ("raw", "bitcast")
                                or isinstance(child, PackedArray))
                if stored_as_is and sharding_of(child, where, key) is not None:
                    hints[key] = sharding_of(child, where, key)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = {key: _restore_target(spec, hints.get(key, device))
                    for key, spec in specs.items() if math.prod(storage(spec)[1])}
        try:
            values = ckptr.restore(where, list(abstract.values())) if abstract else []
        except Exception as e:  # TensorStore raises bare Exceptions for missing data files
            raise ValueError(f"{where}: cannot read the checkpoint's arrays (a missing or "
                             f"corrupted data file): {str(e).splitlines()[0]}") from e
        restored = dict(zip(abstract, values, strict=True))

    def get(key):
        dtype, shape = storage(specs[key])
        x = restored[key] if key in restored else np.zeros(shape, dtype)
        if key not in hints:  # on one device for the restore only: uncommitted, as from a file
            x = np.asarray(x)  # (its bytes come to the host for their CRC all the same)
        verify(where, key, specs[key], x.dtype.name, x.shape, x)
        bar.update()
        return x

    with progress_bar(total=len(specs), enabled=progress, desc="loading", unit="tensor") as bar:
        return rebox_records(target, build(where, header, items, treedef, get))
