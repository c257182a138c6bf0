"""Weight-only dots that dequantize a large weight chunk by chunk (XLA:CPU): the streamed
product equals dequantize-then-dot for every layout, and the float weight never exists whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_mesh import host_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant._dot import qdot_general
from jaxquant._weight_only import _one_level, stream_rows

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="streams on XLA:CPU only")

DN = (((1,), (0,)), ((), ()))  # x (batch, in) . w (in, out)


def _reference(x, qt, dims):
    return np.asarray(jax.lax.dot_general(jnp.asarray(x), jq.dequantize(qt), dims))


def test_when_a_weight_is_streamed():
    qt = jq.quantize(jnp.ones((1024, 1024)), axis=1)  # 4 MiB of float32
    assert stream_rows(qt, (0,), (), 32) == 512  # two chunks of 2 MiB
    assert stream_rows(qt, (0,), (), 512) is None  # compute-bound: many rows
    assert stream_rows(qt, (0,), (), 1) is None  # one row, small weight
    assert stream_rows(qt, (1,), (), 32) is None  # leading axis not contracted
    assert stream_rows(jq.quantize(jnp.ones((256, 1024)), axis=1), (0,), (), 32) is None  # 1 MiB
    blocks = jq.quantize(jnp.ones((1024, 1024)), axis=0, block_size=384 // 3)
    assert stream_rows(blocks, (0,), (), 32) == 512
    odd = jq.quantize(jnp.ones((1023, 1024)), axis=1)  # 1023 = 3 x 11 x 31: chunks of 341
    assert stream_rows(odd, (0,), (), 32) == 341
    packed = jq.quantize(jnp.ones((2048, 1024)), dtype=jnp.int4, axis=1, packed=True)
    assert stream_rows(packed, (0,), (), 32) == 1024  # phases of 4 MiB: two chunks each
    big = jq.quantize(jnp.ones((4096, 1024)), axis=1)  # 16 MiB: streamed for a single row too
    assert stream_rows(big, (0,), (), 1) is None
    bigger = jq.quantize(jnp.ones((4100, 1024)), axis=1)
    assert stream_rows(bigger, (0,), (), 1) == 410


def test_streamed_mlp_never_holds_a_whole_float_weight():
    rng = np.random.default_rng(0)
    ws = [jq.quantize(rng.standard_normal((1024, 1024), np.float32), axis=1) for _ in range(2)]
    x = jnp.ones((32, 1024))

    def mlp(x, ws):
        for w in ws:
            x = jax.nn.relu(qdot_general(x, w, DN))
        return x

    mem = jax.jit(mlp).lower(x, ws).compile().memory_analysis()
    one_layer = 1024 * 1024 * 4
    assert mem.temp_size_in_bytes < 0.75 * one_layer  # half a layer's float weight at a time
    # two-level scales too (their float32 block scales are dequantized first)
    for spec in (dict(dtype="nvfp4", packed=True), dict(dtype="nf4", double_quant=True)):
        w2 = [jq.quantize(jq.dequantize(w), **spec) for w in ws]
        mem = jax.jit(mlp).lower(x, w2).compile().memory_analysis()
        assert mem.temp_size_in_bytes < 0.75 * one_layer, spec
    y = mlp(x, ws)
    ref = x
    for w in ws:
        ref = jax.nn.relu(ref @ jq.dequantize(w))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(ref).max()))


def test_streamed_dot_on_a_sharded_weight_and_batch():
    mesh = host_mesh((2, 4), ("data", "model"), jax.sharding.AxisType.Auto)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1024, 1024), np.float32)
    qt = jq.quantize(w, axis=1)
    x = rng.standard_normal((32, 1024), np.float32)
    assert stream_rows(qt, (0,), (), 16) == 512  # 16 rows per data shard: still streamed
    for w_spec in (P(None, "model"), P("model", None)):  # output channels / the streamed rows
        ws = jax.device_put(w, NamedSharding(mesh, w_spec))
        q = jax.jit(lambda w: jq.quantize(w, axis=1))(ws)  # codes keep the weight's sharding
        assert q.qvalue.sharding.spec == w_spec
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        y = jax.jit(lambda x, w: qdot_general(x, w, DN))(xs, q)
        np.testing.assert_allclose(np.asarray(y), _reference(x, qt, DN), rtol=1e-5, atol=1e-3)


# (quantize kwargs, rows k of the (k, 64) weight): with 8 KiB chunks, k = 1024 streams
# 16 to 32 chunks in a loop for every layout; k = 256 streams 2 to 8 unrolled chunks
# (the same chunk code with constant offsets), for a plain and a packed layout.
STREAMED = [
    (dict(axis=1), 1024),  # per output channel: one scale for every chunk
    (dict(axis=1), 256),
    (dict(), 1024),  # per tensor
    (dict(axis=0), 1024),  # per input row: the scale is cut with the rows
    (dict(axis=0, block_size=32), 1024),  # blocks along the streamed axis
    (dict(axis=1, block_size=8), 1024),  # blocks across it
    (dict(dtype=jnp.uint8, axis=1, symmetric=False), 1024),  # zero points
    (dict(dtype=jnp.int4, axis=0, block_size=32, packed=True), 1024),  # packed along the stream
    (dict(dtype=jnp.int4, axis=0, block_size=32, packed=True), 256),
    (dict(dtype=jnp.int4, axis=1, packed=True), 1024),  # packed across it
    (dict(dtype=jnp.uint2, axis=0, symmetric=False, packed=True), 256),
    (dict(dtype="nf4", axis=0, block_size=32), 1024),  # a codebook
    (dict(dtype=jnp.float8_e4m3fn, axis=1), 1024),
    # two-level scales: float8 block scales of a float32 tensor scale, or of float32 tiles
    (dict(dtype="nvfp4", axis=1), 1024),
    (dict(dtype="nvfp4", axis=0, packed=True), 1024),
    (dict(dtype="nf4", axis=0, block_size=32, double_quant=True), 1024),
    (dict(dtype=jnp.int4, axis=0, block_size=32, double_quant=True, packed=True), 256),
]


@pytest.mark.usefixtures("small_chunks")
class TestSmallChunks:
    """Weights streamed in many small chunks."""

    @pytest.mark.parametrize("spec,k", STREAMED,
                             ids=[f"{k}-spec{i}" for i, (_, k) in enumerate(STREAMED)])
    def test_streamed_equals_dequantize_then_dot(self, spec, k):
        rng = np.random.default_rng(k)
        x = rng.standard_normal((24, k), np.float32)
        spec = dict(spec)
        packed = spec.pop("packed", False)
        qt = jq.quantize(rng.standard_normal((k, 64), np.float32), **spec)
        if packed:
            qt = jq.pack(qt, axis=spec.get("axis", 0) or 0)
        assert stream_rows(_one_level(qt), (0,), (), 24) is not None
        y = jax.jit(lambda x, w: qdot_general(x, w, DN))(x, qt)
        ref = _reference(x, qt, DN)
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    def test_streamed_weight_as_lhs_and_dense_general_kernel(self):
        rng = np.random.default_rng(1)
        qt = jq.quantize(rng.standard_normal((512, 48), np.float32), axis=1)
        x = rng.standard_normal((512, 20), np.float32)
        dims = (((0,), (0,)), ((), ()))  # w^T x, the QTensor first
        assert stream_rows(qt, (0,), (), 20) is not None
        np.testing.assert_allclose(np.asarray(qdot_general(qt, x, dims)),
                                   np.asarray(jq.dequantize(qt)).T @ x, rtol=1e-5, atol=1e-4)
        # a DenseGeneral kernel (heads, head_dim, out) contracted over its two leading axes
        k3 = jq.quantize(rng.standard_normal((16, 32, 40), np.float32), axis=2)
        x3 = rng.standard_normal((6, 16, 32), np.float32)
        dims3 = (((1, 2), (0, 1)), ((), ()))
        assert stream_rows(k3, (0, 1), (), 6) is None  # fewer than STREAM_MIN_ROWS rows
        x3 = np.repeat(x3, 4, axis=0)  # 24 rows
        assert stream_rows(k3, (0, 1), (), 24) is not None
        y3 = qdot_general(x3, k3, dims3)
        ref3 = _reference(x3, k3, dims3)
        np.testing.assert_allclose(np.asarray(y3), ref3, rtol=1e-5, atol=1e-5 * np.abs(ref3).max())

    def test_bfloat16_activations_sum_chunks_in_float32(self):
        rng = np.random.default_rng(2)
        qt = jq.quantize(rng.standard_normal((1024, 32), np.float32), axis=1)
        x = jnp.asarray(rng.standard_normal((16, 1024)), jnp.bfloat16)
        y = qdot_general(x, qt, DN)
        assert y.dtype == jnp.bfloat16
        exact = np.asarray(x, np.float64) @ np.asarray(jq.dequantize(qt, jnp.bfloat16),
                                                       np.float64)
        # one rounding to bfloat16 at the end (half an ulp), not one per chunk (32 chunks)
        np.testing.assert_allclose(np.asarray(y, np.float64), exact, rtol=2 ** -8, atol=1e-3)

    def test_gradient_through_a_streamed_weight(self):
        # adapters trained on a frozen quantized base (QLoRA) differentiate through the dot
        rng = np.random.default_rng(4)
        qt = jq.quantize(rng.standard_normal((512, 64), np.float32), axis=1)
        x = jnp.asarray(rng.standard_normal((20, 512)), jnp.float32)
        assert stream_rows(qt, (0,), (), 20) is not None
        g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(qdot_general(x, qt, DN)))))(x)
        ref = jax.grad(lambda x: jnp.sum(jnp.sin(x @ jq.dequantize(qt))))(x)
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-4,
                                   atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("packed", [False, True])
def test_a_symbolic_batch_is_not_streamed_and_exports(packed):
    """`jax.export` with a symbolic batch: the row count is unknown when the dot is traced,
    so the weight is dequantized whole (streaming compares the rows with its limits); the
    exported dot runs on batches below, inside and above the streamed range."""
    rng = np.random.default_rng(5)
    qt = jq.quantize(rng.standard_normal((1024, 512), np.float32), dtype=jnp.int4, axis=0,
                     block_size=32, packed=packed)
    (b,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(lambda x: qdot_general(x, qt, DN)), platforms=("cpu",))(
        jax.ShapeDtypeStruct((b, 1024), jnp.float32))
    for rows in (1, 32, 300):
        x = rng.standard_normal((rows, 1024)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(exported.call(x)), _reference(x, qt, DN),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
def test_a_weight_under_a_mesh_is_not_streamed_and_not_gathered(axis_type):
    # row-parallel / FSDP: the contracted axis is sharded; slicing it in chunks would gather
    # the whole weight onto every device (2048 x 1024 int8: 8x each device's share)
    mesh = host_mesh((8,), ("x",), axis_type)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2048, 1024), np.float32)
    x = rng.standard_normal((32, 2048), np.float32)
    qt = jax.jit(jq.QuantSpec())(jax.device_put(w, NamedSharding(mesh, P("x", None))))
    xs = jax.device_put(x, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda x, w: qdot_general(x, w, DN))
        hlo = f.lower(xs, qt).compile().as_text()
        y = f(xs, qt)
    assert "all-gather" not in hlo
    np.testing.assert_allclose(np.asarray(y), _reference(x, jq.quantize(w, axis=1), DN),
                               rtol=1e-5, atol=1e-3)
