"""`QTensor` and `PackedArray` in Flax's state dicts, registered when `jaxquant.flax` is imported.

`flax.serialization.to_state_dict` gives a `QTensor` as ``{"qvalue", "scale",
"zero_point"}`` (a `PackedArray` as ``{"data"}``), so `flax.serialization.to_bytes`
(msgpack) writes a quantized parameter tree; `from_state_dict` / `from_bytes` rebuild
the records from a target tree that has them (the metadata is the target's), and refuse
arrays that do not fit it.

Example:
  >>> import jax.numpy as jnp, jaxquant as jq
  >>> from flax import serialization
  >>> tree = {"w": jq.quantize(jnp.arange(8.0).reshape(2, 4), dtype=jnp.int4, packed=True)}
  >>> back = serialization.from_bytes(tree, serialization.to_bytes(tree))
  >>> bool(jnp.array_equal(jq.dequantize(back["w"]), jq.dequantize(tree["w"])))
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import serialization

from jaxquant._leaves import stacked_axes
from jaxquant._packing import PackedArray
from jaxquant._qtensor import QTensor

__all__: list[str] = []

_FIELDS = {QTensor: ("qvalue", "scale", "zero_point"), PackedArray: ("data",)}


def _to_state(record) -> dict:
    return {k: serialization.to_state_dict(getattr(record, k)) for k in _FIELDS[type(record)]}


def _from_state(target, state: dict, name: str = "."):
    fields = _FIELDS[type(target)]
    if not isinstance(state, dict) or set(state) != set(fields):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{name}: a {type(target).__name__} state dict has the keys "
                         f"{sorted(fields)}, got {got}.")
    children = [serialization.from_state_dict(getattr(target, k), state[k], name=f"{name}/{k}")
                for k in fields]
    for k, t, c in zip(fields, (getattr(target, k) for k in fields), children, strict=True):
        want, got = jax.tree.leaves(t), jax.tree.leaves(c)  # a zero point, a code format
        if jax.tree.structure(t) != jax.tree.structure(c) or any(
                jnp.dtype(a.dtype) != jnp.dtype(b.dtype) for a, b in zip(want, got, strict=True)):
            raise ValueError(f"{type(target).__name__} state: {k} holds "
                             f"{[jnp.dtype(b.dtype).name for b in got]}, the target "
                             f"{[jnp.dtype(a.dtype).name for a in want]}.")
    record = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target),
                                          jax.tree_util.tree_leaves(children))
    if isinstance(record, QTensor):  # arrays that fit the target's metadata (stacks too)
        stacked_axes(record, name)
    return record


for _cls in _FIELDS:
    serialization.register_serialization_state(_cls, _to_state, _from_state)
