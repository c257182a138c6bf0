"""Calibration observers for static (activation) quantization.

An `Observer` is three pure functions over an explicit pytree state, as an
optax ``GradientTransformation``: ``init`` builds the state for arrays like a
sample, ``update`` folds one batch into it, ``compute`` turns it into a scale
and zero point. Nothing is kept between calls; every function works under
``jax.jit`` (the state's shapes never change), and the state can be carried
through ``lax.scan``, saved, or averaged across devices like any pytree.

Every observer is per-tensor (``axis=None``) or per-axis (``axis``: the axis
whose entries get their own range, negative allowed), as the computed mode of
`jaxquant.quantize`, and ``compute`` returns scales in the layout ``quantize``
takes back. Ranges become scales through `jaxquant._scales.scale_from_range`,
so `minmax` gives exactly ``quantize``'s computed scale for the data seen.
`minmax`, `moving_average_minmax` and `histogram` follow PyTorch's
``MinMaxObserver``, ``MovingAverageMinMaxObserver`` and ``HistogramObserver``
(and the per-channel ones), with the same float32 ranges; `percentile` and
`mse` read clipping ranges off the running histogram of `histogram`.

The intended differences from PyTorch are listed in `jaxquant.calibration`.

Example:
  >>> import jax.numpy as jnp, jaxquant as jq
  >>> obs = jq.calibration.minmax(axis=-1)  # one range per channel of the last axis
  >>> batches = [jnp.array([[0.5, -2.0], [1.0, 4.0]]), jnp.array([[-1.0, 3.0]])]
  >>> state = jq.calibration.calibrate(obs, batches)
  >>> scale, zp = obs.compute(state, dtype=jnp.int8)
  >>> scale * 127
  Array([1., 4.], dtype=float32)
  >>> jq.quantize(jnp.array([[0.5, 2.0]]), scale, zp, axis=-1).qvalue
  Array([[64, 64]], dtype=int8)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxquant import _histogram
from jaxquant._histogram import HistogramState, no_fma
from jaxquant._observers import (
    Observer,
    RangeState,
    _batch_range,
    _check_count,
    _check_real,
    _observer,
    _range_state,
    _sharded_as,
    _state_range,
)
from jaxquant._progress import progress_bar

__all__ = ["Observer", "RangeState", "HistogramState", "minmax", "moving_average_minmax",
           "histogram", "percentile", "mse", "calibrate"]

_F32 = jnp.float32


@functools.partial(jax.jit, static_argnames=("layout",))
def _minmax_update(state, x, layout):
    lo, hi = _batch_range(x, layout, state)
    return RangeState(jnp.minimum(state.min, lo), jnp.maximum(state.max, hi), state.count + 1)


@functools.partial(jax.jit, static_argnames=("layout", "constant"))
def _moving_average_update(state, x, layout, constant):
    lo, hi = _batch_range(x, layout, state)
    c, first = _F32(constant), state.count == 0
    # PyTorch: min + c * (batch_min - min), the product rounded before the sum.
    new_lo = jnp.where(first, lo, state.min + no_fma(c * (lo - state.min)))
    new_hi = jnp.where(first, hi, state.max + no_fma(c * (hi - state.max)))
    return RangeState(new_lo, new_hi, state.count + 1)


@functools.partial(jax.jit, static_argnames=("layout",))
def _histogram_update(state, x, layout):
    x = _sharded_as(x.astype(_F32))  # one histogram of the whole (gathered) batch
    rows = x.reshape(1, -1) if layout.axis is None else jnp.moveaxis(x, layout.axis, 0)
    rows_state = _histogram.as_rows(jax.tree.map(_sharded_as, state))
    new = _histogram.update(rows_state, rows.reshape(rows.shape[0], -1))
    return jax.tree.map(lambda a, b: _sharded_as(a.reshape(b.shape), b), new, state)


def minmax(*, axis: int | None = None) -> Observer:
    """Running minimum and maximum, as PyTorch's ``MinMaxObserver``.

    The state is a `RangeState`; ``compute`` gives the scale of
    ``jaxquant.quantize(x, dtype=..., axis=axis, symmetric=...)`` for the
    concatenation of all batches seen. Infinities are kept (as PyTorch does).

    Args:
      axis: ``None`` (per-tensor) or the axis whose entries get their own
        range (``PerChannelMinMaxObserver(ch_axis=axis)``); may be negative.

    Returns:
      An `Observer`.

    Raises:
      ValueError: (from ``init``/``update``) ``axis`` out of range, or a batch
        whose length along ``axis`` differs from the state's.
      TypeError: (from ``update``) a non-float batch, or a tuple or list of
        arrays; (from ``update`` and ``compute``) a state that is not a
        `RangeState`, or one with integer ranges or a float count.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> obs = jq.calibration.minmax()
      >>> state = obs.init(jnp.zeros(3))
      >>> state = obs.update(state, jnp.array([-1.0, 0.5, 2.0]))
      >>> state = obs.update(state, jnp.array([0.0, 3.0, -0.5]))
      >>> float(state.min), float(state.max), int(state.count)
      (-1.0, 3.0, 2)
      >>> scale, zp = obs.compute(state, dtype=jnp.uint8, symmetric=False)
      >>> float(scale), int(zp)
      (0.01568627543747425, 64)
    """
    return _observer(axis, _range_state, _minmax_update, _state_range, RangeState)


def moving_average_minmax(averaging_constant: float = 0.01, *,
                          axis: int | None = None) -> Observer:
    """Exponential moving average of each batch's min and max.

    PyTorch's ``MovingAverageMinMaxObserver`` (per-axis:
    ``MovingAveragePerChannelMinMaxObserver``): the first batch sets the
    range, each later one moves it by ``min += c * (batch_min - min)`` (and
    likewise the max), in float32 with the product rounded first, as PyTorch.

    Args:
      averaging_constant: ``c`` in ``(0, 1]``.
      axis: ``None`` (per-tensor) or the per-axis axis, may be negative.

    Returns:
      An `Observer` whose state is a `RangeState`.

    Raises:
      TypeError: ``averaging_constant`` not a real number; from ``update`` as
        `minmax`.
      ValueError: ``averaging_constant`` outside ``(0, 1]``; from
        ``init``/``update`` as `minmax`.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> obs = jq.calibration.moving_average_minmax(0.5)
      >>> state = jq.calibration.calibrate(obs, [jnp.array([-1.0, 1.0]), jnp.array([-3.0, 5.0])])
      >>> float(state.min), float(state.max)
      (-2.0, 3.0)
    """
    c = _check_real(averaging_constant, "averaging_constant")
    if not 0.0 < c <= 1.0:
        raise ValueError(f"averaging_constant must be in (0, 1], got {averaging_constant!r}.")
    update = functools.partial(_moving_average_update, constant=c)
    return _observer(axis, _range_state, update, _state_range, RangeState)


def _histogram_observer(clip_range, bins: int, axis: int | None) -> Observer:
    bins = _check_count(bins, "bins")

    def make_state(groups):
        return HistogramState(jnp.zeros((*groups, bins), _F32),
                              jnp.full(groups, jnp.inf, _F32), jnp.full(groups, -jnp.inf, _F32))

    def rows_range(state, fmt, symmetric):  # clip_range runs on (G, bins) rows
        lo, hi = clip_range(_histogram.as_rows(state), fmt, symmetric)
        return lo.reshape(state.min.shape), hi.reshape(state.max.shape)

    return _observer(axis, make_state, _histogram_update, rows_range, HistogramState)


def histogram(bins: int = 2048, *, axis: int | None = None) -> Observer:
    """PyTorch's ``HistogramObserver``: a growing histogram and an L2 range search.

    ``update`` histograms each batch (``torch.histc``) over the running
    ``[min, max]``; when a batch widens the range, the old counts are moved
    into the new bins (each bin cut into 16 sub-bins, each sub-bin going to
    the new bin that holds its midpoint). ``compute`` runs
    ``_non_linear_param_search``: starting from the full range it greedily
    drops the tail with less mass (quantile steps of 1e-5) while the
    estimated L2 quantization error with ``2 ** bits`` levels of ``dtype``
    decreases, then maps the chosen ``[min, max]`` to a scale. Infinities are
    skipped; the search and histogram equal PyTorch's (the tests compare them
    with ``torch.ao.quantization.HistogramObserver``) except where PyTorch's
    float32 error underflows or overflows (data below about 1e-13 or above
    1e12; it then keeps a sliver of the range, and its histogram of data beyond
    about 1e35 overflows), or
    where the total count passes ``2**24`` (PyTorch's total is a float32
    ``torch.sum``: 19,999,988 for 20,000,000 values; here the count is exact),
    and per-axis observers run one search per entry. A batch is counted in
    int32, so a bin keeps every value past ``2**24`` (as ``torch.histc``).

    Args:
      bins: histogram bins (PyTorch's default 2048).
      axis: ``None`` (per-tensor, as PyTorch) or the per-axis axis.

    Returns:
      An `Observer` whose state is a `HistogramState`. ``compute`` needs an
      integer ``dtype`` (the search assumes evenly spaced levels).

    Raises:
      TypeError: ``bins`` not an int; a state that is not a `HistogramState`
        or has integer counts; from ``update`` as `minmax`.
      ValueError: ``bins <= 0``; from ``compute``, a float format; from
        ``init``/``update`` as `minmax`; from ``update``/``compute``, a state
        of other ``bins`` (as PyTorch).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> obs = jq.calibration.histogram(bins=8)
      >>> state = jq.calibration.calibrate(obs, [jnp.array([0.0, 1.0, 1.0, 2.0]), jnp.array([4.0])])
      >>> state.hist  # [0, 2] in 8 bins, then moved into 8 bins over [0, 4]
      Array([1., 0., 2., 1., 0., 0., 0., 1.], dtype=float32)
      >>> scale, zp = obs.compute(state, dtype=jnp.uint8, symmetric=False)
      >>> float(scale * 255), int(zp)  # the search drops the top bin, as PyTorch's does
      (3.5, 0)
    """
    def search(state, fmt, symmetric):
        if not fmt.is_integer:
            raise ValueError(f"the histogram search models evenly spaced integer levels: dtype "
                             f"must be an integer format, got {fmt.name} (minmax, percentile "
                             f"and mse take it).")
        if fmt.bits > 16:
            raise ValueError(f"the histogram search spreads 2**bits levels over the histogram; "
                             f"dtype must have at most 16 bits, got {fmt.name}.")
        return _histogram.search_range(state, dst_bins=2 ** fmt.bits)

    return _histogram_observer(search, bins, axis)


def percentile(q: float = 99.99, *, bins: int = 2048, axis: int | None = None) -> Observer:
    """Clip to the ``100 - q`` and ``q`` percentiles of the data seen.

    The data are summarized by the running histogram of `histogram` (exact
    min/max, ``bins`` bins). ``compute`` reads both percentiles off it with
    numpy's default (linear) definition: position ``(n - 1) * q / 100`` among
    the ``n`` sorted finite values, interpolated between neighbours, each
    value placed inside its bin (the ``c`` values of a bin spread evenly, the
    extremes at the exact min and max). The result is within about one bin
    width, ``(max - min) / bins``, of ``numpy.percentile`` of all batches (two
    once a batch has widened the range and the counts were re-binned).
    Symmetric scales use ``max(|p_low|, |p_high|)``.

    Args:
      q: the upper percentile, in ``[50, 100]``; ``100`` is `minmax`.
      bins: histogram bins.
      axis: ``None`` (per-tensor) or the per-axis axis.

    Returns:
      An `Observer` whose state is a `HistogramState`.

    Raises:
      TypeError: ``q`` not a real number or ``bins`` not an int.
      ValueError: ``q`` outside ``[50, 100]`` or ``bins <= 0``.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> obs = jq.calibration.percentile(90.0, bins=100)
      >>> state = jq.calibration.calibrate(obs, [jnp.arange(101.0)])
      >>> scale, zp = obs.compute(state, dtype=jnp.uint8, symmetric=False)
      >>> float(scale * 255), int(zp)  # p90 = 90 to within a bin (p10 = 10.5 clamps to 0)
      (90.5, 0)
    """
    q = _check_real(q, "q")
    if not 50.0 <= q <= 100.0:
        raise ValueError(f"q must be in [50, 100] (the upper percentile), got {q!r}.")

    def read(state, fmt, symmetric):
        return _histogram.percentile_range(state, _F32(q))

    return _histogram_observer(read, bins, axis)


def mse(num_candidates: int = 100, *, bins: int = 2048, axis: int | None = None) -> Observer:
    """The clip ratio minimizing the quantize-dequantize squared error.

    The data are summarized by the running histogram of `histogram`.
    ``compute`` tries the ranges ``[r * min, r * max]`` for the ratios
    ``r = k / num_candidates``, ``k = 1 .. num_candidates`` (symmetric
    formats: ``r * absmax``), quantizes each bin center with
    `jaxquant.fake_quant` at the scale that range gives for ``dtype``, and
    keeps the ratio with the least ``sum(count * (fq(center) - center)**2)``
    (the smallest ratio on a tie). ``r = 1`` is `minmax`, so the estimate is
    never worse than it; the error of a value is estimated at its bin center
    (on the range scaled by a power of two: the same choice at any magnitude).

    Args:
      num_candidates: the number of clip ratios tried.
      bins: histogram bins.
      axis: ``None`` (per-tensor) or the per-axis axis.

    Returns:
      An `Observer` whose state is a `HistogramState`.

    Raises:
      TypeError: ``num_candidates`` or ``bins`` not an int.
      ValueError: ``num_candidates`` or ``bins`` not positive.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> x = jnp.concatenate([jnp.linspace(-1.0, 1.0, 10001), jnp.array([20.0])])
      >>> obs = jq.calibration.mse(num_candidates=100)
      >>> scale, _ = obs.compute(jq.calibration.calibrate(obs, [x]), dtype=jnp.int4)
      >>> round(float(scale * 7), 3)  # clipped at 0.05 * 20: the outlier costs less
      1.0
    """
    num_candidates = _check_count(num_candidates, "num_candidates")

    def search(state, fmt, symmetric):
        return _histogram.mse_range(state, fmt, symmetric, num_candidates)

    return _histogram_observer(search, bins, axis)


def calibrate(observer: Observer, batches: Iterable[ArrayLike], *, state: Any = None,
              progress: bool = False) -> Any:
    """Folds ``observer.update`` over ``batches`` and returns the final state.

    Args:
      observer: an `Observer`.
      batches: an iterable (a list, a generator, a data loader) of JAX or NumPy
        arrays, or of what ``numpy.asarray`` takes (``torch.Tensor`` batches, bfloat16
        ones included); arrays sharded on a mesh are observed whole.
      state: a state to continue from; default ``observer.init(first_batch)``.
      progress: show a ``tqdm`` progress bar when tqdm is installed (it is
        optional; without it nothing is shown).

    Returns:
      The state after the last batch; pass it to ``observer.compute``.

    Raises:
      TypeError: ``observer`` is not an `Observer` (an observer factory not called,
        ``minmax`` for ``minmax()``); ``batches`` is not iterable or is a single
        array (wrap it in a list: ``[x]``); from ``observer.update``, a batch that
        is a tuple or list of arrays (a data loader's ``(inputs, labels)``).
      ValueError: no batches and no ``state``.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> obs = jq.calibration.minmax()
      >>> state = jq.calibration.calibrate(obs, (jnp.full(4, float(i)) for i in range(3)))
      >>> float(state.max), int(state.count)
      (2.0, 3)
    """
    if not (callable(getattr(observer, "init", None))
            and callable(getattr(observer, "update", None))):
        hint = " (call it: minmax())" if callable(observer) else ""
        raise TypeError(f"observer must be an Observer, as minmax() returns, got "
                        f"{observer!r}{hint}.")
    if not isinstance(batches, Iterable):
        raise TypeError(f"batches must be an iterable of arrays, got "
                        f"{type(batches).__name__}.")
    if hasattr(batches, "__array__"):  # a NumPy or JAX array, not a list of them
        raise TypeError(f"batches must be an iterable of arrays, got a single array of shape "
                        f"{jnp.shape(batches)} (iterating it would observe its rows one by "
                        f"one); pass [x] for one batch.")
    batches = progress_bar(batches, enabled=progress, desc="calibrating", unit="batch")
    for x in batches:
        if state is None:
            state = observer.init(x)
        state = observer.update(state, x)
    if state is None:
        raise ValueError("calibrate got no batches and no initial state.")
    return state
