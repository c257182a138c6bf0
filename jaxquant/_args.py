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

__all__ = ["as_array", "as_dtype"]


def as_array(value, argname: str) -> jax.Array:
    """``value`` as a JAX array (tracers and arrays unchanged).

    Raises:
      TypeError: ``value`` is not array-like (``None``, a string, an object...),
        naming ``argname``.
    """
    if isinstance(value, jax.Array):
        return value
    try:
        if isinstance(value, str | bytes):  # jnp.asarray would read "a" as a dtype alias
            raise TypeError("a string is not an array")
        return jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{argname} must be an array, got {type(value).__name__} "
                        f"{value!r:.80} ({e}).") from None


def as_dtype(value, argname: str) -> np.dtype:
    """``value`` as a NumPy dtype.

    Raises:
      TypeError: ``value`` does not name a dtype (``None`` included: NumPy would
        read it as float64), naming ``argname``.
    """
    try:
        if value is None or isinstance(value, bool):
            raise TypeError
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"{argname} must be a dtype, got {value!r}.") from None
