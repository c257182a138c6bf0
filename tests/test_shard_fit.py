"""Blocks and packed bytes against the shards of explicitly sharded leaves (8 host CPU devices).

A block that shares a scale, or a byte of two int4 codes, cannot straddle two
devices: a clear ValueError naming the leaf, the axis and the shard length,
instead of a reshape error from inside the library; where they fit, the codes
keep the leaf's sharding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_mesh import host_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq


@pytest.fixture(scope="module")
def mesh():
    return host_mesh((2, 4), ("data", "model"), jax.sharding.AxisType.Explicit)


def _put(mesh, shape, spec):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("shape, spec, quant, message", [
    ((64, 36), P(None, "model"), jq.QuantSpec(dtype=jnp.int4, packed=True),
     r"axis 1 .*'model'.* 9 elements per shard, which packed units of 2 codes.*packed=False"),
    ((64, 36), P(None, "model"), jq.QuantSpec(dtype=jnp.int2, axis=0, packed=True),
     r"9 elements per shard, which packed units of 4 codes"),
    ((36, 64), P("model", None), jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=4),
     r"axis 0 .* 9 elements per shard, which blocks of 4 .*block_size that divides 9"),
    ((64, 128), P(None, "model"), jq.QuantSpec(axis=1, block_size=48),
     r"32 elements per shard, which blocks of 48"),
    ((64, 128), P("data", "model"), jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=24),
     r"2 ways along axis 0 .*'data'.* 32 elements per shard"),
    ((64, 128), P("data", None), jq.QuantSpec(axis=None, block_size=(24, 32)),
     r"tiles \(24, 32\)"),
])
@pytest.mark.parametrize("jit", [False, True])
def test_blocks_that_straddle_shards_are_a_clear_error(mesh, shape, spec, quant, message, jit):
    tree = {"layer": {"w": _put(mesh, shape, spec)}}
    fn = lambda t: jq.quantize_tree(t, [("w", quant)])
    with pytest.raises(ValueError, match=r"leaf 'layer/w' \(float32\[.*\]\): x is sharded") as e:
        (jax.jit(fn) if jit else fn)(tree)
    assert e.match(message)


@pytest.mark.parametrize("shape, spec, quant", [
    ((64, 128), P(None, "model"), jq.QuantSpec(dtype=jnp.int4, axis=1, block_size=8, packed=True)),
    ((64, 128), P("data", "model"), jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32)),
    ((64, 128), P("data", "model"), jq.QuantSpec(axis=None, block_size=(16, 32))),
    ((64, 36), P(None, "model"), jq.QuantSpec(dtype=jnp.int4)),  # unpacked: any length
])
def test_blocks_that_fit_keep_the_leaf_sharding(mesh, shape, spec, quant):
    w = _put(mesh, shape, spec)
    qt = jax.jit(lambda t: jq.quantize_tree(t, [("w", quant)]))({"w": w})["w"]
    codes = qt.qvalue.data if isinstance(qt.qvalue, jq.PackedArray) else qt.qvalue
    assert codes.sharding.spec == spec
    want = quant(jax.device_put(np.asarray(w), jax.devices("cpu")[0]))
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), np.asarray(want.dequantize()))


@pytest.mark.parametrize("dtype, per", [(jnp.int4, 2), (jnp.int2, 4)])
def test_pack_refuses_bytes_that_would_straddle_shards(mesh, dtype, per):
    """One code per device along the packed axis: a clear error, not a reshape error."""
    x = jq.quantize(_put(mesh, (4, 4 * per // 2), P(None, "model")), dtype=dtype, axis=0)
    with pytest.raises(ValueError, match=rf"codes is sharded 4 ways along axis 1 .* "
                                         rf"packed units of {per} codes"):
        jq.pack(x)
    packed = jq.pack(x, axis=0)  # along the unsharded axis: the codes keep their sharding
    assert packed.qvalue.data.sharding.spec == P(None, "model")
    assert np.array_equal(np.asarray(jq.dequantize(packed)), np.asarray(jq.dequantize(x)))


def test_pack_of_float6_codes_refuses_straddling_bytes(mesh):
    codes = jax.device_put(jnp.arange(32, dtype=jnp.uint8).reshape(4, 8),
                           NamedSharding(mesh, P(None, "model")))
    qt = jq.QTensor(codes, jnp.float32(0.5), codebook="float6_e2m3fn")
    with pytest.raises(ValueError, match="packed units of 4 codes"):
        jq.pack(qt)
