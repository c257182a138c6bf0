"""Quantization of unmodified ``flax.linen`` models through ``nn.intercept_methods``.

`quantize_linen` wraps a model and its rules. Its ``init`` / ``apply`` run the
model under a method interceptor that catches ``__call__`` of ``Dense``,
``DenseGeneral``, ``Conv``, ``ConvTranspose``, ``ConvLocal``, ``Einsum`` and
``Embed`` (and ``Embed.attend``)
and re-runs the layer bound to the same scope with an injected
``promote_dtype`` (fake quantization of kernel and input) or ``dot_general``
(the int8 training dot). A layer whose stored kernel is a `jaxquant.QTensor`
(from `QuantizedLinen.quantize_params`) runs quantized instead: weight-only
(dequantized inside the jitted op) or int8 x int8 -> int32; ``ConvTranspose``
and ``ConvLocal`` run on their dequantized kernel (and fake-quantized input).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import flax
import flax.linen as nn
import jax
import numpy as np

from jaxquant._leaves import eval_shape_sharded, is_abstract
from jaxquant._qtensor import is_qtensor
from jaxquant.flax._boxes import box_qtensor
from jaxquant.flax._gptq import check_gptq_layers, gptq_kernel, linen_input_grams
from jaxquant.flax._infer_ops import InferPromote
from jaxquant.flax._linen_infer import check_kernel_shape, get_param, infer
from jaxquant.flax._linen_qat import kernel_name, qat, setup_embed, unrecorded
from jaxquant.flax._ops import QATPromote, init_qparams, learned_qtensor
from jaxquant.flax._rules import QuantConfig, Rules, check_rules, layer_errors, select, unused

__all__ = ["QuantizedLinen", "quantize_linen"]

LAYERS = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Einsum,
          nn.Embed)


def _interceptor(rules, record: dict | None = None):
    def intercept(next_fun, args, kwargs, context):
        m, method = context.module, context.method_name
        if not isinstance(m, LAYERS) or isinstance(m.promote_dtype, QATPromote | InferPromote):
            return next_fun(*args, **kwargs)
        calls = ("__call__", "attend", "setup") if isinstance(m, nn.Embed) else ("__call__",)
        if method not in calls:
            return next_fun(*args, **kwargs)
        path = "/".join(m.path)
        cfg, _ = select(path, rules)
        name = kernel_name(m)
        stored = get_param(m, name)
        where = f"layer {path!r} ({type(m).__name__})"
        if method == "setup":  # Embed: lookup and attend read the table in `infer` / `qat`
            if not is_qtensor(stored):
                next_fun(*args, **kwargs)
            with layer_errors(where):
                out = setup_embed(m, cfg, get_param(m, name))
            if record is not None:  # a table read only as `.embedding` is a layer too
                record[path] = (type(m).__name__, name, np.shape(get_param(m, name)), cfg)
            return out
        if is_qtensor(stored):
            check_kernel_shape(m, name, stored, args, kwargs)
            with layer_errors(where), unrecorded():
                y = infer(m, method, None if cfg is None else cfg.act, stored, args, kwargs)
        elif cfg is None or (cfg.weight is None and cfg.act is None):
            y = next_fun(*args, **kwargs)
        else:
            with layer_errors(where):
                y = qat(m, method, cfg, args, kwargs)
        if record is not None:
            record[path] = (type(m).__name__, name, np.shape(get_param(m, name)), cfg)
        return y

    return intercept


@dataclasses.dataclass(frozen=True)
class QuantizedLinen:
    """A linen model with quantization rules; made by `quantize_linen`.

    ``init`` and ``apply`` take the arguments of ``module.init`` /
    ``module.apply``. With float params, selected layers train with fake
    quantization; with the tree of `quantize_params`, they run on `QTensor`
    kernels. Learned scales (``learn_scale=True``) live in the ``"quant"``
    collection: differentiate with respect to ``{"params", "quant"}``, and add
    ``"quant"`` to ``variable_axes`` of ``nn.scan``.

    Attributes:
      module: the unmodified ``flax.linen`` model.
      rules: a `QuantConfig`, or ``(pattern, QuantConfig | None)`` pairs on
        ``/``-joined module paths.

    Raises:
      TypeError: ``module`` is not a linen Module; malformed rules.
      ValueError: a pattern that is not a regular expression.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from jaxquant.flax import QuantConfig, QuantizedLinen
      >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
      >>> qm = QuantizedLinen(model, (("layers_0", QuantConfig()), ("layers_9", None)))
      >>> x = jnp.ones((1, 3))
      >>> params = qm.init(jax.random.key(0), x)
      >>> qm.layers(params, x)  # doctest: +ELLIPSIS
      {'layers_0': QuantConfig(weight=QuantSpec(dtype=dtype('int8'), axis=-1, ...),
                               act=None, int8_dot=False, learn_scale=False),
       'layers_2': None}
      >>> qm.unused_rules(params, x)
      [('layers_9', None)]
    """

    module: nn.Module
    rules: tuple

    def __post_init__(self):
        if isinstance(self.module, type) and issubclass(self.module, nn.Module):
            raise TypeError(f"module must be a flax.linen.Module instance, got the class "
                            f"{self.module.__name__}; pass {self.module.__name__}(...).")
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"module must be a flax.linen.Module, got "
                            f"{type(self.module).__name__}.")
        object.__setattr__(self, "_compiled", check_rules(self.rules))

    def _run(self, fn, *args, record=None, **kwargs):
        with nn.intercept_methods(_interceptor(self._compiled, record)):
            return fn(*args, **kwargs)

    def init(self, rngs, *args, **kwargs):
        """``module.init`` with the quantized layers.

        Args:
          rngs: as for ``module.init``.
          *args: the model's inputs.
          **kwargs: keyword arguments of ``module.init``.

        Returns:
          The variables; with ``learn_scale=True`` rules, a ``"quant"`` collection too.
        """
        return self._run(self.module.init, rngs, *args, **kwargs)

    def apply(self, variables, *args, **kwargs):
        """``module.apply``: fake-quantized on float kernels, quantized on QTensor kernels.

        Args:
          variables: from `init` (training) or `quantize_params` (inference).
          *args: the model's inputs.
          **kwargs: keyword arguments of ``module.apply``.

        Returns:
          What ``module.apply`` returns.

        Raises:
          ValueError: a QTensor kernel that the layer's int8 dot cannot take (see
            `jaxquant.qdot_general`), or a non-int8 `ActSpec` at inference on a layer
            with an int8 x int8 path (``ConvTranspose`` / ``ConvLocal`` fake-quantize
            their input with any `ActSpec`).
        """
        return self._run(self.module.apply, variables, *args, **kwargs)

    def _survey(self, variables, args, kwargs) -> dict:
        if not isinstance(variables, Mapping) or "params" not in variables:
            got = f"keys {sorted(variables)}" if isinstance(variables, Mapping) else \
                f"{type(variables).__name__} {variables!r:.60}"
            raise TypeError(f"variables must be the model's variables, a dict with 'params' "
                            f"(what init returns), got {got}.")
        record: dict = {}
        kwargs = {k: v for k, v in kwargs.items() if k != "mutable"}  # every one, below
        fn = lambda v: self._run(self.module.apply, v, *args, record=record, mutable=True,
                                 **kwargs)
        jax.eval_shape(fn, variables)
        return record

    def layers(self, variables, *args, **kwargs) -> dict[str, QuantConfig | None]:
        """The covered layers the model calls, by path, with the config each gets.

        Args:
          variables: the model's variables (float, or from `quantize_params`).
          *args: the model's inputs; ``apply`` is traced abstractly
            (``jax.eval_shape``), nothing is computed.
          **kwargs: keyword arguments of ``module.apply``.

        Returns:
          ``{path: QuantConfig or None}`` in call order (``None``: stays float).
        """
        return {p: r[3] for p, r in self._survey(variables, args, kwargs).items()}

    def unused_rules(self, variables, *args, **kwargs) -> list:
        """The rules that select no layer the model calls (likely typos).

        Args:
          variables: the model's variables.
          *args: the model's inputs (see `layers`).
          **kwargs: keyword arguments of ``module.apply``.

        Returns:
          The rules, as given, that are the first match of no layer.
        """
        return unused(self._survey(variables, args, kwargs), self.rules)

    def input_grams(self, variables, *args, **kwargs) -> dict[str, jax.Array]:
        """Gram matrices of the inputs of ``Dense`` layers with a weight rule, for GPTQ.

        Runs the float model once (jitted) on a calibration batch: per layer path,
        ``x^T x`` over the input's rows (every leading axis, padding included).
        Grams of several batches add up (``jax.tree.map(jnp.add, a, b)``).

        Args:
          variables: the float model's variables.
          *args: a calibration batch (the model's inputs).
          **kwargs: keyword arguments of ``module.apply``.

        Returns:
          ``{path: float32 (in, in) array}``, for `quantize_params` ``grams=``.

        Raises:
          ValueError: the layers run inside ``nn.scan`` / ``nn.remat`` (not recorded).
        """
        return linen_input_grams(self.module, self._compiled, variables, args, kwargs)

    def quantize_params(self, variables, *args, grams: dict | None = None, **kwargs):
        """``variables`` with the kernels of selected layers as `QTensor` leaves.

        Each kernel is quantized with its rule's ``weight`` spec (packed int4
        allowed), with its learned ``"quant"`` scale (and zero point, rounded as
        in training) if it has one, else with
        computed scales (the values fake quantization trained with), or with
        GPTQ (`jaxquant.gptq`) where ``grams`` has the layer's input Gram matrix.
        Kernels stacked by ``nn.scan`` / ``nn.vmap`` are quantized layer by layer, each
        array of the `QTensor` stacked on the kernel's stacking axis. Only leading stacking
        axes (``variable_axes={"params": 0}``, Flax's default) have a tree and file form:
        a kernel stacked on a later axis runs with ``apply``, but `jaxquant.dequantize_tree`,
        `jaxquant.quantization_report` and the checkpoints refuse it. The axis is read
        from the shapes, so a kernel whose stack also reads as leading (``(6, 6)`` layers
        stacked 6 times on axis 1) is taken as leading: stack such layers on axis 0. Variables of
        `jax.ShapeDtypeStruct` placeholders (``jax.eval_shape(qm.init, ...)``) give
        abstract `QTensor` kernels: a target for `jaxquant.load_safetensors` /
        `jaxquant.load_orbax` without training or quantizing anything. The model's
        inputs (``*args``, ``**kwargs``) are needed to find the layers; ``apply``
        is traced abstractly.

        Args:
          variables: trained variables (``"params"``, and ``"quant"`` for learned scales).
          *args: the model's inputs.
          grams: ``{path: x^T x}`` from `input_grams`, or None (no GPTQ).
          **kwargs: keyword arguments of ``module.apply``.

        Returns:
          A copy of ``variables``: quantized kernels, the ``"quant"`` collection dropped.

        Raises:
          ValueError: a learned ``"quant"`` scale met by a rule without ``learn_scale``
            (convert with the training rules: the scales are used with the rule's ``weight``
            spec as they are); a gram for no covered layer, or for a layer GPTQ cannot
            quantize (learned scale, a kernel not ``(in, out)``, scales stored in
            another format, a layout other than per output channel or blocked
            along the input axis).
        """
        record = self._survey(variables, args, kwargs)
        if grams is not None:
            check_gptq_layers(grams, {p: (r[3], len(r[2])) for p, r in record.items()})
        out = flax.core.unfreeze(variables)  # a copy, nested dicts
        quant = out.pop("quant", {})
        for path, (_, name, shape, cfg) in record.items():
            if cfg is None or cfg.weight is None:
                continue
            keys = path.split("/") if path else []
            node, qnode = out["params"], quant
            for k in keys:
                node, qnode = node[k], qnode.get(k, {})
            box, spec = node[name], cfg.weight  # placeholders: no sharding constraint
            leaf = box.value if isinstance(box, nn.Partitioned) else nn.meta.unbox(box)
            if is_qtensor(leaf):
                continue
            learned = [qnode[name + k] for k in ("_scale", "_zero_point") if name + k in qnode]
            if learned and not cfg.learn_scale:  # computed scales would drop what QAT learned
                raise ValueError(f"layer {path!r}: its {name} has a learned scale in "
                                 f"variables['quant'], but its rule has learn_scale=False; "
                                 f"convert with the rules it was trained with.")
            fn = functools.partial(learned_qtensor, spec=spec) if learned else spec
            n_stack = leaf.ndim - len(shape)
            stack_axis = _stacking_axis(path, name, leaf.shape, shape)
            in_axes = (stack_axis, *_learned_axes(path, name, learned, spec, shape, leaf.dtype))
            for _ in range(n_stack):  # layers stacked by nn.scan / nn.vmap: one by one
                fn = jax.vmap(fn, in_axes=in_axes, out_axes=stack_axis)
            if grams is not None and path in grams:
                fn = functools.partial(gptq_kernel, gram=grams[path], spec=spec, path=path)
            try:
                if is_abstract(leaf):  # placeholders (jax.eval_shape(qm.init, ...))
                    qt = eval_shape_sharded(fn, leaf, *learned)
                else:
                    qt = fn(leaf, *learned)
            except (TypeError, ValueError) as e:
                if str(e).startswith("grams["):
                    raise
                if stack_axis:
                    raise ValueError(f"layer {path!r}: {name} is stacked along axis "
                                     f"{stack_axis} (variable_axes), where its quantized arrays "
                                     f"do not all have an axis (a per-tensor scale); quantize "
                                     f"it per channel or stack along axis 0. ({e})") from None
                raise type(e)(f"layer {path!r}: cannot quantize its {name} "
                              f"({leaf.dtype}{list(leaf.shape)}) as its rule says: {e}") from None
            if isinstance(box, nn.Partitioned):  # each array keeps its axes' mesh names
                if stack_axis:
                    raise ValueError(f"layer {path!r}: partitioned {name} stacked along axis "
                                     f"{stack_axis}: only leading stacking axes are supported.")
                qt = box_qtensor(qt, box, n_stack)
            node[name] = qt
        return flax.core.freeze(out) if isinstance(variables, flax.core.FrozenDict) else out


def _learned_axes(path: str, name: str, learned: list, spec, shape: tuple, dtype) -> list:
    """The stacking axes of a layer's learned scale (and zero point): ``variable_axes`` may
    stack ``"quant"`` along another axis than ``"params"``."""
    if not learned:
        return []
    one = jax.eval_shape(lambda k: init_qparams(k, spec), jax.ShapeDtypeStruct(shape, dtype))
    return [_stacking_axis(path, f"learned {name} scale", v.shape, o.shape)
            for v, o in zip(learned, [o for o in one if o is not None], strict=True)]


def _stacking_axis(path: str, name: str, stacked: tuple, layer: tuple) -> int:
    """The axis along which ``nn.scan`` / ``nn.vmap`` stacked a layer's parameter of
    shape ``layer`` into ``stacked``: 0 (leading axes, Flax's default), else the one
    ``variable_axes`` position that fits; a ValueError where none or several do. (A
    shape that fits both, such as ``(6, 6)`` stacked 6 times, is read as leading.)"""
    n = len(stacked) - len(layer)
    if n == 0 or stacked[n:] == layer:
        return 0
    fits = [a for a in range(len(stacked)) if stacked[:a] + stacked[a + n:] == layer]
    if n == 1 and len(fits) == 1:
        return fits[0]
    raise ValueError(f"layer {path!r}: cannot tell how its {name} of shape {layer} is stacked "
                     f"into {stacked}; stack layers along leading axes (variable_axes "
                     f"{{'params': 0}}).")


def quantize_linen(module: nn.Module, rules: Rules) -> QuantizedLinen:
    """Quantization-aware training and quantized inference for an unmodified linen model.

    Args:
      module: a ``flax.linen.Module``.
      rules: one `QuantConfig` for every covered layer, or ``(pattern,
        QuantConfig | None)`` pairs: the first pattern `re.search` finds in the
        layer's ``/``-joined module path wins, ``None`` keeps it float.

    Returns:
      A `QuantizedLinen` with ``init``, ``apply``, ``quantize_params``,
      ``input_grams``, ``layers`` and ``unused_rules``.

    Raises:
      TypeError: ``module`` is not a linen Module; malformed rules.
      ValueError: a pattern that is not a regular expression.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import jaxquant as jq
      >>> from jaxquant.flax import QuantConfig, quantize_linen
      >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
      >>> qm = quantize_linen(model, [("layers_2", None), ("Dense|layers", QuantConfig())])
      >>> x = jnp.ones((1, 3))
      >>> params = qm.init(jax.random.key(0), x)
      >>> qparams = qm.quantize_params(params, x)
      >>> qparams["params"]["layers_0"]["kernel"]
      QTensor(int8[3, 4], axis=1, scale[4], dtype=float32)
      >>> bool(jnp.allclose(qm.apply(params, x), qm.apply(qparams, x), atol=1e-6))
      True
    """
    return QuantizedLinen(module, tuple(rules) if isinstance(rules, list) else rules)
