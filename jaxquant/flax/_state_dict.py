"""`QTensor` and `PackedArray` in Flax's state dicts, registered when `jaxquant.flax` is imported.

`flax.serialization.to_state_dict` gives a `QTensor` as ``{"qvalue", "scale",
"zero_point", "meta"}`` (a `PackedArray` as ``{"data", "meta"}``), ``meta`` being a JSON
string of the record's static metadata (axis, block size, dtype, codebook; a packed
array's format, bits, packed axis and its length), so `flax.serialization.to_bytes` (msgpack)
writes a quantized parameter tree that says what it holds. `from_state_dict` /
`from_bytes` rebuild the records from a target tree that has them and refuse, naming
the path, a state whose metadata, array shapes or dtypes differ from the target's
(a state written without ``meta`` is checked on its arrays only).

Example:
  >>> import jax.numpy as jnp, jaxquant as jq
  >>> from flax import serialization
  >>> tree = {"w": jq.quantize(jnp.arange(8.0).reshape(2, 4), dtype=jnp.int4, packed=True)}
  >>> back = serialization.from_bytes(tree, serialization.to_bytes(tree))
  >>> bool(jnp.array_equal(jq.dequantize(back["w"]), jq.dequantize(tree["w"])))
  True
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from jaxquant._leaves import unbox_record
from jaxquant._packing import PackedArray
from jaxquant._qtensor import QTensor

__all__: list[str] = []

_FIELDS = {QTensor: ("qvalue", "scale", "zero_point"), PackedArray: ("data",)}


def _meta(record) -> dict:
    """The static metadata of ``record`` (what its arrays do not say), JSON-ready; its arrays
    may be in Flax boxes (a partitioned linen kernel's)."""
    record = unbox_record(record)
    if isinstance(record, QTensor):
        block = record.block_size
        return {"axis": record.axis, "block_size": list(block) if isinstance(block, tuple)
                else block, "dtype": np.dtype(record.dtype).name, "codebook": record.codebook}
    return {"dtype": np.dtype(record.dtype).name, "bits": record.bits,
            "axis_from_end": record.axis - len(record.shape), "length": record.shape[record.axis]}


def _to_state(record) -> dict:
    state = {k: serialization.to_state_dict(getattr(record, k)) for k in _FIELDS[type(record)]}
    return state | {"meta": json.dumps(_meta(record), sort_keys=True)}


def _check_meta(target, saved: str, where: str) -> None:
    try:
        got = json.loads(saved)
    except (TypeError, ValueError):
        got = None
    if not isinstance(got, dict):
        raise ValueError(f"{where}: a {type(target).__name__} state's meta is a JSON object, "
                         f"got {saved!r:.80}.")
    want = _meta(target)
    for field in sorted(set(want) | set(got)):
        if got.get(field) != want.get(field):
            raise ValueError(f"{where}: the state holds a {type(target).__name__} with "
                             f"{field}={got.get(field)!r}, the target {field}="
                             f"{want.get(field)!r}; load it into a target of the same "
                             f"metadata (or requantize).")


def _held(v) -> str:
    """What a child of a record's state (or of its target) holds, for an error message:
    its arrays' dtypes, or the kind of record whose state Flax handed back as a dict
    (a packed ``qvalue`` or a two-level scale where the target has an array)."""
    if isinstance(v, dict):
        kind = "PackedArray" if set(v) - {"meta"} == {"data"} else "QTensor"
        return f"a {kind} (a state dict with keys {sorted(v)})"
    kind = f"a {type(v).__name__} of " if isinstance(v, tuple(_FIELDS)) else ""
    return kind + str([jnp.dtype(b.dtype).name for b in jax.tree.leaves(v)])


def _from_state(target, state: dict):
    where = serialization.current_path() or "."
    fields = _FIELDS[type(target)]
    if not isinstance(state, dict) or set(state) - {"meta"} != set(fields):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{where}: a {type(target).__name__} state dict has the keys "
                         f"{sorted(fields)} (and 'meta'), got {got}.")
    if "meta" in state:
        _check_meta(target, state["meta"], where)
    children = [serialization.from_state_dict(getattr(target, k), state[k], name=k)
                for k in fields]
    for k, t, c in zip(fields, (getattr(target, k) for k in fields), children, strict=True):
        want, got = jax.tree.leaves(t), jax.tree.leaves(c)  # a zero point, a code format
        if jax.tree.structure(t) != jax.tree.structure(c) or any(
                jnp.dtype(a.dtype) != jnp.dtype(b.dtype) for a, b in zip(want, got, strict=True)):
            raise ValueError(f"{where}: {type(target).__name__} state: {k} holds "
                             f"{_held(c)}, the target {_held(t)}.")
        for a, b in zip(want, got, strict=True):  # with the target's metadata: a record that fits
            if tuple(a.shape) != tuple(np.shape(b)):
                raise ValueError(f"{where}: {type(target).__name__} state: {k} has shape "
                                 f"{tuple(np.shape(b))}, the target {tuple(a.shape)}.")
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target),
                                        jax.tree_util.tree_leaves(children))


for _cls in _FIELDS:
    serialization.register_serialization_state(_cls, _to_state, _from_state)
