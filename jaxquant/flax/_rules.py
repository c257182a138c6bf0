"""Per-layer configuration: `QuantConfig`, `ActSpec` and rules on module paths.

A rule is a plain ``(pattern, QuantConfig | None)`` pair. A layer's path is its
module path joined by ``/`` (linen ``ScanBlock_0/Dense_0``, nnx
``blocks/0/linear``), matched with `re.search`; the first matching rule wins,
``None`` leaves the layer in float, unmatched layers stay float too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxquant._dot import ActQuant
from jaxquant._formats import CODEBOOKS, get_format
from jaxquant._schemes import resolve
from jaxquant._spec import QuantSpec

__all__ = ["ActSpec", "QuantConfig", "Rules", "check_rules", "layer_errors", "select", "unused"]


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def _static_scale(scale) -> float:
    """``scale`` as a Python float: a real number or a concrete one-element array
    (a calibrated scale); a TypeError for other types, a ValueError unless positive
    and finite."""
    number = isinstance(scale, int | float | np.integer | np.floating) \
        and not isinstance(scale, bool | np.bool_)
    if not number and hasattr(scale, "dtype") and hasattr(scale, "size"):
        number = (np.size(scale) == 1 and jnp.issubdtype(scale.dtype, jnp.floating)
                  and not isinstance(scale, jax.core.Tracer))
    if not number:
        raise TypeError(f"ActSpec.scale must be None, a float or a concrete one-element float "
                        f"array, got {scale!r}.")
    value = float(np.asarray(scale).reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"ActSpec.scale must be None or a positive finite float, got "
                         f"{scale!r}.")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActSpec:
    """How a layer's input activations are fake-quantized, symmetrically (unsigned integer
    codes around their mid-range zero point, 128 for uint8, as `jaxquant.quantize`).

    Attributes:
      dtype: the format of the codes (int8, int4, float8..., or a codebook
        name such as ``"nf4"``).
      granularity: dynamic scales, computed on every call: ``"token"``, one
        scale per index of the input's non-contracted dimensions (per row of a
        ``Dense`` input); ``"tensor"``, one scale for the whole input.
        Convolutions use one scale per tensor; an ``Einsum`` takes its tokens
        from the equation it is called with.
      scale: a static per-tensor scale (from calibration, for example, see
        `jaxquant.calibration`: a one-element array is taken as its float);
        ``None`` for dynamic scales.

    Raises:
      ValueError: an unknown granularity or a scale that is not a positive
        finite number.
      TypeError: an unknown format; a scale that is not a number (or a
        concrete one-element float array).

    Example:
      >>> from jaxquant.flax import ActSpec
      >>> ActSpec(granularity="tensor")
      ActSpec(dtype=dtype('int8'), granularity='tensor', scale=None)
    """

    dtype: DTypeLike | str = jnp.int8
    granularity: Literal["token", "tensor"] = "token"
    scale: float | None = None

    def __post_init__(self):
        if not (isinstance(self.dtype, str) and self.dtype in CODEBOOKS):  # keep "nf4"...
            object.__setattr__(self, "dtype", get_format(self.dtype).dtype)
        if self.granularity not in ("token", "tensor"):
            raise ValueError(f"ActSpec.granularity must be 'token' or 'tensor', got "
                             f"{self.granularity!r}.")
        if self.scale is not None:
            object.__setattr__(self, "scale", _static_scale(self.scale))

    def act_quant(self) -> ActQuant:
        """The `jaxquant.ActQuant` of the int8 x int8 -> int32 inference dot.

        Returns:
          ``ActQuant(granularity=self.granularity)``.

        Raises:
          ValueError: a format other than int8 (the integer dot takes int8 codes).
        """
        if self.dtype != jnp.int8:
            raise ValueError(f"int8 x int8 inference needs ActSpec(dtype=jnp.int8), got "
                             f"dtype={_name(self.dtype)}; use act=None (weight-only) for "
                             f"inference or an int8 ActSpec.")
        return ActQuant(granularity=self.granularity)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """How one layer is quantized: a frozen, hashable record.

    Attributes:
      weight: the kernel's `jaxquant.QuantSpec`, or ``None`` to keep the kernel
        float. Default: int8, one scale per index of the kernel's last axis
        (``axis=-1``; stacked layers of ``nn.scan`` / ``nnx.vmap`` each have their
        own): the output features of ``Dense`` / ``Linear``, convolutions
        (``(..., in, out)``), ``Embed`` (its ``features``) and an ``Einsum`` whose
        kernel ends in an output index; the last feature axis of a
        ``DenseGeneral`` with several. A kernel laid out otherwise
        (``ConvTranspose(transpose_kernel=True)``: ``(..., out, in)``; an
        ``Einsum`` such as ``"bd,fd->bf"``) needs its own ``axis``: scales along
        a contracted axis rule out the int8 x int8 inference dot.
      act: an `ActSpec` for the layer's input, or ``None`` (float input;
        weight-only at inference).
      int8_dot: ``Dense``-like layers (linen ``Dense``/``DenseGeneral``, nnx
        ``Linear``/``LinearGeneral``) train through a real int8 x int8 -> int32
        dot with straight-through gradients (`jaxquant.QATDotGeneral`). Needs
        symmetric int8 weights and ``act=None`` or a dynamic int8 `ActSpec`;
        other layers keep fake quantization. The kernel is quantized in its
        ``param_dtype``, before a layer's narrower compute ``dtype`` (bfloat16)
        would round it: the codes `QuantizedLinen.quantize_params` / ``nnx_quantize``
        store.
      learn_scale: the kernel's scale is a trainable variable (LSQ, Esser et
        al. 2020, arXiv:1902.08153), initialized to the scale `jaxquant.quantize`
        computes; with an asymmetric integer spec (``symmetric=False``) so is
        its zero point (LSQ+, Bhalgat et al. 2020, arXiv:2004.09576): a float,
        initialized to the min/max zero point and rounded in the forward pass.
        linen keeps them in the ``"quant"`` collection as ``kernel_scale`` and
        ``kernel_zero_point``, nnx as ``nnx.Param`` s. Needs a weight spec.

    Raises:
      TypeError: a field of the wrong type.
      ValueError: an inconsistent combination (see the attributes).

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> from jaxquant.flax import ActSpec, QuantConfig
      >>> cfg = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, block_size=32), act=ActSpec())
      >>> cfg.weight.block_size, cfg.act.granularity
      (32, 'token')
    """

    weight: QuantSpec | None = dataclasses.field(default_factory=QuantSpec)
    act: ActSpec | None = None
    int8_dot: bool = False
    learn_scale: bool = False

    def __post_init__(self):
        if not (self.weight is None or isinstance(self.weight, QuantSpec)):
            raise TypeError(f"QuantConfig.weight must be a jaxquant.QuantSpec or None, got "
                            f"{type(self.weight).__name__}.")
        if self.weight is not None and self.weight.stacked:
            raise ValueError(f"QuantConfig.weight must describe one layer's kernel (stacked=0): "
                             f"the layers of nn.scan / nnx.scan / nnx.vmap get their own scales "
                             f"already; got stacked={self.weight.stacked}.")
        if not (self.act is None or isinstance(self.act, ActSpec)):
            raise TypeError(f"QuantConfig.act must be an ActSpec or None, got "
                            f"{type(self.act).__name__}.")
        for name in ("int8_dot", "learn_scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QuantConfig.{name} must be a bool, got "
                                f"{getattr(self, name)!r}.")
        if self.learn_scale and self.weight is None:
            raise ValueError("learn_scale=True needs a weight spec, got weight=None.")
        if self.learn_scale:
            w = self.weight
            stored = resolve(w.dtype, w.axis, w.block_size, w.scale_dtype).scale_dtype
            if stored is not None or w.double_quant:
                raise ValueError(
                    f"learn_scale=True learns float32 scales, so it needs a weight spec that "
                    f"stores them as float32 (scale_dtype=None, double_quant=False, no MX / "
                    f"NVFP4 scheme), got weight={w!r} (scales stored as "
                    f"{np.dtype(stored).name if stored is not None else 'float32'}"
                    f"{', double_quant=True' if w.double_quant else ''}).")
        if self.int8_dot:
            w, a = self.weight, self.act
            if w is None or w.dtype != jnp.int8 or not w.symmetric:
                raise ValueError(f"int8_dot=True needs weight=QuantSpec(dtype=jnp.int8, "
                                 f"symmetric=True), got weight={w!r}.")
            if w.scale_dtype is not None or w.double_quant or type(w.block_size) is tuple:
                raise ValueError(f"int8_dot=True scales the int32 dot by float32 scales of "
                                 f"whole rows or 1-D blocks, so it needs a weight spec with "
                                 f"scale_dtype=None, double_quant=False and an int or None "
                                 f"block_size, got weight={w!r}.")
            if a is not None and (a.dtype != jnp.int8 or a.scale is not None):
                raise ValueError(f"int8_dot=True needs act=None or a dynamic int8 ActSpec(), "
                                 f"got act={a!r}.")
            if self.learn_scale:
                raise ValueError("int8_dot=True computes the weight scale from the weight; "
                                 "it cannot be combined with learn_scale=True.")


Rules = QuantConfig | Sequence[tuple[str, QuantConfig | None]]


def check_rules(rules: Rules) -> tuple[tuple[re.Pattern, QuantConfig | None], ...]:
    """Compiled rules; one `QuantConfig` becomes the rule ``("", config)`` (every layer).

    Raises:
      TypeError: ``rules`` is not a QuantConfig or a sequence of
        ``(str, QuantConfig | None)`` pairs.
      ValueError: a pattern that is not a valid regular expression.
    """
    if isinstance(rules, QuantConfig):
        return ((re.compile(""), rules),)
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise TypeError(f"rules must be a QuantConfig or a sequence of (pattern, QuantConfig "
                        f"| None) pairs, got {type(rules).__name__}.")
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)
                and (rule[1] is None or isinstance(rule[1], QuantConfig))):
            raise TypeError(f"rules[{i}] must be a (pattern: str, QuantConfig | None) pair, "
                            f"got {rule!r}.")
        try:
            out.append((re.compile(rule[0]), rule[1]))
        except (re.error, OverflowError, RecursionError) as e:  # a{99999999999}: Overflow
            raise ValueError(f"rules[{i}] has an invalid pattern {rule[0]!r}: {e}.") from None
    return tuple(out)


def select(path: str, rules) -> tuple[QuantConfig | None, int | None]:
    """``(config or None, index of the matching rule or None)`` for a layer path."""
    for i, (pattern, config) in enumerate(rules):
        if pattern.search(path):
            return config, i
    return None, None


def unused(paths, rules: Rules) -> list[tuple[str, QuantConfig | None]]:
    """The rules (as given) that no path in ``paths`` selects first."""
    checked = check_rules(rules)
    if isinstance(rules, QuantConfig):
        rules = [("", rules)]
    used = {select(p, checked)[1] for p in paths}
    return [rule for i, rule in enumerate(rules) if i not in used]


@contextlib.contextmanager
def layer_errors(where: str):
    """Puts ``where`` (``"layer 'b' (Linear)"``) in front of a TypeError or ValueError
    raised inside, so that a rule that does not fit a layer names the layer."""
    try:
        yield
    except (TypeError, ValueError) as e:
        if not where or type(e) not in (TypeError, ValueError):
            raise
        raise type(e)(f"{where}: {e}") from None
