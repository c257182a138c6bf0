"""`scaled_matmul`: block-scaled matmul of two MX / NVFP4 `QTensor` operands.

Both operands are blocked along their last axis, the contracting one (the
layout of `jax.nn.scaled_matmul`): ``lhs`` is ``(M, K)`` or ``(B, M, K)``,
``rhs`` is ``(N, K)`` or ``(B, N, K)``, and the result is
``einsum("bmk,bnk->bmn", dequantize(lhs), dequantize(rhs))``.

Two implementations compute the same maths (products of the dequantized
values, summed in float32):

* ``"cudnn"``: `jax.nn.scaled_matmul` on the element codes and the block
  scales (cuDNN's fused kernel on NVIDIA Blackwell GPUs for MXFP8 with
  ``float8_e8m0fnu`` scales and NVFP4 with ``float8_e4m3fn`` scales, blocks
  of 32 and 16); a two-level scale's float32 tensor scales multiply the
  output.
* ``"xla"``: the operands dequantized inside one jitted function and a
  float32 ``dot_general``; runs on every backend.

The default picks ``"cudnn"`` when the default backend is a GPU and the
operands are of one of the two cuDNN combinations with ``K`` a multiple of
the block size (`jax.nn.scaled_matmul` infers the block length as ``K``
divided by the number of scales, so a partial last block would be read as
blocks of another length), ``"xla"`` otherwise.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jaxquant._packing import unpack
from jaxquant._qtensor import QTensor, is_qtensor
from jaxquant._quantize import dequantize_values

__all__ = ["scaled_matmul"]

_CUDNN = {("float8_e4m3fn", "float8_e8m0fnu", 32), ("float8_e5m2", "float8_e8m0fnu", 32),
          ("float4_e2m1fn", "float8_e4m3fn", 16)}


def _check(qt, name: str) -> None:
    if not is_qtensor(qt):
        raise TypeError(f"{name} must be a jaxquant.QTensor, got {type(qt).__name__}.")
    if qt.ndim not in (2, 3) or qt.layout.kind != "block" or qt.axis != qt.ndim - 1:
        raise ValueError(f"{name} must be of rank 2 or 3 and blocked along its last (contracting) "
                         f"axis, as jax.nn.scaled_matmul; got {qt!r}.")
    if qt.zero_point is not None:
        raise ValueError(f"{name} must hold codes without a zero point, got {qt!r}.")


def _block_scales(qt: QTensor) -> tuple[jax.Array, jax.Array]:
    """(block scales as stored, float32 tensor scale: 1 unless two-level)."""
    s = qt.scale
    if is_qtensor(s):  # a per-tensor second level (checked by _cudnn_ready)
        return s.qvalue, s.scale.astype(jnp.float32).reshape(())
    return s, jnp.ones((), jnp.float32)


def _cudnn_ready(qt: QTensor) -> bool:
    s = qt.scale
    if is_qtensor(s) and s.layout.kind != "tensor":
        return False
    if qt.shape[-1] % qt.block_size:  # jax.nn.scaled_matmul infers blocks as K // n_scales
        return False
    scale_dtype = (s.qvalue if is_qtensor(s) else s).dtype
    return (qt.format.name, np.dtype(scale_dtype).name, qt.block_size) in _CUDNN


def scaled_matmul(lhs: QTensor, rhs: QTensor, *,
                  preferred_element_type: DTypeLike = jnp.float32,
                  implementation: Literal["cudnn", "xla"] | None = None) -> jax.Array:
    """``lhs @ rhs.T`` (per batch) of two block-scaled `QTensor` operands.

    Args:
      lhs: ``(M, K)`` or ``(B, M, K)``, blocked along ``K`` (MXFP8, MXFP6,
        MXFP4, NVFP4, MXINT8, or any blocked QTensor without zero point).
      rhs: ``(N, K)`` or ``(B, N, K)``, blocked along ``K``, same rank.
      preferred_element_type: the output dtype (float).
      implementation: ``"cudnn"`` (`jax.nn.scaled_matmul`), ``"xla"`` (the
        portable fallback) or ``None`` (cuDNN where available, see the module
        docstring).

    Returns:
      ``(M, N)`` or ``(B, M, N)`` in ``preferred_element_type``.

    Raises:
      TypeError: an operand that is not a QTensor, or a ``preferred_element_type``
        that is not a dtype.
      ValueError: ranks, layouts, contracting sizes or block sizes that do not
        match; an operand with a zero point; ``"cudnn"`` for operands cuDNN
        does not take (other formats, a partial last block) or without a GPU;
        a ``preferred_element_type`` that is not a float dtype.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> a = jq.quantize(jnp.ones((2, 64)), dtype="mxfp8_e4m3")
      >>> b = jq.quantize(jnp.full((3, 64), 0.5), dtype="mxfp8_e4m3")
      >>> jq.scaled_matmul(a, b)
      Array([[32., 32., 32.],
             [32., 32., 32.]], dtype=float32)
    """
    _check(lhs, "lhs")
    _check(rhs, "rhs")
    if lhs.ndim != rhs.ndim or lhs.shape[-1] != rhs.shape[-1] \
            or (lhs.ndim == 3 and lhs.shape[0] != rhs.shape[0]):
        raise ValueError(f"lhs and rhs must be (M, K) and (N, K), or (B, M, K) and (B, N, K); got "
                         f"shapes {lhs.shape} and {rhs.shape}.")
    if lhs.block_size != rhs.block_size:
        raise ValueError(f"lhs and rhs must share one block size, got {lhs.block_size} and "
                         f"{rhs.block_size}.")
    if implementation not in (None, "cudnn", "xla"):
        raise ValueError(f"implementation must be None, 'cudnn' or 'xla', got "
                         f"{implementation!r}.")
    ready = _cudnn_ready(lhs) and _cudnn_ready(rhs) and lhs.format == rhs.format
    if implementation == "cudnn":
        if not ready or jax.default_backend() != "gpu":
            raise ValueError(f"implementation='cudnn' needs a GPU and MXFP8 or NVFP4 operands "
                             f"of one format whose K is a multiple of the block size; got "
                             f"backend {jax.default_backend()!r} and {lhs!r}, {rhs!r}.")
    use_cudnn = implementation == "cudnn" or (implementation is None and ready
                                              and jax.default_backend() == "gpu")
    try:
        if preferred_element_type is None:  # np.dtype(None) would be float64
            raise TypeError
        out = np.dtype(preferred_element_type)
    except TypeError:
        raise TypeError(f"preferred_element_type must be a float dtype, got "
                        f"{preferred_element_type!r}.") from None
    if not jnp.issubdtype(out, jnp.floating):
        raise ValueError(f"preferred_element_type must be a float dtype, got {out}.")
    if use_cudnn:
        return _cudnn(lhs, rhs, out)
    return _xla(lhs, rhs, out)


@functools.partial(jax.jit, static_argnums=2)
def _xla(lhs, rhs, out):
    a, b = dequantize_values(lhs), dequantize_values(rhs)
    batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
    dims = (((a.ndim - 1,), (b.ndim - 1,)), batch)
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32).astype(out)


@functools.partial(jax.jit, static_argnums=2)
def _cudnn(lhs, rhs, out):  # pragma: no cover - needs a Blackwell GPU
    lhs, rhs = unpack(lhs), unpack(rhs)
    (ls, lg), (rs, rg) = _block_scales(lhs), _block_scales(rhs)
    a, b = lhs.qvalue, rhs.qvalue
    if a.ndim == 2:
        a, b, ls, rs = a[None], b[None], ls[None], rs[None]
    y = jax.nn.scaled_matmul(a, b, ls, rs, preferred_element_type=jnp.float32)
    y = y[0] if lhs.ndim == 2 else y
    return (y * lg * rg).astype(out)
