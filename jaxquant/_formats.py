"""The table of quantized formats: one record per code dtype.

A format is named by its JAX dtype (``jnp.int8``, ``jnp.float8_e4m3fn``, ...),
or, for codebook formats, by name (``"nf4"``, ``"fp4"``, ``"float6_e2m3fn"``,
``"float6_e3m2fn"``): codes are unsigned indices (uint4, or uint8 holding 6
bits) into a table of values. This module is the single owner of what each
format can represent: its bit width, its kind of codes, its range and, for
codebooks, its table.

Sources of the tables: NF4 and FP4 are bitsandbytes' (``get_4bit_type`` in
``bitsandbytes/functional.py``, the NF4 values of the QLoRA paper,
arXiv:2305.14314, Appendix E; FP4 is bitsandbytes' E2M1 with bias 3 in its own
code order, normalized by 12). The float6 tables are the OCP Microscaling
(MX) v1.0 element formats E2M3 and E3M2, read from ml_dtypes by bit pattern;
XLA has no float6 arrays, so their codes are held as uint8 bit patterns.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import DTypeLike

from jaxquant._args import as_dtype, is_array_value

__all__ = ["Format", "FORMATS", "CODEBOOKS", "get_format", "value_dtype"]


@dataclasses.dataclass(frozen=True)
class Format:
    """What one quantized format can represent.

    Attributes:
      dtype: the JAX/NumPy dtype of the codes.
      bits: storage bits per code (4 for int4, 8 for float8_e4m3fn, ...).
      kind: ``"int"`` for integer codes, ``"float"`` for minifloat codes,
        ``"codebook"`` for indices into ``values``.
      qmin: smallest code value (floats: ``-max_finite``; codebooks: the
        smallest table value).
      qmax: largest code value (floats and codebooks: ``max_finite``).
      max_finite: largest finite magnitude that a code can hold.
      values: codebooks only: the value of each code index, as published
        (decoding rounds them to float32; midpoints are taken before that).
      sign_magnitude: codebooks only: the top code bit is the sign (FP4, float6).
      ties: codebooks only: a value exactly halfway between two codes goes
        ``"down"`` (bitsandbytes' ``x > threshold``; toward zero in magnitude
        for sign-magnitude tables) or to the ``"even"`` code (IEEE, float6).
      label: the format's name when it is not its dtype's (codebooks).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> jq.get_format(jnp.int4)
      Format(name='int4', bits=4, kind='int', qmin=-8, qmax=7, max_finite=7.0)
    """

    dtype: np.dtype = dataclasses.field(repr=False)
    bits: int
    kind: Literal["int", "float", "codebook"]
    qmin: float
    qmax: float
    max_finite: float
    values: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)
    sign_magnitude: bool = dataclasses.field(default=False, repr=False)
    ties: Literal["down", "even"] = dataclasses.field(default="even", repr=False)
    label: str | None = dataclasses.field(default=None, repr=False)

    @property
    def name(self) -> str:
        """The format's name, for example ``"int4"`` or ``"nf4"``."""
        return self.label or self.dtype.name

    @property
    def is_codebook(self) -> bool:
        """True for table formats (NF4, FP4, float6): codes are indices."""
        return self.kind == "codebook"

    @property
    def is_integer(self) -> bool:
        """True for integer codes."""
        return self.kind == "int"

    @property
    def signed(self) -> bool:
        """True when negative codes exist."""
        return self.qmin < 0

    @property
    def always_saturates(self) -> bool:
        """True when values beyond the range always clip to it, whatever ``saturate`` says.

        Integer and codebook codes, and float formats with neither inf nor NaN
        (float4_e2m1fn), whose cast saturates: ONNX ignores ``saturate`` for them.
        """
        if self.kind != "float":
            return True
        return bool(np.isfinite(np.float32(np.inf).astype(self.dtype).astype(np.float32)))

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


def _codebook(name: str, values, bits: int, sign_magnitude: bool, ties: str) -> Format:
    # Kept as published (float64): midpoints are taken before rounding to float32.
    values = tuple(float(v) for v in np.asarray(values, np.float64))
    m = max(abs(v) for v in values)
    return Format(np.dtype(jnp.uint4 if bits == 4 else jnp.uint8), bits, "codebook", -m, m, m,
                  values, sign_magnitude, ties, name)


_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
_FP4 = np.array([0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0,
                 -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]) / 12.0


def _float6(dt) -> np.ndarray:
    return np.arange(64, dtype=np.uint8).view(dt).astype(np.float32)


CODEBOOKS: dict[str, Format] = {
    f.name: f
    for f in (
        _codebook("nf4", _NF4, 4, False, "down"),
        _codebook("fp4", _FP4, 4, True, "down"),
        _codebook("float6_e2m3fn", _float6(ml_dtypes.float6_e2m3fn), 6, True, "even"),
        _codebook("float6_e3m2fn", _float6(ml_dtypes.float6_e3m2fn), 6, True, "even"),
    )
}
"""Codebook formats, by name: codes are indices into ``Format.values``.

Example:
  >>> import jaxquant as jq
  >>> sorted(jq.CODEBOOKS)
  ['float6_e2m3fn', 'float6_e3m2fn', 'fp4', 'nf4']
  >>> nf4 = jq.CODEBOOKS["nf4"]
  >>> nf4.bits, len(nf4.values), nf4.values[-1]
  (4, 16, 1.0)
"""

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        *(_int_format(d) for d in (jnp.int2, jnp.uint2, jnp.int4, jnp.uint4, jnp.int8,
                                   jnp.uint8, jnp.int16, jnp.uint16, jnp.int32)),
        *(_float_format(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn)),
    )
}
"""Every supported format, by dtype name.

Example:
  >>> import jaxquant as jq
  >>> sorted(jq.FORMATS)  # doctest: +NORMALIZE_WHITESPACE
  ['float4_e2m1fn', 'float8_e4m3fn', 'float8_e5m2', 'int16', 'int2', 'int32', 'int4',
   'int8', 'uint16', 'uint2', 'uint4', 'uint8']
  >>> jq.FORMATS["float8_e4m3fn"]
  Format(name='float8_e4m3fn', bits=8, kind='float', qmin=-448.0, qmax=448.0, max_finite=448.0)
"""


def get_format(dtype: DTypeLike, *, argname: str = "dtype", also: str = "") -> Format:
    """Returns the `Format` record of a code dtype.

    Args:
      dtype: a dtype from `FORMATS` (``jnp.int8``, ``"int4"``, ``jnp.float8_e5m2``...)
        or a codebook name from `CODEBOOKS` (``"nf4"``...).
      argname: the argument name to cite in error messages.
      also: more accepted names, appended to the list in the error message.

    Returns:
      The format's record.

    Raises:
      TypeError: if ``dtype`` is not a quantized format.

    Example:
      >>> import jaxquant as jq
      >>> jq.get_format("float8_e4m3fn").max_finite
      448.0
    """
    if isinstance(dtype, str) and dtype in CODEBOOKS:
        return CODEBOOKS[dtype]
    try:
        name = None if is_array_value(dtype) else np.dtype(dtype).name
    except TypeError:
        name = None
    if name in CODEBOOKS:  # NumPy's float6 dtypes (jnp.float6_e2m3fn) name their codebooks
        return CODEBOOKS[name]
    if name not in FORMATS:
        raise TypeError(
            f"{argname} must be one of the quantized formats {sorted(FORMATS)} or codebooks "
            f"{sorted(CODEBOOKS)}{also}, got {dtype!r}."
        )
    return FORMATS[name]


def value_dtype(dtype, argname: str = "dtype") -> np.dtype:
    """``dtype`` as a NumPy float dtype that values (not codes) can have in XLA.

    Args:
      dtype: a float dtype (or its name) of dequantized values.
      argname: the argument to name in errors.

    Returns:
      The ``np.dtype``.

    Raises:
      TypeError: ``None``, not a dtype, not floating, a float6 dtype (codes only:
        XLA has no float6 arrays), or float8_e8m0fnu (no zero, no sign).

    Example:
      >>> value_dtype("bfloat16").name
      'bfloat16'
    """
    try:
        got = as_dtype(dtype, argname)  # None refused: np.dtype(None) would be float64
    except TypeError:
        got = None
    if got is not None and got.name in ("float6_e2m3fn", "float6_e3m2fn"):  # before the
        # floating check, which counts float6 as floating on jax 0.10.2, not on 0.10.0
        raise TypeError(f"{argname} must be a float dtype XLA computes in, got {got.name} "
                        "(float6 is a code format only: dequantize to float32 or bfloat16).")
    if got is None or not jnp.issubdtype(got, jnp.floating):
        shown = repr(dtype) if got is None else got
        raise TypeError(f"{argname} must be a float dtype, got {shown}.")
    if got.name == "float8_e8m0fnu":  # 0 and every negative value would come back NaN
        raise TypeError(f"{argname} must be a float dtype with zero and negative values, got "
                        f"float8_e8m0fnu (positive powers of two only: a scale format).")
    return got
