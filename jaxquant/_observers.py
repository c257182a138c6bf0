"""The `Observer` record and the machinery every calibration observer shares.

`jaxquant._calibration` builds its observers (min/max, moving average, histogram,
percentile, MSE) from `_observer`: a state maker, a jitted update kernel and a
range chooser become the three pure functions of an `Observer`, with argument
checks at trace time and ranges turned into scales by `_qparams`
(`jaxquant._scales.scale_from_range`, NaN- and empty-aware).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxquant._args import as_float_input
from jaxquant._formats import get_format
from jaxquant._granularity import _is_int, explicit_sharding, group_reduce, layout_from_args
from jaxquant._quantize import check_flags
from jaxquant._scales import scale_from_range

__all__ = ["Observer", "RangeState"]

_F32 = jnp.float32


class Observer(NamedTuple):
    """A calibration observer: three pure functions over an explicit state.

    Attributes:
      init: ``init(x_like) -> state``; ``x_like`` is an array or a
        ``jax.ShapeDtypeStruct`` shaped like the batches (per-axis observers
        only use ``x_like.shape[axis]``).
      update: ``update(state, x) -> state``, one batch folded in.
      compute: ``compute(state, *, dtype=jnp.int8, symmetric=True) ->
        (scale, zero_point)``: float32 scales of shape ``()`` (per-tensor) or
        ``(x.shape[axis],)`` (per-axis), and ``None`` or zero points of
        ``dtype``, ready for ``jaxquant.quantize(x, scale, zero_point,
        dtype=dtype, axis=axis)``.

    ``update`` and ``compute`` raise ``TypeError`` for a state that is not
    the observer's own (a `RangeState` or a `HistogramState`) or has fields of
    another kind (integer counts of a histogram), and ``ValueError`` for one of
    other shapes (a histogram of other ``bins``).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> obs = jq.calibration.minmax()
      >>> state = obs.update(obs.init(jnp.zeros(3)), jnp.array([-1.0, 0.5, 2.54]))
      >>> obs.compute(state)  # absmax / 127, no zero point
      (Array(0.02, dtype=float32), None)
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, ArrayLike], Any]
    compute: Callable[..., tuple[jax.Array, jax.Array | None]]


class RangeState(NamedTuple):
    """State of `minmax` and `moving_average_minmax` (a pytree).

    Attributes:
      min: float32 running minimum, ``()`` or ``(channels,)``; ``+inf`` at first.
      max: float32 running maximum, same shape; ``-inf`` at first.
      count: int32 number of batches seen.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> obs = jq.calibration.minmax(axis=0)
      >>> obs.update(obs.init(jnp.zeros((2, 3))), jnp.array([[-1.0, 2.0, 0.5], [3.0, -4.0, 1.0]]))
      RangeState(min=Array([-1., -4.], dtype=float32), max=Array([2., 3.], dtype=float32),
                 count=Array(1, dtype=int32))
    """

    min: jax.Array
    max: jax.Array
    count: jax.Array


@functools.partial(jax.jit, static_argnames=("fmt", "symmetric"))
def _qparams(lo, hi, fmt, symmetric):
    empty = (lo == jnp.inf) & (hi == -jnp.inf)
    scale, zero_point = scale_from_range(jnp.where(empty, _F32(0), lo),
                                         jnp.where(empty, _F32(0), hi),
                                         fmt, symmetric)
    if zero_point is not None and not symmetric:  # no data: torch's scale 1, zero point 0
        zero_point = jnp.where(empty, jnp.zeros((), zero_point.dtype), zero_point)
    return jnp.where(jnp.isnan(lo) | jnp.isnan(hi), _F32(jnp.nan), scale), zero_point


def _sharded_as(a, like=None):
    """``a`` sharded as ``like`` is on explicit mesh axes, else replicated (``like=None``
    too): a state keeps its sharding (the user's, else none) through ``update``; JAX's
    selects and reshapes reject operands sharded unlike."""
    want = None if like is None else explicit_sharding(like)
    if want is None and explicit_sharding(a) is not None:
        want = explicit_sharding(a).update(spec=jax.sharding.PartitionSpec())
    return a if want is None else jax.sharding.reshard(a, want)


def _batch_range(x, layout, state):
    x = x.astype(_F32)  # each device reduces its shard; the (small) ranges are gathered
    return (_sharded_as(group_reduce(x, layout, jnp.min), state.min),
            _sharded_as(group_reduce(x, layout, jnp.max), state.max))


def _check_state(state: Any, state_type: type) -> None:
    if not isinstance(state, state_type):
        raise TypeError(f"state must be a {state_type.__name__} (from this observer's init), "
                        f"got {type(state).__name__}.")


def _observer(axis: int | None, make_state, update_kernel, clip_range,
              state_type: type) -> Observer:
    """An `Observer` from a state maker, a jitted update, a range chooser and the state type."""
    if axis is not None and not _is_int(axis):  # its range is checked against the batches
        raise TypeError(f"axis must be an int or None, got {axis!r}.")
    @functools.lru_cache(maxsize=8)
    def shapes(groups):  # the shapes and dtypes of make_state(groups)'s fields
        return tuple((a.shape, a.dtype)
                     for a in jax.eval_shape(functools.partial(make_state, groups)))

    def check_fields(state):  # e.g. a histogram of other bins, as PyTorch refuses
        groups = jnp.shape(state.min)
        for name, field, (want, dtype) in zip(state._fields, state, shapes(groups),
                                              strict=True):
            if jnp.shape(field) != want:
                raise ValueError(f"state.{name} must have shape {want} for this observer with "
                                 f"ranges of shape {groups}, got {jnp.shape(field)}; init the "
                                 f"state with this observer.")
            floating = jnp.issubdtype(dtype, jnp.floating)
            if not jnp.issubdtype(jnp.result_type(field), jnp.floating if floating
                                  else jnp.integer):
                raise TypeError(f"state.{name} must be {'a float' if floating else 'an integer'}"
                                f" array ({dtype.name} from this observer's init), got dtype "
                                f"{jnp.result_type(field)}.")

    def init(x_like):
        _refuse_pairs(x_like)
        shape = getattr(x_like, "shape", None)
        shape = tuple(np.shape(x_like) if shape is None else shape)
        return make_state(layout_from_args(shape, axis, None).scale_shape(shape))

    def update(state, x):
        _check_state(state, state_type)
        x = _as_batch(x)
        layout = layout_from_args(x.shape, axis, None)
        got, expected = layout.scale_shape(x.shape), jnp.shape(state.min)
        if got != expected:
            raise ValueError(
                f"x of shape {x.shape} needs ranges of shape {got} for axis={axis}, but the "
                f"state holds ranges of shape {expected}; init it with a batch-shaped array.")
        check_fields(state)
        return state if x.size == 0 else update_kernel(state, x, layout)

    def compute(state, *, dtype=jnp.int8, symmetric=True):
        _check_state(state, state_type)
        check_fields(state)
        check_flags(symmetric=symmetric)
        fmt = get_format(dtype)
        if not symmetric and not fmt.is_integer:
            raise ValueError(f"symmetric=False needs an integer format; {fmt.name} has no "
                             f"zero point.")
        lo, hi = clip_range(jax.tree.map(_sharded_as, state), fmt, bool(symmetric))
        return _qparams(lo, hi, fmt, bool(symmetric))  # a Format: codebooks keep their table

    return Observer(init, update, compute)


def _as_batch(x: Any) -> jax.Array:
    """A batch as a float array; a data loader's ``torch.Tensor`` (bfloat16 or requiring
    grad too) through NumPy or DLPack. A tuple or list of arrays (a data loader's
    ``(inputs, labels)``) is a TypeError: stacked, it would observe the labels."""
    _refuse_pairs(x)
    if not isinstance(x, jax.Array | np.ndarray) and hasattr(x, "__array__"):
        x = x.detach() if hasattr(x, "detach") else x  # a torch.Tensor: observed only
        try:
            x = np.asarray(x)
        except (TypeError, RuntimeError):  # a dtype NumPy lacks (torch.bfloat16)
            # DLPack takes compact strides only (a bfloat16 column slice is not)
            x = np.asarray(jnp.from_dlpack(x.contiguous() if hasattr(x, "contiguous") else x))
    return as_float_input(x)


def _refuse_pairs(x: Any) -> None:
    """A TypeError for a tuple or list of arrays: a data loader's ``(inputs, labels)``."""
    if isinstance(x, tuple | list) and any(len(getattr(v, "shape", ())) for v in x):
        raise TypeError(f"x must be one array, got a {type(x).__name__} of {len(x)} arrays "
                        f"(a data loader's (inputs, labels)? pass the inputs, e.g. "
                        f"(b[0] for b in loader); samples of one batch: stack them).")


def _range_state(groups):
    return RangeState(jnp.full(groups, jnp.inf, _F32), jnp.full(groups, -jnp.inf, _F32),
                      jnp.zeros((), jnp.int32))


def _state_range(state, fmt, symmetric):
    return state.min, state.max


def _check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive int, got {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}.")
    return int(value)


def _check_real(value: Any, name: str) -> float:
    """``value`` as a float: a real number or a 0-d real array, never a bool or a string."""
    real_array = (isinstance(value, jax.Array | np.ndarray) and np.shape(value) == ()
                  and (jnp.issubdtype(value.dtype, jnp.integer)
                       or jnp.issubdtype(value.dtype, jnp.floating)))
    if isinstance(value, bool | np.bool_) or not (isinstance(value, numbers.Real) or real_array):
        raise TypeError(f"{name} must be a real number, got {value!r}.")
    return float(value)
