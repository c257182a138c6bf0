"""The numerics injected into Flax layers, shared by linen and nnx.

Training (float kernels): `QATPromote` stands in for a layer's
``promote_dtype`` and fake-quantizes the kernel (computed or learned scales)
and the input activation before the layer's own dot / conv / einsum / take;
`QATDot` is a ``dot_general`` running ``jaxquant._qat_dot.qat_dot_general``
(int8 x int8 -> int32 forward, straight-through backward).

Inference on `QTensor` kernels is in `jaxquant.flax._infer_ops`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxquant._fake_quant import fake_quant
from jaxquant._qtensor import QTensor
from jaxquant._quantize import quantize
from jaxquant._schemes import resolve
from jaxquant._spec import QuantSpec
from jaxquant.flax._rules import ActSpec, layer_errors

__all__ = ["QATPromote", "QATDot", "QATEinsum", "einsum_contract", "explicit_einsum",
           "fake_quant_act", "fake_quant_weight", "init_qparams", "learned_qtensor",
           "learned_scale"]

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _explicit_kwargs(spec: QuantSpec) -> dict:
    """Arguments of `quantize` / `fake_quant` with a given scale in the layout that
    ``spec`` computes: a codebook's default blocks (``"nf4"``: 64 along the last axis)
    spelled out, since a given scale takes its granularity from ``axis`` and
    ``block_size`` alone."""
    r = resolve(spec.dtype, spec.axis, spec.block_size, spec.scale_dtype)
    tiles = isinstance(r.block_size, tuple)  # a tile along every axis: no axis
    return dict(dtype=spec.dtype, axis=None if tiles else r.axis,
                block_size=r.block_size, saturate=spec.saturate)


def _fixed_zero_point(spec: QuantSpec, scale: jax.Array) -> jax.Array | None:
    """The zero point a symmetric spec of an unsigned integer format always has (the
    mid-range code, ``128`` for uint8, as `quantize` and PyTorch's symmetric ``quint8``
    use), as a constant of the code dtype shaped like ``scale``; ``None`` otherwise."""
    fmt = resolve(spec.dtype, spec.axis, spec.block_size, spec.scale_dtype).fmt
    if not (spec.symmetric and fmt.is_integer and not fmt.signed):
        return None
    return jnp.full(jnp.shape(scale), (int(fmt.qmax) + 1) // 2, fmt.dtype)


SCALE_EPS = float(jnp.finfo(jnp.float32).eps)  # torch's _LearnableFakeQuantize default


@jax.custom_jvp
def learned_scale(scale: jax.Array) -> jax.Array:
    """A learned scale as the layer uses it: float32, at least ``SCALE_EPS``.

    As PyTorch's ``_LearnableFakeQuantize`` (which clamps its scale parameter to
    ``eps`` before each forward pass), an optimizer step that takes a scale to 0
    or below leaves the layer working; the gradient passes straight through the
    clamp, so it is the LSQ gradient at the clamped value.

    Example:
      >>> s = learned_scale(jnp.array([0.5, -0.25]))
      >>> float(s[0]), bool(s[1] == jnp.finfo(jnp.float32).eps)
      (0.5, True)
    """
    return jnp.maximum(jnp.asarray(scale, jnp.float32), jnp.float32(SCALE_EPS))


@learned_scale.defjvp
def _learned_scale_jvp(primals, tangents):
    return learned_scale(*primals), jnp.asarray(tangents[0], jnp.float32)


def fake_quant_weight(w: jax.Array, spec: QuantSpec, scale: jax.Array | None = None,
                      zero_point: jax.Array | None = None):
    """``dequantize(spec(w))`` with STE gradients; LSQ (LSQ+ with a float ``zero_point``)
    gradients for a given ``scale``.

    Args:
      w: the float kernel.
      spec: its `QuantSpec`.
      scale: ``None`` (computed from ``w``) or the learned scale, in ``spec``'s layout
        (used as `learned_scale` gives it: at least float32's eps).
      zero_point: the learned float zero point of an asymmetric ``spec``, or ``None``
        (a symmetric unsigned spec then keeps its fixed mid-range zero point).

    Returns:
      The fake-quantized kernel, of ``w``'s shape and dtype.

    Raises:
      TypeError, ValueError: as `jaxquant.fake_quant` (a spec that does not fit ``w``).

    Example:
      >>> w = jnp.array([[-1.0, 0.5], [2.0, 1.5]])
      >>> fake_quant_weight(w, QuantSpec(dtype=jnp.uint8), jnp.array([1.0, 0.5]))
      Array([[-1. ,  0.5],
             [ 2. ,  1.5]], dtype=float32)
    """
    if scale is None:
        return fake_quant(w, **spec.computed_kwargs())
    if zero_point is None:
        zero_point = _fixed_zero_point(spec, scale)
    return fake_quant(w, learned_scale(scale), zero_point, **_explicit_kwargs(spec))


def init_qparams(w: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array | None]:
    """The scale and, for an asymmetric ``spec``, the zero point (as float32) that
    `quantize` computes for ``w``: the LSQ / LSQ+ initial values.

    The fixed zero point of a symmetric unsigned spec is not returned (nothing to learn).

    Example:
      >>> w = jnp.array([[-1.0, 0.0], [2.0, 1.5]])  # one scale per output column
      >>> init_qparams(w, QuantSpec(dtype=jnp.int4, symmetric=False))
      (Array([0.2, 0.1], dtype=float32), Array([-3., -8.], dtype=float32))
    """
    qt = quantize(w, symmetric=spec.symmetric, **_explicit_kwargs(spec))
    if spec.symmetric or qt.zero_point is None:
        return qt.scale, None
    return qt.scale, qt.zero_point.astype(jnp.float32)


def learned_qtensor(w: jax.Array, scale: jax.Array, zero_point: jax.Array | None = None,
                    *, spec: QuantSpec) -> QTensor:
    """``w`` quantized with learned values: the codes `fake_quant_weight` trained with.

    A float zero point is rounded half to even and clamped to the code range, as
    in the forward pass of `jaxquant.fake_quant`; without one, a symmetric unsigned
    spec keeps its fixed mid-range zero point.
    """
    if zero_point is None:
        zp = _fixed_zero_point(spec, scale)
    else:
        fmt = resolve(spec.dtype, spec.axis, spec.block_size, spec.scale_dtype).fmt
        zp = jnp.clip(jnp.round(zero_point), fmt.qmin, fmt.qmax).astype(fmt.dtype)
    return quantize(w, learned_scale(scale), zp, packed=spec.packed, **_explicit_kwargs(spec))


def fake_quant_act(x: jax.Array, act: ActSpec, contract: tuple[int, ...] | None) -> jax.Array:
    """Fake-quantizes an input: static scale, per tensor, or per token.

    Per token: one scale per index of the dimensions not in ``contract``
    (negative entries count from the end); ``contract=None`` means per tensor.

    Raises:
      ValueError: per token, a ``contract`` axis that ``x`` does not have.
    """
    if act.scale is not None:  # symmetric: unsigned codes around their mid-range zero point
        scale = jnp.asarray(act.scale, jnp.float32)
        fq = fake_quant(x, scale, _fixed_zero_point(QuantSpec(dtype=act.dtype), scale),
                        dtype=act.dtype)
        # a NaN's code is the zero point's; inference turns the whole output NaN, as a
        # dynamic per-tensor scale would (_infer_ops._keep_nan): so does training
        return jnp.where(jnp.any(jnp.isnan(x)), jnp.asarray(jnp.nan, fq.dtype), fq)
    if act.granularity == "tensor" or contract is None:
        return fake_quant(x, dtype=act.dtype)
    if any(not -x.ndim <= d < x.ndim for d in contract):
        raise ValueError(f"the layer contracts input axes {tuple(contract)}, but its input "
                         f"has shape {tuple(x.shape)}.")
    red = sorted({d % x.ndim for d in contract})
    keep = [d for d in range(x.ndim) if d not in red]
    xt = jnp.transpose(x, keep + red)
    rows = xt.reshape(math.prod(xt.shape[:len(keep)]), math.prod(xt.shape[len(keep):]))
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
    ``Embed`` lookup), the input the first. An integer input (uint8 pixels) is
    first cast by ``inner``, as the float layer casts it, then fake-quantized.

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
      exact_kernel: fake-quantize a kernel narrower than the compute ``dtype`` in that
        ``dtype`` (the layer deploys as an integer dot, whose scales multiply the codes
        exactly: bfloat16 params computed in float32 are not rounded to bfloat16).
      calls: a list that each call appends to, or ``None``.
      keep_kernel: hand the kernel on in its own dtype, not cast by ``inner`` (the
        int8 training dot, `QATDot`, quantizes the parameter itself, the codes
        ``quantize_params`` / ``nnx_quantize`` store, not its cast to a narrower
        compute ``dtype``).
    """

    inner: Callable
    weight: QuantSpec | None
    act: ActSpec | None
    contract: tuple[int, ...] | None
    scale: Callable | None = None
    where: str = ""
    keep_kernel: bool = False
    exact_kernel: bool = False
    calls: list | None = dataclasses.field(default=None, compare=False, repr=False)

    def __call__(self, *args, dtype=None, inexact: bool = True):
        if self.calls is not None:  # linen: whether a subclass's own method called it
            self.calls.append(1)
        as_tuple = len(args) == 1 and isinstance(args[0], tuple)
        items = list(args[0] if as_tuple else args)
        k = 1 if len(items) >= 2 else 0

        def inner(v):
            if as_tuple:
                return self.inner(tuple(v), dtype=dtype, inexact=inexact)
            return self.inner(*v, dtype=dtype, inexact=inexact)

        with layer_errors(self.where):
            if self.weight is not None and items[k] is not None:
                s, z = (None, None) if self.scale is None else self.scale(items[k])
                w = items[k]
                # the compute dtype: the layer's, or (dtype=None) Flax's inference from the
                # operands (bfloat16 params and a float32 input compute in float32)
                compute = dtype if dtype is not None else _inferred_dtype(items)
                if (self.exact_kernel and compute is not None
                        and jnp.issubdtype(compute, jnp.floating)
                        and jnp.dtype(compute).itemsize > jnp.dtype(w.dtype).itemsize):
                    w = w.astype(compute)
                items[k] = fake_quant_weight(w, self.weight, s, z)
            if self.act is not None and len(items) >= 2:
                # cast to the compute dtype first (a uint8 pixel, a float32 input to a
                # bfloat16 layer), then quantize: the codes inference computes
                items[0] = inner(items[:2])[0]
                items[0] = fake_quant_act(items[0], self.act, self.contract)
        out = inner(items)
        if self.keep_kernel and len(items) >= 2:
            out = [*out[:1], items[1], *out[2:]]
            return tuple(out) if as_tuple else out
        return out


def _inferred_dtype(items):
    """Flax's compute dtype for ``dtype=None``: the operands' promotion; ``None`` where
    strict promotion has none (Flax's own ``promote_dtype`` then says so)."""
    try:
        return jnp.result_type(*(v for v in items if v is not None))
    except jax.dtypes.TypePromotionError:
        return None


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
        if lhs.dtype != rhs.dtype:  # the kernel in its param dtype (`QATPromote.keep_kernel`)
            out = preferred_element_type or lhs.dtype  # the float layer's result dtype
            with jax.numpy_dtype_promotion("standard"):  # bfloat16 and float32: float32
                common = jnp.promote_types(lhs.dtype, rhs.dtype)
            if act is None and jnp.finfo(rhs.dtype).bits < jnp.finfo(common).bits:
                # weight-only: inference dequantizes a bfloat16 kernel to bfloat16, then
                # promotes it; the same here (the int8 dot's weight, rounded to its dtype)
                with layer_errors(self.where):
                    w = fake_quant_weight(rhs, self.weight).astype(common)
                return jax.lax.dot_general(lhs.astype(common), w, dimension_numbers, precision,
                                           out, out_sharding=out_sharding)
            lhs, rhs, preferred_element_type = lhs.astype(common), rhs.astype(common), out
        with layer_errors(self.where):
            return qat_dot_general(lhs, rhs, dimension_numbers, precision,
                                   preferred_element_type, weight=self.weight, act=act,
                                   out_sharding=out_sharding)
