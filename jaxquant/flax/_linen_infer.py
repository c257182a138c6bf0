"""linen layers run on a `QTensor` kernel (inference), for `jaxquant.flax.linen`.

`infer` re-runs an intercepted ``Dense``, ``DenseGeneral``, ``Conv``,
``Einsum`` or ``Embed`` call on its stored QTensor, without materializing a
float kernel, after `check_kernel_shape` compared the QTensor's logical shape
with the one the float layer would create (as Flax's ``ScopeParamShapeError``).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np

from jaxquant._dot import promote_dtype as q_promote_dtype
from jaxquant.flax._ops import (
    InferConv,
    InferDot,
    InferEinsum,
    embed_take,
    fake_quant_act,
)

__all__ = ["PassPromote", "check_kernel_shape", "einsum_str", "get_param", "infer",
           "kernel_shape"]


@dataclasses.dataclass(frozen=True)
class PassPromote:
    """`jaxquant.promote_dtype` (QTensors pass through), marking a re-run layer."""

    def __call__(self, *args, dtype=None, inexact=True):
        return q_promote_dtype(*args, dtype=dtype, inexact=inexact)


def get_param(m, name):
    """The unboxed ``"params"`` variable ``name`` of ``m``, or ``None``."""
    if not m.scope.has_variable("params", name):
        return None
    return nn.meta.unbox(m.scope.get_variable("params", name))


def einsum_str(m, args, kwargs) -> str:
    """The equation of an ``Einsum`` call: the call's, else the module's."""
    s = kwargs.get("einsum_str", args[1] if len(args) > 1 else None)
    return (s if s is not None else m.einsum_str).replace(" ", "")


def _tuple(v) -> tuple:
    return tuple(np.atleast_1d(v).tolist())


def kernel_shape(m, args, kwargs) -> tuple[int, ...]:
    """The shape of the kernel (table) that the float layer creates for this call."""
    if isinstance(m, nn.Embed):
        return (m.num_embeddings, m.features)
    if isinstance(m, nn.Einsum):
        return tuple(m.shape)
    shape = np.shape(args[0] if args else kwargs["inputs"])
    if isinstance(m, nn.Conv):
        return _tuple(m.kernel_size) + (shape[-1] // m.feature_group_count, m.features)
    if isinstance(m, nn.DenseGeneral):
        return (tuple(shape[a] for a in _tuple(m.batch_dims))
                + tuple(shape[a] for a in _tuple(m.axis)) + _tuple(m.features))
    return (shape[-1], m.features)


def check_kernel_shape(m, name: str, qt, args, kwargs) -> None:
    """A ValueError when the QTensor ``qt`` is not the kernel ``m`` would create."""
    want = kernel_shape(m, args, kwargs)
    if tuple(qt.shape) != want:
        raise ValueError(
            f"{type(m).__name__} at {'/'.join(m.path) or '(top)'!r}: the QTensor {name} has "
            f"shape {tuple(qt.shape)}, but the layer (with these inputs) expects {want}.")


def _attend(m, act, qt, args, kwargs):
    """``Embed.attend``: the query as QAT sees it (fake-quantized per token by ``act``)
    times the dequantized table, in ``m.dtype`` as Flax's ``attend``."""
    q = args[0] if args else kwargs["query"]
    if act is not None:  # before the cast, as `QATPromote`
        q = fake_quant_act(q, act, (-1,))
    q, _ = q_promote_dtype(q, qt, dtype=m.dtype)
    return InferDot(None)(q, qt, (((q.ndim - 1,), (1,)), ((), ())))


def infer(m, method: str, act, qt, args, kwargs):
    """A layer with a `QTensor` kernel, without materializing a float kernel."""
    if isinstance(m, nn.Embed):
        if method == "attend":
            return _attend(m, act, qt, args, kwargs)
        return embed_take(qt, args[0] if args else kwargs["inputs"], m.dtype)
    if isinstance(m, nn.Conv):
        if m.mask is not None:
            raise ValueError(f"{type(m).__name__} at {'/'.join(m.path)}: a masked Conv cannot "
                             f"run on a QTensor kernel; leave it float (rule -> None).")
        clone = m.clone(parent=m.scope, conv_general_dilated=InferConv(act),
                        conv_general_dilated_cls=None, promote_dtype=PassPromote(),
                        kernel_init=lambda *a, **k: qt)
        return clone(*args, **kwargs)
    x = args[0] if args else kwargs["inputs"]
    bias = get_param(m, "bias") if m.use_bias else None
    x, _, bias = q_promote_dtype(x, qt, bias, dtype=m.dtype)
    if isinstance(m, nn.Einsum):
        s = einsum_str(m, args, kwargs)
        y = InferEinsum(act)(s, x, qt, precision=m.precision,
                             preferred_element_type=m.preferred_element_type)
        if bias is not None:
            y = y + bias.reshape(m._get_bias_shape(s, x, jax.ShapeDtypeStruct(qt.shape,
                                                                               qt.dtype))[1])
        return y
    if isinstance(m, nn.DenseGeneral):
        axis = tuple(a % x.ndim for a in _tuple(m.axis))
        batch = tuple(a % x.ndim for a in _tuple(m.batch_dims))
        nb = len(batch)
        dims = ((axis, tuple(range(nb, nb + len(axis)))), (batch, tuple(range(nb))))
        expanded = tuple(x.shape[a] if a in batch else 1 for a in range(x.ndim)
                         if a not in axis)
        y = InferDot(act)(x, qt, dims, precision=m.precision)
        return y if bias is None else y + bias.reshape(expanded + _tuple(m.features))
    y = InferDot(act)(x, qt, (((x.ndim - 1,), (0,)), ((), ())), precision=m.precision)
    return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + (-1,))
