"""The table of quantized formats: one record per code dtype.

A format is named by its JAX dtype (``jnp.int8``, ``jnp.float8_e4m3fn``, ...).
This module is the single owner of what each format can represent: its bit
width, whether its codes are integers or floats, and its range.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import DTypeLike

__all__ = ["Format", "FORMATS", "get_format"]


@dataclasses.dataclass(frozen=True)
class Format:
    """What one quantized format can represent.

    Attributes:
      dtype: the JAX/NumPy dtype of the codes.
      bits: storage bits per code (4 for int4, 8 for float8_e4m3fn, ...).
      kind: ``"int"`` for integer codes, ``"float"`` for minifloat codes.
      qmin: smallest code value (for floats, ``-max_finite``).
      qmax: largest code value (for floats, ``max_finite``).
      max_finite: largest finite magnitude that a code can hold.

    Example:
      >>> get_format(jnp.int4)
      Format(name='int4', bits=4, kind='int', qmin=-8, qmax=7, max_finite=7.0)
    """

    dtype: np.dtype = dataclasses.field(repr=False)
    bits: int
    kind: Literal["int", "float"]
    qmin: float
    qmax: float
    max_finite: float

    @property
    def name(self) -> str:
        """The dtype's name, for example ``"int4"``."""
        return self.dtype.name

    @property
    def is_integer(self) -> bool:
        """True for integer codes."""
        return self.kind == "int"

    @property
    def signed(self) -> bool:
        """True when negative codes exist."""
        return self.qmin < 0

    def __repr__(self) -> str:  # name first: the dtype object prints badly
        q = (int(self.qmin), int(self.qmax)) if self.is_integer else (self.qmin, self.qmax)
        return (
            f"Format(name={self.name!r}, bits={self.bits}, kind={self.kind!r}, "
            f"qmin={q[0]}, qmax={q[1]}, max_finite={self.max_finite})"
        )


def _int_format(dt) -> Format:
    dt = np.dtype(dt)
    info = ml_dtypes.iinfo(dt) if dt.itemsize == 1 and dt.name[-1] in "24" else np.iinfo(dt)
    bits = int(dt.name.lstrip("uint"))
    return Format(dt, bits, "int", int(info.min), int(info.max), float(info.max))


def _float_format(dt) -> Format:
    dt = np.dtype(dt)
    info = ml_dtypes.finfo(dt)
    m = float(info.max)
    return Format(dt, int(info.bits), "float", -m, m, m)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        *(_int_format(d) for d in (jnp.int2, jnp.uint2, jnp.int4, jnp.uint4, jnp.int8,
                                   jnp.uint8, jnp.int16, jnp.uint16, jnp.int32)),
        *(_float_format(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn)),
    )
}
"""Every supported format, by dtype name."""


def get_format(dtype: DTypeLike, *, argname: str = "dtype") -> Format:
    """Returns the `Format` record of a code dtype.

    Args:
      dtype: a dtype from `FORMATS` (``jnp.int8``, ``"int4"``, ``jnp.float8_e5m2``...).
      argname: the argument name to cite in error messages.

    Returns:
      The format's record.

    Raises:
      TypeError: if ``dtype`` is not a quantized format.

    Example:
      >>> get_format("float8_e4m3fn").max_finite
      448.0
    """
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in FORMATS:
        raise TypeError(
            f"{argname} must be one of the quantized formats {sorted(FORMATS)}, got {dtype!r}."
        )
    return FORMATS[name]
