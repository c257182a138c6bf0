"""Multi-device workflows on the 8 host CPU devices of tests/conftest.py.

* ``jax.shard_map`` with `QTensor` pytrees crossing its boundary (per-channel,
  packed int4, NF4 and MXFP4 block scales): quantize, dequantize and dots inside
  the body equal the one-device computation (NumPy float64 / float32 references
  for int8); per-tensor scales are per shard unless the range is reduced across
  devices first, as the README says how.
* Tensor parallelism under ``jit`` with ``NamedSharding`` (column- then
  row-parallel dense layers with `QTensor` weights): the results, the output
  sharding, and no all-gather (no full float weight) in the compiled program.
* Checkpoints saved on a (2, 4) mesh loaded onto (4, 2), (8,) and one device,
  and one-device checkpoints loaded sharded (safetensors and orbax).
* ``quantize_tree`` under ``jit`` on other mesh shapes than tests/test_sharding.py's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_mesh import cpu_normal as _x
from host_mesh import host_mesh
from host_mesh import spec_of as _spec
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq

Explicit = jax.sharding.AxisType.Explicit
DN = (((1,), (0,)), ((), ()))


@pytest.fixture(scope="module")
def mesh():
    return host_mesh((2, 4), ("data", "model"), Explicit)


def _bits(a) -> np.ndarray:
    a = np.asarray(a.data if isinstance(a, jq.PackedArray) else a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _assert_same(got, want):
    """Two QTensors (or trees of them) hold the same codes, scales and zero points."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _specs(qt, codes: P, scale: P):
    """shard_map specs for the leaves of ``qt``: ``codes`` for the codes (and same-rank
    block scales), ``scale`` for 1-D per-channel scales and zero points."""
    return jax.tree.map(lambda a: codes if a.ndim == len(codes) else scale, qt)


# --------------------------------------------------------------------- shard_map boundaries

SHARD_MAP_RULES = [
    ("int8", jq.QuantSpec(axis=1)),
    ("int4", jq.QuantSpec(dtype=jnp.int4, axis=1, packed=True)),
    ("nf4", jq.QuantSpec(dtype="nf4", block_size=32, packed=True)),
    ("mxfp4", jq.QuantSpec(dtype="mxfp4", packed=True)),
]


def test_shard_map_quantize_and_dequantize_match_one_device(mesh):
    # regression: packed codes could not cross a shard_map boundary: a PackedArray kept
    # its global logical shape as static metadata, so inside the body it held a shard's
    # bytes but claimed the whole shape (dequantize: "packed bytes of shape (64, 16) do
    # not hold codes of shape (64, 128)", a hint about vmap), and out_specs built from
    # the QTensor did not match the body's output ("different pytree metadata")
    w = _x(64, 128)
    floats = {name: w for name, _ in SHARD_MAP_RULES}
    ref = jq.quantize_tree(floats, SHARD_MAP_RULES)
    specs = _specs(ref, P(None, "model"), P("model"))
    fn = lambda t: jq.quantize_tree(t, SHARD_MAP_RULES)
    q = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(None, "model"), out_specs=specs))(
        jax.device_put(floats, NamedSharding(mesh, P(None, "model"))))
    _assert_same(q, ref)  # channels and blocks of 32 lie within one device's 32 columns
    assert q["int4"].qvalue.shape == (64, 128) and q["int4"].packed
    assert _spec(q["int4"].qvalue) == P(None, "model") and _spec(q["int8"].scale) == P("model")
    # NumPy: per-channel int8 scale = absmax / 127 (float32), codes = rint(w / scale)
    wn = np.asarray(w)
    scale = np.abs(wn).max(axis=0) / np.float32(127)
    np.testing.assert_array_equal(np.asarray(q["int8"].scale), scale)
    np.testing.assert_array_equal(np.asarray(q["int8"].qvalue),
                                  np.clip(np.rint(wn / scale), -127, 127))
    deq = jax.jit(jax.shard_map(jq.dequantize_tree, mesh=mesh, in_specs=(specs,),
                                out_specs=P(None, "model")))
    want = jq.dequantize_tree(ref)
    placed = jax.device_put(ref, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    for got in (deq(q), deq(placed)):
        for k in floats:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


@pytest.mark.parametrize("dtype,length", [(jnp.int4, 15), (jnp.int2, 13),
                                          ("float6_e2m3fn", 14)])
def test_shard_map_refuses_packed_bytes_with_padding_split_along_the_packed_axis(
        mesh, dtype, length):
    # before: every shard was rebuilt as if its last byte held the whole tensor's padding:
    # (2, 15) int4 codes in 4 shards of 2 bytes came back as (2, 12), codes silently lost;
    # packing 3 codes a shard inside gave (2, 15) with a padding code in every shard
    qt = jq.quantize(_x(2, length), dtype=dtype, axis=0, packed=True)
    specs = _specs(qt, P(None, "model"), P())
    placed = jax.device_put(qt, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    into = jax.shard_map(jq.dequantize, mesh=mesh, in_specs=(specs,),
                         out_specs=P(None, "model"))
    with pytest.raises(ValueError, match=r"bytes along the packed axis hold \d padding"):
        into(placed)
    codes = jnp.arange(24, dtype=jnp.int8).reshape(2, 12).astype(jnp.int4) % 8
    out_of = jax.shard_map(jq.pack, mesh=mesh, in_specs=P(None, "model"),
                           out_specs=P(None, "model"))  # 3 codes a shard: 2 bytes, 1 padding
    with pytest.raises(ValueError, match=r"2 bytes along the packed axis hold 1 padding"):
        out_of(jax.device_put(codes, NamedSharding(mesh, P(None, "model"))))
    # padding-free shards (4 codes a shard: 2 whole bytes) cross as before
    codes = jnp.arange(32, dtype=jnp.int8).reshape(2, 16).astype(jnp.int4) % 8
    got = out_of(jax.device_put(codes, NamedSharding(mesh, P(None, "model"))))
    assert got.shape == (2, 16)
    np.testing.assert_array_equal(np.asarray(got.unpack()), np.asarray(codes))


def test_shard_map_column_parallel_dots(mesh):
    # x replicated, the weights' output columns split on "model": each device's dot is
    # the one-device dot of its columns (int8 x int8 -> int32; packed int4 weight-only)
    x, w = _x(8, 64, seed=1), _x(64, 128, seed=2)
    w8, w4 = jq.QuantSpec(axis=1)(w), jq.QuantSpec(dtype=jnp.int4, axis=1, packed=True)(w)
    specs = (_specs(w8, P(None, "model"), P("model")), _specs(w4, P(None, "model"), P("model")))
    placed = jax.device_put((w8, w4), jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    body = lambda x, a, b: (jq.qdot_general(x, a, DN, act_quant=jq.ActQuant()),
                            jq.qdot_general(x, b, DN))
    got8, got4 = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), *specs),
                                       out_specs=P(None, "model")))(
        jax.device_put(x, NamedSharding(mesh, P())), *placed)
    assert _spec(got8) == _spec(got4) == P(None, "model")
    np.testing.assert_array_equal(np.asarray(got8), np.asarray(jax.jit(body)(x, w8, w4)[0]))
    xn = np.asarray(x)
    xs = np.abs(xn).max(axis=1, keepdims=True) / np.float32(127)  # per-token int8
    acc = np.clip(np.rint(xn / xs), -127, 127).astype(np.int64) @ np.asarray(w8.qvalue, np.int64)
    ref = acc * xs.astype(np.float64) * np.asarray(w8.scale, np.float64)
    np.testing.assert_allclose(np.asarray(got8), ref, rtol=1e-6, atol=1e-6)
    ref = xn.astype(np.float64) @ np.asarray(w4.dequantize(), np.float64)
    np.testing.assert_allclose(np.asarray(got4), ref, rtol=1e-5, atol=1e-5)


def test_shard_map_per_tensor_scale_is_per_shard_unless_reduced(mesh):
    # The README's recipe: reduce the range across the devices (lax.pmax / pmin) and
    # quantize the range itself; its scale (and zero point) is the whole tensor's.
    w = _x(64, 128, seed=4) * np.linspace(0.1, 3.0, 128, dtype=np.float32)[None, :]
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    wn = np.asarray(w)

    def local(w):
        return jq.quantize(w).scale[None]

    per_shard = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "model"),
                                      out_specs=P("model")))(ws)
    np.testing.assert_array_equal(  # each device's own absmax
        np.asarray(per_shard), np.abs(wn).reshape(64, 4, 32).max(axis=(0, 2)) / np.float32(127))

    def symmetric(w):
        s = jq.quantize(lax.pmax(jnp.max(jnp.abs(w)), "model")).scale
        return jq.quantize(w, s)

    def affine(w):
        r = jnp.stack([lax.pmin(jnp.min(w), "model"), lax.pmax(jnp.max(w), "model")])
        r = jq.quantize(r, dtype=jnp.uint8, symmetric=False)
        return jq.quantize(w, r.scale, r.zero_point, dtype=jnp.uint8)

    for fn, kw in ((symmetric, {}), (affine, dict(dtype=jnp.uint8, symmetric=False))):
        ref = jq.quantize(w, **kw)
        specs = _specs(ref, P(None, "model"), P())
        q = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(None, "model"),
                                  out_specs=specs))(ws)
        _assert_same(q, ref)
    scale = np.abs(wn).max() / np.float32(127)  # NumPy: the whole tensor's scale
    np.testing.assert_array_equal(np.asarray(jq.quantize(w).scale), scale)


# ---------------------------------------------------------------- tensor parallel under jit

TP_CASES = {
    "w8a8": (jq.QuantSpec(axis=1), jq.QuantSpec(axis=1), jq.ActQuant()),
    "w4-packed": (jq.QuantSpec(dtype=jnp.int4, axis=1, packed=True),
                  jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True), None),
}


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tensor_parallel_mlp_keeps_weights_sharded_and_quantized(mesh, name):
    s1, s2, act = TP_CASES[name]
    x, w1, w2 = _x(16, 64, seed=1), _x(64, 256, seed=2) * 0.1, _x(256, 64, seed=3) * 0.1
    out = NamedSharding(mesh, P("data", None))

    def mlp(x, q1, q2, out_sharding=None):
        h = jax.nn.relu(jq.qdot_general(x, q1, DN, act_quant=act))  # column-parallel
        return jq.qdot_general(h, q2, DN, act_quant=act, out_sharding=out_sharding)  # row

    q1, q2 = s1(w1), s2(w2)
    want = jax.jit(mlp)(x, q1, q2)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    # column-parallel: codes and scales split on the output axis; row-parallel: on the input
    q1s = jax.device_put(q1, jax.tree.map(lambda a: NamedSharding(mesh, P(*[None] * (
        a.ndim - 1), "model")), q1))
    q2s = jax.device_put(q2, jax.tree.map(lambda a: NamedSharding(mesh, P(
        "model" if a.ndim == 2 else None)), q2))
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda x, a, b: mlp(x, a, b, out)).lower(xs, q1s, q2s).compile()
        got = compiled(xs, q1s, q2s)
    hlo = compiled.as_text()
    assert _spec(got) == P("data")
    if act is not None:  # int32 partial sums: exact in any order
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # the weights are never gathered: no all-gather, no float array of a whole weight
    assert "all-gather" not in hlo
    assert not re.search(r"f32\[(64,256|256,64)\]", hlo)
    assert "all-reduce" in hlo  # the row-parallel partial sums


# --------------------------------------------------------------------- checkpoints, meshes

CKPT_RULES = [("b", jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True)),
              ("c", jq.QuantSpec(dtype=jnp.uint8, symmetric=False, axis=0)),
              ("e", jq.QuantSpec(dtype="mxfp4", packed=True)),
              ("f", jq.QuantSpec(dtype=jnp.uint4, axis=1, symmetric=False, packed=True))]


def _on(mesh, spec_fn, tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=NamedSharding(mesh, spec_fn(a))),
                        tree)


def _last_axis(name):
    return lambda a: P(*[None] * (a.ndim - 1), name) if a.shape[-1] % 8 == 0 else P()


@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_checkpoint_moves_between_meshes(mesh, tmp_path, fmt):
    if fmt == "orbax":
        pytest.importorskip("orbax.checkpoint")
        save, load = jq.save_orbax, jq.load_orbax
    else:
        pytest.importorskip("safetensors")
        save, load = jq.save_safetensors, jq.load_safetensors
    floats = {k: _x(64, 128, seed=i) for i, k in enumerate("bcef")}
    ref = jq.quantize_tree(floats, CKPT_RULES)
    two_d = lambda a: P("data", "model") if a.ndim == 2 else P("model")
    q = jax.device_put(ref, jax.tree.map(lambda a: NamedSharding(mesh, two_d(a)), ref))
    assert _spec(q["b"].qvalue) == P("data", "model")  # the packed bytes, on (2, 4)
    save(tmp_path / "sharded", q)
    m42 = host_mesh((4, 2), ("data", "model"), Explicit)
    m8 = host_mesh((8,), ("x",), Explicit)
    transposed = lambda a: P("model", "data") if a.ndim == 2 else P("data")
    targets = [_on(m42, transposed, ref)]
    if fmt == "safetensors":
        targets.append(_on(m8, _last_axis("x"), ref))
    one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[5])
    targets.append(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                                ref))
    for target in targets:
        back = load(tmp_path / "sharded", target)
        _assert_same(back, ref)
        for a, t in zip(jax.tree.leaves(back), jax.tree.leaves(target), strict=True):
            assert a.sharding == t.sharding
    assert _spec(targets[0]["b"].qvalue) == P("model", "data")  # packed bytes on (4, 2)
    _assert_same(load(tmp_path / "sharded"), ref)  # no target: one device
    save(tmp_path / "single", ref)  # and the other way: one device to the (2, 4) mesh
    target = _on(mesh, two_d, ref)
    back = load(tmp_path / "single", target)
    _assert_same(back, ref)
    for a, t in zip(jax.tree.leaves(back), jax.tree.leaves(target), strict=True):
        assert a.sharding == t.sharding


# ------------------------------------------------------------ quantize_tree on other meshes

def test_quantize_tree_under_jit_keeps_shardings_on_a_transposed_mesh():
    m, leaf_spec = host_mesh((4, 2), ("data", "model"), Explicit), P("model", "data")
    rules = [("a", jq.QuantSpec(axis=1)),
             ("b", jq.QuantSpec(dtype=jnp.int4, axis=1, block_size=16, packed=True)),
             ("d", jq.QuantSpec(dtype="mxfp4", packed=True))]  # blocks of 32: 32 per shard
    floats = {k: _x(64, 128, seed=i) for i, k in enumerate("abd")}
    q = jax.jit(lambda t: jq.quantize_tree(t, rules))(
        jax.device_put(floats, NamedSharding(m, leaf_spec)))
    _assert_same(q, jq.quantize_tree(floats, rules))
    want = _spec(jax.device_put(floats["a"], NamedSharding(m, leaf_spec)))
    channel = P(want[1])
    for k in "abd":
        assert _spec(q[k].qvalue) == want, k
        assert q[k].scale.sharding.mesh == m
    assert _spec(q["a"].scale) == channel  # per-channel: the channel's mesh axis
    for k in "bd":  # blocks: along both axes, as the codes
        assert _spec(q[k].scale) == want, k
