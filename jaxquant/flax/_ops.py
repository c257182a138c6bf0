"""The numerics injected into Flax layers, shared by linen and nnx.

Training (float kernels): `QATPromote` stands in for a layer's
``promote_dtype`` and fake-quantizes the kernel (computed or learned scales)
and the input activation before the layer's own dot / conv / einsum / take;
`QATDot` is a ``dot_general`` running ``jaxquant._qat_dot.qat_dot_general``
(int8 x int8 -> int32 forward, straight-through backward).

Inference (`QTensor` kernels): `InferDot`, `InferEinsum` and `InferConv` stand
in for ``lax.dot_general``, ``jnp.einsum`` and ``lax.conv_general_dilated``:
weight-only (dequantized inside the jitted op) or int8 x int8 -> int32 with
the input quantized on the fly (or with a static scale). `embed_take` gathers
rows of quantized codes and dequantizes only those rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant._dot import ActQuant, qdot_general
from jaxquant._dot import promote_dtype as q_promote_dtype
from jaxquant._einsum import qeinsum
from jaxquant._fake_quant import fake_quant
from jaxquant._packing import unpack
from jaxquant._qtensor import QTensor, is_qtensor, scale_values
from jaxquant._quantize import quantize
from jaxquant._schemes import resolve
from jaxquant._tree import QuantSpec
from jaxquant.flax._rules import ActSpec, layer_errors

__all__ = ["QATPromote", "QATDot", "QATEinsum", "InferDot", "InferEinsum", "InferConv",
           "DequantPromote", "embed_take", "einsum_contract", "explicit_einsum", "fake_quant_act",
           "fake_quant_weight", "init_qparams", "learned_qtensor", "promoted_kernel"]

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _explicit_kwargs(spec: QuantSpec) -> dict:
    tiles = isinstance(spec.block_size, tuple)  # a tile along every axis: no axis
    return dict(dtype=spec.dtype, axis=None if tiles else spec.axis,
                block_size=spec.block_size, saturate=spec.saturate)


def fake_quant_weight(w: jax.Array, spec: QuantSpec, scale: jax.Array | None = None,
                      zero_point: jax.Array | None = None):
    """``dequantize(spec(w))`` with STE gradients; LSQ (LSQ+ with a float ``zero_point``)
    gradients for a given ``scale``."""
    if scale is None:
        return fake_quant(w, **spec.computed_kwargs())
    return fake_quant(w, scale.astype(jnp.float32), zero_point, **_explicit_kwargs(spec))


def init_qparams(w: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array | None]:
    """The scale and, for an asymmetric ``spec``, the zero point (as float32) that
    `quantize` computes for ``w``: the LSQ / LSQ+ initial values.

    Example:
      >>> w = jnp.array([[-1.0, 0.0], [2.0, 1.5]])  # one scale per output column
      >>> init_qparams(w, QuantSpec(dtype=jnp.int4, symmetric=False))
      (Array([0.2, 0.1], dtype=float32), Array([-3., -8.], dtype=float32))
    """
    qt = quantize(w, symmetric=spec.symmetric, **_explicit_kwargs(spec))
    return qt.scale, None if qt.zero_point is None else qt.zero_point.astype(jnp.float32)


def learned_qtensor(w: jax.Array, scale: jax.Array, zero_point: jax.Array | None = None,
                    *, spec: QuantSpec) -> QTensor:
    """``w`` quantized with learned values: the codes `fake_quant_weight` trained with.

    A float zero point is rounded half to even and clamped to the code range, as
    in the forward pass of `jaxquant.fake_quant`.
    """
    zp = None
    if zero_point is not None:
        fmt = resolve(spec.dtype, spec.axis, spec.block_size, spec.scale_dtype).fmt
        zp = jnp.clip(jnp.round(zero_point), fmt.qmin, fmt.qmax).astype(fmt.dtype)
    return quantize(w, scale, zp, packed=spec.packed, **_explicit_kwargs(spec))


def fake_quant_act(x: jax.Array, act: ActSpec, contract: tuple[int, ...] | None) -> jax.Array:
    """Fake-quantizes an input: static scale, per tensor, or per token.

    Per token: one scale per index of the dimensions not in ``contract``
    (negative entries count from the end); ``contract=None`` means per tensor.
    """
    if act.scale is not None:
        return fake_quant(x, jnp.asarray(act.scale, jnp.float32), dtype=act.dtype)
    if act.granularity == "tensor" or contract is None:
        return fake_quant(x, dtype=act.dtype)
    red = sorted({d % x.ndim for d in contract})
    keep = [d for d in range(x.ndim) if d not in red]
    xt = jnp.transpose(x, keep + red)
    rows = xt.reshape(math.prod(xt.shape[:len(keep)]), -1)
    if isinstance(act.dtype, str):  # a codebook: blocked along its axis, one block per row
        y = fake_quant(rows, dtype=act.dtype, axis=1, block_size=max(rows.shape[1], 1))
    else:
        y = fake_quant(rows, dtype=act.dtype, axis=0)
    y = y.reshape(xt.shape)
    inverse = [0] * x.ndim
    for i, d in enumerate(keep + red):
        inverse[d] = i
    return jnp.transpose(y, inverse)


def explicit_einsum(einsum_str: str, lhs_ndim: int, rhs_ndim: int) -> str:
    """``einsum_str`` with each ``...`` replaced by letters unused elsewhere."""
    s = einsum_str.replace(" ", "")
    if "..." not in s:
        return s
    ins, out = s.split("->")
    a, b = ins.split(",")
    free = [c for c in _LETTERS if c not in s]
    n = max(lhs_ndim - (len(a) - 3 if "..." in a else len(a)),
            rhs_ndim - (len(b) - 3 if "..." in b else len(b)), 0)
    ell = "".join(free[:n])

    def sub(t, ndim):
        return t.replace("...", ell[n - (ndim - (len(t) - 3)):] if "..." in t else "")

    return f"{sub(a, lhs_ndim)},{sub(b, rhs_ndim)}->{out.replace('...', ell)}"


def einsum_contract(einsum_str: str) -> tuple[int, ...]:
    """The lhs axes an einsum contracts (negative after an ``...``)."""
    s = einsum_str.replace(" ", "")
    ins, out = s.split("->")
    a, b = ins.split(",")
    head, _, tail = a.partition("...")
    letters = [(c, i) for i, c in enumerate(head)]
    if "..." in a:
        letters += [(c, i - len(tail)) for i, c in enumerate(tail)]
    return tuple(i for c, i in letters if c in b and c not in out)


@dataclasses.dataclass(frozen=True)
class QATPromote:
    """A layer's ``promote_dtype`` that first fake-quantizes its kernel and input.

    Called as linen calls it (``(inputs, kernel, bias, dtype=...)``) or as nnx
    does (one tuple); the kernel is the second item (the only one for an
    ``Embed`` lookup), the input the first.

    Attributes:
      inner: the layer's own ``promote_dtype``, applied afterwards.
      weight: the kernel's spec, or ``None`` to leave it (float, or handled by `QATDot`).
      act: the input's `ActSpec`, or ``None``.
      contract: the input axes the layer contracts (per-token scales), or
        ``None`` for per-tensor.
      scale: ``None`` (computed scale) or a function of the kernel returning its
        learned ``(scale, zero_point)`` (``zero_point`` None: symmetric).
      where: the layer, put in front of the errors of its rule (nnx; linen's
        interceptor names it).
    """

    inner: Callable
    weight: QuantSpec | None
    act: ActSpec | None
    contract: tuple[int, ...] | None
    scale: Callable | None = None
    where: str = ""

    def __call__(self, *args, dtype=None, inexact: bool = True):
        as_tuple = len(args) == 1 and isinstance(args[0], tuple)
        items = list(args[0] if as_tuple else args)
        k = 1 if len(items) >= 2 else 0
        with layer_errors(self.where):
            if self.weight is not None and items[k] is not None:
                s, z = (None, None) if self.scale is None else self.scale(items[k])
                items[k] = fake_quant_weight(items[k], self.weight, s, z)
            if self.act is not None and len(items) >= 2:
                items[0] = fake_quant_act(items[0], self.act, self.contract)
        if as_tuple:
            return self.inner(tuple(items), dtype=dtype, inexact=inexact)
        return self.inner(*items, dtype=dtype, inexact=inexact)


@dataclasses.dataclass(frozen=True)
class QATEinsum:
    """An nnx ``Einsum``'s ``einsum_op`` that first fake-quantizes its input.

    Per token along the call's own equation (the constructor's, or the one the
    layer was called with), as the inference `InferEinsum` quantizes it.

    Attributes:
      inner: the layer's own ``einsum_op``.
      act: the input's `ActSpec`.
      where: the layer, put in front of errors.
    """

    inner: Callable
    act: ActSpec
    where: str = ""

    def __call__(self, subscripts, lhs, rhs, *args, **kwargs):
        with layer_errors(self.where):
            lhs = fake_quant_act(lhs, self.act, einsum_contract(subscripts))
        return self.inner(subscripts, lhs, rhs, *args, **kwargs)


def _kwargs(out_sharding, preferred_element_type):
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    if preferred_element_type is not None:
        kw["preferred_element_type"] = preferred_element_type
    return kw


@dataclasses.dataclass(frozen=True)
class QATDot:
    """``dot_general`` for training through ``qat_dot_general`` (int8 forward, STE backward).

    Attributes:
      weight: the kernel's spec (symmetric int8).
      act: the input's `ActSpec`, or ``None``.
      replaced: the layer's own ``(dot_general, dot_general_cls)``, not called;
        kept to undo the replacement.
      where: the layer, put in front of errors.
    """

    weight: QuantSpec
    act: ActSpec | None
    replaced: tuple = (None, None)
    where: str = ""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        from jaxquant._qat_dot import qat_dot_general  # imported when first used

        act = None if self.act is None else self.act.act_quant()
        with layer_errors(self.where):
            return qat_dot_general(lhs, rhs, dimension_numbers, precision,
                                   preferred_element_type, weight=self.weight, act=act,
                                   out_sharding=out_sharding)


def promoted_kernel(qt, dtype):
    """What Flax's ``promote_dtype`` makes of the trained kernel, for a weight-only op.

    The fake-quantized kernel of training has the kernel's dtype (``qt.dtype``)
    and is then cast to the compute ``dtype``. Dequantizing straight to
    ``dtype`` (computed in float32) skips that rounding when ``qt.dtype`` is
    neither float32 nor ``dtype`` (bfloat16 params, float32 compute), so such a
    kernel is dequantized to ``qt.dtype`` and cast here.

    Args:
      qt: a `QTensor` (or an array, returned as it is).
      dtype: the dtype the layer computes in.

    Returns:
      ``qt`` itself where dequantizing to ``dtype`` inside the op gives the same
      values, else the array ``qt.dequantize().astype(dtype)``.
    """
    if not is_qtensor(qt) or qt.dtype == jnp.dtype(dtype) or qt.dtype == jnp.float32:
        return qt
    return qt.dequantize().astype(dtype)


def _static_lhs(x, act: ActSpec) -> QTensor:
    return quantize(x, jnp.asarray(act.scale, jnp.float32), dtype=jnp.int8)


@dataclasses.dataclass(frozen=True)
class InferDot:
    """``dot_general`` over a `QTensor` rhs: weight-only (``act=None``) or int8 x int8."""

    act: ActSpec | None

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        if self.act is None:
            rhs = promoted_kernel(rhs, lhs.dtype)
        if not is_qtensor(rhs):
            return lax.dot_general(lhs, rhs, dimension_numbers, precision,
                                   **_kwargs(out_sharding, preferred_element_type))
        out = preferred_element_type or lhs.dtype
        if self.act is None:
            return qdot_general(lhs, rhs, dimension_numbers, precision, out,
                                out_sharding=out_sharding)
        aq = self.act.act_quant()
        if self.act.scale is not None:
            lhs, aq = _static_lhs(lhs, self.act), ActQuant()
        return qdot_general(lhs, rhs, dimension_numbers, precision, out,
                            out_sharding=out_sharding, act_quant=aq)


@dataclasses.dataclass(frozen=True)
class InferEinsum:
    """``jnp.einsum``-like op (nnx ``einsum_op``) over a `QTensor` rhs, through `qeinsum`."""

    act: ActSpec | None

    def __call__(self, subscripts, lhs, rhs, precision=None, preferred_element_type=None,
                 out_sharding=None, **kwargs):
        if self.act is None:
            rhs = promoted_kernel(rhs, lhs.dtype)
        if not is_qtensor(rhs):
            return jnp.einsum(subscripts, lhs, rhs, precision=precision, **kwargs,
                              **_kwargs(out_sharding, preferred_element_type))
        s = explicit_einsum(subscripts, lhs.ndim, rhs.ndim)
        out = preferred_element_type or lhs.dtype
        aq = None if self.act is None else self.act.act_quant()
        if self.act is not None and self.act.scale is not None:
            lhs, aq = _static_lhs(lhs, self.act), ActQuant()
        return qeinsum(s, lhs, rhs, precision=precision, preferred_element_type=out,
                       act_quant=aq)


@dataclasses.dataclass(frozen=True)
class InferConv:
    """``lax.conv_general_dilated`` over a `QTensor` kernel.

    Weight-only: the kernel is dequantized inside the jitted convolution.
    int8 x int8 -> int32 (``act`` given): the input gets one scale (static, or
    its absmax / 127), the kernel needs symmetric integer codes of at most 8
    bits, per tensor or per output feature.
    """

    act: ActSpec | None

    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
                 rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                 batch_group_count=1, precision=None, preferred_element_type=None,
                 out_sharding=None):
        conv = lambda a, b, **kw: lax.conv_general_dilated(
            a, b, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, **kw)
        if not is_qtensor(rhs):
            return conv(lhs, rhs, **_kwargs(out_sharding, preferred_element_type))
        out = preferred_element_type or lhs.dtype
        if self.act is None:
            return conv(lhs, rhs.dequantize().astype(lhs.dtype)).astype(out)
        self.act.act_quant()  # int8 only
        dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        fmt, layout = rhs.format, rhs.layout
        if not (fmt.is_integer and fmt.signed and fmt.bits <= 8 and rhs.zero_point is None
                and (layout.kind == "tensor"
                     or (layout.kind == "axis" and layout.axis == dn.rhs_spec[0]))):
            raise ValueError(
                f"the int8 convolution needs a kernel of symmetric signed integer codes of at "
                f"most 8 bits, quantized per tensor or per output feature (axis "
                f"{dn.rhs_spec[0]}), got {rhs!r}; use act=None for a weight-only convolution.")
        x = _static_lhs(lhs, self.act) if self.act.scale is not None else \
            quantize(lhs, dtype=jnp.int8)
        acc = conv(x.qvalue, unpack(rhs).qvalue.astype(jnp.int8),
                   preferred_element_type=jnp.int32)
        shape = [1] * acc.ndim
        shape[dn.out_spec[1]] = -1
        sv = scale_values(rhs)
        s = sv.reshape(shape) if layout.kind == "axis" else sv.reshape(())
        y = acc.astype(jnp.float32) * x.scale.reshape(()) * s
        return y.astype(out)


@dataclasses.dataclass(frozen=True)
class DequantPromote:
    """nnx ``Embed.promote_dtype`` on a QTensor table: dequantized inside the jitted step
    (to the table's dtype, then cast as Flax casts a float table); the query of
    ``attend`` fake-quantized per token by ``act``, as in training."""

    act: ActSpec | None = None

    def __call__(self, args, dtype=None, inexact=True):
        args = tuple(a.dequantize() if is_qtensor(a) else a for a in args)
        if self.act is not None and len(args) >= 2:
            args = (fake_quant_act(args[0], self.act, (-1,)),) + args[1:]
        return q_promote_dtype(args, dtype=dtype, inexact=inexact)


def embed_take(table, idx: jax.Array, dtype=None) -> jax.Array:
    """Rows ``idx`` of an embedding table; a `QTensor` table dequantizes only those rows.

    The rows are the dequantized table's (its ``dtype``), cast to ``dtype``, as
    Flax casts a float table before the lookup.
    """
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
    return (codes * rows(scale_values(qt))).astype(table.dtype).astype(dtype)
