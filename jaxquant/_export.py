"""`QTensor` and `PackedArray` in `jax.export`'s serialized calling convention.

A function exported with `QTensor` or `PackedArray` arguments or results keeps their
tree structure in its ``in_tree`` and ``out_tree``; `jax.export.Exported.serialize`
writes that structure only for registered node types. The static metadata is stored
as JSON (never pickle: a serialized function may come from elsewhere), dtypes by name.

Example:
  >>> import jax, jax.numpy as jnp, jaxquant as jq
  >>> q = jq.quantize(jnp.arange(8.0).reshape(2, 4), dtype=jnp.int4, axis=1, packed=True)
  >>> exp = jax.export.export(jax.jit(jq.dequantize))(q)
  >>> back = jax.export.deserialize(exp.serialize())
  >>> bool(jnp.array_equal(back.call(q), jq.dequantize(q)))
  True
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

from jaxquant._packing import PackedArray
from jaxquant._qtensor import QTensor

__all__: list[str] = []


def _tuples(v):
    """JSON's lists back to the tuples the metadata held (nested: a packed shape)."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _dtype_name(d) -> str | None:
    return None if d is None else jnp.dtype(d).name


def _dtype(name: str | None):
    return None if name is None else jnp.dtype(name)


def _qtensor_aux(aux) -> bytes:
    axis, block_size, dtype, codebook = aux
    return json.dumps([axis, block_size, _dtype_name(dtype), codebook]).encode()


def _qtensor_from(data: bytes):
    axis, block_size, dtype, codebook = _tuples(json.loads(data))
    return axis, block_size, _dtype(dtype), codebook


def _packed_aux(aux) -> bytes:
    dtype, back, bits, pad, stated = aux
    return json.dumps([_dtype_name(dtype), back, bits, pad, stated]).encode()


def _packed_from(data: bytes):
    dtype, back, bits, pad, stated = _tuples(json.loads(data))
    if isinstance(pad, int):  # written before the byte length joined the padding
        pad = (pad, None)
    return _dtype(dtype), back, bits, pad, stated


jax.export.register_pytree_node_serialization(
    QTensor, serialized_name="jaxquant.QTensor", serialize_auxdata=_qtensor_aux,
    deserialize_auxdata=_qtensor_from)
jax.export.register_pytree_node_serialization(
    PackedArray, serialized_name="jaxquant.PackedArray", serialize_auxdata=_packed_aux,
    deserialize_auxdata=_packed_from)
