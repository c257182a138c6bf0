"""linen layers run on a `QTensor` kernel (inference), for `jaxquant.flax.linen`.

`infer` re-runs an intercepted ``Dense``, ``DenseGeneral``, ``Conv``,
``Einsum`` or ``Embed`` call on its stored QTensor, without materializing a
float kernel, after `check_kernel_shape` compared the QTensor's logical shape
with the one the float layer would create (as Flax's ``ScopeParamShapeError``).
``ConvTranspose`` and ``ConvLocal`` (`DEQUANTIZED`), whose ops take no
QTensor, run on the dequantized kernel, as in training.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._barriers import keep_rounding
from jaxquant._packing import unpack
from jaxquant._qtensor import is_qtensor, scale_values
from jaxquant.flax._infer_ops import InferConv, InferDot, InferEinsum, InferPromote, check_own_op
from jaxquant.flax._ops import fake_quant_act

__all__ = ["DEQUANTIZED", "check_kernel_shape", "check_not_overridden", "einsum_str",
           "embed_take", "get_param", "infer", "kernel_shape"]

DEQUANTIZED = nn.ConvTranspose | nn.ConvLocal  # no injectable op: run on the float kernel


def _promote(m) -> InferPromote:
    """``m``'s ``promote_dtype`` (Flax's or the layer's own), passing QTensors through."""
    return InferPromote(None if m.promote_dtype is nn.dtypes.promote_dtype else m.promote_dtype)


def get_param(m, name):
    """The unboxed ``"params"`` variable ``name`` of ``m``, or ``None``."""
    if not m.scope.has_variable("params", name):
        return None
    return nn.meta.unbox(m.scope.get_variable("params", name))


def einsum_str(m, args, kwargs) -> str:
    """The equation of an ``Einsum`` call: the call's, else the module's.

    Raises:
      ValueError: both given, as Flax's ``Einsum`` (``nn.merge_param``) raises.
    """
    return nn.merge_param("einsum_str", m.einsum_str,
                          kwargs.get("einsum_str", args[1] if len(args) > 1 else None)
                          ).replace(" ", "")


def _tuple(v) -> tuple:
    return tuple(np.atleast_1d(v).tolist())


def _dense_general_axes(m, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A `DenseGeneral`'s ``(batch_dims, axis)`` as Flax lays out its kernel: non-negative
    and sorted (``axis=(-1, 1)`` contracts input axes 1, 3 with kernel axes 0, 1)."""
    return tuple(sorted(a % ndim for a in _tuple(m.batch_dims))), \
        tuple(sorted(a % ndim for a in _tuple(m.axis)))


def kernel_shape(m, args, kwargs) -> tuple[int, ...] | None:
    """The shape of the kernel (table) that the float layer creates for this call;
    ``None`` for `DEQUANTIZED` layers (checked when they create it: `_stored_init`)."""
    if isinstance(m, DEQUANTIZED):
        return None
    if isinstance(m, nn.Embed):
        return (m.num_embeddings, m.features)
    if isinstance(m, nn.Einsum):
        return tuple(m.shape)
    shape = np.shape(args[0] if args else kwargs["inputs"])
    if isinstance(m, nn.Conv):
        return _tuple(m.kernel_size) + (shape[-1] // m.feature_group_count, m.features)
    if isinstance(m, nn.DenseGeneral):
        batch, axis = _dense_general_axes(m, len(shape))
        return tuple(shape[a] for a in batch + axis) + _tuple(m.features)
    return (shape[-1], m.features)


def check_kernel_shape(m, name: str, qt, args, kwargs) -> None:
    """A ValueError when the QTensor ``qt`` is not the kernel ``m`` would create."""
    want = kernel_shape(m, args, kwargs)
    if want is not None and tuple(qt.shape) != want:
        raise ValueError(_shape_error(m, name, qt, want))


def _shape_error(m, name: str, qt, want) -> str:
    return (f"{type(m).__name__} at {'/'.join(m.path) or '(top)'!r}: the QTensor {name} has "
            f"shape {tuple(qt.shape)}, but the layer (with these inputs) expects "
            f"{tuple(int(d) for d in want)}.")


def _stored_init(m, qt):
    """A ``kernel_init`` giving the stored QTensor ``qt`` where the layer asks for a
    kernel of its shape (Flax checks a stored param against the init's shape)."""
    def init(key, shape, *args, **kwargs):
        if tuple(shape) != tuple(qt.shape):
            raise ValueError(_shape_error(m, "kernel", qt, shape))
        return qt
    return init


def embed_take(table, idx, dtype=None) -> jax.Array:
    """Rows ``idx`` of an embedding table, as Flax's ``Embed`` takes them.

    A `QTensor` table dequantizes only those rows (its ``dtype``), cast to
    ``dtype`` as Flax casts a float table. As with a float table, a single-row
    table is broadcast whatever the index, and an index out of range gives NaN.

    Args:
      table: a `QTensor` or an array of shape ``(num_embeddings, features)``.
      idx: integer indices.
      dtype: the output dtype of a QTensor table; ``None``: its ``dtype``.

    Returns:
      An array of shape ``idx.shape + (features,)``.
    """
    n = table.shape[0]
    if n == 1:  # Flax broadcasts the single row
        idx = jnp.zeros(jnp.shape(idx), jnp.int32)
    if not is_qtensor(table):
        return jnp.take(table, idx, axis=0)
    dtype = dtype or table.dtype
    qt, layout = unpack(table), table.layout
    if layout.kind in ("block", "tile") or qt.format.is_codebook or is_qtensor(qt.scale):
        return jnp.take(qt.dequantize(), idx, axis=0).astype(dtype)

    def rows(v):  # scale / zero point, broadcast against the gathered rows
        if layout.kind == "tensor":
            return v.reshape(())
        if layout.axis == 0:
            return jnp.take(v, idx, axis=0)[..., None]
        return v.reshape((1,) * jnp.ndim(idx) + v.shape)

    codes = jnp.take(qt.qvalue, idx, axis=0).astype(jnp.float32)
    if qt.zero_point is not None:
        codes = codes - rows(qt.zero_point).astype(jnp.float32)
    nan = jnp.take(jnp.zeros(n, jnp.float32), idx, axis=0)[..., None]  # NaN out of range
    rows_out = (codes * rows(scale_values(qt)) + nan).astype(table.dtype)
    # kept in the table's dtype where XLA:GPU would fold the rounding into a cast to float32
    return (keep_rounding(rows_out) if rows_out.dtype.itemsize < 4 else rows_out).astype(dtype)


def _attend(m, act, qt, args, kwargs):
    """``Embed.attend``: the query as QAT sees it (fake-quantized per token by ``act``)
    times the dequantized table, in ``m.dtype`` as Flax's ``attend``."""
    q = args[0] if args else kwargs["query"]
    if act is not None:  # before the cast, as `QATPromote`
        q = fake_quant_act(q, act, (-1,))
    q, _ = _promote(m)(q, qt, dtype=m.dtype)
    return InferDot(None)(q, qt, (((q.ndim - 1,), (1,)), ((), ())))


def check_not_overridden(m, method: str) -> None:
    """A ValueError where ``m``'s class overrides Flax's ``method``, which jaxquant computes
    itself for this layer (the override would be skipped, silently)."""
    base = next(c for c in type(m).__mro__ if c.__module__.startswith("flax."))
    if getattr(type(m), method) is not getattr(base, method):
        raise ValueError(f"{type(m).__name__} overrides {base.__name__}.{method}, which "
                         f"jaxquant computes itself for a quantized {base.__name__}, so the "
                         f"override would not run: leave the layer float (rule -> None).")


def infer(m, method: str, act, qt, args, kwargs):
    """A layer with a `QTensor` kernel, without materializing a float kernel.

    Args:
      m: the intercepted layer (bound).
      method: ``"__call__"`` or (``Embed``) ``"attend"``.
      act: the rule's `ActSpec` (int8 x int8), or ``None`` (weight-only).
      qt: the stored kernel (table).
      args: the call's positional arguments.
      kwargs: the call's keyword arguments.

    Returns:
      What the float layer returns, computed on ``qt``.

    Raises:
      ValueError: a masked convolution; a layer built with its own dot or convolution op;
        a QTensor or `ActSpec` the int8 path cannot take (the caller puts the layer's path
        in front).
    """
    if not isinstance(m, nn.Embed | DEQUANTIZED):
        check_own_op(m)
    if isinstance(m, nn.Dense) and type(m) is not nn.Dense and method == "__call__":
        clone = m.clone(parent=m.scope, dot_general=InferDot(act), dot_general_cls=None,
                        promote_dtype=_promote(m), kernel_init=lambda *a, **k: qt)
        return clone(*args, **kwargs)  # a subclass: its own __call__ runs
    if not isinstance(m, nn.Conv | DEQUANTIZED):  # (their clones run the subclass's method)
        check_not_overridden(m, method)
    if isinstance(m, nn.Embed):
        if method == "attend":
            return _attend(m, act, qt, args, kwargs)
        idx = args[0] if args else kwargs["inputs"]
        if _promote(m).inner is not None:  # the layer's own cast of the dequantized table
            (table,) = m.promote_dtype(qt.dequantize(), dtype=m.dtype, inexact=False)
            return embed_take(table, idx)
        return embed_take(qt, idx, m.dtype)
    if isinstance(m, nn.Conv | DEQUANTIZED) and m.mask is not None:
        raise ValueError(f"a masked {type(m).__name__} cannot run on a QTensor kernel; leave "
                         f"it float (rule -> None).")
    if isinstance(m, DEQUANTIZED):  # dequantized, the input fake-quantized, as in training
        promote = InferPromote(_promote(m).inner, act, dequantize=True, contract=None)
        return m.clone(parent=m.scope, promote_dtype=promote,
                       kernel_init=_stored_init(m, qt))(*args, **kwargs)
    if isinstance(m, nn.Conv):
        clone = m.clone(parent=m.scope, conv_general_dilated=InferConv(act),
                        conv_general_dilated_cls=None, promote_dtype=_promote(m),
                        kernel_init=lambda *a, **k: qt)
        return clone(*args, **kwargs)
    x = args[0] if args else kwargs["inputs"]
    bias = get_param(m, "bias") if m.use_bias else None
    x, _, bias = _promote(m)(x, qt, bias, dtype=m.dtype)
    if isinstance(m, nn.Einsum):
        s = einsum_str(m, args, kwargs)
        y = InferEinsum(act)(s, x, qt, precision=m.precision,
                             preferred_element_type=m.preferred_element_type)
        if bias is not None:
            y = y + bias.reshape(m._get_bias_shape(s, x, jax.ShapeDtypeStruct(qt.shape,
                                                                               qt.dtype))[1])
        return y
    if isinstance(m, nn.DenseGeneral):
        batch, axis = _dense_general_axes(m, x.ndim)
        nb = len(batch)
        dims = ((axis, tuple(range(nb, nb + len(axis)))), (batch, tuple(range(nb))))
        expanded = tuple(x.shape[a] if a in batch else 1 for a in range(x.ndim)
                         if a not in axis)
        y = InferDot(act)(x, qt, dims, precision=m.precision)
        return y if bias is None else y + bias.reshape(expanded + _tuple(m.features))
    y = InferDot(act)(x, qt, (((x.ndim - 1,), (0,)), ((), ())), precision=m.precision)
    return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + (-1,))
