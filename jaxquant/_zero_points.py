"""Zero points: the layout of their scale, the dtype of their codes, zeros for floats."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._args import as_array
from jaxquant._formats import FORMATS, Format

__all__ = ["as_zero_point", "check_zero_point", "zero_point_like_scale"]


def as_zero_point(value, fmt: Format) -> jax.Array:
    """``value`` as a zero point of the format ``fmt`` (a `Format`): a Python int becomes
    the code dtype, as ONNX's zero point has it.

    Raises:
      ValueError: a Python int outside the codes' range ``[fmt.qmin, fmt.qmax]``.
    """
    if isinstance(value, int) and not isinstance(value, bool):  # concrete, also under jit
        if not fmt.qmin <= value <= fmt.qmax:
            raise ValueError(f"zero_point must lie within the {fmt.name} codes [{fmt.qmin:g}, "
                             f"{fmt.qmax:g}], got {value!r}.")
        return jnp.asarray(value, fmt.dtype)
    return as_array(value, "zero_point")  # its dtype is checked against the format's


def zero_point_like_scale(zero_point, scale):
    """``zero_point`` in the shape of ``scale``, or a ValueError naming both shapes.

    One-element zero points and scales are both per-tensor whatever their rank
    (ONNX's own conformance cases pair a scalar scale with a ``[1]`` zero
    point), so they are reshaped to the scale's shape.
    """
    zshape, sshape = tuple(zero_point.shape), tuple(scale.shape)
    if zshape == sshape:
        return zero_point
    if math.prod(zshape) == 1 and math.prod(sshape) == 1:
        return zero_point.reshape(sshape)
    raise ValueError(f"zero_point must have the shape of scale, {sshape}; got {zshape}.")


def check_zero_point(zero_point, fmt: Format) -> None:
    """Checks a zero point's dtype against the format (and its values, for floats).

    Integer formats need a zero point of the code dtype itself (as ONNX, where
    the zero point's type is the output type). Float formats need zeros; the
    values are checked when they are concrete, and under ``jit`` through
    `jax.experimental.checkify` (enforced when the caller is checkified).

    Raises:
      TypeError: on a dtype mismatch.
      ValueError: on a concrete non-zero zero point of a float format.
    """
    if np.dtype(zero_point.dtype) != fmt.dtype:
        weak = ("a weakly typed float, such as a Python float"
                if jnp.issubdtype(zero_point.dtype, jnp.floating) else  # eager ints: codes
                "a weakly typed int, such as a Python int traced by jit")
        hint = (f" ({weak}: pass it as jnp.{fmt.name} codes)"
                if getattr(zero_point, "weak_type", False) else
                f"; pass dtype=jnp.{zero_point.dtype} to quantize to that format"
                if np.dtype(zero_point.dtype).name in FORMATS else "")
        raise TypeError(
            f"zero_point must have the code dtype {fmt.name}, got {zero_point.dtype}{hint}."
        )
    if fmt.is_integer:
        return
    if isinstance(zero_point, jax.core.Tracer):
        from jax.experimental import checkify

        checkify.debug_check(
            jnp.all(zero_point.astype(jnp.float32) == 0),
            f"zero_point must be all zeros for {fmt.name}.",
        )
    elif np.any(np.asarray(zero_point).astype(np.float32) != 0):
        raise ValueError(
            f"zero_point must be all zeros for the float format {fmt.name} (as ONNX requires), "
            f"got non-zero values."
        )
