"""The numerics injected into Flax layers at inference, shared by linen and nnx.

`InferDot`, `InferEinsum` and `InferConv` stand in for ``lax.dot_general``,
``jnp.einsum`` and ``lax.conv_general_dilated`` over `QTensor` kernels:
weight-only (dequantized inside the jitted op) or int8 x int8 -> int32 with
the input quantized on the fly (or with a static scale); errors raised there
name the layer (``where``). `InferPromote` keeps the layer's own
``promote_dtype`` and lets the QTensor through. Training's ops are in
`jaxquant.flax._ops`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant._barriers import int_conv
from jaxquant._dot import ActQuant, QDotGeneral, qdot_general
from jaxquant._dot import promote_dtype as q_promote_dtype
from jaxquant._einsum import qeinsum
from jaxquant._fake_quant import fake_quant
from jaxquant._packing import unpack
from jaxquant._qat_dot import QATDotGeneral
from jaxquant._qtensor import is_qtensor, scale_values
from jaxquant._quantize import quantize
from jaxquant._weight_only import dequantized_in_turn
from jaxquant.flax._ops import QATDot, QATEinsum, explicit_einsum, fake_quant_act
from jaxquant.flax._rules import ActSpec, layer_errors

__all__ = ["InferDot", "InferEinsum", "InferConv", "InferPromote", "check_own_op",
           "promoted_kernel"]


def _kwargs(out_sharding, preferred_element_type):
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    if preferred_element_type is not None:
        kw["preferred_element_type"] = preferred_element_type
    return kw


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
      The float kernel in ``dtype``: ``qt.dequantize().astype(dtype)`` where that
      rounding matters, else ``qt.dequantize(dtype)``.
    """
    if not is_qtensor(qt):
        return qt
    return qt.dequantize().astype(dtype) if _rounds_through_its_dtype(qt, dtype) \
        else qt.dequantize(dtype)


def _sums_out_a_letter(subscripts: str) -> bool:
    """Whether an explicit two-operand equation sums a letter of one operand only (`qeinsum`
    does not): weight-only, such a layer runs on its dequantized kernel instead."""
    (a, b), out = subscripts.split("->")[0].split(","), subscripts.split("->")[1]
    return any(c not in out for c in set(a) ^ set(b))


def _rounds_through_its_dtype(qt, dtype) -> bool:
    return is_qtensor(qt) and qt.dtype not in (jnp.dtype(dtype), jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _straight_through(exact: Callable, approx: Callable, lhs, rhs):
    """``exact(lhs, rhs)`` (an op on the input's int8 codes) with the gradients of
    ``approx(lhs, rhs)`` (the float op on the fake-quantized input and the dequantized
    kernel): straight through the input's quantization, as `jaxquant.qdot_general`'s
    dynamic int8 dot is differentiated."""
    return exact(lhs, rhs)


def _straight_through_fwd(exact, approx, lhs, rhs):
    return exact(lhs, rhs), (lhs, rhs)


def _straight_through_bwd(exact, approx, res, g):
    return jax.vjp(approx, *res)[1](g)


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def _keep_nan(x: jax.Array, y: jax.Array) -> jax.Array:
    """``y``, all NaN where ``x`` holds a NaN: the int8 codes of a static scale have none
    (quantizing gives a NaN the zero code), so the result of one scale per tensor turns
    NaN as a NaN dynamic per-tensor scale turns it."""
    return jnp.where(jnp.any(jnp.isnan(x)), jnp.asarray(jnp.nan, y.dtype), y)


def _check_static(act: ActSpec) -> None:
    """A ValueError (`ActSpec.act_quant`'s) unless the codes of ``act``'s static scale are
    int8 codes: int8, or uint8 around its zero point 128 (``u - 128``: the same codes)."""
    if act.dtype not in (jnp.int8, jnp.uint8):
        act.act_quant()


def _int8_op(act: ActSpec | None, int_op: Callable, float_op: Callable, lhs, rhs, out):
    """``int_op(lhs, rhs, act_quant)`` for `qdot_general` / `qeinsum`: the input as it is
    with its dynamic `ActQuant` (``None``: weight-only), or its codes of ``act``'s static
    scale (a NaN input: all NaN), differentiated straight through as ``float_op`` of the
    float operands.

    Raises:
      ValueError: an ``act`` of another format than int8 (static scales: or uint8).
    """
    if act is None or act.scale is None:
        return int_op(lhs, rhs, None if act is None else act.act_quant())
    _check_static(act)
    scale = jnp.asarray(act.scale, jnp.float32)
    exact = lambda a, b: _keep_nan(a, int_op(quantize(a, scale, dtype=jnp.int8), b,
                                             ActQuant()))
    approx = lambda a, b: float_op(fake_quant(a, scale, dtype=jnp.int8).astype(jnp.float32),
                                   b.dequantize(jnp.float32)).astype(out)
    return _straight_through(exact, approx, lhs, rhs)


@dataclasses.dataclass(frozen=True)
class _InferOp:
    """A layer's op at inference (its ``dot_general``, ``einsum_op`` or convolution).

    Attributes:
      act: the input's `ActSpec` (int8), or ``None`` (weight-only).
      where: the layer, put in front of errors (nnx; linen's interceptor names it).
    """

    act: ActSpec | None
    where: str = ""


class InferDot(_InferOp):
    """``dot_general`` over a `QTensor` rhs: weight-only (``act=None``) or int8 x int8."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        if not is_qtensor(rhs) or (self.act is None and _rounds_through_its_dtype(rhs, lhs.dtype)):
            dot = lambda a, b: lax.dot_general(  # noqa: E731
                a, promoted_kernel(b, a.dtype), dimension_numbers, precision,
                **_kwargs(out_sharding, preferred_element_type))
            return dequantized_in_turn(dot, lhs, rhs) if is_qtensor(rhs) else dot(lhs, rhs)
        out = preferred_element_type or lhs.dtype
        int_op = lambda a, b, aq: qdot_general(a, b, dimension_numbers, precision, out,
                                               out_sharding=out_sharding, act_quant=aq)
        float_op = lambda a, b: lax.dot_general(a, b, dimension_numbers, precision,
                                                preferred_element_type=jnp.float32)
        with layer_errors(self.where):
            return _int8_op(self.act, int_op, float_op, lhs, rhs, out)


class InferEinsum(_InferOp):
    """``jnp.einsum``-like op (nnx ``einsum_op``) over a `QTensor` rhs, through `qeinsum`."""

    def __call__(self, subscripts, lhs, rhs, precision=None, preferred_element_type=None,
                 out_sharding=None, **kwargs):
        s = explicit_einsum(subscripts, lhs.ndim, rhs.ndim)
        if not is_qtensor(rhs) or (self.act is None and (
                _rounds_through_its_dtype(rhs, lhs.dtype) or _sums_out_a_letter(s))):
            op = lambda a, b: jnp.einsum(  # noqa: E731
                subscripts, a, promoted_kernel(b, a.dtype), precision=precision, **kwargs,
                **_kwargs(out_sharding, preferred_element_type))
            return dequantized_in_turn(op, lhs, rhs) if is_qtensor(rhs) else op(lhs, rhs)
        out = preferred_element_type or lhs.dtype
        int_op = lambda a, b, aq: qeinsum(s, a, b, precision=precision,
                                          preferred_element_type=out, act_quant=aq)
        float_op = lambda a, b: jnp.einsum(s, a, b, precision=precision,
                                           preferred_element_type=jnp.float32)
        with layer_errors(self.where):
            return _int8_op(self.act, int_op, float_op, lhs, rhs, out)


class InferConv(_InferOp):
    """``lax.conv_general_dilated`` over a `QTensor` kernel.

    Weight-only: the kernel is dequantized inside the jitted convolution.
    int8 x int8 -> int32 (``act`` given): the input gets one scale (static, or
    its absmax / 127), the kernel needs symmetric integer codes of at most 8
    bits, per tensor or per output feature; gradients pass straight through the
    input's quantization (those of the float convolution of the fake-quantized input).
    A NaN in the input makes the whole result NaN (one scale per tensor).

    Raises:
      ValueError: int8: an input of another rank than the kernel's; a kernel it cannot take.
    """

    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
                 rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                 batch_group_count=1, precision=None, preferred_element_type=None,
                 out_sharding=None):
        conv = lambda a, b, **kw: lax.conv_general_dilated(
            a, b, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, **kw)
        kw = _kwargs(out_sharding, preferred_element_type)
        if not is_qtensor(rhs):
            return conv(lhs, rhs, **kw)
        with layer_errors(self.where):
            if self.act is None:  # as the float conv of the promoted kernel
                return conv(lhs, rhs.dequantize().astype(lhs.dtype), **kw)
            return self._int8_conv(conv, lhs, rhs, dimension_numbers, feature_group_count,
                                   preferred_element_type or lhs.dtype)

    def _int8_conv(self, conv, lhs, rhs, dimension_numbers, feature_group_count, out):
        if self.act.scale is None:
            self.act.act_quant()  # int8 only
        else:
            _check_static(self.act)
        if lhs.ndim != rhs.ndim:
            raise ValueError(f"conv_general_dilated lhs and rhs must have the same number of "
                             f"dimensions, got lhs of shape {lhs.shape} and a kernel of shape "
                             f"{rhs.shape}.")
        dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        fmt, layout = rhs.format, rhs.layout
        if not (fmt.is_integer and fmt.signed and fmt.bits <= 8 and rhs.zero_point is None
                and (layout.kind == "tensor"
                     or (layout.kind == "axis" and layout.axis == dn.rhs_spec[0]))):
            raise ValueError(
                f"the int8 convolution needs a kernel of symmetric signed integer codes of at "
                f"most 8 bits, quantized per tensor or per output feature (axis "
                f"{dn.rhs_spec[0]}), got {rhs!r}; use act=None for a weight-only convolution.")
        scale = None if self.act.scale is None else jnp.asarray(self.act.scale, jnp.float32)

        def exact(lhs, rhs):
            x = quantize(lhs, scale, dtype=jnp.int8)
            acc = int_conv(conv, x.qvalue, unpack(rhs).qvalue.astype(jnp.int8), dn,
                           feature_group_count)
            shape = [1] * acc.ndim
            shape[dn.out_spec[1]] = -1
            sv = scale_values(rhs)
            s = sv.reshape(shape) if layout.kind == "axis" else sv.reshape(())
            y = acc.astype(jnp.float32) * x.scale.reshape(()) * s
            return (y if scale is None else _keep_nan(lhs, y)).astype(out)

        def approx(lhs, rhs):  # the float convolution of the fake-quantized input
            a = fake_quant(lhs, scale, dtype=jnp.int8).astype(jnp.float32)
            y = conv(a, rhs.dequantize(jnp.float32), preferred_element_type=jnp.float32)
            return y.astype(out)

        return _straight_through(exact, approx, lhs, rhs)


@dataclasses.dataclass(frozen=True)
class InferPromote:
    """A layer's ``promote_dtype`` at inference, passing its `QTensor` kernel through.

    The layer's own function casts the input and bias (called with a dequantized
    stand-in kernel, unused: XLA drops it); the QTensor is dequantized inside the
    op, to the input's dtype. Called as linen calls it or as nnx does (one tuple).

    Attributes:
      inner: the layer's own ``promote_dtype``; ``None`` for Flax's (`jaxquant.promote_dtype`).
      act: with ``dequantize``, the `ActSpec` of the input (``Embed.attend``'s query,
        a ``ConvTranspose`` input), fake-quantized as in training.
      dequantize: dequantize the QTensor here, then cast it as a float kernel (nnx
        ``Embed``; ``ConvTranspose`` and ``ConvLocal``, whose ops take no QTensor).
      contract: the input axes ``act`` scales per token (`fake_quant_act`); ``None``:
        per tensor (convolutions).
    """

    inner: Callable | None = None
    act: ActSpec | None = None
    dequantize: bool = False
    contract: tuple[int, ...] | None = (-1,)

    def __call__(self, *args, **kwargs):
        as_tuple = len(args) == 1 and isinstance(args[0], tuple)
        items = list(args[0] if as_tuple else args)
        inner = self.inner or q_promote_dtype
        call = lambda v: inner(tuple(v), **kwargs) if as_tuple else inner(*v, **kwargs)
        if self.dequantize:
            items = [a.dequantize() if is_qtensor(a) else a for a in items]
            if self.act is not None and len(items) >= 2:
                if not jnp.issubdtype(jnp.result_type(items[0]), jnp.inexact):
                    items[0] = call(items)[0]  # integer input: cast first, as `QATPromote`
                items[0] = fake_quant_act(items[0], self.act, self.contract)
        if inner is q_promote_dtype or not any(map(is_qtensor, items)):
            return call(items)
        stand = [a.dequantize() if is_qtensor(a) else a for a in items]
        out = [a if is_qtensor(a) else b for a, b in zip(items, call(stand), strict=True)]
        return tuple(out) if as_tuple else out


_OP_FIELDS = ("dot_general", "dot_general_cls", "conv_general_dilated",
              "conv_general_dilated_cls", "einsum_op")


def check_own_op(layer, where: str = "") -> None:
    """A ValueError (``where`` in front) where ``layer`` (linen or nnx) was built with its
    own dot, convolution or einsum op: the quantized op put in its place would skip it.

    Flax's defaults (``None``, ``lax.dot_general``, ``lax.conv_general_dilated``,
    ``jnp.einsum``) and jaxquant's own ops pass.
    """
    for name in _OP_FIELDS:
        op = getattr(layer, name, None)
        if op is None or op is lax.dot_general or op is lax.conv_general_dilated \
                or op is jnp.einsum or isinstance(op, InferDot | InferConv | InferEinsum | QATDot
                                                  | QATEinsum | QDotGeneral | QATDotGeneral):
            continue
        raise ValueError(f"{where}{where and ': '}{type(layer).__name__} was built with its "
                         f"own {name} ({op!r}), which the quantized op would replace "
                         f"without running it: leave the layer float (rule -> None).")
