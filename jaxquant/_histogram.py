"""Running histograms per group, and the ranges chosen from them.

This module is the numerical core of the histogram-based observers in
`jaxquant._calibration`. It replicates PyTorch's
``torch.ao.quantization.HistogramObserver``, vectorized over groups (one
histogram per entry of the observed axis, or one for the whole tensor):

* `update`: ``torch.histc`` of each batch over the running range; when the
  range grows, the old histogram is cut into 16 sub-bins per bin and each
  sub-bin lands in the new bin that holds its midpoint
  (``_combine_histograms`` / ``_upscale_histogram``).
* `search_range`: ``_non_linear_param_search``, the greedy L2-error search
  for a clipped ``[min, max]`` (from caffe2's ``NormMinimization``).
* `percentile_range`: percentiles read off the same histogram.
* `mse_range`: the clip ratio with the least squared error on the bin centers.

PyTorch mixes float32 tensors, float64 scalars and sums, and FMA kernels
(``torch.linspace``); the scalars that decide a bin are computed here from
float32 pieces that multiply exactly (x64 off, `jaxquant._exact_f32`), and
`no_fma` keeps XLA from fusing a product PyTorch rounds first. Ranges are
scaled into ``[1, 2)`` by exact powers of two, so no piece or bin width is
subnormal (XLA:CPU flushes those), ``(x - min) * bins`` does not overflow
(PyTorch's does beyond about 1e35), and the search's error, a cube of bin
widths, neither underflows (data below about 1e-13) nor overflows (above
1e12), where PyTorch compares zeros or infinities; `mse_range`'s squared
errors likewise. Elsewhere histograms and ranges equal PyTorch's bit for bit
in randomized comparisons (hundreds of cases, 16 to 2048 bins), up to ties
broken by float32 sums taken in another order. Steps that move neither end
(up to 1e5) take one bisection.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxquant._exact_f32 import cumsum, exact_sum, fma_int, no_fma, pieces8, power_of_two, split
from jaxquant._fake_quant import fake_quant
from jaxquant._formats import Format
from jaxquant._rounding import divide
from jaxquant._scales import scale_from_range

__all__ = ["HistogramState", "as_rows", "no_fma", "update", "search_range", "percentile_range",
           "mse_range"]

_F32 = jnp.float32
_UPSAMPLE = 16  # HistogramObserver.upsample_rate
_STEPS = 100000  # 1 / HistogramObserver's search step (1e-5)


class HistogramState(NamedTuple):
    """A running histogram per group (a pytree of float32 arrays).

    Attributes:
      hist: counts, ``(bins,)`` per-tensor or ``(channels, bins)`` per-axis;
        equal-width bins over ``[min, max]``.
      min: the smallest finite value seen per group (``+inf`` before any).
      max: the largest finite value seen per group (``-inf`` before any).
    """

    hist: jax.Array
    min: jax.Array
    max: jax.Array


def _linspace(start: jax.Array, end: jax.Array, steps: int) -> jax.Array:
    """``torch.linspace`` per group, ``(G,) -> (G, steps)``, rounded as its FMA kernel."""
    start, end = start[:, None], end[:, None]
    step = divide(end - start, _F32(steps - 1))
    idx = jnp.arange(steps, dtype=_F32)[None]
    low = fma_int(step, idx, start)
    high = fma_int(-step, _F32(steps - 1) - idx, end)
    return jnp.where(idx < steps // 2, low, high)


def _bin_index(x: jax.Array, lo: jax.Array, hi: jax.Array, bins: int,
               point: jax.Array | int) -> jax.Array:
    """The ``torch.histc`` bin of ``x`` over ``[lo, hi]`` (``point`` if ``lo == hi``)."""
    pos = jnp.clip(jnp.floor(divide((x - lo) * _F32(bins), hi - lo)), 0, bins - 1)
    return jnp.where(lo == hi, point, pos.astype(jnp.int32))


def _point_bin(v: jax.Array, bins: int) -> jax.Array:
    """``torch.histc``'s bin for the values of a range ``[v, v]``: it bins them over
    ``[v - 1, v + 1]`` (float32 ends; ``bins // 2`` once both round to ``v``)."""
    return _bin_index(v, v - 1, v + 1, bins, bins // 2)


def _bincount(idx: jax.Array, weights: jax.Array, bins: int) -> jax.Array:
    """Per-row weighted bincount: ``(G, M)`` indices in ``[0, bins)`` -> ``(G, bins)``.

    Counts (int32 ``weights``) are summed as integers: a float32 sum stops at
    ``2**24`` (one more adds nothing), a bin of a large batch's zeros say."""
    g = idx.shape[0]
    flat = (idx + bins * jnp.arange(g, dtype=jnp.int32)[:, None]).ravel()
    return jax.ops.segment_sum(weights.ravel(), flat, num_segments=g * bins).reshape(g, bins)


def _upscale(hist, old_min, old_max, new_min, new_max):
    """``HistogramObserver._upscale_histogram`` per group."""
    bins = hist.shape[1]
    n = bins * _UPSAMPLE
    sub = jnp.repeat(hist, _UPSAMPLE, axis=1) / _F32(_UPSAMPLE)
    size = divide(old_max - old_min, _F32(n))
    mids = _linspace(old_min, old_max, n + 1)[:, :-1] + _F32(0.5) * size[:, None]
    edges = _linspace(new_min, new_max, bins + 1)
    # torch.bucketize(mids, edges, right=True) - 1: a guess from the width, then
    # one step either way against the (exactly rounded) edges.
    new_width = divide(new_max - new_min, _F32(bins))[:, None]
    idx = jnp.clip(jnp.floor(divide(mids - new_min[:, None], new_width)), 0, bins - 1)
    idx = idx.astype(jnp.int32)
    idx = (idx - (jnp.take_along_axis(edges, idx, axis=1) > mids).astype(jnp.int32)
           + (jnp.take_along_axis(edges, idx + 1, axis=1) <= mids).astype(jnp.int32))
    return _bincount(jnp.clip(idx, 0, bins - 1), sub, bins)


@jax.jit
def update(state: HistogramState, x: jax.Array) -> HistogramState:
    """Adds a batch to the histograms, as ``HistogramObserver.forward`` does.

    Args:
      state: histograms ``(G, bins)`` with ``min``/``max`` of shape ``(G,)``.
      x: ``(G, M)`` float32, one row per group.

    Returns:
      The new state. Infinities are skipped (as PyTorch does); a NaN makes
      its group's ``min``/``max`` NaN, so that its scale comes out NaN.
    """
    bins = state.hist.shape[1]
    finite = jnp.isfinite(x)
    x_min = jnp.min(jnp.where(finite, x, jnp.inf), axis=1)
    x_max = jnp.max(jnp.where(finite, x, -jnp.inf), axis=1)
    seen = jnp.any(finite, axis=1)
    new_min, new_max = jnp.minimum(state.min, x_min), jnp.maximum(state.max, x_max)
    fresh = (state.min == jnp.inf) | (state.max == -jnp.inf)
    same = (new_min == state.min) & (new_max == state.max)
    point = state.min == state.max
    grow = seen & ~fresh & ~same & ~point
    # Ranges scaled into [1, 2) (exact): no subnormal piece in `_linspace`, and no
    # `(x - min) * bins` overflows (PyTorch's does beyond about 1e35).
    f = power_of_two(jnp.maximum(jnp.abs(new_min), jnp.abs(new_max)))
    old_lo, old_hi, lo, hi = state.min * f, state.max * f, new_min * f, new_max * f
    batch = _bincount(_bin_index(x * f[:, None], lo[:, None], hi[:, None], bins,
                                 _point_bin(new_min, bins)[:, None]), finite.astype(jnp.int32),
                      bins).astype(_F32)  # exact counts, rounded once (as torch.histc's)
    upscaled = lax.cond(jnp.any(grow), lambda: _upscale(state.hist, old_lo, old_hi, lo, hi),
                        lambda: jnp.zeros_like(state.hist))
    one = _bin_index(old_lo, lo, hi, bins, bins // 2)[:, None] \
        == jnp.arange(bins, dtype=jnp.int32)[None]  # int32 under x64 too (strict promotion)
    single = jnp.where(one, jnp.sum(state.hist, axis=1, keepdims=True), _F32(0))
    moved = jnp.where(point[:, None], single, upscaled)
    old = jnp.where(fresh[:, None], _F32(0), jnp.where(same[:, None], state.hist, moved))
    hist = jnp.where(seen[:, None], old + batch, state.hist)
    nan = jnp.any(jnp.isnan(x), axis=1)
    lo = jnp.where(nan, jnp.nan, jnp.where(seen, new_min, state.min))
    hi = jnp.where(nan, jnp.nan, jnp.where(seen, new_max, state.max))
    return HistogramState(hist, lo, hi)


def _fraction(total: jax.Array, k: jax.Array) -> jax.Array:
    """``float32(total * k / 100000)`` rounded once, for integer ``0 <= k < 2**17``.

    PyTorch compares float32 cumulative counts with ``alpha * total`` where
    ``alpha`` is a float64 multiple of 1e-5; the product must be rounded once.
    """
    k_hi, k_lo = (k >> 9).astype(_F32) * _F32(512), (k & 511).astype(_F32)
    t_hi, t_lo = split(total, 0xFFFFF000)
    terms = (t_hi * k_hi, t_hi * k_lo, t_lo * k_hi, t_lo * k_lo)  # all exact
    q = divide(exact_sum(*terms), _F32(_STEPS))
    q_hi, q_lo = split(q, 0xFFFFF000)
    rest = exact_sum(*terms, -(q_hi * _F32(3125)) * _F32(32), -(q_lo * _F32(3125)) * _F32(32))
    return q + divide(rest, _F32(_STEPS))


def _norm(begin, end, density):
    """``HistogramObserver._get_norm``: density * (end**3 - begin**3) / 3."""
    return density * divide(no_fma(end * end * end) - no_fma(begin * begin * begin), _F32(3))


def _error(hist, width, span, span_err, start, end, dst):
    """``HistogramObserver._compute_quantization_error`` for bins ``[start, end]``."""
    bins = hist.shape[0]
    n = (end - start + 1).astype(_F32)
    # float32(span * n / (bins * dst)), span = max - min exactly (span + span_err).
    dst_width = divide(exact_sum(*(p * n for p in (*pieces8(span), *pieces8(span_err)))),
                       _F32(bins * dst))
    half = dst_width / 2
    begin = no_fma((jnp.arange(bins, dtype=jnp.int32) - start).astype(_F32) * width)
    stop = begin + width
    d_begin = jnp.clip(jnp.floor_divide(begin, dst_width), 0, dst - 1)
    d_end = jnp.clip(jnp.floor_divide(stop, dst_width), 0, dst - 1)
    density = divide(hist, width)
    norm = _norm(begin - no_fma((d_begin + _F32(0.5)) * dst_width), half, density)
    norm = norm + no_fma((d_end - d_begin - 1) * _norm(-half, half, density))
    norm = norm + no_fma(_norm(-half, stop - (no_fma(d_end * dst_width) + half), density))
    return jnp.where(dst_width == 0, _F32(0), jnp.sum(norm))


def _search_one(hist, lo, hi, dst):
    """``HistogramObserver._non_linear_param_search`` for one group."""
    bins = hist.shape[0]
    csum = cumsum(hist)
    total = csum[-1]
    span = hi - lo
    span_err = (hi - (span - (span - hi))) + (-lo - (span - hi))  # TwoSum: hi - lo exactly
    f = power_of_two(span)  # the errors of a span in [1, 2): all normal numbers
    span_f, span_err_f = span * f, span_err * f
    width_f = divide(span_f, _F32(bins))  # the width itself may be subnormal (flushed)

    def first_beta_move(ka, kb, start, end):
        # While l == start and r == end PyTorch only steps beta; jump to the
        # first step whose threshold drops below csum[end] (or past the loop).
        def moves(j):
            return (start < end) & (csum[end] > _fraction(total, _STEPS - j - 1))

        def bisect(_, bounds):  # smallest j in [a, b) with moves(j), else b
            a, b = bounds
            m = (a + b) // 2
            hit = moves(m)
            return jnp.where((a < b) & ~hit, m + 1, a), jnp.where((a < b) & hit, m, b)

        last = _STEPS - ka + 1
        return lax.fori_loop(0, 18, bisect, (kb + 1, last))[0]

    def cond(c):
        ka, kb, _, _, _, done = c
        return ~done & (ka + kb <= _STEPS)  # alpha < beta (float64 steps of 1e-5)

    def body(c):
        ka, kb, start, end, best, _ = c
        l_ = jnp.searchsorted(csum, _fraction(total, ka + 1), side="left")
        r_ = jnp.searchsorted(csum, _fraction(total, _STEPS - kb - 1), side="right") - 1
        l_, r_ = jnp.clip(l_, start, end), jnp.clip(r_, start, end)
        move_start = (l_ - start) > (end - r_)
        new_start = jnp.where(move_start, l_, start)
        new_end = jnp.where(move_start, end, r_)
        stuck = (new_start == start) & (new_end == end)
        norm = _error(hist, width_f, span_f, span_err_f, new_start, new_end, dst)
        worse = ~stuck & (norm > best)
        take = ~stuck & ~worse
        ka = ka + (move_start & ~stuck).astype(jnp.int32)
        kb = jnp.where(stuck, first_beta_move(ka, kb, start, end),
                       kb + (~move_start).astype(jnp.int32))
        return (ka, kb, jnp.where(take, new_start, start), jnp.where(take, new_end, end),
                jnp.where(take, norm, best), worse)

    skip = ~(lo < hi)  # one value (PyTorch ends with the same range), nothing seen, or NaN
    i0 = jnp.int32(0)
    _, _, start, end, _, _ = lax.while_loop(
        cond, body, (i0, i0, i0, jnp.int32(bins - 1), _F32(jnp.inf), skip))
    new_lo = (lo * f + no_fma(width_f * start.astype(_F32))) / f
    new_hi = (lo * f + no_fma(width_f * (end + 1).astype(_F32))) / f
    return jnp.where(skip, lo, new_lo), jnp.where(skip, hi, new_hi)


@functools.partial(jax.jit, static_argnames=("dst_bins",))
def search_range(state: HistogramState, dst_bins: int) -> tuple[jax.Array, jax.Array]:
    """The clipped ``[min, max]`` per group minimizing the estimated L2 error.

    Args:
      state: ``(G, bins)`` histograms.
      dst_bins: the number of quantization levels (``2 ** bits``).

    Returns:
      ``(lo, hi)`` of shape ``(G,)``, as ``_non_linear_param_search`` returns.

    Example:
      >>> empty = HistogramState(jnp.zeros((1, 8)), jnp.full(1, jnp.inf), jnp.full(1, -jnp.inf))
      >>> state = update(update(empty, jnp.array([[0.0, 1.0, 1.0, 2.0]])), jnp.array([[4.0]]))
      >>> search_range(state, dst_bins=256)  # PyTorch: (tensor(0.), tensor(3.5000))
      (Array([0.], dtype=float32), Array([3.5], dtype=float32))
    """
    return jax.vmap(functools.partial(_search_one, dst=dst_bins))(
        state.hist, state.min, state.max)


def as_rows(state: HistogramState) -> HistogramState:
    """``state`` with its groups flattened: ``hist (G, bins)``, ``min``/``max`` ``(G,)``."""
    bins = state.hist.shape[-1]
    return HistogramState(state.hist.reshape(-1, bins), state.min.reshape(-1),
                          state.max.reshape(-1))


def _percentile_one(hist, lo, hi, qs):
    bins = hist.shape[0]
    csum = cumsum(hist)
    n = csum[-1]
    width = divide(hi - lo, _F32(bins))

    def order_stat(k):  # the k-th smallest value (0-based): where the mass reaches k + 1/2
        m = k + _F32(0.5)  # in a bin of fractional count (re-binned), as in a whole one
        b = jnp.clip(jnp.searchsorted(csum, m, side="right"), 0, bins - 1)
        before = jnp.where(b > 0, csum[b - 1], _F32(0))
        v = lo + width * (b.astype(_F32) + jnp.clip(divide(m - before, hist[b]), 0, 1))
        return jnp.clip(jnp.where(k <= 0, lo, jnp.where(k >= n - 1, hi, v)), lo, hi)

    h = (n - 1) * qs / _F32(100)
    k = jnp.floor(h)
    a, b = order_stat(k), order_stat(k + 1)
    return a + (h - k) * (b - a)


@jax.jit
def percentile_range(state: HistogramState, q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ``100 - q`` and ``q`` percentiles per group, read off the histograms.

    numpy's default (linear) definition, the ``k``-th value where the counts,
    spread evenly across each bin, add up to ``k + 0.5`` (re-binned counts are
    fractions; ``c`` whole ones put the ``j``-th at ``left + width * (j + 0.5) / c``),
    the extremes at the exact ``min`` and ``max`` (see `jaxquant._calibration.percentile`).

    Args:
      state: ``(G, bins)`` histograms.
      q: the upper percentile, in ``[50, 100]`` (float32 scalar).

    Returns:
      ``(lo, hi)`` of shape ``(G,)``.
    """
    qs = jnp.stack([_F32(100) - q, q]).astype(_F32)
    f = power_of_two(jnp.maximum(jnp.abs(state.min), jnp.abs(state.max)))  # no subnormal width
    out = jax.vmap(lambda h, a, b: _percentile_one(h, a, b, qs))(
        state.hist, state.min * f, state.max * f) / f[:, None]
    valid = state.min < state.max  # else: one value, nothing seen (inf, -inf), or NaN
    return jnp.where(valid, out[:, 0], state.min), jnp.where(valid, out[:, 1], state.max)


@functools.partial(jax.jit, static_argnames=("fmt", "symmetric", "num_candidates"))
def mse_range(state: HistogramState, fmt: Format, symmetric: bool,
              num_candidates: int) -> tuple[jax.Array, jax.Array]:
    """``r * [min, max]`` per group for the ratio ``r`` with the least squared error.

    The ratios are ``k / num_candidates``, ``k = 1 .. num_candidates``; the
    error of ratio ``r`` is ``sum(hist * (fake_quant(center) - center)**2)``
    over the bin centers, with the scale `scale_from_range` gives for that
    range; the first (smallest) ratio wins a tie.

    Args:
      state: ``(G, bins)`` histograms.
      fmt: the format (a codebook's table, not its storage dtype).
      symmetric: symmetric or affine scales.
      num_candidates: the number of ratios.

    Returns:
      ``(lo, hi)`` of shape ``(G,)``.
    """
    hist, lo, hi = state
    # Errors of ranges scaled into [1, 2) (exact): squares that neither underflow nor overflow.
    f = power_of_two(jnp.maximum(jnp.abs(lo), jnp.abs(hi)))
    lo_f, hi_f = lo * f, hi * f
    width = divide(hi_f - lo_f, _F32(hist.shape[1]))
    idx = jnp.arange(hist.shape[1], dtype=_F32)[None]
    centers = lo_f[:, None] + no_fma(width[:, None] * (idx + _F32(0.5)))

    def error(k):
        r = divide((k + 1).astype(_F32), _F32(num_candidates))
        scale, zero_point = scale_from_range(lo_f * r, hi_f * r, fmt, symmetric)
        fq = fake_quant(centers, scale, zero_point, dtype=fmt.name, axis=0)
        return jnp.sum(hist * jnp.square(fq - centers), axis=1)

    errors = lax.map(error, jnp.arange(num_candidates, dtype=jnp.int32))
    r = divide((jnp.argmin(errors, axis=0) + 1).astype(_F32), _F32(num_candidates))
    valid = lo < hi
    return jnp.where(valid, lo * r, lo), jnp.where(valid, hi * r, hi)
