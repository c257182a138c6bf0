"""`QTensor`: quantized codes with their scale, zero point and granularity."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxquant._args import check_float_scale
from jaxquant._bits import packed_length
from jaxquant._formats import FORMATS, Format, get_format, value_dtype
from jaxquant._granularity import Layout, expand, layout_from_scale, squeeze_tensor_scale
from jaxquant._packing import PackedArray, check_packed
from jaxquant._zero_points import check_zero_point, zero_point_like_scale

__all__ = ["QTensor", "is_qtensor", "scale_values", "check_consistent"]


def _is_arraylike(v) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype")


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class QTensor:
    """Quantized codes, their scale and zero point, and how they were grouped.

    Invariants (checked on construction):

    * ``qvalue.dtype`` is the format and ``qvalue.shape`` the original array's
      shape (the logical view: a `PackedArray` keeps the same ``dtype`` and
      ``shape``);
    * ``scale`` (and ``zero_point``, of the same shape) follow ONNX's layouts:
      one element (per-tensor; ``axis`` is then ``None``), ``(shape[axis],)``
      (per-axis), or ``shape`` with ``ceil(shape[axis] / block_size)`` along
      ``axis`` (blocked); or, with a tuple ``block_size`` (one tile length per
      axis, ``axis=None``), ``ceil(shape[i] / block_size[i])`` along every axis;
    * ``scale`` is a float array of any float dtype (float32, bfloat16,
      ``float8_e8m0fnu`` powers of two for MX formats...; a weakly typed one,
      ``jnp.array(0.5)``, is stored as float32) or itself a `QTensor` of float
      scales (two-level scales: NVFP4's float8 block scales with a float32 tensor
      scale, double quantization);
    * ``codebook`` names a codebook format (``"nf4"``, ``"fp4"``,
      ``"float6_e2m3fn"``...): ``qvalue`` then holds unsigned code indices
      (uint4, or uint8 for 6-bit codes) and the value of a code is its table
      entry;
    * ``zero_point`` is ``None`` or has the code dtype (all zeros for floats);
    * ``axis`` is stored non-negative; ``axis``, ``block_size`` and ``dtype``
      are static (hashable, part of the ``jit`` cache key);
    * the represented value is ``(qvalue - zero_point) * scale`` in float32,
      returned as ``dtype``.

    Pytree children are ``qvalue``, ``scale`` and ``zero_point``. Like
    equinox modules, unflattening skips the checks, because JAX rebuilds
    pytrees with placeholder leaves (``None``, ``ShapeDtypeStruct``, stacked
    ``vmap`` outputs); dequantize inside a vmapped function (`check_consistent`).
    ``np.asarray`` / ``jnp.asarray`` raise a TypeError (call `dequantize`);
    equality and hash are by identity (compare leaves with ``jax.tree.map``).

    Args:
      qvalue: codes of a format from `jaxquant.FORMATS`, or a `PackedArray`.
      scale: float scales in one of the layouts above, or a `QTensor` of them.
      zero_point: ``None`` or zero points of the code dtype, shaped as ``scale``.
      axis: the quantized axis (per-axis or blocked); may be negative.
      block_size: the block length along ``axis`` (blocked), or a tuple of
        tile lengths, one per axis.
      dtype: the float dtype that `dequantize` returns by default.
      codebook: ``None``, or the name of a codebook format in
        `jaxquant.CODEBOOKS` whose indices ``qvalue`` holds.

    Raises:
      TypeError: codes not of a quantized format, non-float scale, mismatched
        zero-point dtype, non-float ``dtype``, an unknown codebook or codebook codes of
        the wrong dtype.
      ValueError: a scale or zero point whose shape fits no layout; concrete float6
        codebook codes of 64 or more.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> qt = jq.QTensor(jnp.array([[-3, 7]], jnp.int8), jnp.array([0.5, 0.25]), axis=1)
      >>> qt.dequantize()
      Array([[-1.5 ,  1.75]], dtype=float32)
    """

    qvalue: jax.Array | PackedArray
    scale: jax.Array
    zero_point: jax.Array | None
    axis: int | None
    block_size: int | tuple[int, ...] | None
    dtype: np.dtype
    codebook: str | None

    def __init__(
        self,
        qvalue,
        scale,
        zero_point=None,
        *,
        axis: int | None = None,
        block_size: int | tuple[int, ...] | None = None,
        dtype: DTypeLike = jnp.float32,
        codebook: str | None = None,
    ):
        if not (_is_arraylike(qvalue) and _is_arraylike(scale)):
            raise TypeError(f"qvalue and scale must be arrays, got {type(qvalue).__name__} and "
                            f"{type(scale).__name__}.")
        if codebook is None:
            fmt = get_format(qvalue.dtype, argname="qvalue.dtype")
        else:
            fmt = get_format(codebook, argname="codebook")
            if not fmt.is_codebook or np.dtype(qvalue.dtype) != fmt.dtype:
                raise TypeError(
                    f"codebook must name a codebook format whose codes are {fmt.dtype.name} "
                    f"indices; got codebook={codebook!r} with qvalue.dtype {qvalue.dtype}.")
            if zero_point is not None:
                raise ValueError(f"codebook format {codebook} takes no zero_point.")
            concrete = isinstance(qvalue, np.ndarray | jax.Array) and \
                not isinstance(qvalue, jax.core.Tracer)  # not a placeholder or a tracer
            if fmt.bits == 6 and concrete and qvalue.size and \
                    (top := int(jnp.max(qvalue))) >= 64:
                raise ValueError(f"qvalue: {fmt.name} codes are 6-bit indices (0 to 63), got "
                                 f"a code {top}.")
        check_float_scale(scale.dtype)
        if getattr(scale, "weak_type", False):  # jnp.array(0.5): float32, as `quantize` stores it
            scale = jax.lax.convert_element_type(scale, jnp.float32)  # (a weak leaf retraces)
        dtype = value_dtype(dtype)
        if isinstance(qvalue, PackedArray):
            check_packed(qvalue)
        try:
            layout = layout_from_scale(tuple(qvalue.shape), tuple(scale.shape), axis, block_size)
        except ValueError as e:  # replace() of a vmap output: say how to build a stack
            stacks = any(_fits(qvalue.shape[k:], scale.shape[k:], axis, block_size)
                         and qvalue.shape[:k] == scale.shape[:k] for k in range(1, qvalue.ndim))
            raise (ValueError(f"{e}{STACK_HINT}") if stacks else e) from None
        scale = squeeze_tensor_scale(scale, layout)
        if zero_point is not None:
            if not _is_arraylike(zero_point):
                raise TypeError(f"zero_point must be an array or None, got "
                                f"{type(zero_point).__name__}.")
            zero_point = zero_point_like_scale(zero_point, scale)
            check_zero_point(zero_point, fmt)
        for name, value in (
            ("qvalue", qvalue), ("scale", scale), ("zero_point", zero_point),
            ("axis", layout.axis), ("block_size", layout.block_size), ("dtype", dtype),
            ("codebook", codebook),
        ):
            object.__setattr__(self, name, value)

    @property
    def format(self) -> Format:
        """The `Format` record of the codes."""
        return get_format(self.codebook or self.qvalue.dtype)

    @property
    def T(self) -> QTensor:  # noqa: N802  (as arrays name it)
        """The QTensor with its axes reversed: `jaxquant.transpose` (a kernel from a
        PyTorch ``(out, in)`` weight), the quantized axis and block scales moved along."""
        from jaxquant._transpose import transpose

        return transpose(self)

    @property
    def layout(self) -> Layout:
        """The granularity: per-tensor, per-axis, blocked or tiled."""
        if isinstance(self.block_size, tuple):
            return Layout("tile", None, self.block_size)
        if self.block_size:
            return Layout("block", self.axis, self.block_size)
        return Layout("tensor") if self.axis is None else Layout("axis", self.axis)

    @property
    def shape(self) -> tuple[int, ...]:
        """The original array's shape."""
        return tuple(self.qvalue.shape)

    @property
    def ndim(self) -> int:
        """The original array's rank."""
        return len(self.qvalue.shape)

    @property
    def size(self) -> int:
        """The number of codes."""
        return math.prod(self.shape)

    @property
    def packed(self) -> bool:
        """Whether the codes are stored packed (see `jaxquant.pack`)."""
        return isinstance(self.qvalue, PackedArray)

    @property
    def nbytes(self) -> int:
        """The real storage cost in bytes: codes at their bit width, plus scale and zero point.

        Unpacked sub-byte codes and zero points count as checkpoints store them and
        `jaxquant.pack` packs them: along the last axis, each row rounded up to whole
        bytes (two int4 per byte, 6-bit codes four in three bytes); a `PackedArray` its bytes.
        """
        bits = self.format.bits

        def stored(shape) -> int:
            shape = tuple(shape) or (1,)  # a scalar is stored as one element
            if bits % 8 == 0:
                return math.prod(shape) * bits // 8
            return math.prod(shape[:-1]) * packed_length(shape[-1], bits)

        codes = self.qvalue.nbytes if self.packed else stored(self.shape)
        zp = 0 if self.zero_point is None else stored(self.zero_point.shape)
        return codes + _nbytes(self.scale) + zp

    @property
    def bits_per_element(self) -> float:
        """``8 * nbytes / size``: storage bits per value, scales included (MXFP4: 4.25)."""
        return 8 * self.nbytes / max(self.size, 1)

    def dequantize(self, dtype: DTypeLike | None = None) -> jax.Array:
        """``(qvalue - zero_point) * scale`` in float32, returned as ``dtype``.

        See `jaxquant.dequantize`.
        """
        from jaxquant._quantize import dequantize

        return dequantize(self, dtype)

    def __getitem__(self, index) -> QTensor:
        """``qt[...]`` is ``qt`` itself (how ``flax.nnx`` reads a parameter's value).

        Raises:
          TypeError: any other index; slice ``qt.dequantize()`` instead.
        """
        if index is Ellipsis:
            return self
        raise TypeError(
            f"QTensor supports only qt[...]; got index {index!r}. Slice qt.dequantize() "
            "or quantize the slice instead."
        )

    def __array__(self, dtype=None, copy=None):
        """Refuses the conversion that ``np.asarray`` / ``jnp.asarray`` would make.

        Raises:
          TypeError: always; a QTensor's value is ``qt.dequantize()``.
        """
        raise TypeError(f"a jaxquant.QTensor is not an array ({self!r}); call qt.dequantize() "
                        "(or jaxquant.dequantize_tree) to get its values.")

    def __repr__(self) -> str:
        if not (all(_is_arraylike(a) for a in (self.qvalue, self.scale)) and _known(self)):
            # placeholder leaves (PartitionSpecs, None, ...) of a tree rebuilt by a tree map,
            # or leaves of other dtypes (a gradient's float0 codes)
            return (f"QTensor(qvalue={self.qvalue!r}, scale={self.scale!r}, "
                    f"zero_point={self.zero_point!r}, axis={self.axis}, "
                    f"block_size={self.block_size}, dtype={np.dtype(self.dtype).name})")
        zp = "" if self.zero_point is None else ", zero_point"
        gran = {"tensor": "per-tensor", "axis": f"axis={self.axis}",
                "block": f"axis={self.axis}, block_size={self.block_size}",
                "tile": f"tiles={self.block_size}"}[self.layout.kind]
        sdt = "" if np.dtype(self.scale.dtype) == np.float32 or is_qtensor(self.scale) \
            else f" {self.scale.dtype}"
        scale = repr(self.scale) if is_qtensor(self.scale) else \
            f"scale{list(self.scale.shape)}{sdt}"
        return (
            f"QTensor({self.format.name}{'(packed)' if self.packed else ''}{list(self.shape)}, "
            f"{gran}, {scale}{zp}, dtype={self.dtype.name})"
        )


def _known(qt: QTensor) -> bool:  # codes of a format: not a gradient's float0 codes
    return getattr(qt.qvalue.dtype, "name", None) in FORMATS  # codebook codes too: uint4/8


STACK_HINT = (
    " A QTensor stacked by jax.vmap / lax.scan (or jax.tree.map(jnp.stack, ...)) holds one "
    "QTensor per entry of its leading axis: use it inside jax.vmap or lax.scan, e.g. "
    "jax.vmap(jaxquant.dequantize)(qt); a stack of layers quantized as one array has one "
    "scale set for all of them: quantize it with QuantSpec(stacked=1). Layers stacked on a "
    "later axis (nn.scan / nn.vmap variable_axes other than 0) have no tree or file form.")


def _fits(shape, scale_shape, axis, block_size) -> bool:
    try:
        layout_from_scale(tuple(shape), tuple(scale_shape), axis, block_size)
        return True
    except (TypeError, ValueError):
        return False


def check_consistent(qt: QTensor, argname: str = "qt") -> None:
    """Checks that ``qt``'s leaves still fit its metadata (static shapes and dtypes only).

    Unflattening skips the constructor's checks: a stack of per-layer QTensors
    (``vmap``/``scan`` outputs) keeps one layer's ``axis`` and ``block_size``.

    Args:
      qt: the QTensor.
      argname: the argument to name in errors.

    Raises:
      TypeError: leaves that are not arrays, or codes of no quantized format.
      ValueError: a scale, zero point or packed storage whose shape does not fit the codes.
    """
    hint = STACK_HINT
    if not (_is_arraylike(qt.qvalue) and _is_arraylike(qt.scale) and _known(qt)):
        got = [getattr(a, "dtype", type(a).__name__) for a in (qt.qvalue, qt.scale)]
        raise TypeError(f"{argname} must hold codes of a quantized format and a float scale, "
                        f"got {got[0]} and {got[1]} (a gradient's or a tree map's output?).")
    if isinstance(qt.qvalue, PackedArray):
        check_packed(qt.qvalue, f"{argname}.qvalue", hint)
    layout = qt.layout
    sshape, ndim = tuple(qt.scale.shape), qt.ndim
    bad_axis = layout.axis is not None and not 0 <= layout.axis < ndim
    if bad_axis or layout.kind == "tile" and len(layout.block_size) != ndim:
        raise ValueError(f"{argname}: axis={qt.axis}, block_size={qt.block_size} do not fit "
                         f"codes of shape {qt.shape}.{hint}")
    want = layout.scale_shape(qt.shape)
    fits = math.prod(sshape) == 1 and len(sshape) <= 1 if layout.kind == "tensor" \
        else sshape == want
    if not fits:
        raise ValueError(f"{argname}.scale has shape {sshape}; codes of shape {qt.shape} with "
                         f"axis={qt.axis}, block_size={qt.block_size} need {want}.{hint}")
    if qt.zero_point is not None and tuple(qt.zero_point.shape) != sshape:
        raise ValueError(f"{argname}.zero_point has shape {tuple(qt.zero_point.shape)}, not the "
                         f"scale's {sshape}.{hint}")
    if isinstance(qt.scale, QTensor):
        check_consistent(qt.scale, f"{argname}.scale")


def _nbytes(a) -> int:
    if isinstance(a, QTensor):
        return a.nbytes
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def scale_values(qt: QTensor) -> jax.Array:
    """``qt``'s scales as float32 values (a two-level scale is dequantized)."""
    s = qt.scale
    if isinstance(s, QTensor):
        from jaxquant._quantize import dequantize_values

        return dequantize_values(s)
    return s.astype(jnp.float32)


def _flatten_with_keys(qt: QTensor):
    keys = ("qvalue", "scale", "zero_point")
    children = tuple((jax.tree_util.GetAttrKey(k), getattr(qt, k)) for k in keys)
    return children, (qt.axis, qt.block_size, qt.dtype, qt.codebook)


def _flatten(qt: QTensor):
    return (qt.qvalue, qt.scale, qt.zero_point), (qt.axis, qt.block_size, qt.dtype, qt.codebook)


def _unflatten(aux, children) -> QTensor:
    qt = object.__new__(QTensor)
    for name, value in zip(("qvalue", "scale", "zero_point", "axis", "block_size", "dtype",
                            "codebook"), (*children, *aux), strict=True):
        object.__setattr__(qt, name, value)
    return qt


jax.tree_util.register_pytree_with_keys(QTensor, _flatten_with_keys, _unflatten, _flatten)


def is_qtensor(x) -> bool:
    """True for a `QTensor`: use as ``is_leaf=`` in tree utilities.

    Args:
      x: any object.

    Returns:
      Whether ``x`` is a `QTensor` (an array or a `PackedArray` is not).

    Example:
      >>> import jax, jax.numpy as jnp, jaxquant as jq
      >>> tree = {"w": jq.quantize(jnp.ones((2, 2)))}
      >>> [type(l).__name__ for l in jax.tree.leaves(tree, is_leaf=jq.is_qtensor)]
      ['QTensor']
    """
    return isinstance(x, QTensor)


def expand_scale(qt: QTensor, v: jax.Array) -> jax.Array:
    """Broadcasts a scale-shaped array of ``qt`` against its codes."""
    return expand(v, qt.shape, qt.layout)
