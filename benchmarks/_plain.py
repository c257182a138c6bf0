"""Plain ``jnp`` spellings of each format: the baselines `benchmarks.run` times jaxquant against.

Each is what a user would write without jaxquant: one jitted expression per
format, codes stored one per byte (no sub-byte packing), the usual inexact
``x / s``. They match jaxquant's formats in layout and scale choice, so the
rows compare the same work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np


def quantize(x, s):
    """The usual inexact one-liner: ``clip(round(x / s), -128, 127)`` as int8."""
    return jnp.clip(jnp.round(x / s), -128, 127).astype(jnp.int8)


def dequantize(q, s):
    """``q * s`` in float32."""
    return q.astype(jnp.float32) * s


def fake_quant(x, s):
    """``dequantize(quantize(x))`` without a custom gradient."""
    return jnp.clip(jnp.round(x / s), -128, 127) * s


def absmax_scale(x, axis=None, qmax=127):
    """``absmax / qmax`` over ``axis`` (all of ``x`` for ``None``), kept broadcastable."""
    return jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None) / qmax


def block_codes(x, block=128, qmax=7):
    """Blocked symmetric codes along the last axis, stored as int8 (no sub-byte dtype)."""
    b = x.reshape(x.shape[0], -1, block)
    s = absmax_scale(b, axis=-1, qmax=qmax)
    q = jnp.clip(jnp.round(b / s), -qmax - 1, qmax).astype(jnp.int8)
    return q.reshape(x.shape), s


def block_dequantize(q, s, block=128):
    """``codes * scale`` in blocks along the last axis, float32."""
    b = q.astype(jnp.float32).reshape(q.shape[0], -1, block)
    return (b * s.astype(jnp.float32)).reshape(q.shape)


NF4_VALUES = np.asarray(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
"""bitsandbytes' NF4 table (code i holds value i)."""


def _e8m0_scale(amax, emax: int):
    """OCP MX shared scale ``2**(floor(log2(amax)) - emax)`` (1 for all-zero blocks), float32."""
    _, e = jnp.frexp(amax)  # amax = m * 2**e with m in [0.5, 1): floor(log2(amax)) = e - 1
    return jnp.exp2(jnp.where(amax > 0, jnp.clip(e - 1 - emax, -127, 127), 0).astype(jnp.float32))


def nf4_quantize(x, block=64):
    """NF4 the usual way: absmax per block, then the nearest table entry by ``argmin``."""
    b = x.reshape(x.shape[0], -1, block)
    s = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
    s = jnp.where(s > 0, s, 1.0)
    q = jnp.argmin(jnp.abs((b / s)[..., None] - NF4_VALUES), axis=-1).astype(jnp.uint8)
    return q.reshape(x.shape), s


def nf4_dequantize(q, s, block=64):
    """``table[codes] * scale``."""
    b = jnp.asarray(NF4_VALUES)[q.reshape(q.shape[0], -1, block)]
    return (b * s).reshape(q.shape)


def mx_quantize(x, dtype=jnp.float8_e4m3fn, emax=8, block=32):
    """OCP MX: a power-of-two scale per block of 32, codes cast to ``dtype`` after clipping."""
    b = x.reshape(x.shape[0], -1, block)
    s = _e8m0_scale(jnp.max(jnp.abs(b), axis=-1, keepdims=True), emax)
    top = float(jnp.finfo(dtype).max)
    q = jnp.clip(b / s, -top, top).astype(dtype)
    return q.reshape(x.shape), s.astype(jnp.float8_e8m0fnu)


def mx_dequantize(q, s):
    """``codes * scale`` in blocks of 32."""
    return block_dequantize(q, s, 32)


def nvfp4_quantize(x):
    """NVFP4: a float32 tensor scale, float8_e4m3fn scales per block of 16, E2M1 codes."""
    b = x.reshape(x.shape[0], -1, 16)
    block_scale = jnp.max(jnp.abs(b), axis=-1, keepdims=True) / 6
    tensor_scale = jnp.max(block_scale) / 448
    s8 = (block_scale / tensor_scale).astype(jnp.float8_e4m3fn)
    q = jnp.clip(b / (s8.astype(jnp.float32) * tensor_scale), -6, 6).astype(jnp.float4_e2m1fn)
    return q.reshape(x.shape), s8, tensor_scale


def nvfp4_dequantize(q, s8, tensor_scale):
    """``codes * block scale * tensor scale``."""
    b = q.astype(jnp.float32).reshape(q.shape[0], -1, 16)
    return (b * (s8.astype(jnp.float32) * tensor_scale)).reshape(q.shape)


FORMATS: dict[str, tuple[Callable, Callable]] = {
    "int4": (block_codes, block_dequantize),
    "nf4": (nf4_quantize, nf4_dequantize),
    "mxfp8_e4m3": (mx_quantize, mx_dequantize),
    "mxfp4": (functools.partial(mx_quantize, dtype=jnp.float4_e2m1fn, emax=2),
              mx_dequantize),
    "nvfp4": (nvfp4_quantize, nvfp4_dequantize),
}
"""Each format's plain jnp (quantize, dequantize): unpacked codes, one byte each."""
