"""GPTQ for Flax layers: input Gram matrices recorded on calibration batches, GPTQ kernels.

`record_gram` adds ``x^T x`` of a ``Dense`` / ``Linear`` layer's input (all
leading axes flattened into rows) to a dict keyed by the layer's path; linen
records through a method interceptor (`linen_input_grams`), nnx through a
recording ``dot_general`` (`GramRecorder`) put on the layer for the call.
`gptq_kernel` turns a float kernel into the `QTensor` of `jaxquant.gptq` with
the layer's weight spec, after `check_gptq_layers` has checked that every
recorded layer can take it; `gptq_kernels` does both for every layer at once, so
that a caller changing a model in place (nnx) changes nothing when one fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxquant._formats import get_format
from jaxquant._gptq import gptq
from jaxquant._packing import pack
from jaxquant._qtensor import QTensor
from jaxquant._schemes import SCHEMES
from jaxquant._spec import QuantSpec
from jaxquant.flax._rules import QuantConfig, layer_errors, select

__all__ = ["GramRecorder", "check_gptq_layers", "gptq_kernel", "gptq_kernels",
           "linen_input_grams", "live_grams", "record_gram", "recorded_grams"]


def record_gram(grams: dict, path: str, x: jax.Array) -> None:
    """``grams[path] += x^T x`` over ``x``'s last axis (float32)."""
    rows = jnp.reshape(x, (-1, x.shape[-1])).astype(jnp.float32)
    gram = rows.T @ rows
    grams[path] = gram if path not in grams else grams[path] + gram


@dataclasses.dataclass
class GramRecorder:
    """A ``dot_general`` that records its left operand's Gram matrix, then calls ``inner``."""

    inner: Callable
    grams: dict
    path: str

    def __call__(self, lhs, rhs, *args, **kwargs):
        record_gram(self.grams, self.path, lhs)
        return self.inner(lhs, rhs, *args, **kwargs)


def live_grams(grams: dict) -> dict:
    """``grams`` as they are, once checked to hold no tracer escaped from a transform.

    A `GramRecorder` on a layer called inside ``nnx.scan``, ``nnx.vmap`` or
    ``nnx.remat`` records a tracer of that transform, which outlives it (and is
    one Gram for all the stacked layers).

    Args:
      grams: ``{path: gram}`` recorded by `GramRecorder` s.

    Returns:
      ``grams``.

    Raises:
      ValueError: a gram recorded inside a transform, naming its layer.
    """
    for path, gram in grams.items():
        try:
            jnp.add(gram, 0)  # an escaped tracer fails here; an outer jit's does not
        except jax.errors.UnexpectedTracerError:
            raise ValueError(f"nnx_input_grams records Linear layers called directly by the "
                             f"model; the layer at {path!r} runs inside a transform (nnx.scan, "
                             f"nnx.vmap, nnx.remat, nnx.cond), which is not supported; give "
                             f"it a None rule in the rules of nnx_input_grams.") from None
    return grams


def recorded_grams(call: Callable[[], Any], grams: dict) -> dict:
    """Runs ``call`` (a model whose layers record into ``grams``), then `live_grams`.

    Raises:
      ValueError: a gram recorded inside a transform, naming its layer (also when the
        layer runs again and its escaped gram fails the sum: ``nnx.remat`` then a direct
        call, both branches of ``nnx.cond``).
      jax.errors.UnexpectedTracerError: the model's own, where no gram escaped.
    """
    try:
        call()
    except jax.errors.UnexpectedTracerError:
        live_grams(grams)  # names the layer whose gram escaped
        raise  # not a gram's: the model's own
    return live_grams(grams)


def linen_input_grams(module: nn.Module, rules, variables, args: tuple,
                      kwargs: dict) -> dict[str, jax.Array]:
    """`QuantizedLinen.input_grams`: ``module.apply`` jitted under a recording interceptor.

    The arrays among ``args`` and ``kwargs`` are traced; other values (a ``train`` flag,
    ``mutable``) reach the model as they are, as in ``module.apply``.
    """
    leaves, tree = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(x, jax.Array | np.ndarray) for x in leaves]

    def run(variables, arrays):
        it = iter(arrays)
        args, kwargs = jax.tree.unflatten(tree, [next(it) if a else x
                                                 for x, a in zip(leaves, is_array, strict=True)])
        grams: dict = {}

        def intercept(next_fun, a, k, context):
            m = context.module
            if context.method_name == "__call__" and isinstance(m, nn.Dense):
                cfg, _ = select("/".join(m.path), rules)
                if cfg is not None and cfg.weight is not None:  # Dense(inputs=x) too
                    record_gram(grams, "/".join(m.path), a[0] if a else k["inputs"])
            return next_fun(*a, **k)

        with nn.intercept_methods(intercept):
            module.apply(variables, *args, **kwargs)
        return grams

    try:
        return jax.jit(run)(variables, [x for x, a in zip(leaves, is_array, strict=True) if a])
    except jax.errors.UnexpectedTracerError as e:
        raise ValueError("input_grams records Dense layers called directly by the model; "
                         "layers inside nn.scan / nn.remat are not supported.") from e


def _why_not(spec: QuantSpec | None, cfg: QuantConfig | None, kernel_ndim: int) -> str | None:
    """Why a layer cannot be quantized by GPTQ, or None."""
    if cfg is None or spec is None:
        return "no rule gives it a weight spec"
    if cfg.learn_scale:
        return "its rule learns the weight scale (learn_scale=True)"
    if kernel_ndim != 2:
        return f"its kernel has {kernel_ndim} dimensions, not (in, out)"
    scheme = SCHEMES.get(spec.dtype) if isinstance(spec.dtype, str) else None
    if scheme is not None and scheme.scale_dtype is not None or spec.scale_dtype is not None \
            or spec.double_quant:
        return "its weight spec stores scales in another format (scale_dtype, double_quant, MX)"
    blocked = spec.axis in (0, -2) and isinstance(spec.block_size, int)
    if not (spec.block_size is None and spec.axis in (-1, 1) or blocked):
        return (f"its weight spec (axis={spec.axis}, block_size={spec.block_size}) is neither "
                f"per output channel nor blocked along the input axis")
    if not blocked and get_format(spec.dtype).is_codebook:
        return (f"its weight spec's {spec.dtype} codes need blocks along the input axis "
                f"(axis=0 and a block_size), got axis={spec.axis}, block_size=None")
    return None


def check_gptq_layers(grams: dict, layers: dict[str, tuple[QuantConfig | None, int]]) -> None:
    """Raises a ValueError for a gram of no layer, or of a layer GPTQ cannot quantize.

    Args:
      grams: ``{path: gram}``.
      layers: ``{path: (config, kernel ndim)}`` of the model's covered layers.
    """
    if not isinstance(grams, dict):
        raise TypeError(f"grams must be a dict of {{layer path: Gram matrix}}, got "
                        f"{type(grams).__name__}.")
    unknown = sorted(set(grams) - set(layers))
    if unknown:
        raise ValueError(f"grams has entries for no covered layer of the model: {unknown}; "
                         f"layers: {sorted(layers)}.")
    for path in grams:
        cfg, ndim = layers[path]
        why = _why_not(None if cfg is None else cfg.weight, cfg, ndim)
        if why:
            raise ValueError(f"grams[{path!r}] cannot be used: {why}.")


def gptq_kernel(kernel: jax.Array, gram: jax.Array, spec: QuantSpec, path: str) -> QTensor:
    """`jaxquant.gptq` of a 2-D ``(in, out)`` kernel with ``spec``'s format and layout.

    Raises:
      ValueError: a kernel that is not 2-D (stacked by ``nn.scan``), naming ``path``.
      TypeError, ValueError: an error of `jaxquant.gptq` (a gram of the wrong shape or
        dtype, a block size not dividing ``in``, a gram that is not positive definite),
        naming ``path``.
    """
    if kernel.ndim != 2:
        raise ValueError(f"grams[{path!r}] cannot be used: the kernel is stacked (shape "
                         f"{kernel.shape}), not (in, out).")
    with layer_errors(f"grams[{path!r}] cannot be used"):
        qt = gptq(kernel, gram, dtype=spec.dtype, axis=spec.axis, block_size=spec.block_size,
                  symmetric=spec.symmetric)
    return pack(qt) if spec.packed else qt


def gptq_kernels(grams: dict, layers: dict[str, tuple[QuantConfig | None, jax.Array]]
                 ) -> dict[str, QTensor]:
    """`check_gptq_layers`, then `gptq_kernel` of every float kernel that has a gram.

    Args:
      grams: ``{path: gram}``.
      layers: ``{path: (config, kernel)}`` of the model's covered layers.

    Returns:
      ``{path: QTensor}`` for the paths of ``grams`` whose kernel is not a QTensor yet.

    Raises:
      TypeError, ValueError: as `check_gptq_layers` and `gptq_kernel`, before any
        kernel is returned.
    """
    check_gptq_layers(grams, {p: (cfg, np.ndim(k)) for p, (cfg, k) in layers.items()})
    return {p: gptq_kernel(layers[p][1], g, layers[p][0].weight, p) for p, g in grams.items()
            if not isinstance(layers[p][1], QTensor)}


def tied_grams(grams: dict, kernels: dict[str, int]) -> dict:
    """Grams of layers that share one kernel (tied weights), summed under the first one's path.

    Such a kernel sees every one of its layers' inputs, as a linen module called twice
    records both calls: one GPTQ over the summed gram, not the first layer's alone.

    Args:
      grams: ``{path: gram}``.
      kernels: ``{path: key}`` of the quantized layers, in model order; equal keys
        (``id`` of the kernel ``Variable``) share a kernel.

    Returns:
      ``grams`` with each group of tied paths as one entry (other paths as given).
    """
    first: dict[int, str] = {}
    for path, key in kernels.items():
        first.setdefault(key, path)
    out: dict = {}
    for path, gram in grams.items():
        owner = first[kernels[path]] if path in kernels else path
        out[owner] = gram if owner not in out else out[owner] + gram
    return out
