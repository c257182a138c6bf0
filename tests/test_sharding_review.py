"""Sharded trees on the 8 host CPU devices of tests/conftest.py: double-quantized
scales whose tiles span shards, fake-quant blocks that would straddle shards, and
checkpoints loaded onto shardings that packed bytes cannot honour.

References are the same computations on one device (bit for bit).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_mesh import cpu_normal as _x
from host_mesh import host_mesh
from host_mesh import spec_of as _spec
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq

Explicit = jax.sharding.AxisType.Explicit


def _bits(a) -> np.ndarray:
    a = np.asarray(a.data if isinstance(a, jq.PackedArray) else a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


@pytest.mark.parametrize("mesh_shape,leaf_spec,spec", [
    # (64, 8) block scales in tiles of (32, 8): 16 rows per shard of "model"
    ((2, 4), P("model", "data"), jq.QuantSpec(dtype="nf4", block_size=16, double_quant=True)),
    # (16, 128) block scales in tiles of (2, 128): 2 rows per shard of 8 devices
    ((8, 1), P("data", "model"),
     jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=4, packed=True, double_quant=True)),
], ids=["nf4-2x4", "int4-packed-8x1"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_double_quant_tiles_spanning_shards(mesh_shape, leaf_spec, spec, jit):
    # regression: the tiles of 256 block scales that double_quant quantizes spanned
    # several shards of an explicitly sharded leaf: a ShardingTypeError from a reshape
    mesh = host_mesh(mesh_shape, ("data", "model"), Explicit)
    x = _x(64, 128)
    xs = jax.device_put(x, NamedSharding(mesh, leaf_spec))
    fn = lambda t: jq.quantize_tree(t, [("w", spec)])
    q = (jax.jit(fn) if jit else fn)({"w": xs})["w"]
    ref = spec(x)
    assert _spec(q.qvalue) == _spec(xs)
    assert _spec(q.scale.qvalue) == _spec(xs)  # the float8 block scales, as their blocks
    for got, want in zip(jax.tree.leaves(q), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    back = jax.jit(jq.dequantize_tree)({"w": q})["w"]
    assert back.sharding.is_equivalent_to(xs.sharding, 2)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(ref.dequantize()))


@pytest.mark.parametrize("leaf_spec,kwargs,message", [
    (P(("data", "model")), dict(dtype=jnp.int4, axis=0, block_size=8),
     r"8 ways along axis 0 .* 4 elements per shard, which blocks of 8"),
    (P(("data", "model")), dict(dtype="mxfp4", axis=0),
     r"8 ways along axis 0 .* 4 elements per shard, which blocks of 32"),
    (P(None, "model"), dict(dtype=jnp.int8, axis=None, block_size=(8, 32)),
     r"4 ways along axis 1 .* 16 elements per shard, which tiles \(8, 32\)"),
], ids=["int4-blocks", "mxfp4", "tiles"])
def test_fake_quant_blocks_that_straddle_shards_are_a_clear_error(leaf_spec, kwargs, message):
    # regression: quantize raised a ValueError naming the axis; fake_quant (QAT) failed
    # with "This reshape is not supported" or "select cases must have the same shardings"
    mesh = host_mesh((2, 4), ("data", "model"), Explicit)
    ws = jax.device_put(_x(32, 64), NamedSharding(mesh, leaf_spec))
    grad = jax.jit(jax.grad(lambda w: jnp.sum(jnp.sin(jq.fake_quant(w, **kwargs)))))
    with pytest.raises(ValueError, match=message):
        grad(ws)
    with pytest.raises(ValueError, match=message):
        jq.fake_quant(ws, **kwargs)


def test_fake_quant_blocks_that_fit_shards_match_one_device():
    mesh = host_mesh((2, 4), ("data", "model"), Explicit)
    w = _x(32, 64)
    ws = jax.device_put(w, NamedSharding(mesh, P(("data", "model"))))
    kwargs = dict(dtype=jnp.int4, axis=0, block_size=4)
    f = jax.jit(jax.value_and_grad(lambda w: jnp.sum(jnp.sin(jq.fake_quant(w, **kwargs)))))
    (v, g), (v1, g1) = f(ws), f(w)
    assert _spec(g) == P(("data", "model"))
    fq = jax.jit(lambda w: jq.fake_quant(w, **kwargs))
    np.testing.assert_array_equal(np.asarray(fq(ws)), np.asarray(fq(w)))
    np.testing.assert_allclose(np.asarray(v), np.asarray(v1), rtol=1e-6)  # sum order
    np.testing.assert_allclose(np.asarray(g), np.asarray(g1), rtol=1e-6)


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_loading_packed_bytes_onto_a_sharding_they_cannot_split_evenly(tmp_path, fmt):
    # (64, 36) uint4 codes packed along axis 1 are (64, 18) bytes: "model" (4) splits
    # the codes (9 per shard) but not the bytes. Before: JAX's IndivisibleError without
    # the tensor's name (safetensors), or "a missing or corrupted data file" (orbax).
    if fmt == "orbax":
        pytest.importorskip("orbax.checkpoint")
        save, load, path = jq.save_orbax, jq.load_orbax, tmp_path / "ckpt"
    else:
        pytest.importorskip("safetensors")
        save, load, path = jq.save_safetensors, jq.load_safetensors, tmp_path / "m.safetensors"
    mesh = host_mesh((2, 4), ("data", "model"), Explicit)
    q = jq.QuantSpec(dtype=jnp.uint4, axis=0, symmetric=False, packed=True)(_x(64, 36))
    save(path, {"w": q})
    on = lambda sp: (lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                    sharding=NamedSharding(mesh, sp)))
    packed = jax.tree.map(lambda a: on(P(None, "model") if a.ndim == 2 else P("data"))(a),
                          {"w": q})
    assert isinstance(packed["w"].qvalue, jq.PackedArray)
    with pytest.raises(ValueError, match=r"'w/qvalue': the target's sharding P\(None, 'model'\) "
                                         r"does not split its packed bytes \(64, 18\)"):
        load(path, packed)
    # the codes unpacked onto the same sharding: 9 codes per device
    unpacked = {"w": jq.QTensor(on(P(None, "model"))(q.qvalue.unpack()),
                                on(P("data"))(q.scale), on(P("data"))(q.zero_point), axis=0)}
    back = load(path, unpacked)["w"]
    assert not back.packed and _spec(back.qvalue) == P(None, "model")
    np.testing.assert_array_equal(np.asarray(back.qvalue), np.asarray(q.qvalue.unpack()))
    np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(q.dequantize()))


def test_mesh_axes_of_size_one_keep_channel_shardings():
    # a (1, 8) mesh: "data" has one device; channels and blocks stay on their axes
    mesh = host_mesh((1, 8), ("data", "model"), Explicit)
    x = _x(64, 128)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    rules = [("a", jq.QuantSpec(dtype=jnp.uint8, axis=1, symmetric=False)),
             ("b", jq.QuantSpec(dtype=jnp.int4, axis=1, block_size=16, packed=True))]
    q = jax.jit(lambda t: jq.quantize_tree(t, rules))({"a": xs, "b": xs})
    assert _spec(q["a"].scale) == P("model") and _spec(q["a"].zero_point) == P("model")
    assert _spec(q["b"].qvalue) == P("data", "model") and _spec(q["b"].scale) == P("data", "model")
    for k, (_, spec) in zip("ab", rules, strict=True):
        for got, want in zip(jax.tree.leaves(q[k]), jax.tree.leaves(spec(x)), strict=True):
            np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, Explicit])
@pytest.mark.parametrize("kw", [dict(axis=1), dict(), dict(axis=1, dtype=jnp.uint8,
                                                           symmetric=False),
                                dict(dtype=jnp.uint8, symmetric=False),
                                dict(axis=1, dtype=jnp.float8_e4m3fn),
                                dict(axis=1, scale_dtype=jnp.bfloat16)],
                         ids=["axis", "tensor", "axis-asym", "tensor-asym", "fp8", "bf16-scale"])
def test_a_group_holding_a_nan_gets_a_nan_scale_across_devices(axis_type, kw):
    # before: XLA's max / min across devices drops a NaN, so a channel holding one got a
    # finite scale on a mesh (its NaN dequantized to 0.0, silently) and NaN on one device
    x0 = np.array(_x(16, 32))
    x0[0, 2], x0[9, 30] = np.nan, -np.nan
    x = jax.device_put(x0, NamedSharding(host_mesh((2, 4), ("d", "m"), axis_type), P("d", "m")))
    for fn in (jq.quantize, jax.jit(lambda v: jq.quantize(v, **kw))):
        got, want = (fn(v, **kw) if fn is jq.quantize else fn(v) for v in (x, x0))
        assert np.isnan(np.asarray(got.scale, np.float32)).any()
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    got, want = jq.fake_quant(x, **kw), jq.fake_quant(x0, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.isnan(np.asarray(got)[0, 2]) and np.isnan(np.asarray(got)[9, 30])


@pytest.mark.parametrize("kw", [dict(axis=1), dict(), dict(axis=0, dtype=jnp.uint8, symmetric=False),
                                dict(dtype=jnp.int4, symmetric=False),
                                dict(axis=1, dtype=jnp.float8_e4m3fn),
                                dict(axis=1, scale_dtype=jnp.float8_e8m0fnu),
                                dict(axis=0, scale_dtype=jnp.bfloat16)],
                         ids=["axis", "tensor", "axis-asym", "tensor-asym", "fp8", "e8m0", "bf16"])
def test_one_device_float_maxima_equal_the_integer_ones_of_several(monkeypatch, kw):
    """With several devices, per-tensor and per-axis maxima are integer reductions of the
    bits (NaN survives XLA's reductions across devices); one device keeps XLA's faster float
    reductions. This suite runs on 8 devices, so its references check the integer ones:
    here the float ones give the same bits on edge values (NaN, inf, subnormals, -0.0)."""
    from jaxquant import _scales

    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, (48, 40), dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).copy()
    x[:, :8] = rng.standard_normal((48, 8)).astype(np.float32)
    x[:, 8:12] = np.float32(1e-40) * rng.standard_normal((48, 4)).astype(np.float32)
    x[:4, 12] = [np.inf, -np.inf, -0.0, 0.0]
    x[:, 13] = 0.0
    x = np.where(np.abs(x) > 1e30, np.float32(3.5), x)  # mostly finite groups, a few NaN/inf
    x[5, 14], x[6, 15], x[7, 16] = np.nan, np.inf, -np.inf
    results = []
    for several in (True, False):
        monkeypatch.setattr(_scales, "_several_devices", lambda s=several: s)
        jax.clear_caches()
        results.append(jax.device_get((jq.quantize(jnp.asarray(x), **kw),
                                       jq.fake_quant(jnp.asarray(x), **kw))))
    jax.clear_caches()
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        if np.dtype(a.dtype).kind == "f" or a.dtype == jnp.bfloat16:  # NaN payloads may differ
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(_bits(a), _bits(b))
