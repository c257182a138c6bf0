"""Calibration observers for static activation quantization (pure functions).

Each observer is an `Observer` of three pure functions over an explicit state
pytree: ``init(sample)``, ``update(state, batch)`` and
``compute(state, dtype=...) -> (scale, zero_point)``; `calibrate` folds an
iterable of batches through one. Every function works under ``jax.jit`` and the
state is a pytree (carried through ``lax.scan``, saved, averaged across devices).

`minmax`, `moving_average_minmax` and `histogram` follow PyTorch's
``MinMaxObserver``, ``MovingAverageMinMaxObserver`` and ``HistogramObserver`` (and
the per-channel ones) with the same float32 ranges, and `minmax` gives exactly
`jaxquant.quantize`'s computed scale for the data seen. Intended differences from
PyTorch's ``calculate_qparams``: symmetric scales map the absmax to ``qmax``
(``absmax / 127`` for int8, as ``quantize``), not to ``(qmax - qmin) / 2``
(``absmax / 127.5``); scales are clamped at the smallest normal float32, not at
float32 ``eps``; an observer that saw nothing gives scale 1, and a NaN seen gives a
NaN scale. There is no ``reduce_range`` or ``quant_min`` / ``quant_max``: the code
range is the ``dtype`` given to ``compute`` (``jnp.int4`` or ``jnp.uint4``...).

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
