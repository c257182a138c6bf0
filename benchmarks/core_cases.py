"""The cases of the core benchmark (`benchmarks.run`): inputs, rows and their callables.

`cases` lists every row: jaxquant's quantize / dequantize / fake_quant of each
format and granularity, the plain ``jnp`` spelling of the same maths
(`benchmarks._plain`), the peers (ONNX Runtime, PyTorch, qwix, each optional)
and the memory-copy limits (`LIMIT_CASE` on the host, `DEVICE_LIMIT_CASE` on an
accelerator; `limit_case` picks). Every case builds, from the shared
`Inputs`, a zero-argument callable that returns when its work is done.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq

try:  # python -m benchmarks.run
    from benchmarks import _plain as plain
    from benchmarks._peers import ort_call, torch_call
except ImportError:  # python benchmarks/run.py
    import _plain as plain
    from _peers import ort_call, torch_call

LIMIT_CASE = "numpy.copyto (preallocated)"
"""The host's memory-copy limit: every case on the CPU is compared with its bandwidth."""
DEVICE_LIMIT_CASE = "jax jit copy (x + 0)"
"""An accelerator's copy limit: a device-to-device copy into a fresh buffer."""
HOST_PACKAGES = ("onnxruntime", "torch")
"""Peers that run on the host CPU whatever JAX's backend (as NumPy does)."""
INT4_B128, INT8_B128 = 4 + (4 + 32 / 128) / 8, 4 + (8 + 32 / 128) / 8
"""Bytes per element of float32 and codes in blocks of 128 with float32 scales: int4 codes
two per byte; one byte per code (int8, or int4 held unpacked, as JAX and qwix hold it)."""


def limit_case(backend: str) -> str:
    """The copy-limit row for JAX's ``backend``: NumPy's on the CPU, else the device's own."""
    return LIMIT_CASE if backend == "cpu" else DEVICE_LIMIT_CASE


# --------------------------------------------------------------------------- inputs


class Inputs:
    """The benchmark array and everything derived from it, built once on first use.

    Attributes:
      size: the array is ``size x size`` float32.
    """

    def __init__(self, size: int, seed: int = 0):
        self.size = size
        self.seed = seed
        self._formatted: dict[str, jq.QTensor] = {}
        self._plain_formatted: dict[str, tuple[jax.Array, ...]] = {}

    @functools.cached_property
    def x_np(self) -> np.ndarray:
        """The random-normal float32 array, in host memory."""
        return np.random.default_rng(self.seed).standard_normal((self.size,) * 2, np.float32)

    @functools.cached_property
    def x(self) -> jax.Array:
        """``x_np`` on the JAX device."""
        return jax.device_put(self.x_np).block_until_ready()

    @functools.cached_property
    def scale_np(self) -> np.float32:
        """Per-tensor int8 scale: ``absmax / 127``."""
        return np.float32(np.abs(self.x_np).max() / np.float32(127))

    @functools.cached_property
    def scales_np(self) -> np.ndarray:
        """Per-row (axis 0) int8 scales: ``absmax / 127`` of each row."""
        return (np.abs(self.x_np).max(axis=1) / np.float32(127)).astype(np.float32)

    @functools.cached_property
    def scale(self) -> jax.Array:
        """``scale_np`` on the device."""
        return jnp.asarray(self.scale_np)

    @functools.cached_property
    def scales(self) -> jax.Array:
        """``scales_np`` on the device."""
        return jnp.asarray(self.scales_np)

    @functools.cached_property
    def qt(self) -> jq.QTensor:
        """Per-tensor int8 `QTensor` of ``x`` (the dequantize input)."""
        return jax.block_until_ready(jq.quantize(self.x, self.scale))

    @functools.cached_property
    def qt_ch(self) -> jq.QTensor:
        """Per-row int8 `QTensor` of ``x`` (the per-channel dequantize input)."""
        return jax.block_until_ready(jq.quantize(self.x, self.scales, axis=0))

    def formatted(self, fmt: str) -> jq.QTensor:
        """``x`` quantized by jaxquant to ``FORMATS[fmt]`` (a dequantize input), built once."""
        if fmt not in self._formatted:
            fn = jax.jit(functools.partial(jq.quantize, **FORMATS[fmt]))
            self._formatted[fmt] = jax.block_until_ready(fn(self.x))
        return self._formatted[fmt]

    def plain_formatted(self, fmt: str) -> tuple[jax.Array, ...]:
        """``x`` quantized by the plain jnp spelling of ``fmt`` (codes and scales), built once."""
        if fmt not in self._plain_formatted:
            quantize, _ = plain.FORMATS[fmt]
            self._plain_formatted[fmt] = jax.block_until_ready(jax.jit(quantize)(self.x))
        return self._plain_formatted[fmt]

    @functools.cached_property
    def codes_np(self) -> np.ndarray:
        """Per-tensor int8 codes in host memory."""
        return np.asarray(self.qt.qvalue)

    @functools.cached_property
    def codes_ch_np(self) -> np.ndarray:
        """Per-row int8 codes in host memory."""
        return np.asarray(self.qt_ch.qvalue)


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark row.

    Attributes:
      name: the row label (library and operation).
      group: the format and granularity the row belongs to.
      bytes_per_element: bytes that must cross memory per array element
        (input read plus output written; an extra read where the scale must be
        known before the first code can be written).
      build: makes the zero-argument callable to time from the `Inputs`; the
        callable must return only when the work is done.
      baseline: the name of the plain ``jnp`` case doing the same operation.
      requires: the optional package the case needs.
    """

    name: str
    group: str
    bytes_per_element: float
    build: Callable[[Inputs], Callable[[], object]]
    baseline: str | None = None
    requires: str | None = None

    def device(self, backend: str) -> str:
        """Where the case runs: ``"host cpu"`` for NumPy and the host peers, else ``backend``."""
        host = backend == "cpu" or self.name == LIMIT_CASE or self.requires in HOST_PACKAGES
        return "host cpu" if host else backend


def jax_call(fn: Callable, *args) -> Callable[[], object]:
    """``jax.jit(fn)`` bound to ``args``, as a callable that blocks until the result is ready."""
    jitted = jax.jit(fn)
    return lambda: jax.block_until_ready(jitted(*args))


# --------------------------------------------------------------------------- low-bit formats

FORMATS: dict[str, dict] = {
    "int4": dict(dtype=jnp.int4, axis=-1, block_size=128, packed=True),
    "nf4": dict(dtype="nf4", packed=True),
    "mxfp8_e4m3": dict(dtype="mxfp8_e4m3"),
    "mxfp4": dict(dtype="mxfp4", packed=True),
    "nvfp4": dict(dtype="nvfp4", packed=True),
}
"""The ``jq.quantize`` arguments of each low-bit format timed here (all along the rows)."""


def jq_format_quantize(fmt: str) -> Callable[[Inputs], Callable[[], object]]:
    """A builder of ``jq.quantize(x, **FORMATS[fmt])``, jitted."""
    return lambda i: jax_call(functools.partial(jq.quantize, **FORMATS[fmt]), i.x)


def jq_format_dequantize(fmt: str) -> Callable[[Inputs], Callable[[], object]]:
    """A builder of ``jq.dequantize`` of ``x`` in format ``fmt``, jitted."""
    return lambda i: jax_call(jq.dequantize, i.formatted(fmt))


def plain_format_quantize(fmt: str) -> Callable[[Inputs], Callable[[], object]]:
    """A builder of the plain jnp quantize of ``fmt``, jitted."""
    return lambda i: jax_call(plain.FORMATS[fmt][0], i.x)


def plain_format_dequantize(fmt: str) -> Callable[[Inputs], Callable[[], object]]:
    """A builder of the plain jnp dequantize of ``fmt`` (of its own codes), jitted."""
    return lambda i: jax_call(plain.FORMATS[fmt][1], *i.plain_formatted(fmt))


def format_cases(fmt: str, group: str, label: str, packed_bits: float, plain_bits: float,
                 plain_label: str, extra_read: float = 0.0) -> list[Case]:
    """jaxquant and plain jnp quantize and dequantize rows of one low-bit format.

    Args:
      fmt: the key of `FORMATS` and `plain.FORMATS`.
      group: the rows' group.
      label: the jaxquant rows' format description.
      packed_bits: jaxquant's stored bits per element (codes and scales).
      plain_bits: the plain spelling's stored bits per element (one byte per code).
      plain_label: the plain rows' format description.
      extra_read: bytes per element read before the first code can be written
        (4 for NVFP4's tensor scale).
    """
    q, dq = f"quantize {label}", f"dequantize {label}"
    pq, pdq = _pt(f"{fmt} quantize ({plain_label})"), _pt(f"{fmt} dequantize ({plain_label})")
    return [
        Case(f"jaxquant {q}", group, 4 + packed_bits / 8 + extra_read,
             jq_format_quantize(fmt), pq),
        Case(pq, group, 4 + plain_bits / 8 + extra_read, plain_format_quantize(fmt)),
        Case(f"jaxquant {dq}", group, 4 + packed_bits / 8, jq_format_dequantize(fmt), pdq),
        Case(pdq, group, 4 + plain_bits / 8, plain_format_dequantize(fmt)),
    ]


def donated_fake_quant(inp: Inputs) -> Callable[[], object]:
    """``jq.fake_quant`` with its input donated: XLA writes the result into the input's buffer.

    Each call feeds the previous result back in (the same work every time), so
    no call needs a freshly allocated output.
    """
    fn = jax.jit(jq.fake_quant, donate_argnums=0)
    state = [inp.x + 0]  # a private copy: donation consumes it

    def call():
        state[0] = fn(state[0], inp.scale).block_until_ready()

    return call


def quantize_into_donated_buffer(inp: Inputs) -> Callable[[], object]:
    """``jq.quantize`` writing its codes into the previous call's donated code buffer.

    The output has the shape and dtype of the donated argument, so XLA aliases
    them and no call allocates (and page-faults in) a fresh 64 MiB output: the
    JAX equivalent of ONNX Runtime's reused memory pool.
    """
    fn = jax.jit(lambda x, s, out: jq.quantize(x, s).qvalue, donate_argnums=2, keep_unused=True)
    state = [jnp.zeros(inp.x.shape, jnp.int8)]

    def call():
        state[0] = fn(inp.x, inp.scale, state[0]).block_until_ready()

    return call


def numpy_copy(inp: Inputs) -> Callable[[], object]:
    """``numpy.copyto`` into a buffer allocated (and touched) once."""
    out = np.empty_like(inp.x_np)
    np.copyto(out, inp.x_np)
    return lambda: np.copyto(out, inp.x_np)


def torch_qtensor(inp: Inputs, per_channel: bool):
    """The torch quantized tensor matching ``inp.qt`` / ``inp.qt_ch`` (dequantize input)."""
    import torch

    x = torch.from_numpy(inp.x_np)
    if per_channel:
        n = inp.size
        return torch.quantize_per_channel(x, torch.from_numpy(inp.scales_np).double(),
                                          torch.zeros(n, dtype=torch.int64), 0, torch.qint8)
    return torch.quantize_per_tensor(x, float(inp.scale_np), 0, torch.qint8)


def qwix_call(qtype, **kwargs) -> Callable[[Inputs], Callable[[], object]]:
    """A builder of ``qwix.quantize(x, qtype, **kwargs)``, jitted (computed absmax scales)."""
    def build(inp: Inputs):
        import qwix

        return jax_call(lambda x: qwix.quantize(x, qtype, **kwargs), inp.x)

    return build


def _pt(name: str) -> str:
    return f"plain jnp {name}"


def cases() -> list[Case]:
    """The table of benchmark cases, in the order they run and print."""
    t, c, cm, b4 = ("int8 per-tensor", "int8 per-channel (axis 0)", "int8 computed scale",
                    "int4 block-128 computed")
    ort, torch, qwix = "onnxruntime", "torch", "qwix"
    return [
        Case(LIMIT_CASE, "memory copy", 8, numpy_copy),
        Case(DEVICE_LIMIT_CASE, "memory copy", 8, lambda i: jax_call(lambda x: x + 0, i.x)),
        # --- per-tensor, explicit scale
        Case("jaxquant quantize", t, 5,
             lambda i: jax_call(jq.quantize, i.x, i.scale), _pt("quantize")),
        Case(_pt("quantize"), t, 5, lambda i: jax_call(plain.quantize, i.x, i.scale)),
        Case("onnxruntime QuantizeLinear", t, 5,
             lambda i: ort_call("QuantizeLinear", i.x_np, i.scale_np, np.int8(0)),
             _pt("quantize"), ort),
        Case("torch quantize_per_tensor", t, 5,
             lambda i: torch_call("quantize_per_tensor", lambda th: (
                 th.from_numpy(i.x_np), float(i.scale_np), 0, th.qint8)),
             _pt("quantize"), torch),
        Case("jaxquant dequantize", t, 5,
             lambda i: jax_call(jq.dequantize, i.qt), _pt("dequantize")),
        Case(_pt("dequantize"), t, 5,
             lambda i: jax_call(plain.dequantize, i.qt.qvalue, i.scale)),
        Case("onnxruntime DequantizeLinear", t, 5,
             lambda i: ort_call("DequantizeLinear", i.codes_np, i.scale_np, np.int8(0)),
             _pt("dequantize"), ort),
        Case("torch dequantize", t, 5,
             lambda i: torch_call("dequantize", lambda th: (torch_qtensor(i, False),)),
             _pt("dequantize"), torch),
        Case("jaxquant fake_quant", t, 8,
             lambda i: jax_call(jq.fake_quant, i.x, i.scale), _pt("fake_quant")),
        Case("jaxquant quantize (output buffer donated)", t, 5, quantize_into_donated_buffer,
             _pt("quantize")),
        Case("jaxquant fake_quant (input donated)", t, 8, donated_fake_quant, _pt("fake_quant")),
        Case(_pt("fake_quant"), t, 8, lambda i: jax_call(plain.fake_quant, i.x, i.scale)),
        Case("torch fake_quantize_per_tensor_affine", t, 8,
             lambda i: torch_call("fake_quantize_per_tensor_affine", lambda th: (
                 th.from_numpy(i.x_np), float(i.scale_np), 0, -128, 127)),
             _pt("fake_quant"), torch),
        # --- per-channel (one scale per row), explicit scale
        Case("jaxquant quantize (axis 0)", c, 5,
             lambda i: jax_call(functools.partial(jq.quantize, axis=0), i.x, i.scales),
             _pt("quantize (axis 0)")),
        Case(_pt("quantize (axis 0)"), c, 5,
             lambda i: jax_call(plain.quantize, i.x, i.scales[:, None])),
        Case("onnxruntime QuantizeLinear (axis 0)", c, 5,
             lambda i: ort_call("QuantizeLinear", i.x_np, i.scales_np,
                                np.zeros(i.size, np.int8), axis=0),
             _pt("quantize (axis 0)"), ort),
        Case("torch quantize_per_channel", c, 5,
             lambda i: torch_call("quantize_per_channel", lambda th: (
                 th.from_numpy(i.x_np), th.from_numpy(i.scales_np).double(),
                 th.zeros(i.size, dtype=th.int64), 0, th.qint8)),
             _pt("quantize (axis 0)"), torch),
        Case("jaxquant dequantize (axis 0)", c, 5,
             lambda i: jax_call(jq.dequantize, i.qt_ch), _pt("dequantize (axis 0)")),
        Case(_pt("dequantize (axis 0)"), c, 5,
             lambda i: jax_call(plain.dequantize, i.qt_ch.qvalue, i.scales[:, None])),
        Case("onnxruntime DequantizeLinear (axis 0)", c, 5,
             lambda i: ort_call("DequantizeLinear", i.codes_ch_np, i.scales_np,
                                np.zeros(i.size, np.int8), axis=0),
             _pt("dequantize (axis 0)"), ort),
        Case("torch dequantize (per-channel)", c, 5,
             lambda i: torch_call("dequantize", lambda th: (torch_qtensor(i, True),)),
             _pt("dequantize (axis 0)"), torch),
        # --- int8, scales computed from the data
        Case("jaxquant quantize (computed, per-tensor)", cm, 9,
             lambda i: jax_call(jq.quantize, i.x), _pt("quantize (computed, per-tensor)")),
        Case(_pt("quantize (computed, per-tensor)"), cm, 9,
             lambda i: jax_call(lambda x: plain.quantize(x, plain.absmax_scale(x)), i.x)),
        Case("jaxquant quantize (computed, axis 0)", cm, 5,
             lambda i: jax_call(functools.partial(jq.quantize, axis=0), i.x),
             _pt("quantize (computed, axis 0)")),
        Case(_pt("quantize (computed, axis 0)"), cm, 5,
             lambda i: jax_call(lambda x: plain.quantize(x, plain.absmax_scale(x, 1)), i.x)),
        Case("qwix quantize (int8, channelwise_axes=(0,))", cm, 5,
             qwix_call(jnp.int8, channelwise_axes=(0,)),
             _pt("quantize (computed, axis 0)"), qwix),
        # --- int4 in blocks of 128 along the rows, computed scales
        Case("jaxquant int4 + jq.pack (one jit)", b4, INT4_B128,
             lambda i: jax_call(lambda x: jq.pack(jq.quantize(
                 x, dtype=jnp.int4, axis=-1, block_size=128)), i.x),
             _pt("int8-stored int4 codes")),
        Case("jaxquant int4 packed=True", b4, INT4_B128,
             lambda i: jax_call(lambda x: jq.quantize(
                 x, dtype=jnp.int4, axis=-1, block_size=128, packed=True), i.x),
             _pt("int8-stored int4 codes")),
        Case("jaxquant int4 (unpacked jnp.int4 codes)", b4, INT8_B128,
             lambda i: jax_call(functools.partial(
                 jq.quantize, dtype=jnp.int4, axis=-1, block_size=128), i.x),
             _pt("int8-stored int4 codes")),
        Case("jaxquant int8 block-128 (int8 codes)", b4, INT8_B128,
             lambda i: jax_call(functools.partial(
                 jq.quantize, dtype=jnp.int8, axis=-1, block_size=128), i.x),
             _pt("int8-stored int4 codes")),
        Case(_pt("int8-stored int4 codes"), b4, INT8_B128,
             lambda i: jax_call(plain.block_codes, i.x)),
        # one scale per row and block of 128, as jaxquant's rows (tiled_axes alone would
        # share each scale across all rows of a 128-column stripe)
        Case("qwix quantize (int4, channelwise_axes=(0,), tiled_axes={1: 128})", b4,
             INT8_B128, qwix_call(jnp.int4, channelwise_axes=(0,), tiled_axes={1: 128}),
             _pt("int8-stored int4 codes"), qwix),
        Case("jaxquant int4 dequantize (packed)", b4, INT4_B128, jq_format_dequantize("int4"),
             _pt("dequantize int8-stored int4 codes")),
        Case(_pt("dequantize int8-stored int4 codes"), b4, INT8_B128,
             plain_format_dequantize("int4")),
        # --- low-bit formats, scales computed from the data, blocks along the rows
        *format_cases("nf4", "nf4 block-64", "nf4 packed=True", 4.5, 8.5, "uint8 codes"),
        *format_cases("mxfp8_e4m3", "mxfp8_e4m3 block-32", "mxfp8_e4m3", 8.25, 8.25,
                      "float8 codes"),
        *format_cases("mxfp4", "mxfp4 block-32", "mxfp4 packed=True", 4.25, 8.25,
                      "unpacked float4_e2m1fn codes"),
        *format_cases("nvfp4", "nvfp4 block-16", "nvfp4 packed=True", 4.5, 8.5,
                      "unpacked float4_e2m1fn codes", extra_read=4),
    ]
