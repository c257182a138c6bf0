"""QTensor: construction from existing codes, invariants, errors, and metadata."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq


def test_wraps_existing_codes_in_onnx_layouts():
    codes = jnp.arange(24, dtype=jnp.int8).reshape(4, 6)
    per_tensor = jq.QTensor(codes, jnp.array([0.5], jnp.float32))
    assert per_tensor.axis is None and per_tensor.layout.kind == "tensor"
    per_axis = jq.QTensor(codes, jnp.ones(4), jnp.zeros(4, jnp.int8), axis=-2)
    assert per_axis.axis == 0 and per_axis.layout.kind == "axis"
    blocked = jq.QTensor(codes, jnp.ones((4, 2)), axis=1, block_size=4)
    assert (blocked.axis, blocked.block_size) == (1, 4)
    np.testing.assert_array_equal(per_tensor.dequantize(), np.arange(24).reshape(4, 6) * 0.5)
    assert per_tensor.shape == (4, 6) and per_tensor.ndim == 2 and per_tensor.size == 24


def test_frozen_and_hashable_metadata():
    qt = jq.quantize(jnp.ones((2, 3)), axis=0)
    with pytest.raises(AttributeError):
        qt.axis = 1
    hash((qt.axis, qt.block_size, qt.dtype))


def test_dequantize_formula_with_zero_point_matches_numpy():
    codes = np.array([[0, 17, 255], [3, 128, 1]], np.uint8)
    scale = np.array([0.1, 0.03], np.float32)
    zp = np.array([128, 7], np.uint8)
    qt = jq.QTensor(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(zp), axis=0)
    expected = (codes.astype(np.float32) - zp[:, None].astype(np.float32)) * scale[:, None]
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), expected)


def test_errors():
    codes = jnp.zeros((4, 6), jnp.int8)
    with pytest.raises(TypeError, match=r"qvalue.dtype must be one of the quantized formats.*got dtype\('float32'\)"):
        jq.QTensor(jnp.zeros((4, 6)), jnp.ones(()))
    with pytest.raises(TypeError, match="scale must be a float array, got dtype int32"):
        jq.QTensor(codes, jnp.ones((), jnp.int32))
    with pytest.raises(ValueError, match=r"scale must have shape \(6,\) for per-axis.*got \(4,\)"):
        jq.QTensor(codes, jnp.ones(4), axis=1)
    with pytest.raises(ValueError, match=r"zero_point must have the shape of scale, \(4,\); got \(1,\)"):
        jq.QTensor(codes, jnp.ones(4), jnp.zeros(1, jnp.int8), axis=0)
    with pytest.raises(TypeError, match="zero_point must have the code dtype int8, got int32"):
        jq.QTensor(codes, jnp.ones(4), jnp.zeros(4, jnp.int32), axis=0)
    with pytest.raises(TypeError, match="dtype must be a float dtype, got int32"):
        jq.QTensor(codes, jnp.ones(()), dtype=jnp.int32)
    with pytest.raises(TypeError, match="qvalue and scale must be arrays, got list"):
        jq.QTensor([1, 2], jnp.ones(()))
    with pytest.raises(ValueError, match=r"scale must have shape \(4, 2\) for blocked"):
        jq.QTensor(codes, jnp.ones((4, 3)), axis=1, block_size=4)


def test_repr_names_format_and_granularity():
    qt = jq.quantize(jnp.ones((4, 8)), dtype=jnp.int4, axis=1, block_size=4)
    assert repr(qt) == "QTensor(int4[4, 8], axis=1, block_size=4, scale[4, 2], dtype=float32)"


def test_formats_table():
    assert set(jq.FORMATS) == {"int2", "uint2", "int4", "uint4", "int8", "uint8", "int16",
                               "uint16", "int32", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"}
    f = jq.get_format(jnp.uint4)
    assert (f.bits, f.kind, f.qmin, f.qmax) == (4, "int", 0, 15)
    f = jq.get_format(jnp.float8_e5m2)
    assert (f.bits, f.kind, f.max_finite) == (8, "float", 57344.0)
    assert jq.get_format(jnp.float4_e2m1fn).max_finite == 6.0
    assert jq.get_format("int32").qmin == -(2**31)


def test_repr_of_a_tree_of_placeholders():
    """A QTensor rebuilt by a tree map with PartitionSpec (or None) leaves still prints."""
    from jax.sharding import PartitionSpec as P

    qt = jq.quantize(jnp.ones((4, 8)), axis=1)
    specs = jax.tree.map(lambda a: P(None, "model") if a.ndim == 2 else P("model"), qt)
    text = repr(specs)
    assert "qvalue=P(None, 'model')" in text and "axis=1" in text


@pytest.mark.parametrize("dtype", [jnp.uint4, jnp.int4, jnp.uint2, jnp.int2])
@pytest.mark.parametrize("packed", [False, True])
def test_nbytes_is_what_a_checkpoint_stores(dtype, packed, tmp_path):
    """Sub-byte codes and zero points count at their bit width, as safetensors stores them."""
    safetensors = pytest.importorskip("safetensors.numpy")
    x = jax.random.normal(jax.random.key(0), (64, 128))
    qt = jq.quantize(x, dtype=dtype, axis=1, block_size=32, symmetric=False, packed=packed)
    assert qt.zero_point.shape == (64, 4)
    jq.save_safetensors(tmp_path / "w.safetensors", {"w": qt})
    stored = safetensors.load_file(tmp_path / "w.safetensors")
    assert sorted(stored) == ["w/qvalue", "w/scale", "w/zero_point"]
    assert qt.nbytes == sum(a.nbytes for a in stored.values())
    assert stored["w/zero_point"].nbytes == 64 * 4 * jnp.iinfo(dtype).bits // 8
