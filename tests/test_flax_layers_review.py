"""jaxquant.flax layer coverage against an independent NumPy fake-quant reference.

The reference (`_fq`) is written from the spec of the default weight rule: int8,
symmetric, one scale per index of the kernel's last axis, ``s = absmax / 127``,
``q = clip(round_half_even(w / s), -128, 127)``, dequantized as ``q * s`` in float32.
Each model runs in float with its kernels replaced by the reference; QAT must give the
same outputs and, straight through, the float model's gradients at those kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

import jaxquant as jq  # noqa: E402
from jaxquant.flax import (  # noqa: E402
    ActSpec,
    QuantConfig,
    nnx_layers,
    nnx_qat,
    nnx_quantize,
    quantize_linen,
)


def _x(*shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32) * 0.37).reshape(shape)


def _init(key, shape, dtype=jnp.float32, factor=1.0):
    """A deterministic kernel: no random initializer to compile."""
    return (_x(*shape) * factor).astype(dtype)


def _linen_params(model, x):
    """``model``'s params, each a deterministic array of its shape and dtype."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    return jax.tree.map(lambda s: _init(None, s.shape, s.dtype), shapes)


def _fq(w, stacked: int = 0):
    """Per-channel int8 fake quantization over the last axis, in NumPy; ``stacked``
    leading axes are separate layers (each its own scales)."""
    w = np.asarray(w)
    if stacked:
        return np.stack([_fq(v, stacked - 1) for v in w])
    w32 = w.astype(np.float32)
    red = tuple(range(w.ndim - 1))
    s = (np.abs(w32.astype(np.float64)).max(axis=red, keepdims=True) / 127).astype(np.float32)
    q = np.clip(np.round(w32 / s), -128, 127)  # NumPy rounds half to even
    return (q.astype(np.float32) * s).astype(w.dtype)


def _fq_tree(params, stacked=()):
    """Every kernel of a linen params tree through `_fq` (layers of paths containing a
    name in ``stacked`` along their leading axis)."""
    def fq(path, leaf):
        key = jax.tree_util.keystr(path)
        if "kernel" not in key and "embedding" not in key:
            return leaf
        return jnp.asarray(_fq(leaf, int(any(s in key for s in stacked))))
    return jax.tree_util.tree_map_with_path(fq, params)


def _scale_shapes(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=jq.is_qtensor)[0]
    return {jax.tree_util.keystr(p): tuple(v.scale.shape) for p, v in leaves if jq.is_qtensor(v)}


def _close(a, b, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol,
                               rtol=0)


class _Upsampler(nn.Module):
    """Transposed convolutions (both kernel layouts) and an unshared convolution."""

    @nn.compact
    def __call__(self, x):
        h = nn.ConvTranspose(4, (3,), strides=2, name="up")(x)
        h = nn.ConvTranspose(6, (2,), transpose_kernel=True, use_bias=False, name="up_t")(h)
        return nn.ConvLocal(5, (3,), name="local")(jnp.tanh(h))


def test_linen_conv_transpose_and_conv_local_are_quantized():
    # regression: ConvTranspose and ConvLocal were not covered: a QuantConfig for every
    # layer left them float, silently (layers() did not list them, no QTensor kernel)
    model, x = _Upsampler(), _x(2, 6, 3)
    qm = quantize_linen(model, QuantConfig())
    params = _linen_params(model, x)
    ref = _fq_tree(params)
    loss = lambda p, f: jnp.sum(jnp.sin(f(p, x)))
    y, g = jax.jit(jax.value_and_grad(lambda p: loss(p, qm.apply)))(params)
    y_ref, g_ref = jax.jit(jax.value_and_grad(lambda p: loss(p, model.apply)))(ref)
    _close(y, y_ref, 1e-5)
    jax.tree.map(lambda a, b: _close(a, b, 1e-5), g, g_ref)  # straight through

    qparams = qm.quantize_params(params, x)
    # per index of the kernel's last axis: the output features of ConvTranspose and
    # ConvLocal ((positions, window * in, out)); transpose_kernel's (k, out, in): its `in`
    assert _scale_shapes(qparams) == {"['params']['up']['kernel']": (4,),
                                      "['params']['up_t']['kernel']": (4,),
                                      "['params']['local']['kernel']": (5,)}
    _close(jax.jit(model.apply)(ref, x), jax.jit(qm.apply)(qparams, x))


def test_linen_quantized_conv_local_errors():
    model, x = nn.ConvLocal(4, (3,)), _x(2, 6, 3)
    qm = quantize_linen(model, QuantConfig())
    qparams = qm.quantize_params(_linen_params(model, x), x)
    with pytest.raises(ValueError, match=r"QTensor kernel has shape \(6, 9, 4\).*\(7, 9, 4\)"):
        qm.apply(qparams, _x(2, 7, 3))
    masked = quantize_linen(nn.ConvLocal(4, (3,), mask=jnp.ones((6, 9, 4))), QuantConfig())
    with pytest.raises(ValueError, match="masked ConvLocal"):
        masked.apply(qparams, x)


class _Stack(nnx.Module):
    """A ConvTranspose stacked by nnx.vmap and run by nnx.scan, and a plain one."""

    def __init__(self):
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(factor):
            init = functools.partial(_init, factor=factor)
            return nnx.ConvTranspose(4, 4, (3,), kernel_init=init, rngs=nnx.Rngs(0))

        self.blocks = make(jnp.array([1.0, -0.5, 2.0]))
        self.up = nnx.ConvTranspose(4, 2, (2,), strides=2, kernel_init=_init,
                                    rngs=nnx.Rngs(1))

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, block):
            return h + jnp.tanh(block(h))

        return self.up(body(x, self.blocks))


def test_nnx_conv_transpose_is_quantized():
    # regression: nnx.ConvTranspose was not covered (left float, not in nnx_layers)
    x = _x(2, 5, 4)
    ref = _Stack()
    for path, var in nnx.iter_graph(ref):
        if isinstance(var, nnx.Param) and path[-1] == "kernel":
            var.set_value(jnp.asarray(_fq(var[...], int(path[0] == "blocks"))))
    model = nnx_qat(_Stack(), QuantConfig())
    assert list(nnx_layers(model, QuantConfig())) == ["blocks", "up"]
    y = model(x)
    _close(y, ref(x))
    nnx_quantize(model, QuantConfig())
    assert model.blocks.kernel[...].scale.shape == (3, 4)  # per layer, per output feature
    assert model.up.kernel[...].scale.shape == (2,)
    _close(model(x), y)


def test_nnx_conv_transpose_with_activations_and_mask():
    make = lambda: nnx.ConvTranspose(3, 4, (3,), strides=2, transpose_kernel=True,
                                     kernel_init=_init, rngs=nnx.Rngs(0))
    cfg = QuantConfig(act=ActSpec(scale=0.02))
    model, x = nnx_qat(make(), cfg), _x(2, 4, 3)
    y = model(x)
    assert float(jnp.max(jnp.abs(y - make()(x)))) > 1e-4
    _close(nnx_quantize(model, cfg)(x), y)
    masked = nnx.ConvTranspose(3, 4, (3,), mask=jnp.ones((3, 3, 4)), kernel_init=_init,
                               rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="ConvTranspose at '' has a mask"):
        nnx_quantize(masked, QuantConfig())


class _Block(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return c + jnp.tanh(nn.DenseGeneral((2, 3), axis=-1)(c).reshape(c.shape)), None


class _Layers(nn.Module):
    """nn.scan'd DenseGeneral blocks (two feature axes), DenseGeneral with a batch axis,
    an Einsum whose kernel is (out, in), a dilated circular and a grouped 2-D Conv."""

    @nn.compact
    def __call__(self, x):  # (2, 4, 6)
        x, _ = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)()(x, None)
        h = nn.DenseGeneral((3, 2), axis=(-1,), batch_dims=(0,), name="dg")(x)  # (2,4,3,2)
        h = nn.Einsum((5, 6), "btd,fd->btf", name="ein")(h.reshape(x.shape))
        c = nn.Conv(4, (3, 3), kernel_dilation=2, padding="CIRCULAR", name="conv")(
            h[..., None, :].repeat(3, axis=-2))
        return nn.Conv(4, (2, 2), feature_group_count=2, padding="REFLECT", name="grouped")(c)


def test_linen_layers_match_the_numpy_reference_and_scale_shapes():
    model, x = _Layers(), _x(2, 4, 6)
    qm = quantize_linen(model, QuantConfig())
    params = _linen_params(model, x)
    y = jax.jit(qm.apply)(params, x)
    _close(y, jax.jit(model.apply)(_fq_tree(params, stacked=("Scan_Block",)), x), 1e-5)
    qparams = qm.quantize_params(params, x)
    # one scale per index of the kernel's last axis, per scanned layer (HWIO convs: O;
    # DenseGeneral (batch, in, 3, 2): its last feature axis; Einsum (out, in): `in`)
    assert _scale_shapes(qparams) == {
        "['params']['Scan_Block_0']['DenseGeneral_0']['kernel']": (3, 3),
        "['params']['dg']['kernel']": (2,), "['params']['ein']['kernel']": (6,),
        "['params']['conv']['kernel']": (4,), "['params']['grouped']['kernel']": (4,)}
    _close(jax.jit(qm.apply)(qparams, x), y, 1e-5)


class _PositionTable(nn.Module):
    """A learned positional table read only as ``.embedding`` (never called)."""

    @nn.compact
    def __call__(self, x):
        pos = nn.Embed(16, 8, name="pos")
        return nn.Dense(4)(x + pos.embedding[None, : x.shape[1]])


@pytest.mark.parametrize("learn_scale", [False, True])
def test_linen_embed_read_only_as_its_table_is_a_layer_converted_as_trained(learn_scale):
    # before: fake-quantized in training, but missing from layers(), its rule reported
    # unused, the table left float by quantize_params and (learn_scale) the scale dropped
    x = _x(2, 5, 8)
    rules = [("pos", QuantConfig(learn_scale=learn_scale)), ("", None)]
    qm = quantize_linen(_PositionTable(), rules)
    v = qm.init(jax.random.key(0), x)
    assert set(qm.layers(v, x)) == {"pos", "Dense_0"}
    assert qm.unused_rules(v, x) == []
    q = qm.quantize_params(v, x)
    table = q["params"]["pos"]["embedding"]
    assert jq.is_qtensor(table)
    trained = qm.apply(v, x)
    float_model = _PositionTable().apply({"params": v["params"]}, x)
    assert float(jnp.max(jnp.abs(trained - float_model))) > 0  # the table was fake-quantized
    np.testing.assert_allclose(np.asarray(qm.apply(q, x)), np.asarray(trained),
                               rtol=1e-6, atol=1e-6)
