"""Quantization of Flax models (linen and nnx), selected by rules on module paths.

Two uses, one set of rules (``(pattern, QuantConfig | None)`` pairs, the
first `re.search` match on the ``/``-joined module path wins):

* **Quantization-aware training** of unmodified models: kernels (int8 / int4 /
  float8, per channel or blocked) and optionally input activations are
  fake-quantized with straight-through gradients (`jaxquant.fake_quant`),
  optionally with learned scales (LSQ) or a real int8 training dot.
  linen: `quantize_linen` (``nn.intercept_methods``); nnx: `nnx_qat` (surgery).
* **Inference** on `jaxquant.QTensor` kernels: `QuantizedLinen.quantize_params`
  / `nnx_quantize` convert the trained kernels, then the same model runs
  weight-only (dequantized inside the jitted dot) or int8 x int8 -> int32.
  With Gram matrices of calibration inputs (`QuantizedLinen.input_grams`,
  `nnx_input_grams`), ``Dense`` / ``Linear`` kernels are quantized with GPTQ.

Covered layers: linen ``Dense``, ``DenseGeneral``, ``Conv``, ``ConvTranspose``,
``ConvLocal``, ``Einsum``, ``Embed``; nnx ``Linear``, ``LinearGeneral``, ``Conv``,
``ConvTranspose``, ``Einsum``, ``Embed`` (``ConvTranspose`` and ``ConvLocal`` run
on their dequantized kernel at inference).
`flax.serialization` (``to_state_dict``, ``to_bytes`` / ``from_bytes``) takes trees
with `jaxquant.QTensor` leaves once this package is imported.
Flax is imported only here, never by the core.
"""

from jaxquant.flax import _state_dict  # noqa: F401  (QTensors in flax.serialization)
from jaxquant.flax._rules import ActSpec, QuantConfig
from jaxquant.flax.linen import QuantizedLinen, quantize_linen
from jaxquant.flax.nnx import (
    LearnedScale,
    QuantizedParam,
    nnx_input_grams,
    nnx_layers,
    nnx_qat,
    nnx_quantize,
    nnx_unused_rules,
)

__all__ = [
    "ActSpec",
    "LearnedScale",
    "QuantConfig",
    "QuantizedParam",
    "QuantizedLinen",
    "nnx_input_grams",
    "nnx_layers",
    "nnx_qat",
    "nnx_quantize",
    "nnx_unused_rules",
    "quantize_linen",
]
