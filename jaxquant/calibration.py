"""Calibration observers for static activation quantization (pure functions).

Each observer is an `Observer` of three pure functions over an explicit state
pytree: ``init(sample)``, ``update(state, batch)`` and
``compute(state, dtype=...) -> (scale, zero_point)``; `calibrate` folds an
iterable of batches through one. See `jaxquant._calibration` for the details.

Example:
  >>> import jax.numpy as jnp, jaxquant as jq
  >>> obs = jq.calibration.minmax()
  >>> state = jq.calibration.calibrate(obs, [jnp.array([-1.0, 2.0]), jnp.array([4.0])])
  >>> scale, zero_point = obs.compute(state, dtype=jnp.int8)
  >>> float(scale * 127)
  4.0
"""

from jaxquant._calibration import (
    Observer,
    RangeState,
    calibrate,
    histogram,
    minmax,
    moving_average_minmax,
    mse,
    percentile,
)
from jaxquant._histogram import HistogramState

__all__ = [
    "HistogramState",
    "Observer",
    "RangeState",
    "calibrate",
    "histogram",
    "minmax",
    "moving_average_minmax",
    "mse",
    "percentile",
]
