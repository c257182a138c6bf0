"""linen layers run in training (float kernels), for `jaxquant.flax.linen`.

`qat` re-runs an intercepted ``Dense``, ``DenseGeneral``, ``Conv``,
``ConvTranspose``, ``ConvLocal`` or ``Einsum`` call as a clone bound to the same
scope with an injected ``promote_dtype`` (`QATPromote`: fake quantization of
kernel and input) or ``dot_general`` (`QATDot`: the int8 training dot);
``Embed`` lookups and ``attend`` are
computed here on the fake-quantized table. Learned scales (``learn_scale``) are
the ``"quant"`` variables of the layer's scope (`learned`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxquant._qtensor import is_qtensor
from jaxquant.flax._infer_ops import check_own_op
from jaxquant.flax._linen_infer import DEQUANTIZED, check_not_overridden, einsum_str, get_param
from jaxquant.flax._ops import QATDot, QATPromote, einsum_contract, fake_quant_weight, init_qparams
from jaxquant.flax._rules import QuantConfig

__all__ = ["contract", "kernel_name", "learned", "qat", "setup_embed", "unrecorded"]


def kernel_name(m) -> str:
    """``"embedding"`` for an ``Embed``, else ``"kernel"``."""
    return "embedding" if isinstance(m, nn.Embed) else "kernel"


def contract(m, args, kwargs) -> tuple[int, ...] | None:
    """The input axes ``m`` contracts (per-token activation scales); ``None`` for a
    convolution (one scale per tensor)."""
    if isinstance(m, nn.Conv | DEQUANTIZED):
        return None
    if isinstance(m, nn.DenseGeneral):
        return tuple(m.axis) if isinstance(m.axis, tuple | list) else (m.axis,)
    if isinstance(m, nn.Einsum):
        return einsum_contract(einsum_str(m, args, kwargs))
    return (-1,)


@contextlib.contextmanager
def unrecorded():
    """Calls inside are not recorded by ``capture_intermediates``: the clone that `qat`
    (or inference) runs is the intercepted call itself, which Flax records once."""
    stack = getattr(getattr(nn.module, "_context", None), "capture_stack", None)
    if stack is None:  # another Flax layout: nothing to suppress
        yield
        return
    stack.append(None)  # Flax records a call when the innermost filter is truthy
    try:
        yield
    finally:
        stack.pop()


def learned(scope, name: str, spec, kernel):
    """The ``"quant"`` variables ``<name>_scale`` and (asymmetric ``spec``)
    ``<name>_zero_point`` as ``(scale, zero_point or None)``, created at init from the
    values `jaxquant.quantize` computes for ``kernel``.

    Raises:
      ValueError: they are missing and the ``"quant"`` collection cannot be created
        (``apply`` on ``"params"`` alone, or ``nn.scan`` without ``"quant"`` axes).
    """
    names = (name + "_scale", None if spec.symmetric else name + "_zero_point")
    if not scope.has_variable("quant", names[0]):  # Embed: lookup and attend share them
        if not scope.is_mutable_collection("quant"):
            raise ValueError(f"learn_scale=True needs the 'quant' variable {names[0]} of init "
                             f"(pass init's whole variables, not only 'params'); nn.scan / "
                             f"nn.vmap need 'quant' in variable_axes (or, where they broadcast "
                             f"'params', in variable_broadcast).")
        for n, value in zip(names, init_qparams(kernel, spec), strict=True):
            if n is not None:
                scope.put_variable("quant", n, value)
    return tuple(n and scope.get_variable("quant", n) for n in names)


def qat(m, method: str, cfg: QuantConfig, args, kwargs):
    """The intercepted call of ``m`` with fake-quantized kernel and input (or the int8
    training dot), as the rule ``cfg`` says.

    Args:
      m: the intercepted layer (bound), with a float kernel.
      method: ``"__call__"`` or (``Embed``) ``"attend"``.
      cfg: the layer's rule.
      args: the call's positional arguments.
      kwargs: the call's keyword arguments.

    Returns:
      What the float layer returns, computed on the fake-quantized kernel and input.

    Raises:
      ValueError: non-integer ``Embed`` indices; a spec that does not fit the layer
        (the caller puts the layer's path in front); a subclass's method that never calls
        ``promote_dtype``.
    """
    weight, act = cfg.weight, cfg.act
    updates: dict[str, Any] = {}
    int8_dot = cfg.int8_dot and isinstance(m, nn.Dense | nn.DenseGeneral)
    if int8_dot:  # the kernel reaches QATDot uncast: its codes are those quantize_params stores
        check_own_op(m)
        updates.update(dot_general=QATDot(weight, act), dot_general_cls=None)
        weight = act = None
    scale = None
    if cfg.learn_scale:
        scale = functools.partial(learned, m.scope, kernel_name(m), weight)
    calls: list = []  # a subclass's own __call__ may never call promote_dtype
    promote = QATPromote(m.promote_dtype, weight, act, contract(m, args, kwargs), scale,
                         keep_kernel=int8_dot,  # an ActSpec: deployed as an integer dot
                         exact_kernel=act is not None and not isinstance(m, DEQUANTIZED | nn.Embed),
                         calls=calls)
    if isinstance(m, nn.Embed):  # set up already: a clone would create its table again
        check_not_overridden(m, method)
        table = get_param(m, "embedding")  # float (`m.embedding` is fake-quantized: `_setup`)
        if method == "attend":
            query, table = promote(args[0] if args else kwargs["query"], table, dtype=m.dtype)
            return jnp.dot(query, table.T)
        (table,) = promote(table, dtype=m.dtype, inexact=False)
        inputs = args[0] if args else kwargs["inputs"]
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"Embed inputs must be integer indices, got dtype {inputs.dtype}.")
        if m.num_embeddings == 1:
            return jnp.broadcast_to(table, inputs.shape + (m.features,))
        return jnp.take(table, inputs, axis=0)
    updates["promote_dtype"] = promote
    with unrecorded():
        out = getattr(m.clone(parent=m.scope, **updates), method)(*args, **kwargs)
    if not calls:
        raise ValueError(f"{type(m).__name__}.{method} never calls self.promote_dtype, through "
                         f"which jaxquant fake-quantizes the kernel and input: it would train "
                         f"float. Call it as the Flax layer does, or leave the layer float "
                         f"(rule -> None).")
    return out


def setup_embed(m, cfg: QuantConfig | None, stored) -> None:
    """``Embed.embedding`` read directly (a tied head ``h @ embed.embedding.T``) holds
    what the rule's layers compute with: the dequantized table of a QTensor, the
    fake-quantized table in training (a weight rule), else the float table."""
    if is_qtensor(stored):
        m.embedding = stored.dequantize()
    elif cfg is not None and cfg.weight is not None:
        sz = learned(m.scope, "embedding", cfg.weight, stored) if cfg.learn_scale else ()
        m.embedding = fake_quant_weight(stored, cfg.weight, *sz)
