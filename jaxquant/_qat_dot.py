"""Quantization-aware training with a real int8 dot: `qat_dot_general`, `QATDotGeneral`.

The forward pass of ``qat_dot_general(x, w, dims)`` has the value of
``lax.dot_general(fake_quant(x), fake_quant(w), dims)`` (up to float summation
order), but runs as an int8 x int8 -> int32 ``lax.dot_general``: the weight is
quantized to symmetric int8 with an absmax scale (`QuantSpec`: per-tensor,
per-output-channel, or blocked along the single contracting axis), the
activation on the fly with `ActQuant` (per token or per tensor), and the int32
sums are multiplied by both scales (`jaxquant._int_dot.int_dot_parts`). The int32
sums are exact while ``K * 127 * 127 < 2**31`` (``K`` up to 133,000).

The backward pass is the straight-through estimator (Bengio et al., 2013,
arXiv:1308.3432) through both quantizers, as `jaxquant.fake_quant` in computed
mode: the scales are constants, and because an absmax scale maps every element
into ``[-127, 127]`` nothing is clipped, so the STE mask is all ones and::

    d lhs = d/d lhs  dot_general(lhs_fq, w_fq) . g      (g . w_fq^T for a Dense)
    d rhs = d/d rhs  dot_general(lhs_fq, w_fq) . g      (x_fq^T . g for a Dense)

with ``x_fq``, ``w_fq`` the dequantized codes of the forward pass (kept as
int8 codes and scales between the passes). Both backward dots run in float, so
the gradients equal those of the fake-quant reference up to summation order.
One module-level `jax.custom_vjp` carries this, its static configuration a
frozen `_Config`. On CPU the backward pass runs inside a ``lax.cond`` whose
two branches are the same: a conditional's operands are materialized, so the
backward reads the int8 codes, and each quantization stays one loop over the
floats (left alone, XLA:CPU rebuilds the dequantized values from the float
quotients ``x / s``, which it then writes out in full: one pass and 4x the
bytes more per operand). Under ``vmap`` over the weight the predicate stays
one scalar (`jaxquant._weight_only.moot_predicate`).

``backward="int8"`` (SwitchBack, Wortsman et al., 2023, arXiv:2304.13013) also runs the gradient
wrt ``lhs`` as an int8 dot: ``g . w_fq^T = (g * s_w) . codes^T`` because the weight's scale ``s_w``
is constant along the forward contraction; ``g * s_w`` is quantized to int8 per row (absmax / 127)
and multiplied with the weight's codes. Its error against the STE gradient is at most ``s_g / 2 *
sum_n |codes_kn|`` per element (``s_g`` the row's scale), about 1% relative on random data. The
weight gradient stays float: quantizing ``g`` along the batch, the contraction of that dot, would
put one outlier token's scale on every example.

``fake=True`` runs the plain fake-quant graph instead (`jaxquant.fake_quant` on both operands,
float dot, autodiff through its STE): the same values and gradients, at float speed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jaxquant._args import as_array, as_dtype, as_precision
from jaxquant._barriers import int_dot_general
from jaxquant._dot import _check_dims
from jaxquant._explicit_sharding import reshard_like
from jaxquant._fake_quant import fake_quant
from jaxquant._formats import get_format
from jaxquant._granularity import Layout, apply_grouped, normalize_axis
from jaxquant._int_dot import (
    ActQuant,
    check_act_quant,
    contraction_pieces,
    exact_length,
    int_dot_parts,
    int_operand,
    slice_axes,
    spec_of_axes,
    to_output,
)
from jaxquant._qtensor import is_qtensor
from jaxquant._quantize import check_flags, quantize
from jaxquant._rounding import divide, round_to_codes
from jaxquant._scales import scale_from_range
from jaxquant._spec import QuantSpec
from jaxquant._weight_only import moot_predicate

__all__ = ["QATDotGeneral", "qat_dot_general"]

_SIDES = ("lhs", "rhs")
_INT8 = get_format(jnp.int8)


@dataclasses.dataclass(frozen=True)
class _Config:
    dims: tuple
    weight: QuantSpec
    act: ActQuant | None
    backward: str
    dtype: np.dtype
    precision: Any
    out_dtype: np.dtype
    out_sharding: Any


def _float_dot(cfg: _Config, lhs, rhs):
    return lax.dot_general(lhs, rhs, cfg.dims, cfg.precision, cfg.out_dtype,
                           out_sharding=cfg.out_sharding)


def _weight_codes(rhs, cfg: _Config):
    """``(int8 codes, float32 scale)`` of the weight, the codes of `jaxquant.fake_quant`.

    The scale has ``rhs``'s rank: size 1 along every axis but ``weight.axis``
    (blocked: a QTensor's scale, ``n_blocks`` along the blocked axis).
    """
    w = cfg.weight
    if w.block_size:  # a block holding a NaN gets a NaN scale
        qt = quantize(rhs, dtype=jnp.int8, axis=w.axis, block_size=w.block_size)
        return qt.qvalue, qt.scale
    x = rhs.astype(jnp.float32)
    axes = tuple(d for d in range(x.ndim) if d != w.axis)
    # max(|min|, |max|): fake_quant's; 0 (scale 1) for an empty weight
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True, initial=0.0)
    scale, _ = scale_from_range(amax, amax, _INT8, True)  # NaN for a NaN amax
    return round_to_codes(divide(x, scale, "normal"), None, _INT8), scale


def _dequantize_weight(codes, scale, cfg: _Config, dtype):
    """``codes * scale`` in ``dtype``; blocked scales broadcast in the blocked view (a
    repeat along a sharded axis is rejected on a mesh with explicit axes)."""
    w, q = cfg.weight, codes.astype(jnp.float32)
    if not w.block_size:  # the scale has the codes' rank
        return (q * scale).astype(dtype)
    return apply_grouped(jnp.multiply, q, Layout("block", w.axis, w.block_size),
                         scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _qat_dot(lhs, rhs, cfg: _Config):
    return _qat_dot_fwd(lhs, rhs, cfg)[0]


def _qat_dot_fwd(lhs, rhs, cfg: _Config):
    w = _weight_codes(rhs, cfg)
    if cfg.act is None:  # weight-only QAT: float activations, float dot
        return _float_dot(cfg, lhs, _dequantize_weight(*w, cfg, lhs.dtype)), (lhs, w)
    x = int_operand(lhs, cfg.dims[0][0], cfg.act)[:2]
    y = int_dot_parts([(*x, None), (*w, None)], cfg.dims, cfg.weight.block_size, cfg.out_dtype,
                      cfg.out_sharding)
    return y, (x, w)


def _qat_dot_bwd(cfg: _Config, residuals, g):
    x, w = residuals

    def grads(x, w, g):
        if cfg.act is not None:  # int8 codes and their per-token (or per-tensor) scale
            x = (x[0].astype(jnp.float32) * x[1]).astype(cfg.dtype)
        fq_w = _dequantize_weight(*w, cfg, cfg.dtype)
        # the transposes of the float dot, without its (dead) forward evaluation
        (dw,) = jax.linear_transpose(lambda b: _float_dot(cfg, x, b), fq_w)(g)
        if cfg.backward == "int8":
            return _int8_grad_lhs(g, w, cfg, x), dw
        (dx,) = jax.linear_transpose(lambda a: _float_dot(cfg, a, fq_w), x)(g)
        return dx, dw

    def cpu(x, w, g):  # reads the int8 codes (see the module docstring)
        return lax.cond(moot_predicate(w[1]), grads, grads, x, w, g)

    return lax.platform_dependent(x, w, g, cpu=cpu, default=grads)


def _int8_grad_lhs(g, w, cfg: _Config, lhs):
    """``d lhs = g . fq(w)^T`` as int8 x int8 -> int32: ``g * s_w`` quantized per row.

    ``fq(w) = codes * s_w`` with ``s_w`` constant along the forward contraction, so
    ``s_w`` moves onto ``g`` (its axes are ``g``'s contracted ones here); the product
    is quantized to int8 per row (one scale per index of the batch and lhs free
    dimensions) and multiplied with the weight's codes (SwitchBack, Wortsman et
    al., 2023, arXiv:2304.13013). The sums are laid out as ``lhs`` (an array of its
    shape and sharding) on a mesh with explicit axes.
    """
    (lc, rc), (lb, rb) = cfg.dims
    codes, s_w = w
    nb = len(lb)
    rhs_free = tuple(d for d in range(codes.ndim) if d not in rc and d not in rb)
    lhs_free = [d for d in range(g.ndim - len(rhs_free) + len(lc)) if d not in lc + lb]
    g_rhs_free = tuple(range(nb + len(lhs_free), g.ndim))
    src = list(lb) + lhs_free + [lc[i] for i in np.argsort(rc)]  # lhs's axes of the sums
    gw = g.astype(jnp.float32) * to_output(s_w, rc, rb, 1, len(lhs_free))
    qg, s_g, _ = int_operand(gw, g_rhs_free, ActQuant())
    pieces = contraction_pieces(tuple(codes.shape[d] for d in rhs_free), exact_length(False))
    acc = sum(int_dot_general(slice_axes(qg, g_rhs_free, p), slice_axes(codes, rhs_free, p),
                              ((g_rhs_free, rhs_free), (tuple(range(nb)), rb)),
                              out_sharding=spec_of_axes(lhs, src)).astype(jnp.float32)
              for p in pieces)  # int32 sums exact in each piece
    s_g = s_g.reshape(s_g.shape[:nb + len(lhs_free)] + (1,) * len(rc))
    dx = acc * reshard_like(s_g, acc)  # axes: lhs batch, lhs free, lhs contracting (by rc)
    return jnp.transpose(dx, tuple(np.argsort(src))).astype(cfg.dtype)


_qat_dot.defvjp(_qat_dot_fwd, _qat_dot_bwd)


def _fake_operand(x, contract: tuple, act: ActQuant):
    """`fake_quant` of an activation per token (rows = the non-contracting indices) or tensor."""
    if act.granularity == "tensor":
        return fake_quant(x)
    free = tuple(d for d in range(x.ndim) if d not in contract)
    t = jnp.transpose(x, free + contract)
    rows = math.prod(t.shape[:len(free)])
    fq = fake_quant(t.reshape(rows, t.size // max(rows, 1)), axis=0).reshape(t.shape)
    return jnp.transpose(fq, tuple(np.argsort(free + contract)))


@functools.partial(jax.jit, static_argnames=("cfg", "fake"))
def _run(lhs, rhs, cfg: _Config, fake: bool):
    if not fake:
        return _qat_dot(lhs, rhs, cfg)
    w = cfg.weight
    rhs = fake_quant(rhs, axis=w.axis, block_size=w.block_size)
    if cfg.act is not None:
        lhs = _fake_operand(lhs, cfg.dims[0][0], cfg.act)
    return _float_dot(cfg, lhs, rhs)


def _check_options(weight, act, fake, backward) -> None:
    """The checks that need no operand (`QATDotGeneral` runs them when it is built)."""
    check_flags(fake=fake)
    if not isinstance(weight, QuantSpec):
        raise TypeError(f"weight must be a jaxquant.QuantSpec, got {type(weight).__name__}.")
    check_act_quant(act, "act")
    if backward not in ("float", "int8"):
        raise ValueError(f"backward must be 'float' or 'int8', got {backward!r}.")


def _check_weight(weight, rhs_ndim: int, rhs_contract: tuple) -> QuantSpec:
    if weight.dtype != np.dtype(jnp.int8):  # a scheme name ("mxint8") is a str
        raise ValueError(f"weight must quantize to int8 (the int8 x int8 -> int32 dot), got "
                         f"dtype={getattr(weight.dtype, 'name', weight.dtype)}.")
    if weight.double_quant or weight.scale_dtype is not None or type(weight.block_size) is tuple:
        raise ValueError(f"weight must have float32 scales per tensor, axis or block (the int8 "
                         f"dot scales its sums with them), got block_size={weight.block_size}, "
                         f"scale_dtype={weight.scale_dtype}, double_quant={weight.double_quant}.")
    if weight.stacked:  # a stack of layers runs under jax.vmap / lax.scan
        raise ValueError(f"weight must describe rhs itself (stacked=0), got {weight.stacked}.")
    if not weight.symmetric:
        raise ValueError("weight must be symmetric (symmetric=True): the int8 dot takes codes "
                         "without a zero point; got symmetric=False.")
    if weight.axis is None:
        return weight
    axis = normalize_axis(weight.axis, rhs_ndim, "weight.axis")
    if weight.block_size is not None:
        if rhs_contract != (axis,):
            raise ValueError(
                f"a blocked weight must be blocked along its single contracting dimension; "
                f"weight.axis={weight.axis} (block_size={weight.block_size}) and the rhs "
                f"contracting dimensions are {rhs_contract}.")
    elif axis in rhs_contract:
        raise ValueError(
            f"the weight's scale must be constant along the contraction, but weight.axis="
            f"{weight.axis} is the contracting dimension {axis} of rhs (contracting dimensions "
            f"{rhs_contract}); use the output axis (axis=-1 for an (in, out) kernel) or None.")
    return dataclasses.replace(weight, axis=axis)


def qat_dot_general(
    lhs: ArrayLike,
    rhs: ArrayLike,
    dimension_numbers,
    precision=None,
    preferred_element_type: DTypeLike | None = None,
    *,
    weight: QuantSpec = QuantSpec(dtype=jnp.int8, axis=-1),  # noqa: B008 (frozen)
    act: ActQuant | None = ActQuant(),  # noqa: B008 (frozen)
    fake: bool = False,
    backward: Literal["float", "int8"] = "float",
    out_sharding=None,
) -> jax.Array:
    """``lax.dot_general(fake_quant(lhs), fake_quant(rhs))`` run as an int8 dot, for QAT.

    ``rhs`` is the weight. Forward: both operands are quantized to symmetric
    int8 (``rhs`` by ``weight``, ``lhs`` dynamically by ``act``), their codes
    multiplied into int32 and the sums scaled; the value equals the fake-quant
    reference up to float summation order. Backward: the straight-through
    estimator, that is the gradient of the float dot of the fake-quantized
    operands (absmax scales clip nothing), computed with float dots. See the
    module docstring.

    Args:
      lhs: the float activation.
      rhs: the float weight, of ``lhs``'s dtype.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
        rhs_batch))``, as for ``lax.dot_general``.
      precision: for the float dots (the forward int8 dot is exact).
      preferred_element_type: a float result dtype; default: the operands' dtype.
      weight: how ``rhs`` is quantized: int8, symmetric, ``axis`` a
        non-contracting axis of ``rhs`` (``-1``: per output channel of an
        ``(in, out)`` kernel) or ``None`` (per tensor), or ``block_size`` along
        the single contracting axis.
      act: `ActQuant` for ``lhs`` (``"token"``: one scale per index of the
        non-contracting dimensions; ``"tensor"``), or ``None`` to leave ``lhs``
        in float (weight-only QAT: a float dot with the fake-quantized weight).
      fake: run the plain fake-quant graph (`jaxquant.fake_quant` on both
        operands, float dot) instead of the int8 dot: same maths, float speed.
      backward: ``"float"``: both backward dots in float, the exact STE
        gradients. ``"int8"``: the gradient wrt ``lhs`` runs as an int8 dot,
        the incoming gradient (times the weight's scales) quantized per row to
        int8; it then differs from the STE gradient by at most half a
        quantization step of that row per product term (see the module
        docstring). The weight gradient stays float.
      out_sharding: passed to ``lax.dot_general`` (the blocked int8 dot, whose
        dot has an extra axis of blocks, reshards its result to it).

    Returns:
      The ``lax.dot_general`` result: batch, then lhs free, then rhs free dims.

    Raises:
      TypeError: a `QTensor` or non-float operand, operands of different dtypes,
        ``weight`` not a `QuantSpec`, ``act`` not an `ActQuant`, ``fake`` not a
        bool, a ``preferred_element_type`` that is not a dtype.
      ValueError: bad ``dimension_numbers``; ``weight`` not int8, not symmetric,
        tiled, with a ``scale_dtype`` or ``double_quant``, or with a scale varying
        along the contraction; an integer ``preferred_element_type``; an unknown
        ``backward``, or ``"int8"`` without the int8 forward path (``act=None``, a
        blocked weight, ``fake``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxquant as jq
      >>> x = jnp.array([[1.0, -0.3, 0.2]])
      >>> w = jnp.array([[0.5], [1.0], [-2.0]])
      >>> dims = (((1,), (0,)), ((), ()))
      >>> y = jq.qat_dot_general(x, w, dims)  # int8 x int8 -> int32, then scaled
      >>> y.round(6)  # the products are exact; the scaling rounds (one ulp apart on GPU)
      Array([[-0.191332]], dtype=float32)
      >>> (jq.fake_quant(x, axis=0) @ jq.fake_quant(w, axis=-1)).round(6)  # the reference
      Array([[-0.191332]], dtype=float32)
      >>> jax.grad(lambda w: jq.qat_dot_general(x, w, dims).sum())(w).T  # STE: fq(x)^T . 1
      Array([[ 1.        , -0.2992126 ,  0.19685039]], dtype=float32)
    """
    _check_options(weight, act, fake, backward)
    ops = []
    for name, op in zip(_SIDES, (lhs, rhs), strict=True):
        if is_qtensor(op):
            raise TypeError(f"{name} must be a float array, got a jaxquant.QTensor; "
                            f"qat_dot_general quantizes float operands (for QTensor weights "
                            f"use jaxquant.qdot_general).")
        op = as_array(op, name)
        if not jnp.issubdtype(op.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got dtype {op.dtype}.")
        ops.append(op)
    if ops[0].dtype != ops[1].dtype:
        raise TypeError(f"lhs and rhs must have the same dtype, got {ops[0].dtype} and "
                        f"{ops[1].dtype}; cast one of them first.")
    dims = _check_dims(dimension_numbers, (ops[0].shape, ops[1].shape))
    weight = _check_weight(weight, ops[1].ndim, dims[0][1])
    out_dtype = ops[0].dtype
    if preferred_element_type is not None:
        out_dtype = as_dtype(preferred_element_type, "preferred_element_type")
        if not jnp.issubdtype(out_dtype, jnp.floating):
            raise ValueError(f"preferred_element_type must be a float dtype (the int32 sums "
                             f"are scaled), got {out_dtype}.")
    if backward == "int8" and (act is None or weight.block_size or fake):
        raise ValueError("backward='int8' needs the int8 forward path: an act (not None), a "
                         "weight scale constant along the contraction (no block_size) and "
                         f"fake=False; got act={act!r}, weight.block_size="
                         f"{weight.block_size}, fake={fake}.")
    cfg = _Config(dims, weight, act, backward, ops[0].dtype, as_precision(precision), out_dtype,
                  out_sharding)
    return _run(ops[0], ops[1], cfg, bool(fake))


@dataclasses.dataclass(frozen=True, kw_only=True)
class QATDotGeneral:
    """`qat_dot_general` as a ``lax.dot_general`` drop-in for Flax's ``dot_general=``.

    A frozen (hashable) dataclass, so it can be a Flax module field:
    ``nn.Dense(1024, dot_general=QATDotGeneral())`` trains with int8 forward
    dots and straight-through gradients; the kernel stays a float parameter.

    Attributes:
      weight: how the kernel (``rhs``) is quantized; see `qat_dot_general`.
      act: `ActQuant` for the activation (``lhs``), or ``None``.
      fake: the plain fake-quant graph instead of the int8 dot.
      backward: ``"float"`` or ``"int8"`` (the gradient wrt the activation as
        an int8 dot); see `qat_dot_general`.

    Raises:
      TypeError, ValueError: when built, the checks of `qat_dot_general` that need no
        operand (``weight`` a `QuantSpec`, ``act``, ``fake``, ``backward``).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> dot = jq.QATDotGeneral(act=jq.ActQuant(granularity="tensor"))
      >>> dot(jnp.array([[64.0, -127.0]]), jnp.eye(2), (((1,), (0,)), ((), ())))  # exact
      Array([[  64., -127.]], dtype=float32)
    """

    weight: QuantSpec = QuantSpec(dtype=jnp.int8, axis=-1)
    act: ActQuant | None = ActQuant()
    fake: bool = False
    backward: Literal["float", "int8"] = "float"

    def __post_init__(self):  # a typo fails here, not at the first call
        _check_options(self.weight, self.act, self.fake, self.backward)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kw) -> jax.Array:
        """Calls `qat_dot_general` with this configuration (``kw``: ``out_sharding``)."""
        unknown = set(kw) - {"out_sharding"}
        if unknown:
            raise TypeError(f"QATDotGeneral got unexpected keyword arguments {sorted(unknown)}; "
                            f"it accepts out_sharding.")
        return qat_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                               weight=self.weight, act=self.act, fake=self.fake,
                               backward=self.backward, out_sharding=kw.get("out_sharding"))
