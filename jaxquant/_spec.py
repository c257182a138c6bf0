"""`QuantSpec`: how to quantize one array, a frozen and hashable record (the value of a
`jaxquant.quantize_tree` rule, and the weight part of the Flax and QAT configurations)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxquant._args import as_dtype
from jaxquant._formats import CODEBOOKS, get_format
from jaxquant._granularity import _is_int, check_block_size
from jaxquant._qtensor import QTensor
from jaxquant._quantize import check_flags, quantize
from jaxquant._scale_formats import scale_options
from jaxquant._schemes import SCHEMES, resolve

__all__ = ["QuantSpec"]


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How to quantize one array: a frozen, hashable record.

    Attributes:
      dtype: the format (see `jaxquant.FORMATS`), a codebook name (``"nf4"``,
        ``"fp4"``, ``"float6_e2m3fn"``, ...) or a named composite format
        (``"mxfp4"``, ``"nvfp4"``, ...: `jaxquant.SCHEMES`).
      axis: the axis with its own scales (``-1``: the output features of a
        ``(in, out)`` kernel); ``None`` for per-tensor.
      block_size: split ``axis`` into blocks of this length (``None``: no
        blocks), or a tuple of tile lengths, one per axis (``axis`` is then
        not used).
      symmetric: symmetric scales, or asymmetric with a zero point (integer
        formats only).
      saturate: float formats: clip to the largest finite value.
      packed: store 2-, 4- and 6-bit codes packed (two int4 per byte) along the last axis.
      scale_dtype: how scales are stored (``None``: float32; see `jaxquant.quantize`).
      scale_rounding: ``float8_e8m0fnu`` scales: ``"floor"``, ``"ceil"`` or
        ``"up_on_overflow"``.
      double_quant: quantize the scales themselves to float8 (groups of 256).
      stacked: how many leading axes stack layers (the kernels of ``nn.scan`` or
        ``nnx.scan`` / ``nnx.vmap`` layers, ``(layers, in, out)``): each layer gets its
        own scales, as under that many ``jax.vmap``, and ``axis`` counts within one
        layer. The result is the stacked `QTensor` that ``lax.scan`` and ``jax.vmap``
        slice layer by layer (and checkpoints store as such).

    Raises:
      TypeError: unknown format or scale dtype; ``axis`` or ``stacked`` not an int
        (``axis`` may be ``None``).
      ValueError: ``block_size <= 0``, ``block_size`` without ``axis``, a block
        length that contradicts a named format, ``packed`` for a wide format,
        ``symmetric=False`` for a float or codebook format (only integer formats
        have zero points), ``stacked < 0``.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> jq.QuantSpec(dtype=jnp.int4, block_size=32)
      QuantSpec(dtype=dtype(int4), axis=-1, block_size=32, symmetric=True,
                saturate=True, packed=False, scale_dtype=None, scale_rounding='floor',
                double_quant=False, stacked=0)
      >>> jq.QuantSpec(stacked=1)(jnp.ones((12, 64, 32)))  # one scale per layer and column
      QTensor(int8[12, 64, 32], axis=1, scale[12, 32], dtype=float32)
      >>> jq.QuantSpec(dtype="nf4", packed=True, double_quant=True)(jnp.ones((4, 128))).scale
      QTensor(float8_e4m3fn[4, 2], tiles=(4, 2), scale[1, 1], dtype=float32)
    """

    dtype: DTypeLike | str = jnp.int8
    axis: int | None = -1
    block_size: int | tuple[int, ...] | None = None
    symmetric: bool = True
    saturate: bool = True
    packed: bool = False
    scale_dtype: DTypeLike | None = None
    scale_rounding: str = "floor"
    double_quant: bool = False
    stacked: int = 0

    def __post_init__(self):
        check_flags(symmetric=self.symmetric, saturate=self.saturate, packed=self.packed,
                    double_quant=self.double_quant)
        named = isinstance(self.dtype, str) and (self.dtype in SCHEMES or self.dtype in CODEBOOKS)
        if not named:
            object.__setattr__(self, "dtype", get_format(self.dtype).dtype)
        if self.axis is not None and not _is_int(self.axis):
            raise TypeError(f"axis must be an int or None, got {self.axis!r}.")
        if not _is_int(self.stacked):
            raise TypeError(f"stacked must be an int (the leading axes that stack layers), got "
                            f"{self.stacked!r}.")
        if self.stacked < 0:
            raise ValueError(f"stacked must be 0 or more (the leading axes that stack layers), "
                             f"got {self.stacked}.")
        # NumPy integers as Python ints: the fields are static metadata, checked below
        as_int = lambda v: int(v) if _is_int(v) else v  # noqa: E731
        object.__setattr__(self, "axis", as_int(self.axis))
        object.__setattr__(self, "stacked", int(self.stacked))
        b = self.block_size
        object.__setattr__(self, "block_size", tuple(map(as_int, b))
                           if isinstance(b, list | tuple) else as_int(b))
        if self.scale_dtype is not None:
            object.__setattr__(self, "scale_dtype", as_dtype(self.scale_dtype, "scale_dtype"))
        r = resolve(self.dtype, self.axis, self.block_size, self.scale_dtype,
                    double_quant=self.double_quant)
        if isinstance(r.block_size, tuple):  # quantize's TypeError / ValueError
            for b in r.block_size:
                check_block_size(b)
        elif r.block_size is not None:
            check_block_size(r.block_size)
            if r.axis is None:
                raise ValueError("block_size requires axis: the axis that is split into blocks.")
        if self.packed and r.fmt.bits not in (2, 4, 6):
            raise ValueError(f"packed=True needs a 2-, 4- or 6-bit format, got {r.fmt.name}.")
        if not self.symmetric and not r.fmt.is_integer:
            raise ValueError(f"symmetric=False needs an integer format (a zero point); "
                             f"{r.fmt.name} is a {r.fmt.kind} format, which has none.")
        scale_options(r.scale_dtype, self.scale_rounding, self.double_quant, self.symmetric)

    def __call__(self, x: jax.Array) -> QTensor:
        """Quantizes one array with this spec (scales computed from ``x``).

        Args:
          x: a float array.

        Returns:
          ``jaxquant.quantize(x, dtype=..., axis=..., ...)`` with this spec's fields,
          under ``stacked`` ``jax.vmap`` (a stacked `QTensor`: one layer's metadata).

        Raises:
          TypeError, ValueError: as `jaxquant.quantize` (non-float ``x``, ``axis``
            out of range...); ``x`` with no axes beyond the ``stacked`` ones.

        Example:
          >>> import jax.numpy as jnp, jaxquant as jq
          >>> jq.QuantSpec(axis=0)(jnp.array([[1.0, -2.0], [0.5, 0.25]])).scale
          Array([0.01574803, 0.00393701], dtype=float32)
        """
        f = functools.partial(quantize, packed=self.packed, **self.computed_kwargs())
        if self.stacked:
            shape = jnp.shape(x)
            if len(shape) <= self.stacked:
                raise ValueError(f"stacked={self.stacked} needs an array with more axes than "
                                 f"the {self.stacked} that stack layers, got shape {shape}.")
            for _ in range(self.stacked):
                f = jax.vmap(f)
            try:
                return f(x)
            except (TypeError, ValueError) as e:  # quantize saw one layer: say so
                raise type(e)(f"{e} (stacked={self.stacked}: each layer has shape "
                              f"{shape[self.stacked:]})") from e
        return f(x)

    def computed_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `jaxquant.quantize` / `jaxquant.fake_quant` (computed
        scales) that this spec stands for, ``packed`` and ``stacked`` apart.

        Example:
          >>> import jaxquant as jq
          >>> jq.QuantSpec(dtype="nf4", double_quant=True).computed_kwargs()["double_quant"]
          True
        """
        tiles = isinstance(self.block_size, tuple)
        return dict(dtype=self.dtype, axis=None if tiles else self.axis,
                    block_size=self.block_size, symmetric=self.symmetric,
                    saturate=self.saturate, scale_dtype=self.scale_dtype,
                    scale_rounding=self.scale_rounding, double_quant=self.double_quant)
