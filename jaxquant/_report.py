"""Per-leaf quantization report: format, granularity, bytes, SQNR and largest error.

`quantization_report` pairs the leaves of a float tree with those of its
quantized version (by ``/``-joined path, as `jaxquant.quantize_tree` names
them) and returns one frozen `LeafReport` row per leaf. The error statistics
of each quantized leaf come from a jitted program (dequantization included),
compiled once per leaf signature, which runs wherever the leaf lives, sharded
or not; all leaves are dispatched before the few scalars of each come back.
`format_report` prints the rows as an aligned table with a total.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._args import as_array
from jaxquant._leaves import is_abstract, is_record, leaf_dtype, leaf_nbytes, stacked_axes
from jaxquant._qtensor import QTensor, is_qtensor
from jaxquant._quantize import dequantize_values
from jaxquant._schemes import format_name
from jaxquant._spec import QuantSpec
from jaxquant._tree import path_str

__all__ = ["LeafReport", "quantization_report", "format_report"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafReport:
    """One leaf of a quantization report.

    Attributes:
      path: the leaf's ``/``-joined tree path.
      shape: the (logical) shape.
      format: the code format (``"int4(packed)"`` for packed codes), or ``"-"``
        for a leaf kept as it is.
      granularity: ``"per-tensor"``, ``"axis=1"``, ``"axis=0 block=32"``, or
        ``"-"`` for a kept leaf; ``"stacked=1 axis=1"`` for a `QTensor` of stacked
        layers (``QuantSpec(stacked=1)``), whose ``axis`` counts within one layer.
      dtype: the original dtype, that of the leaf of ``tree`` (described alone, a
        `QTensor`'s is the dtype it dequantizes to).
      nbytes_before: bytes of the original leaf.
      nbytes_after: bytes of the stored leaf (`QTensor.nbytes`: codes at their
        bit width, plus scale and zero point).
      sqnr_db: signal-to-quantization-noise ratio ``10 log10(sum x^2 / sum
        (x - x_hat)^2)`` in dB (``inf`` when exact); ``nan`` when there is no
        reference to compare with (or an abstract one, of `jax.ShapeDtypeStruct`
        leaves) or the leaf was kept, and also for a compared leaf when its
        reference or its codes hold NaN or inf.
      max_abs_error: ``max |x - x_hat|``; ``nan`` where there is no (concrete)
        reference or the leaf was kept, or either side holds NaN; ``inf`` where one
        side holds an infinity the other does not (codes of ``saturate=False``).
      compared: whether the leaf was compared with its reference (the two
        statistics were computed); `format_report` prints a NaN statistic as
        ``nan`` when it was, ``-`` when it was not.

    Example:
      >>> import jaxquant as jq
      >>> row = jq.LeafReport(path="dense/bias", shape=(8,), format="-", granularity="-",
      ...                     dtype="float32", nbytes_before=32, nbytes_after=32)
      >>> row.quantized, row.sqnr_db
      (False, nan)
    """

    path: str
    shape: tuple[int, ...]
    format: str
    granularity: str
    dtype: str
    nbytes_before: int
    nbytes_after: int
    sqnr_db: float = math.nan
    max_abs_error: float = math.nan
    compared: bool = False

    @property
    def quantized(self) -> bool:
        """Whether the leaf is a `QTensor`."""
        return self.format != "-"


def _granularity(qt: QTensor, stacked: int) -> str:
    layers = f"stacked={stacked} " if stacked else ""
    if isinstance(qt.block_size, tuple):
        return layers + "tiles=" + "x".join(map(str, qt.block_size))
    if qt.block_size:
        return layers + f"axis={qt.axis} block={qt.block_size}"
    return layers + ("per-tensor" if qt.axis is None else f"axis={qt.axis}")


def _scaled_square_sum(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum (v * 2**-e)^2, e)``, ``e`` the exponent of ``max |v|`` (``frexp``'s).

    Squares of float32 values overflow above about 1e19 and flush to zero below
    about 1e-19; scaled by a power of two near their largest magnitude they lie
    in [0, 1). The factor is applied exactly, as two normal powers of two (one of
    ``2**-128`` would be subnormal, flushed to zero on CPU).
    """
    e = jnp.frexp(jnp.max(jnp.abs(v), initial=0.0))[1]
    h, one = e // 2, jnp.float32(1)
    u = v * jnp.ldexp(one, -h) * jnp.ldexp(one, h - e)
    return jnp.sum(u * u), e


@functools.partial(jax.jit, static_argnums=3)
def _errors(x: jax.Array, qt: QTensor, lo: jax.Array | None = None,
            stacked: int = 0) -> tuple[jax.Array, ...]:
    """One leaf's ``(sum x^2, sum d^2)`` as scaled sums and exponents
    (`_scaled_square_sum`) and ``max |d|``, with ``d = x - x_hat``, in float32.

    ``stacked``: the leading axes of a stacked ``qt`` (`jaxquant._leaves.stacked_axes`), each
    dequantized under one ``jax.vmap``.

    ``lo``: for a float64 reference, ``x - float32(x)`` (`_reference`), added to
    the difference so that ``d`` is that of the float64 values, not of their
    float32 roundings (which can hide an int16 or int32 error entirely).

    Compiled once per leaf signature (shape, dtype, format): the layers of a
    model share a handful of programs, where one program over the whole tree
    would compile for as long as the tree is large.
    """
    x = x.astype(jnp.float32)
    x_hat = dequantize_values
    for _ in range(stacked):
        x_hat = jax.vmap(x_hat)
    d = x - x_hat(qt)
    if lo is not None:
        d = d + lo
    sig, sig_e = _scaled_square_sum(x)
    err, err_e = _scaled_square_sum(d)
    return sig, sig_e, err, err_e, jnp.max(jnp.abs(d), initial=0.0)


def _reference(ref) -> tuple[jax.Array, jax.Array | None]:
    """``(x, lo)``: the reference leaf as a JAX array and, for float64 (a NumPy array
    while ``jax_enable_x64`` is off), the float32 remainder ``x - float32(x)``."""
    if leaf_dtype(ref) != np.float64:
        return as_array(ref, "tree"), None
    if isinstance(ref, jax.Array):  # float64 on device (x64 on): split there, sharding kept
        hi = ref.astype(jnp.float32)
        return hi, (ref - hi.astype(ref.dtype)).astype(jnp.float32)
    ref = np.asarray(ref)
    with np.errstate(all="ignore"):  # inf - inf, 1e300 -> inf: NaN statistics, no warning
        hi = ref.astype(np.float32)
        lo = (ref - hi).astype(np.float32)
    return jnp.asarray(hi), jnp.asarray(lo)


def _sqnr(sig: float, sig_e: int, err: float, err_e: int) -> float:
    """``10 log10(sum x^2 / sum d^2)``, with ``sum x^2 = sig * 4**sig_e`` (and so ``d``)."""
    if not (np.isfinite(sig) and np.isfinite(err)):
        return math.nan
    if err == 0:
        return math.inf
    if sig == 0:
        return -math.inf
    return 10 * math.log10(sig / err) + 20 * math.log10(2) * (int(sig_e) - int(err_e))


def quantization_report(tree: Any, qtree: Any = None) -> list[LeafReport]:
    """One row per leaf: format, granularity, bytes before and after, SQNR, max error.

    Args:
      tree: the float tree (arrays, sharded or not); or, with ``qtree=None``, a
        quantized tree described alone (formats and bytes; "before" is the
        size of each `QTensor` leaf in its float ``dtype``).
      qtree: ``tree`` after `jaxquant.quantize_tree` (same paths and shapes;
        `QTensor` leaves where a rule applied), or ``None``. Leaves are paired by
        path, so ``qtree`` may list them in another order (a list of 11 layers,
        saved and loaded back as a dict, comes as ``layers/0, layers/1, layers/10``).
        Either tree may be abstract (`jax.ShapeDtypeStruct` leaves, as `jax.eval_shape`
        gives): its leaves are counted, not compared. A `QTensor` stacked by
        ``jax.vmap`` / ``lax.scan`` (a scanned model's layers) is compared layer by layer.

    Returns:
      `LeafReport` rows in the order of the tree's leaves. With both trees, the
      SQNR and largest error of every quantized leaf come from a jitted
      program compiled once per leaf signature (float32 sums of squares scaled
      by a power of two, so that values from about 1e-38 to 3e38 neither
      overflow nor flush to zero; a float64 leaf's differences are those of its
      float64 values, not of their float32 roundings).

    Raises:
      ValueError: the two trees have different leaf paths (or a repeated path in
        another order), a leaf's shape differs, or a `QTensor`'s arrays fit its
        metadata with no number of leading axes taken as stacked.
      TypeError: ``tree`` holds a `QTensor` where ``qtree`` does not, or a
        non-float leaf where ``qtree`` holds a `QTensor`; ``qtree`` holds a
        `QuantSpec` (rules, not the quantized tree).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> params = {"w": jnp.arange(-4.0, 4.0).reshape(2, 4), "b": jnp.ones(4)}
      >>> rows = jq.quantization_report(params, jq.quantize_tree(params))
      >>> [(r.path, r.format, r.granularity, r.nbytes_before, r.nbytes_after) for r in rows]
      [('b', '-', '-', 16, 16), ('w', 'int8', 'axis=1', 32, 24)]
      >>> round(rows[1].sqnr_db, 2), round(rows[1].max_abs_error, 5)
      (55.5, 0.00787)
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_record)
    paths = [path_str(p) for p, _ in leaves]
    if qtree is None:
        return [_row(path, leaf, leaf, alone=True) for path, (_, leaf) in zip(paths, leaves,
                                                                             strict=True)]
    qleaves = jax.tree_util.tree_leaves_with_path(qtree, is_leaf=is_record)
    if any(isinstance(q, QuantSpec) for _, q in qleaves):
        raise TypeError(f"qtree must be the quantized tree, jaxquant.quantize_tree(tree, rules), "
                        f"not the rules; got {qtree!r:.200}.")
    qpaths = [path_str(p) for p, _ in qleaves]
    if paths != qpaths:
        if len(set(paths)) == len(paths) and sorted(paths) == sorted(qpaths):
            # Paired by path: a list of 11 layers reloaded from a checkpoint is a dict
            # whose leaves come as layers/0, layers/1, layers/10, layers/2...
            where = {p: i for i, p in enumerate(qpaths)}
            qleaves = [qleaves[where[p]] for p in paths]
        else:
            only = sorted(set(paths) ^ set(qpaths))
            raise ValueError(f"tree and qtree must have the same leaf paths; they differ at "
                             f"{only[:5] or 'repeated paths in another order'}.")
    refs, qts, picked = [], [], []
    for i, ((_, ref), (_, q)) in enumerate(zip(leaves, qleaves, strict=True)):
        if tuple(np.shape(ref)) != tuple(np.shape(q)):
            raise ValueError(f"{paths[i]!r}: shape mismatch: tree has {tuple(np.shape(ref))}, "
                             f"qtree has {tuple(np.shape(q))}.")
        if is_qtensor(ref) and not is_qtensor(q):
            raise TypeError(f"{paths[i]!r}: tree holds a QTensor but qtree does not; pass the "
                            f"float tree first.")
        if is_qtensor(q) and not is_qtensor(ref):
            if not jnp.issubdtype(leaf_dtype(ref), jnp.floating):
                raise TypeError(f"{paths[i]!r}: the reference leaf must be a float array, got "
                                f"dtype {leaf_dtype(ref)}.")
            if is_abstract(ref) or is_abstract(q):  # ShapeDtypeStructs: no values to compare
                continue
            refs.append(_reference(ref))
            qts.append((q, stacked_axes(q, f"qtree leaf {paths[i]!r}")))
            picked.append(i)
    stats = {}
    if picked:
        # All leaves dispatched first, then fetched together: one wait, not one a leaf.
        results = jax.device_get([_errors(x, q, lo, k) for (x, lo), (q, k)
                                  in zip(refs, qts, strict=True)])
        for i, (sig, sig_e, err, err_e, worst) in zip(picked, results, strict=True):
            stats[i] = (_sqnr(float(sig), sig_e, float(err), err_e), float(worst), True)
    return [_row(path, ref, q, *stats.get(i, ())) for i, (path, (_, ref), (_, q))
            in enumerate(zip(paths, leaves, qleaves, strict=True))]


def _row(path: str, ref, q, sqnr: float = math.nan, worst: float = math.nan,
         compared: bool = False, *, alone: bool = False) -> LeafReport:
    """The row of leaf ``q`` (``ref`` its original); ``alone``: no original was given."""
    if is_qtensor(q):
        gran = _granularity(q, stacked_axes(q, f"{'tree' if alone else 'qtree'} leaf {path!r}"))
        fmt = format_name(q) + ("(packed)" if q.packed else "")
    else:
        fmt, gran = "-", "-"
    dtype = leaf_dtype(ref)  # the original's (alone, ref is q: a QTensor's float dtype)
    before = math.prod(q.shape) * dtype.itemsize if alone and is_qtensor(q) else leaf_nbytes(ref)
    return LeafReport(path=path, shape=tuple(int(d) for d in np.shape(q)), format=fmt,
                      granularity=gran, dtype=dtype.name, nbytes_before=before,
                      nbytes_after=leaf_nbytes(q), sqnr_db=sqnr, max_abs_error=worst,
                      compared=compared)


def _num(v: float, fmt: str, compared: bool) -> str:
    """A statistic's cell: ``-`` for a leaf not compared, ``nan`` for a NaN statistic."""
    if math.isnan(v):
        return "nan" if compared else "-"
    return ("inf" if v > 0 else "-inf") if math.isinf(v) else format(v, fmt)


def _ratio(after: int, before: int) -> str:
    return f"{after / before:.3f}" if before else "-"


def format_report(rows: list[LeafReport]) -> str:
    """The rows as an aligned text table, with a total row (bytes and ratio).

    Args:
      rows: `LeafReport` rows, as `quantization_report` returns.

    Returns:
      The table: one line per leaf, then the total of bytes before and after
      and their ratio.

    Raises:
      TypeError: ``rows`` is not a list or tuple of `LeafReport`.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> params = {"w": jnp.linspace(-1.0, 1.0, 4096).reshape(64, 64), "b": jnp.ones(64)}
      >>> print(jq.format_report(jq.quantization_report(params, jq.quantize_tree(params))))
      path   shape     format  granularity  dtype    before  after  ratio  SQNR dB   max err
      --------------------------------------------------------------------------------------
      b      (64,)     -       -            float32     256    256  1.000        -         -
      w      (64, 64)  int8    axis=1       float32  16,384  4,352  0.266     48.8  3.92e-03
      --------------------------------------------------------------------------------------
      total                                          16,640  4,608  0.277
    """
    if not (isinstance(rows, list | tuple) and all(isinstance(r, LeafReport) for r in rows)):
        raise TypeError(f"rows must be a list of LeafReport, as quantization_report returns; "
                        f"got {type(rows).__name__} {rows!r:.80}.")
    head = ("path", "shape", "format", "granularity", "dtype", "before", "after", "ratio",
            "SQNR dB", "max err")
    cells = [(r.path, str(r.shape), r.format, r.granularity, r.dtype, f"{r.nbytes_before:,}",
              f"{r.nbytes_after:,}", _ratio(r.nbytes_after, r.nbytes_before),
              _num(r.sqnr_db, ".1f", r.compared), _num(r.max_abs_error, ".2e", r.compared))
             for r in rows]
    before = sum(r.nbytes_before for r in rows)
    after = sum(r.nbytes_after for r in rows)
    total = ("total", "", "", "", "", f"{before:,}", f"{after:,}", _ratio(after, before), "", "")
    width = [max(len(c[k]) for c in (head, *cells, total)) for k in range(len(head))]

    def line(c):  # path .. dtype left-aligned, numbers right-aligned
        return "  ".join(v.ljust(w) if k < 5 else v.rjust(w)
                         for k, (v, w) in enumerate(zip(c, width, strict=True))).rstrip()

    rule = "-" * len(line(head))
    return "\n".join([line(head), rule, *map(line, cells), rule, line(total)])
