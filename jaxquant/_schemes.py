"""Named composite formats: an element format, a block length and a scale dtype.

``jq.quantize(x, dtype="mxfp4")`` is ``jq.quantize(x, dtype=jnp.float4_e2m1fn,
axis=-1, block_size=32, scale_dtype=jnp.float8_e8m0fnu)``: the name only fills
in those arguments, and the `QTensor` it returns describes itself (element
codes, ``float8_e8m0fnu`` scales, ``block_size=32``).

==============  ================  =====  ================================  ==========
name            elements          block  scale                             bits/value
==============  ================  =====  ================================  ==========
``mxfp8_e4m3``  float8_e4m3fn     32     float8_e8m0fnu                    8.25
``mxfp8_e5m2``  float8_e5m2       32     float8_e8m0fnu                    8.25
``mxfp6_e2m3``  float6_e2m3fn     32     float8_e8m0fnu                    6.25
``mxfp6_e3m2``  float6_e3m2fn     32     float8_e8m0fnu                    6.25
``mxfp4``       float4_e2m1fn     32     float8_e8m0fnu                    4.25
``mxint8``      int8              32     float8_e8m0fnu                    8.25
``nvfp4``       float4_e2m1fn     16     float8_e4m3fn + float32/tensor    4.5
``nf4``         NF4 codebook      64     float32 (``double_quant``: fp8)   4.5 (4.13)
``fp4``         bnb FP4 codebook  64     float32                           4.5
==============  ================  =====  ================================  ==========

The MX rows follow the OCP Microscaling Formats (MX) v1.0 specification
(blocks of 32, an E8M0 shared scale); for MXINT8 the stored power of two is
the spec's shared scale times ``2**-6`` (the spec's implied element scale), so
that codes are plain int8. NVFP4 is NVIDIA's: E2M1 elements in blocks of 16, a
float8_e4m3fn scale per block and a float32 scale per tensor. MX and NVFP4
block lengths are part of the format and cannot be changed; NF4/FP4 blocks can,
and can be n-D tiles as for any format (``block_size=(4, 64)``, ``axis=None``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxquant._args import as_dtype
from jaxquant._formats import Format, get_format

__all__ = ["Scheme", "SCHEMES", "resolve", "format_name"]


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A named composite format.

    Attributes:
      element: the element format (a dtype or a codebook name).
      block_size: the block length along the quantized axis.
      scale_dtype: the stored scale dtype (``None``: float32).
      fixed_block: whether the block length is part of the format.

    Example:
      >>> import jaxquant as jq
      >>> jq.SCHEMES["mxfp4"]
      Scheme(element='float4_e2m1fn', block_size=32, scale_dtype='float8_e8m0fnu', fixed_block=True)
    """

    element: str
    block_size: int
    scale_dtype: str | None
    fixed_block: bool = True


SCHEMES: dict[str, Scheme] = {
    "mxfp8_e4m3": Scheme("float8_e4m3fn", 32, "float8_e8m0fnu"),
    "mxfp8_e5m2": Scheme("float8_e5m2", 32, "float8_e8m0fnu"),
    "mxfp6_e2m3": Scheme("float6_e2m3fn", 32, "float8_e8m0fnu"),
    "mxfp6_e3m2": Scheme("float6_e3m2fn", 32, "float8_e8m0fnu"),
    "mxfp4": Scheme("float4_e2m1fn", 32, "float8_e8m0fnu"),
    "mxint8": Scheme("int8", 32, "float8_e8m0fnu"),
    "nvfp4": Scheme("float4_e2m1fn", 16, "float8_e4m3fn"),
    "nf4": Scheme("nf4", 64, None, fixed_block=False),
    "fp4": Scheme("fp4", 64, None, fixed_block=False),
}
"""Every named composite format, by name (the ``dtype=`` of `jaxquant.quantize`).

Example:
  >>> import jaxquant as jq
  >>> sorted(jq.SCHEMES)  # doctest: +NORMALIZE_WHITESPACE
  ['fp4', 'mxfp4', 'mxfp6_e2m3', 'mxfp6_e3m2', 'mxfp8_e4m3', 'mxfp8_e5m2', 'mxint8', 'nf4',
   'nvfp4']
  >>> jq.SCHEMES["nvfp4"].block_size, jq.SCHEMES["nvfp4"].scale_dtype
  (16, 'float8_e4m3fn')
"""


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A format argument with a scheme's defaults filled in."""

    fmt: Format
    axis: int | None
    block_size: int | tuple[int, ...] | None
    scale_dtype: DTypeLike | None


def resolve(dtype, axis, block_size, scale_dtype, explicit: bool = False,
            double_quant: bool = False) -> Resolved:
    """The element format and granularity that ``dtype`` (a format or scheme name) selects.

    With ``explicit`` (a scale is given), codebooks (``"nf4"``, ``"fp4"``) take
    their granularity from the scale as every format does; MX and NVFP4 keep
    their block length.

    Raises:
      TypeError: unknown format, a ``scale_dtype`` that is not a dtype.
      ValueError: a block length, scale dtype or ``double_quant`` that contradicts a
        scheme.
    """
    name = dtype if isinstance(dtype, str) else None
    scheme = SCHEMES.get(name) if name else None
    if double_quant and name == "nvfp4":
        raise ValueError("nvfp4 has one float32 scale per tensor over its float8 block scales; "
                         "double_quant (one per 256 block scales) is another format: pass "
                         "dtype=jnp.float4_e2m1fn, axis=-1, block_size=16, "
                         "scale_dtype=jnp.float8_e4m3fn for it.")
    if scheme is None:
        return Resolved(get_format(dtype, also=f" or schemes {sorted(SCHEMES)}"), axis,
                        block_size, scale_dtype)
    if scheme.fixed_block and block_size not in (None, scheme.block_size):
        raise ValueError(f"{name} has blocks of {scheme.block_size} by definition; got "
                         f"block_size={block_size!r} (use the element dtype "
                         f"{scheme.element!r} with scale_dtype for other blocks).")
    if scheme.scale_dtype and scale_dtype is not None \
            and as_dtype(scale_dtype, "scale_dtype") != np.dtype(scheme.scale_dtype):
        raise ValueError(f"{name} stores its scales as {scheme.scale_dtype}; got "
                         f"scale_dtype={np.dtype(scale_dtype).name}.")
    if explicit and not scheme.fixed_block:
        return Resolved(get_format(scheme.element), axis, block_size, scale_dtype)
    fmt = get_format(scheme.element if scheme.element in ("nf4", "fp4") or
                     scheme.element.startswith("float6") else jnp.dtype(scheme.element))
    tiles = isinstance(block_size, tuple | list)  # codebooks: tiles over every axis, no axis
    return Resolved(fmt, axis if tiles or axis is not None else -1,
                    scheme.block_size if block_size is None else block_size,
                    scheme.scale_dtype if scale_dtype is None else scale_dtype)


def format_name(qt) -> str:
    """The name of a `QTensor`'s format: a scheme's (``"mxfp4"``) when it is one.

    Args:
      qt: a `QTensor`.

    Returns:
      The name of the scheme whose element format, block size and scale dtype ``qt``
      has (``"nf4"``, ``"mxfp8_e4m3"``, ``"nvfp4"``, ...), otherwise the name of its code
      format (``"int8"``, ``"float8_e4m3fn"``, ...).

    Raises:
      TypeError: ``qt`` is not a `QTensor`.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> jq.format_name(jq.quantize(jnp.ones((2, 32)), dtype="mxfp4"))
      'mxfp4'
      >>> jq.format_name(jq.quantize(jnp.ones((2, 32)), dtype="nf4", block_size=16))
      'nf4'
    """
    from jaxquant._qtensor import is_qtensor

    if not is_qtensor(qt):
        raise TypeError(f"qt must be a jaxquant.QTensor, got {type(qt).__name__}.")
    scale = qt.scale
    scale_dtype = (scale.qvalue if is_qtensor(scale) else scale).dtype
    second = is_qtensor(scale) and scale.layout.kind == "tensor"
    for name, s in SCHEMES.items():
        if s.scale_dtype is None or not s.fixed_block:
            continue
        if qt.format.name == s.element and qt.block_size == s.block_size \
                and np.dtype(scale_dtype).name == s.scale_dtype \
                and (second or not is_qtensor(scale)):
            return name
    return qt.format.name
