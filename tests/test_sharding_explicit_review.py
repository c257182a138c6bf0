"""Explicit mesh axes (8 host CPU devices of tests/conftest.py): row-parallel `qeinsum`,
tiles that fit their shards, and stacked MX layers. References: the same on one device."""

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


@pytest.mark.parametrize("subscripts,w_first", [("bk,kn->bn", False), ("kn,bk->bn", True),
                                                ("kn,bk->nb", True)])
@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, axis=0,
                                                               block_size=32, packed=True)],
                         ids=["int8", "int4-packed"])
def test_row_parallel_qeinsum_takes_out_sharding(subscripts, w_first, spec):
    # a contracted letter sharded on explicit axes needs the output's sharding, as jnp.einsum
    mesh = host_mesh((2, 4), ("d", "m"), Explicit)
    x, w = _x(16, 256), _x(256, 128, seed=1)
    qt = spec(w)
    xs = jax.device_put(x, NamedSharding(mesh, P("d", "m")))
    ws = jax.jit(spec)(jax.device_put(w, NamedSharding(mesh, P("m", None))))
    out = P("d", None) if subscripts.endswith("bn") else P(None, "d")
    ops = (ws, xs) if w_first else (xs, ws)
    with jax.set_mesh(mesh):
        y = jq.qeinsum(subscripts, *ops, out_sharding=out)
        y_named = jq.qeinsum(subscripts, *ops, out_sharding=NamedSharding(mesh, out))
    assert y.sharding.spec == out and y_named.sharding.spec == out
    ref = jq.qeinsum(subscripts, *((qt, x) if w_first else (x, qt)))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(y_named), np.asarray(y))


def test_qeinsum_out_sharding_errors():
    x, w = jnp.ones((4, 8)), jq.quantize(jnp.ones((8, 2)))
    with pytest.raises(TypeError, match="out_sharding must be a PartitionSpec"):
        jq.qeinsum("bk,kn->bn", x, w, out_sharding=("d", None))
    with pytest.raises(ValueError, match="out_sharding .* has 3 entries"):
        jq.qeinsum("bk,kn->bn", x, w, out_sharding=P("d", None, None))


def _bits(a) -> np.ndarray:
    a = np.asarray(a.data if isinstance(a, jq.PackedArray) else a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def test_fake_quant_of_tiles_that_fit_their_shards():
    # (128, 256) on a (2, 4) mesh: 64 x 64 per device, whole (16, 32) tiles
    mesh = host_mesh((2, 4), ("a", "b"), Explicit)
    x = _x(128, 256)
    xs = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
    kw = dict(axis=None, block_size=(16, 32))

    def loss(v):
        return jnp.sum(jnp.sin(jq.fake_quant(v, **kw)))

    with jax.set_mesh(mesh):
        y, g = jq.fake_quant(xs, **kw), jax.jit(jax.grad(loss))(xs)
    assert y.sharding.spec == P("a", "b") and g.sharding.spec == P("a", "b")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jq.fake_quant(x, **kw)))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.grad(loss)(x)))


@pytest.mark.parametrize("spec", [
    jq.QuantSpec(stacked=1, axis=None, block_size=(16, 32)),  # tiles of each layer
    jq.QuantSpec(dtype="mxfp4", stacked=1),
    jq.QuantSpec(dtype="mxfp8_e4m3", stacked=1),
    jq.QuantSpec(dtype="mxint8", stacked=1),
], ids=["tiles", "mxfp4", "mxfp8", "mxint8"])
@pytest.mark.parametrize("leaf_spec", [P("a"), P(None, "a", "b")], ids=["layers", "kernel"])
def test_stacked_layers_on_explicit_axes(spec, leaf_spec):
    # regressions: a reshape without the output's sharding (tiles), and a conditional whose
    # predicate vmap batched into a select (MX scales), inside the vmap over the layers
    mesh = host_mesh((2, 4), ("a", "b"), Explicit)
    k = _x(4, 128, 256)
    ks = jax.device_put(k, NamedSharding(mesh, leaf_spec))
    with jax.set_mesh(mesh):
        q = jax.jit(spec)(ks)
    ref = spec(k)
    assert _spec(q.qvalue) == leaf_spec
    np.testing.assert_array_equal(_bits(q.qvalue), _bits(ref.qvalue))
    np.testing.assert_array_equal(_bits(q.scale), _bits(ref.scale))


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.uint8, symmetric=False),
                                  jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32,
                                               packed=True)],
                         ids=["int8", "uint8-zero-points", "int4-packed-blocks"])
def test_fsdp_weight_only_dot_gathers_codes_not_floats(spec):
    # the weight sharded on its contracted axis ("d") where the activation's is whole: the
    # codes are gathered (before: the dequantized float32 weight, 4x / 8x the bytes)
    import re

    mesh = host_mesh((2, 4), ("d", "m"), Explicit)
    x, w = _x(16, 1024), _x(1024, 512, seed=1)
    dims = (((1,), (0,)), ((), ()))
    xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
    wq = jax.jit(spec)(jax.device_put(w, NamedSharding(mesh, P("d", "m"))))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda x, w: jq.qdot_general(x, w, dims))
        hlo = f.lower(xs, wq).compile().as_text()
        y = f(xs, wq)
    gathered = re.findall(r"= (\w+)\[([\d,]+)\]\S* all-gather", hlo)
    assert gathered
    for dtype, shape in gathered:  # bytes of codes (scales: a few float32 rows)
        size = np.prod([int(n) for n in shape.split(",")])
        assert dtype in ("s8", "u8") or size <= 32 * 128, (dtype, shape)
    ref = jq.qdot_general(x, spec(w), dims)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))


def _calls_without_set_mesh():
    D = (((1,), (0,)), ((), ()))
    block = jq.QuantSpec(axis=0, block_size=8)
    grad = lambda **kw: jax.jit(jax.grad(  # noqa: E731
        lambda x, w: jq.qat_dot_general(x, w, D, **kw).sum(), argnums=(0, 1)))
    return {
        "weight-only, per channel": lambda x, w: jax.jit(
            lambda x, q: jq.qdot_general(x, q, D))(x, jq.quantize(w, axis=1)),
        "weight-only, packed int4 blocks": lambda x, w: jax.jit(lambda x, q: jq.qdot_general(
            x, q, D))(x, jq.quantize(w, dtype=jnp.int4, axis=0, block_size=8, packed=True)),
        "int8 x int8, blocked weight": lambda x, w: jax.jit(lambda x, q: jq.qdot_general(
            x, q, D, act_quant=jq.ActQuant()))(x, jq.quantize(w, axis=0, block_size=8)),
        "qat, blocked weight": lambda x, w: grad(weight=block)(x, w),
        "qat, int8 backward": lambda x, w: grad(backward="int8")(x, w),
    }


@pytest.mark.parametrize("name", list(_calls_without_set_mesh()))
@pytest.mark.parametrize("w_spec", [P("d", None), P()], ids=["fsdp", "replicated"])
def test_arrays_placed_on_an_explicit_mesh_need_no_set_mesh(name, w_spec):
    # before: a bare PartitionSpec inside (reshard / out_sharding) raised "Using PartitionSpec
    # when you are not under a mesh context is not allowed" where lax.dot_general works
    mesh = host_mesh((2, 4), ("d", "m"), Explicit)
    x = jax.device_put(_x(8, 64), NamedSharding(mesh, P("d", None)))
    w = jax.device_put(_x(64, 32, seed=1), NamedSharding(mesh, w_spec))
    call = _calls_without_set_mesh()[name]
    got = call(x, w)
    with jax.set_mesh(mesh):
        want = call(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.spec == b.sharding.spec


@pytest.mark.parametrize("layout", [dict(axis=1), dict(axis=0, block_size=8)],
                         ids=["per-channel", "blocked"])
@pytest.mark.parametrize("call", ["qdot_general", "qeinsum"])
def test_int8_dot_out_sharding_given_as_a_named_sharding_without_set_mesh(layout, call):
    # before: the blocked int8 x int8 path (its result resharded after summing the blocks)
    # dropped a NamedSharding out_sharding outside jax.set_mesh: P('d', 'm'), not P(None, 'd')
    mesh = host_mesh((2, 4), ("d", "m"), Explicit)
    x = jax.device_put(_x(8, 32), NamedSharding(mesh, P("d", None)))
    w = jax.device_put(_x(32, 16, seed=1), NamedSharding(mesh, P(None, "m")))
    want, D = NamedSharding(mesh, P(None, "d")), (((1,), (0,)), ((), ()))
    dot = lambda x, q: jq.qdot_general(x, q, D, act_quant=jq.ActQuant(), out_sharding=want) \
        if call == "qdot_general" else jq.qeinsum("bk,kn->bn", x, q, act_quant=jq.ActQuant(),
                                                  out_sharding=want)
    q = jq.quantize(w, **layout)
    assert jax.lax.dot_general(x, w, D, out_sharding=want).sharding.spec == want.spec
    for got in (dot(x, q), jax.jit(dot)(x, q)):
        assert got.sharding.spec == want.spec
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jq.qdot_general(
            _x(8, 32), jq.quantize(_x(32, 16, seed=1), **layout), D, act_quant=jq.ActQuant())))


@pytest.mark.parametrize("length, kw", [
    (10, dict(dtype=jnp.int4, axis=1, block_size=4)),  # a partial last block
    (10, dict(dtype=jnp.int4, axis=1, block_size=10)),  # one whole block
    (10, dict(dtype="mxfp4")), (40, dict(dtype="nvfp4")), (10, dict(dtype="nf4", block_size=16)),
    (7, dict(dtype=jnp.int4, axis=0, packed=True)),  # an odd length packed
], ids=["partial-block", "one-block", "mxfp4", "nvfp4", "nf4", "packed-odd"])
def test_a_mesh_axis_of_size_one_splits_nothing(length, kw):
    # before: "x is sharded 1 ways ... one would straddle two devices" (there is one
    # device along it), or JAX's DuplicateSpecError for a single block
    mesh = host_mesh((1, 8), ("one", "m"), Explicit)
    v = _x(8, length)
    x = jax.device_put(v, NamedSharding(mesh, P("m", "one")))
    want = jq.dequantize(jq.quantize(v, **kw))
    for fn in (lambda x: jq.quantize(x, **kw), jax.jit(lambda x: jq.quantize(x, **kw))):
        np.testing.assert_array_equal(np.asarray(jq.dequantize(fn(x))), np.asarray(want))


@pytest.mark.parametrize("kw", [dict(dtype="nf4", block_size=16), dict(dtype="fp4", axis=None),
                                dict(dtype="nf4", block_size=16, double_quant=True)],
                         ids=["nf4", "fp4-per-tensor", "nf4-double-quant"])
def test_bitsandbytes_codebooks_under_set_mesh(kw):
    # before: the reciprocal of the scale was 1 (unsharded) / scale (sharded): a select of
    # operands sharded unlike (ShardingTypeError) inside jax.set_mesh
    mesh = host_mesh((8,), ("x",), Explicit)
    v = _x(64, 128)
    x = jax.device_put(v, NamedSharding(mesh, P("x", None)))
    want = np.asarray(jq.dequantize(jq.quantize(v, **kw)))
    with jax.set_mesh(mesh):
        got = jq.quantize(x, **kw)
        fq = jq.fake_quant(x, **kw)
    np.testing.assert_array_equal(np.asarray(jq.dequantize(got)), want)
    np.testing.assert_array_equal(np.asarray(fq), want)


@pytest.mark.parametrize("scale_spec", [P(), P("m")], ids=["replicated", "channel-sharded"])
def test_lsq_gradients_of_a_scale_sharded_unlike_its_kernel(scale_spec):
    # before: the scale's (and zero point's) gradient kept the kernel's sharding, which a
    # custom VJP must not return for a replicated scale ("bwd rule must produce an output
    # with the same type"): a linen learn_scale model with a replicated "quant" collection
    mesh = host_mesh((2, 4), ("d", "m"), Explicit)
    w0, s0, z0 = _x(32, 64), jnp.full((64,), 0.05), jnp.full((64,), 7.0)

    def loss(w, s, z):
        return jnp.sum(jnp.sin(jq.fake_quant(w, s, z, dtype=jnp.uint4, axis=1)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    want = grad(w0, s0, z0)
    with jax.set_mesh(mesh):
        w = jax.device_put(w0, NamedSharding(mesh, P(None, "m")))
        s, z = (jax.device_put(v, NamedSharding(mesh, scale_spec)) for v in (s0, z0))
        got = grad(w, s, z)
    assert _spec(got[1]) == _spec(s) and _spec(got[2]) == _spec(z)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("x_spec,s_spec", [(P("d", None), P()), (P("d", "m"), P()),
                                           (P(None, "m"), P()), (P("d", "m"), P("d", None)),
                                           (P("d", None), P(None, "m"))])
def test_learned_block_scales_sharded_unlike_the_input(x_spec, s_spec):
    # before: the block scale repeated over x kept the scale's sharding, which JAX would not
    # mix with x's (forward), nor return as x's gradient (backward); quantize worked
    mesh = host_mesh((2, 4), ("d", "m"), Explicit)
    x0, s0 = _x(8, 16), jnp.abs(_x(8, 4, seed=1)) / 50 + 0.01

    def loss(x, s):
        return jnp.sum(jnp.sin(jq.fake_quant(x, s, axis=1, block_size=4)))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    want = fn(x0, s0)
    x = jax.device_put(x0, NamedSharding(mesh, x_spec))
    s = jax.device_put(s0, NamedSharding(mesh, s_spec))
    got = fn(x, s)
    assert _spec(got[1][0]) == _spec(x) and _spec(got[1][1]) == _spec(s)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(jq.fake_quant(x, s, axis=1, block_size=4)),
                                  np.asarray(jq.fake_quant(x0, s0, axis=1, block_size=4)))


@pytest.mark.parametrize("kw", [{}, {"dtype": jnp.uint8}, {"dtype": jnp.float8_e4m3fn},
                                {"scale": jnp.float32(0.01)}])
def test_per_tensor_fake_quant_of_an_explicitly_sharded_input(kw):
    # before: a per-tensor scale (rank 0) was "resharded like" x, rank 2: an internal
    # zip() ValueError, forward and backward; quantize of the same x worked
    mesh = host_mesh((2, 4), ("d", "m"), Explicit)
    x0 = _x(16, 32)
    x = jax.device_put(x0, NamedSharding(mesh, P("d", "m")))
    kw = dict(kw)
    scale = kw.pop("scale", None)

    def loss(v):
        return jnp.sum(jnp.sin(jq.fake_quant(v, scale, **kw)))

    fn = jax.jit(jax.value_and_grad(loss))
    got, want = fn(x), fn(x0)
    assert _spec(got[1]) == _spec(x)
    np.testing.assert_array_equal(np.asarray(jq.fake_quant(x, scale, **kw)),
                                  np.asarray(jq.fake_quant(x0, scale, **kw)))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)  # sum order
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("dtype,length", [(jnp.int4, 15), (jnp.int2, 13), ("float6_e2m3fn", 14)])
def test_padded_packed_codes_sharded_along_the_packed_axis_unpack(dtype, length):
    # whole bytes on every device, the padding in the last one's: dropping it sliced a
    # sharded axis to a length the shards do not divide, JAX's ShardingTypeError in
    # dequantize, unpack, transpose and the weight-only dot
    mesh = host_mesh((4,), ("b",), Explicit)
    qt = jq.quantize(_x(2, length), dtype=dtype, axis=0, packed=True)
    placed = jax.device_put(qt, jax.tree.map(
        lambda a: NamedSharding(mesh, P(None, "b") if a.ndim == 2 else P()), qt))
    x = _x(3, 2, seed=1)
    calls = {"dequantize": jq.dequantize, "unpack": lambda q: q.qvalue.unpack(),
             "transpose": lambda q: jq.transpose(q).dequantize(),
             "qdot": lambda q: jq.qdot_general(x, q, (((1,), (0,)), ((), ())))}
    want = {name: np.asarray(call(qt)) for name, call in calls.items()}
    x = jax.device_put(x, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        for name, call in calls.items():
            np.testing.assert_array_equal(np.asarray(call(placed)), want[name], name)
