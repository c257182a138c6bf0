"""`jax.export` of the public functions with a symbolic batch dimension, for CPU and CUDA at
once (each platform lowers its own division), called on this CPU: the same result as the
jitted function at two batch sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

DN = (((1,), (0,)), ((), ()))  # x (batch, in) . w (in, out)
_W = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)

CASES = {
    "quantize per tensor": lambda x: jq.quantize(x).qvalue,
    "quantize per column": lambda x: jq.quantize(x, axis=1).qvalue,
    "quantize per row": lambda x: jq.quantize(x, axis=0, symmetric=False).qvalue,
    "quantize int4 blocks": lambda x: jq.quantize(x, dtype=jnp.int4, axis=1, block_size=32).qvalue,
    "quantize float8": lambda x: jq.quantize(x, dtype=jnp.float8_e4m3fn, axis=1).qvalue,
    "dequantize": lambda x: jq.dequantize(jq.quantize(x, axis=1)),
    "fake_quant gradient": lambda x: jax.grad(lambda x: jnp.sum(jnp.sin(jq.fake_quant(x, axis=1))))(x),
    "weight-only int8 dot": lambda x: jq.qdot_general(x, jq.quantize(_W, axis=1), DN),
    "weight-only packed int4 dot": lambda x: jq.qdot_general(
        x, jq.quantize(_W, dtype=jnp.int4, axis=0, block_size=32, packed=True), DN),
    "int8 x int8 dot": lambda x: jq.QDotGeneral(act_quant=jq.ActQuant())(
        x, jq.quantize(_W, axis=1), DN),
    # packed along the concrete axis, the batch axis symbolic (a PackedArray refused it)
    "quantize packed int4": lambda x: jq.quantize(x, dtype=jnp.int4, axis=0,
                                                  packed=True).qvalue.data,
    "pack": lambda x: jq.pack(jq.quantize(x, dtype=jnp.int2, axis=1)).qvalue.data,
}


@pytest.mark.parametrize("name", list(CASES))
def test_symbolic_batch_exports_for_cpu_and_cuda(name):
    fn = jax.jit(CASES[name])
    (b,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(fn, platforms=("cpu", "cuda"))(
        jax.ShapeDtypeStruct((b, 64), jnp.float32))
    assert exported.platforms == ("cpu", "cuda")
    rng = np.random.default_rng(0)
    for rows in (1, 5):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        got, want = exported.call(x), fn(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(want).view(np.uint8))


_RECORDS = {
    "int8 per channel": dict(axis=1),
    "uint8 with a zero point": dict(dtype=jnp.uint8, axis=0, symmetric=False),
    "packed int4 blocks": dict(dtype=jnp.int4, axis=0, block_size=32, packed=True),
    "int8 tiles": dict(axis=None, block_size=(16, 8)),
    "nf4 codebook, packed": dict(dtype="nf4", axis=1, block_size=32, packed=True),
    "packed float6": dict(dtype="float6_e2m3fn", axis=1, packed=True),
    "nvfp4 (two-level scales)": dict(dtype="nvfp4", packed=True),
    "float8 with bfloat16 dtype": dict(dtype=jnp.float8_e4m3fn, axis=1),
}


@pytest.mark.parametrize("name", list(_RECORDS))
def test_serialized_export_takes_and_returns_qtensors(name):
    # QTensor / PackedArray arguments and results are in the calling convention that
    # `serialize` writes; the deserialized function accepts the same records, bit for bit.
    w = jnp.asarray(_W, jnp.bfloat16 if "bfloat16" in name else jnp.float32)
    q = jq.quantize(w, **_RECORDS[name])
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)

    def fn(x, q):
        return jq.qdot_general(x, q, DN), jq.quantize(jq.dequantize(q), **_RECORDS[name])

    exported = jax.export.export(jax.jit(fn))(x, q)
    back = jax.export.deserialize(exported.serialize())
    assert back.in_tree == exported.in_tree and back.out_tree == exported.out_tree
    (got_y, got_q), (want_y, want_q) = back.call(x, q), jax.jit(fn)(x, q)
    np.testing.assert_array_equal(np.asarray(got_y).view(np.uint8),
                                  np.asarray(want_y).view(np.uint8))
    assert jax.tree.structure(got_q) == jax.tree.structure(want_q)
    for a, b in zip(jax.tree.leaves(got_q), jax.tree.leaves(want_q), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                      np.asarray(b).reshape(-1).view(np.uint8))


def test_a_symbolic_packed_axis_is_a_type_error_naming_it():
    (b,) = jax.export.symbolic_shape("b")
    with pytest.raises(TypeError, match=r"symbolic dimensions allowed but along the packed "
                                        r"axis\) and axis an int; got shape=\(64, b\), axis=1"):
        jax.export.export(jax.jit(lambda x: jq.quantize(x, dtype=jnp.int4, axis=0, packed=True)))(
            jax.ShapeDtypeStruct((64, b), jnp.float32))


def test_a_packed_array_built_with_numpy_ints_serializes():
    codes = jnp.array([[1, -2, 3, 7]], jnp.int4)
    p = jq.PackedArray(jq.pack_bits(codes), jnp.int4, (np.int64(1), np.int64(4)), np.int64(1))
    assert type(p.axis) is int and all(type(d) is int for d in p.shape)
    exported = jax.export.export(jax.jit(lambda p: p.unpack()))(p)
    np.testing.assert_array_equal(jax.export.deserialize(exported.serialize()).call(p), codes)


def test_packed_metadata_serialized_before_the_byte_length_still_loads():
    """The serialized metadata of a `PackedArray` gained the byte length along the packed
    axis (padded codes only); functions exported before read back with it unknown."""
    from jaxquant import _export

    old = _export._packed_from(b'["int4", -1, null, 1, null]')
    assert old == (jnp.dtype("int4"), -1, None, (1, None), None)
    p = jq.pack(jnp.array([[1, -2, 3]], jnp.int4))
    aux = jax.tree_util.tree_flatten(p)[1].node_data()[1]
    assert _export._packed_from(_export._packed_aux(aux)) == aux == (
        jnp.dtype("int4"), -1, None, (1, 2), None)
