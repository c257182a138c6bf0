"""GPTQ: weight quantization that compensates each row's rounding error on calibration inputs.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers" (ICLR 2023), Algorithm 1 with lazy batch updates.
For a kernel ``w`` of shape ``(in, out)`` (``y = x @ w``) and the Gram matrix
``H = sum x^T x`` of calibration inputs, the input rows are quantized one at
a time and each row's error, divided by the diagonal of the upper Cholesky
factor ``U`` of ``H^-1``, is subtracted from the rows not yet quantized in
proportion to ``U``'s row: the greedy (OBQ) solution of
``min ||x w - x q||^2`` over the code grid. Scales are absmax (or min/max)
scales as `jaxquant.quantize` computes them: per output channel from ``w``,
or per block of input rows from the updated rows when the block's first row
is reached (from ``w`` itself with ``act_order``, "static groups", so that the
blocks stay contiguous while rows are visited by decreasing ``H[i, i]``).
The result is an ordinary `QTensor`: the same format, layout and bytes as
`jaxquant.quantize` gives, only other codes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jaxquant._args import as_array
from jaxquant._explicit_sharding import explicit_sharding, explicit_spec, sharding_with_spec
from jaxquant._formats import get_format
from jaxquant._granularity import _is_int
from jaxquant._qtensor import QTensor
from jaxquant._quantize import check_flags, dequantize, quantize
from jaxquant._rounding import exponent, pow2
from jaxquant._schemes import SCHEMES

__all__ = ["gptq"]

_LAZY_ROWS = 128  # rows per lazy batch update (a multiple of the block size when blocked)


def _check(w, hessian, axis, block_size, damp) -> tuple[int | None, int | None]:
    """Validates the arguments; returns ``(axis, block_size)`` normalized."""
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w must be a 2-D float kernel of shape (in, out), got shape {w.shape} "
                         f"and dtype {w.dtype}.")
    k = w.shape[0]
    if not (jnp.issubdtype(hessian.dtype, jnp.floating)
            or jnp.issubdtype(hessian.dtype, jnp.integer)):
        raise TypeError(f"hessian must be a real array, got dtype {hessian.dtype}.")
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must have shape (in, in) = {(k, k)} for w of shape "
                         f"{w.shape}, got {hessian.shape}.")
    if isinstance(damp, jax.Array) and damp.ndim == 0 and not isinstance(damp, jax.core.Tracer):
        damp = damp.item()  # a concrete 0-d array, as NumPy scalars
    if not isinstance(damp, int | float | np.integer | np.floating) or isinstance(damp, bool):
        raise TypeError(f"damp must be a number, got {type(damp).__name__} {damp!r:.60} (a "
                        f"static value: a Python or NumPy number, or a concrete 0-d array).")
    if not 0 <= damp < np.inf:
        raise ValueError(f"damp must be a finite non-negative number, got {damp!r}.")
    if block_size is None:
        if not _is_int(axis) or axis not in (-1, 1):
            raise ValueError(f"axis must be -1 or 1 (one scale per output channel) without "
                             f"block_size, or 0 with block_size; got axis={axis!r}.")
        return 1, None
    if not _is_int(axis) or axis not in (0, -2):
        raise ValueError(f"with block_size, axis must be 0 or -2 (blocks of input rows), got "
                         f"axis={axis!r}.")
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) \
            or block_size < 1 or k % block_size:
        raise ValueError(f"block_size must be a positive int dividing in={k}, got "
                         f"{block_size!r}.")
    return 0, int(block_size)


def gptq(w: ArrayLike, hessian: ArrayLike, *, dtype: DTypeLike | str = jnp.int8,
         axis: int = -1, block_size: int | None = None, symmetric: bool = True,
         damp: float = 0.01, act_order: bool = False) -> QTensor:
    """Quantizes a kernel with GPTQ: rounding errors compensated on calibration inputs.

    Args:
      w: a float kernel of shape ``(in, out)``, used as ``x @ w``.
      hessian: ``(in, in)``, the sum of ``x^T x`` over calibration inputs ``x`` of shape
        ``(rows, in)`` (any positive multiple: it is scaled by a power of four before
        it is factored, so a multiple by a power of four gives the same codes; another
        multiple rounds differently, which can move a code near a tie, and through the
        error feedback a few more). Only its symmetric part ``(H + H^T) / 2`` is used.
        An input never seen (a zero row of ``H``) couples to no other: its row is rounded
        to nearest.
      dtype: the code format (integer, float8 or a codebook name, as in `quantize`).
      axis: ``-1`` (or ``1``) for one scale per output channel; ``0`` (or ``-2``) with
        ``block_size`` for blocks of ``block_size`` input rows (the group size).
      block_size: rows per block along the input axis, dividing ``in``; or None.
      symmetric: absmax scales without zero point (True) or min/max with one.
      damp: added to ``H``'s diagonal, as a fraction of its mean (GPTQ's ``percdamp``;
        inputs never seen count 0 in the mean, not 1 as in the reference code, so that the
        damping does not depend on ``H``'s magnitude).
      act_order: visit rows by decreasing ``H[i, i]`` (block scales then come from ``w``).

    Returns:
      A `QTensor` of ``w``'s shape and dtype, laid out as ``quantize(w, dtype=dtype,
      axis=axis, block_size=block_size, symmetric=symmetric)`` would be. On mesh axes of
      type Explicit the sweep runs on whole (replicated) arrays; the codes come back on
      ``w``'s sharding, the scales replicated.

    Raises:
      TypeError: ``w`` or ``hessian`` not an array, ``hessian`` not real (float or
        integer); ``symmetric`` or ``act_order`` not a bool; ``damp`` not a static
        number; an MX or NVFP4 scheme as ``dtype``.
      ValueError: ``w`` not a 2-D float array, ``hessian`` not ``(in, in)``, an axis or
        block size other than the ones above (codebooks need blocks), a negative or
        infinite ``damp``; a damped ``hessian`` that is not positive definite (singular,
        indefinite, or a NaN or inf in any entry; raising ``damp`` helps a singular one).
        Under ``jit``, where that cannot raise, the scales come back NaN instead.

    Example:
      >>> import jax, jax.numpy as jnp, jaxquant as jq
      >>> x = jax.random.normal(jax.random.key(0), (256, 64))
      >>> w = jax.random.normal(jax.random.key(1), (64, 32))
      >>> qt = jq.gptq(w, x.T @ x, dtype=jnp.int4)
      >>> rtn = jq.quantize(w, dtype=jnp.int4, axis=-1)
      >>> def err(q):
      ...     return float(jnp.sum((x @ w - x @ jq.dequantize(q)) ** 2))
      >>> err(qt) < err(rtn)
      True
    """
    w, hessian = as_array(w, "w"), as_array(hessian, "hessian")
    check_flags(symmetric=symmetric, act_order=act_order)
    axis, block_size = _check(w, hessian, axis, block_size, damp)
    if isinstance(dtype, str) and dtype in SCHEMES and SCHEMES[dtype].scale_dtype is not None:
        raise TypeError(f"dtype {dtype!r} is a block-scaled scheme, which gptq does not compute "
                        f"(its scales are not float32 per block); use an element format with "
                        f"axis=0 and a block_size, e.g. dtype=jnp.int4 or 'nf4'.")
    fmt = get_format(dtype, argname="dtype")
    if fmt.is_codebook and block_size is None:
        raise ValueError(f"dtype {fmt.name} scales blocks of input rows: pass axis=0 and a "
                         f"block_size (bitsandbytes uses 64); got axis={axis}, block_size=None.")
    if w.shape[0] == 0:  # no input rows: nothing to compensate, quantize's empty QTensor
        return quantize(w, dtype=dtype, axis=axis, block_size=block_size,
                        symmetric=bool(symmetric))
    placed = explicit_sharding(w)  # the sweep gathers and scatters rows: whole arrays
    w, hessian = (a if explicit_spec(a) is None else
                  jax.sharding.reshard(a, sharding_with_spec(a, (None,) * a.ndim))
                  for a in (w, hessian))
    qt, factored = _gptq(w, hessian, fmt.name, block_size, bool(symmetric), float(damp),
                         bool(act_order))
    if placed is not None:
        qt = dataclasses.replace(qt, qvalue=jax.sharding.reshard(qt.qvalue, placed))
    if not isinstance(factored, jax.core.Tracer) and not bool(factored):
        raise ValueError(f"hessian + damp * mean(diag(hessian)) * I is not positive definite "
                         f"(damp={damp}): the hessian is singular, indefinite or not finite. "
                         f"Use more calibration rows than inputs ({w.shape[0]}), or a larger "
                         f"damp.")
    return qt


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _gptq(w, hessian, dtype: str, block_size, symmetric, damp, act_order) -> QTensor:
    k, n = w.shape
    wf, h = w.astype(jnp.float32), hessian.astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(h))  # the factorizations read one triangle only
    # A power of four (exact, also for the square roots of the Cholesky factors) brings the
    # largest diagonal entry to [1, 4): no overflow or underflow for any magnitude.
    h = h * pow2(jnp.clip(-2 * (exponent(jnp.max(jnp.diag(h))) // 2), -126, 126))
    h = h * 0.5 + h.T * 0.5  # the symmetric part (exact for a symmetric h)
    # Inputs never seen: a zero row (a zero diagonal entry beside others is indefinite).
    dead = jnp.all(h == 0, axis=1)
    mean = jnp.mean(jnp.diag(h))  # of the hessian as given: a dead input adds 0, at any scale
    h = h + jnp.diag(dead.astype(jnp.float32))  # a dead input: its own, uncoupled row
    perm = jnp.argsort(-jnp.diag(h), stable=True) if act_order else jnp.arange(k)
    h = h[perm][:, perm]
    h = h + damp * mean * jnp.eye(k, dtype=jnp.float32)
    # The upper Cholesky factor of H^-1 (H^-1 = U^T U) without forming H^-1: with J the
    # reversal, J H J = M M^T (M lower) gives H^-1 = (J M^-1 J)^T (J M^-1 J), J M^-1 J upper.
    # Half the flops of inverting H and factoring the inverse, and as accurate.
    m = jnp.linalg.cholesky(h[::-1, ::-1])
    u = jax.scipy.linalg.solve_triangular(m, jnp.eye(k, dtype=jnp.float32), lower=True)
    u = u[::-1, ::-1]
    factored = finite & jnp.all(jnp.isfinite(u))  # NaN where a Cholesky factorization failed
    kw = dict(dtype=dtype, symmetric=symmetric)
    if block_size is None:  # per output channel, from w
        base = quantize(wf, axis=1, **kw)
        scales, zps = base.scale[None], None if base.zero_point is None else base.zero_point[None]
    else:  # one row of scales per block; from w for act_order, else filled in on the way
        base = quantize(wf, axis=0, block_size=block_size, **kw)
        scales, zps = base.scale, base.zero_point
    dynamic = block_size is not None and not act_order

    def row_values(row, s, z):
        return dequantize(quantize(row[None], s, z, axis=1, dtype=dtype))[0]

    # Lazy batches of `lazy` rows, run by one loop (one traced body whatever ``k``): ``k`` is
    # padded to whole batches with zero rows that couple to nothing (U's identity block),
    # visited last, so that no real row sees them; their values and scales are dropped.
    lazy = _LAZY_ROWS if block_size is None else block_size * -(-_LAZY_ROWS // block_size)
    lazy = min(lazy, k)  # a multiple of block_size either way, as k is
    batches = -(-k // lazy)
    pad = batches * lazy - k
    ws = wf[perm]
    if pad:
        ws = jnp.pad(ws, ((0, pad), (0, 0)))
        u = jnp.pad(u, ((0, pad), (0, pad))) + jnp.diag(jnp.arange(k + pad) >= k).astype(u.dtype)
        perm = jnp.concatenate([perm, jnp.arange(k, k + pad, dtype=perm.dtype)])
    if pad and block_size is not None:  # the padded rows' own blocks
        scales = jnp.pad(scales, ((0, pad // block_size), (0, 0)), constant_values=1)
        zps = None if zps is None else jnp.pad(zps, ((0, pad // block_size), (0, 0)))

    group = (lambda r: 0) if block_size is None else (lambda r: perm[r] // block_size)

    def batch(b, carry):
        ws, done, scales, zps = carry
        i1 = b * lazy
        u1 = lax.dynamic_slice(u, (i1, i1), (lazy, lazy))

        def step(r, carry):
            w1, err, scales, zps = carry
            if dynamic:  # a block's scales from its rows as updated so far
                def fresh(scales, zps):
                    rows = lax.dynamic_slice_in_dim(w1, r, block_size, axis=0)
                    qt = quantize(rows, axis=0, block_size=block_size, **kw)
                    g = (i1 + r) // block_size
                    scales = lax.dynamic_update_slice_in_dim(scales, qt.scale, g, axis=0)
                    if zps is not None:
                        zps = lax.dynamic_update_slice_in_dim(zps, qt.zero_point, g, axis=0)
                    return scales, zps

                scales, zps = lax.cond((i1 + r) % block_size == 0, fresh,
                                       lambda s, z: (s, z), scales, zps)
            g = group(i1 + r)
            row = w1[r]
            value = row_values(row, scales[g], None if zps is None else zps[g])
            e = (row - value) / u1[r, r]
            later = (jnp.arange(lazy) > r).astype(jnp.float32) * u1[r]
            w1 = w1 - later[:, None] * e[None, :]
            return w1.at[r].set(value), err.at[r].set(e), scales, zps

        w1, err, scales, zps = lax.fori_loop(
            0, lazy, step, (lax.dynamic_slice_in_dim(ws, i1, lazy, axis=0),
                            jnp.zeros((lazy, n), jnp.float32), scales, zps))
        done = lax.dynamic_update_slice_in_dim(done, w1, i1, axis=0)
        # The later rows' update (in float32 on every platform, not TF32). U is upper
        # triangular: rows before the batch get zero; the batch's own rows are not read again.
        ws = ws - jnp.matmul(lax.dynamic_slice_in_dim(u, i1, lazy, axis=0).T, err,
                             precision=lax.Precision.HIGHEST)
        return ws, done, scales, zps

    _, q, scales, zps = lax.fori_loop(0, batches, batch, (ws, jnp.zeros_like(ws), scales, zps))
    q = q[:k][jnp.argsort(perm[:k])]
    if block_size is not None:
        scales = scales[:k // block_size]
        zps = None if zps is None else zps[:k // block_size]
    if block_size is None:
        qt = quantize(q, scales[0], None if zps is None else zps[0], axis=1, dtype=dtype)
    else:
        qt = quantize(q, scales, zps, axis=0, block_size=block_size, dtype=dtype)
    scale = jnp.where(factored, qt.scale, jnp.nan)  # never a plausible kernel from a failure
    return QTensor(qt.qvalue, scale, qt.zero_point, axis=qt.axis, block_size=qt.block_size,
                   dtype=w.dtype, codebook=qt.codebook), factored  # dequantizes to w's dtype
