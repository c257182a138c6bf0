"""Quantization of ``flax.nnx`` models by module surgery.

`nnx_qat` walks the model's graph (`jaxquant.flax._nnx_graph`) and, in each selected
``Linear``, ``LinearGeneral``, ``Conv``, ``ConvTranspose``, ``Einsum`` or ``Embed``, replaces the
layer's ``promote_dtype`` (fake quantization of kernel and input) or ``dot_general`` (the
int8 training dot): the layers' own extension points, no parameter moves. `nnx_quantize`
puts a `jaxquant.QTensor` in each selected kernel ``Param`` (``qt[...]`` is ``qt``) and injects
``dot_general`` / ``einsum_op`` / ``conv_general_dilated`` that run on it (``Embed`` and
``ConvTranspose``: a ``promote_dtype`` that dequantizes it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype as nnx_promote_dtype

from jaxquant._dot import promote_dtype as q_promote_dtype
from jaxquant._qtensor import is_qtensor
from jaxquant._schemes import resolve
from jaxquant.flax._boxes import QuantizedParam, keep_sharding
from jaxquant.flax._gptq import GramRecorder, gptq_kernels, recorded_grams, tied_grams
from jaxquant.flax._infer_ops import InferConv, InferDot, InferEinsum, InferPromote, check_own_op
from jaxquant.flax._nnx_graph import (
    covered_layers,
    kernel_name,
    layer_paths,
    spec_layout,
    stack,
    stacked_axes,
)
from jaxquant.flax._ops import QATDot, QATEinsum, QATPromote, init_qparams, learned_qtensor
from jaxquant.flax._rules import QuantConfig, Rules, layer_errors, unused

__all__ = ["LearnedScale", "QuantizedParam", "nnx_input_grams", "nnx_layers", "nnx_qat",
           "nnx_quantize", "nnx_unused_rules"]


class LearnedScale(nnx.Module):
    """A layer's ``promote_dtype`` whose kernel scale (LSQ) and, for an asymmetric
    spec, zero point (LSQ+) are ``nnx.Param`` s.

    Installed by `nnx_qat` for ``learn_scale=True``; the state paths are
    ``<layer>/promote_dtype/scale`` and ``<layer>/promote_dtype/zero_point``.

    Args:
      promote: the `QATPromote` that fake-quantizes with ``scale``.
      scale: the initial scale, in the weight spec's layout.
      zero_point: the initial float zero point (scale's shape), or None (symmetric).

    Example:
      >>> from flax import nnx
      >>> from jaxquant.flax import QuantConfig, nnx_qat
      >>> layer = nnx_qat(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), QuantConfig(learn_scale=True))
      >>> layer.promote_dtype.scale.shape
      (2,)
    """

    def __init__(self, promote: QATPromote, scale: jax.Array | nnx.Param,
                 zero_point: jax.Array | nnx.Param | None = None):
        self.promote = promote  # a Param given (another layer's, one kernel): shared
        param = lambda v: v if isinstance(v, nnx.Param) else nnx.Param(v)  # noqa: E731
        self.scale = param(scale)
        self.zero_point = None if zero_point is None else param(zero_point)

    def values(self) -> tuple[jax.Array, jax.Array | None]:
        """The current ``(scale, zero_point or None)``."""
        return self.scale[...], None if self.zero_point is None else self.zero_point[...]

    def __call__(self, *args, **kwargs):
        fn = dataclasses.replace(self.promote, scale=lambda _: self.values())
        return fn(*args, **kwargs)


def _contract(layer):
    if isinstance(layer, nnx.Conv | nnx.ConvTranspose | nnx.Einsum):  # Einsum: `QATEinsum`
        return None
    if isinstance(layer, nnx.LinearGeneral):
        return tuple(layer.axis)
    return (-1,)


def _own_promote(layer):
    """The layer's own ``promote_dtype`` under what `nnx_qat` / `nnx_quantize` installed;
    ``None`` for Flax's (or `jaxquant.promote_dtype`)."""
    p = layer.promote_dtype
    p = p.promote if isinstance(p, LearnedScale) else p
    p = p.inner if isinstance(p, QATPromote | InferPromote) else p
    return None if p in (None, nnx_promote_dtype, q_promote_dtype) else p


def _unwire(layer) -> None:
    """Gives a layer back the ``promote_dtype`` / ``dot_general`` / ``einsum_op`` that
    an earlier `nnx_qat` replaced (so that new rules start from the float layer)."""
    p = layer.promote_dtype
    p = p.promote if isinstance(p, LearnedScale) else p
    if isinstance(p, QATPromote):
        layer.promote_dtype = nnx.static(p.inner)
    if isinstance(getattr(layer, "dot_general", None), QATDot):
        layer.dot_general, cls = layer.dot_general.replaced
        if isinstance(layer, nnx.LinearGeneral):
            layer.dot_general_cls = cls
    if isinstance(getattr(layer, "einsum_op", None), QATEinsum):
        layer.einsum_op = layer.einsum_op.inner


def nnx_layers(model: nnx.Module, rules: Rules) -> dict[str, QuantConfig | None]:
    """The covered layers of ``model``, by ``/``-joined path, with the config each gets.

    Args:
      model: an ``nnx.Module``.
      rules: as for `nnx_qat`.

    Returns:
      ``{path: QuantConfig or None}`` (``None``: stays float).

    Raises:
      TypeError: ``model`` is not an nnx Module; malformed rules.
      ValueError: an invalid pattern; rules that disagree on a shared layer or kernel.

    Example:
      >>> from flax import nnx
      >>> from jaxquant.flax import nnx_layers
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
      >>> nnx_layers(model, [("layers/0", None)])
      {'layers/0': None}
    """
    return {p: cfg for p, _, cfg in covered_layers(model, rules)}


def nnx_unused_rules(model: nnx.Module, rules: Rules) -> list:
    """The rules that select no covered layer of ``model`` (likely typos).

    Args:
      model: an ``nnx.Module``.
      rules: as for `nnx_qat`.

    Returns:
      The rules, as given, that are the first match of no layer (at any of
      its paths: a shared layer has several).

    Raises:
      TypeError, ValueError: as `nnx_layers`.

    Example:
      >>> from flax import nnx
      >>> from jaxquant.flax import QuantConfig, nnx_unused_rules
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
      >>> nnx_unused_rules(model, [("layers/0", QuantConfig()), ("head", None)])
      [('head', None)]
    """
    nnx_layers(model, rules)  # malformed rules, disagreeing rules of a shared layer
    return unused([p for paths in layer_paths(model).values() for p in paths], rules)


def nnx_qat(model: nnx.Module, rules: Rules) -> nnx.Module:
    """Makes an nnx model train with fake-quantized kernels and inputs, in place.

    Args:
      model: an ``nnx.Module``; its covered layers (``Linear``,
        ``LinearGeneral``, ``Conv``, ``ConvTranspose``, ``Einsum``, ``Embed``) are
        rewired.
      rules: one `QuantConfig` for every covered layer, or ``(pattern,
        QuantConfig | None)`` pairs on ``/``-joined attribute paths
        (``blocks/0/linear``); first match wins, ``None`` keeps a layer float.

    A layer is rewired through the ops Flax's layers call (``promote_dtype``,
    ``dot_general``, ``einsum_op``, ``conv_general_dilated``): a subclass whose own
    ``__call__`` computes with its kernel directly trains in float. Stacks of
    layers (``nnx.vmap``) are read from the kernel's shape: one stacked on a later
    axis whose shape also reads as leading is taken as leading.

    Returns:
      ``model`` itself. Parameters are untouched; ``learn_scale=True`` adds an
      ``nnx.Param`` scale (and zero point) per layer (see `LearnedScale`; layers
      sharing one kernel ``Variable`` share them). A
      second call starts from the float layers: what an earlier call injected
      is removed first (a ``None`` rule makes a layer float again).

    Raises:
      TypeError: ``model`` is not an nnx Module; malformed rules.
      ValueError: an invalid pattern; a selected layer with a QTensor kernel; a
        spec that does not fit a layer. Each before any layer changes.

    Example:
      >>> from flax import nnx
      >>> from jaxquant.flax import QuantConfig, nnx_qat
      >>> model = nnx_qat(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), QuantConfig())
      >>> type(model.promote_dtype).__name__
      'QATPromote'
    """
    layers, inits = list(covered_layers(model, rules)), {}
    for path, layer, cfg in layers:  # what can fail, before the model changes
        var = getattr(layer, kernel_name(layer))
        if is_qtensor(var[...]):
            if cfg is None:
                continue
            raise ValueError(f"the {type(layer).__name__} at {path!r} has a QTensor "
                             f"{kernel_name(layer)} (from nnx_quantize); quantization-aware "
                             f"training needs its float {kernel_name(layer)}.")
        if cfg is not None and cfg.learn_scale and id(var) not in inits:
            init = stack(functools.partial(init_qparams, spec=cfg.weight),
                         stacked_axes(path, layer, var[...]))
            with layer_errors(f"layer {path!r} ({type(layer).__name__})"):
                inits[id(var)] = init(var[...])
    learned: dict = {}  # {id(kernel Variable): (Variable, its LearnedScale)}
    for path, layer, cfg in layers:
        if is_qtensor(getattr(layer, kernel_name(layer))[...]):
            continue
        _unwire(layer)
        if cfg is None or (cfg.weight is None and cfg.act is None):
            continue
        weight, act, where = cfg.weight, cfg.act, f"layer {path!r} ({type(layer).__name__})"
        int8_dot = cfg.int8_dot and isinstance(layer, nnx.Linear | nnx.LinearGeneral)
        if int8_dot:  # the kernel reaches QATDot uncast (QATPromote keep_kernel)
            check_own_op(layer, where)
            cls = getattr(layer, "dot_general_cls", None)
            layer.dot_general = QATDot(weight, act, (layer.dot_general, cls), where)
            if isinstance(layer, nnx.LinearGeneral):
                layer.dot_general_cls = None
            weight = act = None
        if isinstance(layer, nnx.Einsum) and act is not None:  # per token of the call's string
            layer.einsum_op = QATEinsum(layer.einsum_op, act, where)
            act = None
        promote = QATPromote(layer.promote_dtype, weight, act, _contract(layer), where=where,
                             keep_kernel=int8_dot, exact_kernel=cfg.act is not None
                             and not isinstance(layer, nnx.Embed | nnx.ConvTranspose))
        if cfg.learn_scale:
            var = getattr(layer, kernel_name(layer))
            if id(var) in learned:  # the same kernel: the same learned scale
                first = learned[id(var)][1]
                layer.promote_dtype = nnx.data(LearnedScale(promote, first.scale,
                                                            first.zero_point))
                continue
            layer.promote_dtype = nnx.data(LearnedScale(promote, *inits[id(var)]))
            learned[id(var)] = (var, layer.promote_dtype)
        else:
            layer.promote_dtype = nnx.static(promote)
    return model


def nnx_input_grams(model: nnx.Module, rules: Rules, *args, **kwargs) -> dict[str, jax.Array]:
    """Gram matrices of the inputs of ``Linear`` layers with a weight rule, for GPTQ.

    Calls ``model(*args, **kwargs)`` once (eagerly) on a calibration batch with a recording
    ``dot_general`` on each such layer, removed afterwards, and returns per layer path ``x^T x``
    over the rows of its dot's input (every leading axis). Grams add up over batches.

    Args:
      model: a float ``nnx.Module``.
      rules: as for `nnx_qat`.
      *args: a calibration batch.
      **kwargs: keyword arguments of the model's call.

    Returns:
      ``{path: float32 (in, in) array}``, for `nnx_quantize` ``grams=``.

    Raises:
      TypeError: ``model`` is not an nnx Module; malformed rules.
      ValueError: a recorded layer run inside ``nnx.scan``, ``nnx.vmap``, ``nnx.remat`` or
        ``nnx.cond`` (naming it).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxquant.flax import QuantConfig, nnx_input_grams
      >>> model = nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
      >>> {k: v.shape for k, v in nnx_input_grams(model, QuantConfig(), jnp.ones((5, 3))).items()}
      {'layers/0': (3, 3)}
    """
    grams: dict = {}
    hooked = []
    for path, layer, cfg in list(covered_layers(model, rules)):
        if isinstance(layer, nnx.Linear) and cfg is not None and cfg.weight is not None:
            hooked.append((layer, layer.dot_general))
            layer.dot_general = GramRecorder(layer.dot_general, grams, path)
    try:
        return recorded_grams(lambda: model(*args, **kwargs), grams)
    finally:
        for layer, dot in hooked:
            layer.dot_general = dot


def _quantize_kernel(path: str, kernel, spec, hook, extra: int):
    """The QTensor of one layer's kernel (learned scales from ``hook``), or an error naming
    the layer."""
    learned = isinstance(hook, LearnedScale)
    ndim = kernel.ndim - extra  # axis -1 and ndim - 1 are one layout; packing is storage
    norm = lambda w: dataclasses.replace(  # noqa: E731
        w, packed=False, axis=w.axis if w.axis is None else w.axis % ndim)
    if learned and norm(hook.promote.weight) != norm(spec):
        raise ValueError(f"layer {path!r} learned its scales in nnx_qat for weight="
                         f"{hook.promote.weight}, but the rule gives weight={spec}; quantize "
                         f"it with the spec it was trained with (packed may differ).")
    fn = functools.partial(learned_qtensor, spec=spec) if learned else spec
    try:
        return stack(fn, extra)(kernel, *(hook.values() if learned else ()))
    except (TypeError, ValueError) as e:
        raise type(e)(f"layer {path!r}: cannot quantize its kernel ({kernel.dtype}"
                      f"{list(kernel.shape)}) as its rule says: {e}") from None


def nnx_quantize(model: nnx.Module, rules: Rules, grams: dict | None = None) -> nnx.Module:
    """Replaces the kernels of selected layers by `QTensor` values for inference, in place.

    Each kernel is quantized with its rule's ``weight`` spec (packed int4
    allowed), with the learned scale of `nnx_qat` if there is one, else with
    computed scales (what fake quantization trained with); a rule with ``weight=None``
    and an `ActSpec` fake-quantizes the layer's input, as in training; a ``None`` rule
    runs the layer float (as in linen). ``Linear``,
    ``LinearGeneral``, ``Einsum`` and ``Conv`` then run weight-only (``act=None``)
    or int8 x int8 -> int32 (an int8 `ActSpec`); ``Embed`` dequantizes its table
    inside the jitted step, ``ConvTranspose`` its kernel (its input fake-quantized
    by an `ActSpec`, as in training).

    Args:
      model: an ``nnx.Module``, trained float or after `nnx_qat`.
      rules: as for `nnx_qat`.
      grams: ``{path: x^T x}`` from `nnx_input_grams`: those layers' kernels are
        quantized with GPTQ (`jaxquant.gptq`; layers sharing a kernel: their grams
        summed); None: no GPTQ.

    Returns:
      ``model`` itself.

    Raises:
      TypeError: ``model`` is not an nnx Module; malformed rules.
      ValueError: an invalid pattern; a masked convolution; a layer built with its own
        dot / conv / einsum op; a rule whose weight spec is not the one a layer learned its
        scales for in `nnx_qat`, or whose format or layout (axis, block, zero points;
        packing aside) is not that of a layer's QTensor kernel (converted before); a gram
        for no covered layer, for a layer GPTQ cannot quantize (see
        `QuantizedLinen.quantize_params`) or that `jaxquant.gptq` refuses. Each is raised
        before any kernel of ``model`` changes.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxquant.flax import QuantConfig, nnx_quantize
      >>> model = nnx_quantize(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), QuantConfig())
      >>> model.kernel[...]
      QTensor(int8[3, 2], axis=1, scale[2], dtype=float32)
      >>> model(jnp.ones((1, 3))).shape
      (1, 2)
    """
    layers = list(covered_layers(model, rules))
    tied = {p: id(getattr(layer, kernel_name(layer))) for p, layer, cfg in layers
            if cfg is not None and cfg.weight is not None}  # shared kernels: summed grams
    solved = {} if grams is None else gptq_kernels(tied_grams(grams, tied), {
        p: (cfg, getattr(layer, kernel_name(layer))[...]) for p, layer, cfg in layers})
    planned, kernels = [], {}  # every kernel first: an error leaves the model as it was
    for path, layer, cfg in layers:
        if cfg is None or cfg.weight is None:  # float, or an ActSpec's `nnx_qat` (below)
            continue
        if isinstance(layer, nnx.Conv | nnx.ConvTranspose) and layer.mask is not None:
            raise ValueError(f"the {type(layer).__name__} at {path!r} has a mask and cannot "
                             f"run on a QTensor kernel; leave it float with a (pattern, None) "
                             f"rule.")
        if not isinstance(layer, nnx.Embed | nnx.ConvTranspose):
            check_own_op(layer, f"layer {path!r}")
        var, spec = getattr(layer, kernel_name(layer)), cfg.weight
        kernel = kernels.get(id(var), var[...])  # a Variable shared with a layer before
        extra = stacked_axes(path, layer, kernel)  # nnx.vmap-made layers: one QTensor per layer
        if not is_qtensor(kernel):
            kernels[id(var)] = solved[path] if path in solved else _quantize_kernel(
                path, kernel, spec, layer.promote_dtype, extra)
        elif kernel.format != resolve(spec.dtype, spec.axis, spec.block_size, None).fmt:
            raise ValueError(f"the {type(layer).__name__} at {path!r} holds a {kernel.format.name}"
                             f" QTensor {kernel_name(layer)} (an earlier nnx_quantize), but its "
                             f"rule gives weight dtype {spec.dtype}; a QTensor is not quantized "
                             f"again: convert the float (or QAT) model.")
        elif spec_layout(kernel) != spec_layout(jax.eval_shape(
                lambda k: stack(spec, extra)(k),  # noqa: B023 (called at once)
                jax.ShapeDtypeStruct(kernel.shape, kernel.dtype))):
            raise ValueError(f"the {type(layer).__name__} at {path!r} holds {kernel!r} (an "
                             f"earlier nnx_quantize), but its rule gives weight={spec}; a "
                             f"QTensor is not quantized again: convert the float (or QAT) model.")
        planned.append((path, layer, cfg, var, extra))
    boxed: dict = {}  # layers sharing a kernel Variable go on sharing its QuantizedParam
    for path, layer, cfg, var, extra in planned:
        if id(var) in kernels and id(var) not in boxed:
            var.set_value(kernels[id(var)])
        keep_sharding(layer, kernel_name(layer), var, extra, boxed)
        act, where = cfg.act, f"layer {path!r} ({type(layer).__name__})"
        if isinstance(layer, nnx.Embed | nnx.ConvTranspose):  # ops that take no QTensor
            contract = None if isinstance(layer, nnx.ConvTranspose) else (-1,)
            layer.promote_dtype = nnx.static(InferPromote(_own_promote(layer), act, True,
                                                          contract))
            continue
        layer.promote_dtype = nnx.static(InferPromote(_own_promote(layer)))
        if isinstance(layer, nnx.Einsum):
            layer.einsum_op = InferEinsum(act, where)
        elif isinstance(layer, nnx.Conv):
            layer.conv_general_dilated = InferConv(act, where)
        else:
            layer.dot_general = InferDot(act, where)
            if isinstance(layer, nnx.LinearGeneral):
                layer.dot_general_cls = None
    for _, layer, cfg in layers:  # act-only rules: the input fake-quantized, as in nnx_qat;
        if cfg is not None and cfg.weight is None and cfg.act is not None:  # None: float
            nnx_qat(layer, cfg)
        elif (cfg is None or cfg.weight is None) \
                and not is_qtensor(getattr(layer, kernel_name(layer))[...]):
            _unwire(layer)
    return model
