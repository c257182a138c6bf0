"""`jq.transpose` / `QTensor.T`: a PyTorch ``(out, in)`` weight quantized per output channel
becomes a Flax ``(in, out)`` kernel with the same codes, bit for bit what quantizing the
transposed weight gives; a square weight does not silently keep the old axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

_W = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96)), jnp.float32)


def _bits(tree):
    return [(a.dtype, a.shape, np.asarray(a).reshape(-1).view(np.uint8).tobytes())
            for a in jax.tree.leaves(tree)]


# (quantize the (out, in) weight, quantize its transpose the same way)
_PAIRS = {
    "int8 per output channel": (dict(axis=0), dict(axis=1)),
    "uint8 with zero points": (dict(dtype=jnp.uint8, axis=0, symmetric=False),
                               dict(dtype=jnp.uint8, axis=1, symmetric=False)),
    "int8 per tensor": ({}, {}),
    "packed int4 blocks": (dict(dtype=jnp.int4, axis=1, block_size=32, packed=True),
                           dict(dtype=jnp.int4, axis=0, block_size=32, packed=True)),
    "nf4 with double quantization": (dict(dtype="nf4", axis=1, block_size=32, packed=True,
                                          double_quant=True),
                                     dict(dtype="nf4", axis=0, block_size=32, packed=True,
                                          double_quant=True)),
    "nvfp4": (dict(dtype="nvfp4"), dict(dtype="nvfp4", axis=0)),
    "mxfp4 packed": (dict(dtype="mxfp4", packed=True), dict(dtype="mxfp4", axis=0, packed=True)),
    "float6 packed": (dict(dtype="float6_e2m3fn", axis=0, packed=True),
                      dict(dtype="float6_e2m3fn", axis=1, packed=True)),
    "int8 tiles": (dict(axis=None, block_size=(16, 32)), dict(axis=None, block_size=(32, 16))),
}


@pytest.mark.parametrize("name", list(_PAIRS))
def test_transpose_is_quantizing_the_transposed_weight(name):
    of_weight, of_transposed = _PAIRS[name]
    got = jq.transpose(jq.quantize(_W, **of_weight))
    want = jq.quantize(_W.T, **of_transposed)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert _bits(got) == _bits(want)
    assert _bits(jax.jit(jq.transpose)(jq.quantize(_W, **of_weight))) == _bits(want)


def test_a_square_weight_keeps_each_scale_on_its_channel():
    # jax.tree.map(jnp.transpose, qt) kept axis=0 on a square weight: silently wrong values.
    w = _W[:64, :64]
    qt = jq.quantize(w, axis=0)
    np.testing.assert_array_equal(jq.dequantize(qt.T), jq.dequantize(qt).T)
    codes_only = jax.tree.map(jnp.transpose, qt)
    wrong = np.asarray(jq.dequantize(codes_only)) - np.asarray(jq.dequantize(qt)).T
    assert np.abs(wrong).max() > 0.1


def test_a_pytorch_linear_as_a_flax_kernel():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 96)), jnp.float32)
    qt = jq.quantize(_W, dtype=jnp.int4, axis=0, packed=True)  # (out, in), per output channel
    kernel = jq.transpose(qt)
    y = jq.qdot_general(x, kernel, (((1,), (0,)), ((), ())))
    np.testing.assert_allclose(y, x @ jq.dequantize(qt).T, rtol=1e-5, atol=1e-5)
    w8 = jq.transpose(jq.quantize(_W, axis=0))
    y8 = jq.QDotGeneral(act_quant=jq.ActQuant())(x, w8, (((1,), (0,)), ((), ())))
    ref = x @ jq.dequantize(w8)  # int8 activations add their own rounding error
    assert np.linalg.norm(y8 - ref) / np.linalg.norm(ref) < 0.02


def test_axes_of_a_rank_3_weight_and_stacked_layers():
    w = jnp.asarray(np.random.default_rng(2).standard_normal((4, 32, 16)), jnp.float32)
    qt = jq.quantize(w, dtype=jnp.int4, axis=1, block_size=8)
    got = jq.transpose(qt, (2, -3, 1))
    assert (got.axis, got.shape) == (2, (16, 4, 32))
    assert _bits(got) == _bits(jq.quantize(jnp.transpose(w, (2, 0, 1)), dtype=jnp.int4, axis=2,
                                           block_size=8))
    stacked = jq.quantize_tree({"k": w}, jq.QuantSpec(axis=0, stacked=1, dtype=jnp.int4,
                                                      packed=True))["k"]
    flipped = jq.transpose(stacked)  # each layer's (32, 16) kernel becomes (16, 32)
    want = jq.quantize_tree({"k": jnp.swapaxes(w, 1, 2)},
                            jq.QuantSpec(axis=1, stacked=1, dtype=jnp.int4, packed=True))["k"]
    assert _bits(flipped) == _bits(want)


def test_arrays_pass_to_jnp_transpose_and_bad_axes_are_named():
    np.testing.assert_array_equal(jq.transpose(_W, (1, 0)), _W.T)
    qt = jq.quantize(_W, axis=0)
    with pytest.raises(ValueError, match=r"axes must be a permutation of the 2 axes of x, got "
                                         r"\(0, 0\)"):
        jq.transpose(qt, (0, 0))
    with pytest.raises(ValueError, match=r"axes must be in \[-2, 2\)"):
        jq.transpose(qt, (0, 2))
    with pytest.raises(TypeError, match=r"axes must be None or a sequence of ints, got 1"):
        jq.transpose(qt, 1)


def test_a_sharded_packed_weight_keeps_its_bytes_on_their_devices():
    # (8, 32) sharded 8 ways along axis 0, packed along axis 1: the repack along the new last
    # axis (8 rows over 8 devices) would straddle devices, so the bytes stay along the old one.
    from host_mesh import host_mesh, spec_of
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = host_mesh((4, 2), ("a", "b"))
    w = jax.device_put(jnp.asarray(_W[:8, :32]), NamedSharding(mesh, P(("a", "b"), None)))
    qt = jq.quantize(w, dtype=jnp.int4, axis=0, packed=True)
    t = jq.transpose(qt)
    assert (t.shape, t.axis, t.qvalue.axis) == ((32, 8), 1, 0)
    assert spec_of(t.qvalue) == P(None, ("a", "b"))
    np.testing.assert_array_equal(jq.dequantize(t), np.asarray(jq.dequantize(qt)).T)


def test_axes_as_a_numpy_array():
    qt = jq.quantize(_W, axis=0)
    assert _bits(jq.transpose(qt, np.array([1, 0]))) == _bits(qt.T)
