"""Argument conversion that names the argument when it fails.

``jnp.asarray(None)`` and ``np.dtype("foo")`` raise errors that do not say which
argument was wrong ("None is not a valid value for jnp.array", "data type 'foo'
not understood"); the public functions convert their array and dtype arguments
through these helpers instead, so every such error names the argument, what it
expects and what it got.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

__all__ = ["as_array", "as_float_input", "as_dtype", "as_precision", "known_dtype",
           "check_float_scale"]


def as_array(value, argname: str) -> jax.Array:
    """``value`` as a JAX array (tracers and arrays unchanged).

    Raises:
      TypeError: ``value`` is not array-like (``None``, a string, an object...),
        naming ``argname``.
    """
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, np.ndarray | np.generic):  # before XLA sees (and rejects) a float6
        refuse_numpy_only(value.dtype, argname)
    try:
        if isinstance(value, str | bytes):  # jnp.asarray would read "a" as a dtype alias
            raise TypeError("a string is not an array")
        return jnp.asarray(value)
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:  # a Python int > int32;
        if hasattr(value, "__dlpack__"):  # torch: bfloat16 has no NumPy view, a Parameter
            try:  # refuses one ("use tensor.detach()"), strides DLPack cannot take
                return jnp.from_dlpack(value)
            except (TypeError, ValueError, RuntimeError, BufferError):
                pass
        raise TypeError(f"{argname} must be an array, got {type(value).__name__} "
                        f"{value!r:.80} ({e}).") from None


def known_dtype(dtype) -> np.dtype | None:
    """``dtype`` as a NumPy dtype: NumPy's and ml_dtypes' own, or another library's of the
    same name (``torch.bfloat16`` is ``bfloat16``); ``None`` when it names none of them."""
    if dtype is None:
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        try:
            return jnp.dtype(str(dtype).rsplit(".", 1)[-1])
        except TypeError:
            return None


def as_float_input(x: ArrayLike, argname: str = "x") -> jax.Array:
    """``x`` as a JAX array, or a TypeError if it is not floating point."""
    dt = known_dtype(getattr(x, "dtype", None))  # NumPy's float6 is refused before XLA sees it
    if dt is None or not isinstance(x, np.ndarray | jax.Array):
        x = as_array(x, argname)
        dt = x.dtype
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"{argname} must be a floating-point array, got dtype {dt}; " + (
                "integer arrays are codes already (wrap them in jaxquant.QTensor)."
                if jnp.issubdtype(dt, jnp.integer) else
                "quantize the real and imaginary parts as two float arrays."
                if jnp.issubdtype(dt, jnp.complexfloating) else "cast it to a float dtype."))
    refuse_numpy_only(dt, argname)
    if dt.name == "float8_e8m0fnu":  # its dequantized zeros would be NaN
        raise TypeError(f"{argname} must be a float array with zero and negative values, got "
                        f"dtype float8_e8m0fnu (a scale format): cast it to float32 first.")
    return as_array(x, argname)


def check_float_scale(dtype, argname: str = "scale") -> None:
    """A TypeError naming ``argname`` unless ``dtype`` is a float dtype XLA computes with."""
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{argname} must be a float array, got dtype {dtype}.")
    refuse_numpy_only(dtype, argname)


def refuse_numpy_only(dtype, argname: str) -> None:
    """A TypeError naming ``argname`` for float6, which XLA cannot compile (it aborts)."""
    if getattr(dtype, "name", None) in ("float6_e2m3fn", "float6_e3m2fn"):
        raise TypeError(f"{argname} must be an array XLA can hold, got dtype "
                        f"{np.dtype(dtype).name} (float6 exists in NumPy only): cast it to "
                        f"float32 first.")


def is_array_value(value) -> bool:
    """Whether ``value`` is an array or a scalar value (a tracer included), not a dtype."""
    return isinstance(value, (jax.Array, np.ndarray, np.generic))


def as_dtype(value, argname: str) -> np.dtype:
    """``value`` as a NumPy dtype.

    Raises:
      TypeError: ``value`` does not name a dtype (``None`` included: NumPy would
        read it as float64), naming ``argname``.
    """
    try:
        if value is None or isinstance(value, bool) or is_array_value(value):
            raise TypeError  # np.dtype would read an array's .dtype, as jnp no longer does
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{argname} must be a dtype, got {value!r}.") from None


def as_precision(value, argname: str = "precision"):
    """``value`` as ``lax.dot_general`` takes it, hashable (a list pair becomes a tuple).

    The int8 x int8 -> int32 dot is exact and ignores its ``precision``; checking it
    here means a typo fails on every path, not only on the float ones.

    Raises:
      ValueError: ``value`` is not ``None``, a ``lax.Precision`` or its name, a
        pair of them, or a ``lax.DotAlgorithmPreset``, naming ``argname``.
    """
    if isinstance(value, list):
        value = tuple(value)
    if value is None:
        return None
    one = jax.ShapeDtypeStruct((1,), jnp.float32)
    try:
        hash(value)
        jax.eval_shape(lambda a, b: lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                                    precision=value), one, one)
    except (TypeError, ValueError):
        raise ValueError(f"{argname} must be None, a jax.lax.Precision or its name "
                         f"('default', 'high', 'highest'), a pair of them, or a "
                         f"jax.lax.DotAlgorithmPreset, got {value!r}.") from None
    return value
