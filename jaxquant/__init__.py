"""jaxquant: pure, jit-compiled quantization for JAX.

`quantize` turns float arrays into `QTensor` records of integer, float8/6/4 or
codebook (NF4) codes, bit for bit as ONNX QuantizeLinear, with float32,
power-of-two (MX) or two-level (NVFP4, double quantization) scales; `dequantize` turns them back;
`fake_quant` does both with straight-through gradients for training; and
`quantize_tree` converts whole parameter pytrees by path rules; `qdot_general`
runs dots on `QTensor` operands (int8 x int8 -> int32, weight-only int8/int4/fp8);
`save_safetensors` / `load_safetensors` store such trees bit for bit.
"""

from jaxquant import (
    _export,  # noqa: F401  (registers QTensor, PackedArray with jax.export)
    calibration,
)
from jaxquant._bits import pack_bits, unpack_bits
from jaxquant._checkpoint import load_orbax, load_safetensors, save_orbax, save_safetensors
from jaxquant._dot import ActQuant, QDotGeneral, promote_dtype, qdot_general
from jaxquant._einsum import qeinsum
from jaxquant._fake_quant import fake_quant
from jaxquant._formats import CODEBOOKS, FORMATS, Format, get_format
from jaxquant._gptq import gptq
from jaxquant._hadamard import hadamard_transform
from jaxquant._packing import PackedArray, pack, unpack
from jaxquant._qat_dot import QATDotGeneral, qat_dot_general
from jaxquant._qtensor import QTensor, is_qtensor
from jaxquant._quantize import dequantize, quantize
from jaxquant._report import LeafReport, format_report, quantization_report
from jaxquant._scaled_matmul import scaled_matmul
from jaxquant._schemes import SCHEMES, Scheme, format_name
from jaxquant._spec import QuantSpec
from jaxquant._transpose import transpose
from jaxquant._tree import (
    dequantize_tree,
    match_rules,
    quantize_tree,
    tree_nbytes,
    unused_rules,
)

__version__ = "0.1.0"

__all__ = [
    "CODEBOOKS",
    "FORMATS",
    "SCHEMES",
    "Scheme",
    "ActQuant",
    "Format",
    "LeafReport",
    "PackedArray",
    "QATDotGeneral",
    "QDotGeneral",
    "QTensor",
    "QuantSpec",
    "calibration",
    "dequantize",
    "dequantize_tree",
    "fake_quant",
    "format_name",
    "format_report",
    "get_format",
    "gptq",
    "hadamard_transform",
    "is_qtensor",
    "load_orbax",
    "load_safetensors",
    "match_rules",
    "pack",
    "pack_bits",
    "promote_dtype",
    "qat_dot_general",
    "qdot_general",
    "qeinsum",
    "quantization_report",
    "quantize",
    "quantize_tree",
    "save_orbax",
    "save_safetensors",
    "scaled_matmul",
    "transpose",
    "tree_nbytes",
    "unpack",
    "unpack_bits",
    "unused_rules",
]
