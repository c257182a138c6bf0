"""Sharded trees on the 8 host CPU devices of tests/conftest.py (a 2 x 4 data x model mesh).

QTensor leaves keep NamedShardings: codes as their float leaf, scales along the
mesh axis of their channel (blocked scales along both axes); dequantize keeps
them; quantized dots and a fake-quant training step run sharded and match one
device; safetensors checkpoints load onto target shardings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from host_mesh import cpu_normal as _x
from host_mesh import host_mesh
from host_mesh import spec_of as _spec
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq


def _mesh(axis_type=jax.sharding.AxisType.Explicit):
    """A 2 x 4 mesh of host CPU devices (also where the default backend is a GPU)."""
    return host_mesh((2, 4), ("data", "model"), axis_type)


@pytest.fixture(scope="module")
def mesh():
    """JAX's default mesh: explicit axes (shardings are part of the types)."""
    return _mesh()


# (leaf spec, QuantSpec, expected codes spec, expected scale spec). The code dtype does not
# change how shardings flow: float element formats (float8, unpacked MX) lay out their codes
# and scales as int8 per channel and the packed MX case below.
CASES = [
    (P("data", "model"), jq.QuantSpec(), P("data", "model"), P("model")),
    (P("data", "model"), jq.QuantSpec(axis=0), P("data", "model"), P("data")),
    (P(None, "model"), jq.QuantSpec(), P(None, "model"), P("model")),
    (P("model", None), jq.QuantSpec(), P("model"), P()),
    (P("model", None), jq.QuantSpec(axis=0), P("model"), P("model")),
    (P("data", "model"), jq.QuantSpec(axis=None), P("data", "model"), P()),
    (P("data", "model"), jq.QuantSpec(axis=0, block_size=8), P("data", "model"),
     P("data", "model")),
    (P("data", "model"), jq.QuantSpec(axis=1, block_size=4), P("data", "model"),
     P("data", "model")),
    (P("data", "model"), jq.QuantSpec(dtype=jnp.int4, packed=True), P("data", "model"),
     P("model")),
    (P("data", "model"), jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True),
     P("data", "model"), P("data", "model")),
    (P("data", "model"), jq.QuantSpec(dtype=jnp.uint8, symmetric=False), P("data", "model"),
     P("model")),
    (P("data", "model"), jq.QuantSpec(dtype="mxfp4", packed=True), P("data", "model"),
     P("data", "model")),
]


@pytest.mark.parametrize("jit,axis_type", [(True, "Explicit"), (True, "Auto"),
                                           (False, "Explicit")], ids=["jit", "jit-auto", "eager"])
@pytest.mark.parametrize("leaf_spec,spec,codes_spec,scale_spec", CASES)
def test_quantize_tree_keeps_shardings(jit, axis_type, leaf_spec, spec, codes_spec, scale_spec):
    mesh = _mesh(getattr(jax.sharding.AxisType, axis_type))
    x = _x(64, 128)
    xs = jax.device_put(x, NamedSharding(mesh, leaf_spec))
    bias = jax.device_put(x[0], NamedSharding(mesh, P()))
    fn = lambda t: jq.quantize_tree(t, [("w", spec)])
    q = (jax.jit(fn) if jit else fn)({"w": xs, "b": bias})["w"]
    assert _spec(q.qvalue) == codes_spec
    assert _spec(q.scale) == scale_spec
    assert q.scale.sharding.mesh == mesh
    if q.zero_point is not None:
        assert _spec(q.zero_point) == scale_spec
    ref = spec(x)  # one device: the same codes and scales
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(ref.scale))
    got = q.qvalue.data if q.packed else q.qvalue
    want = ref.qvalue.data if ref.packed else ref.qvalue
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    back = (jax.jit(jq.dequantize_tree) if jit else jq.dequantize_tree)({"w": q})["w"]
    assert back.sharding.is_equivalent_to(xs.sharding, 2)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(ref.dequantize()))


@pytest.mark.parametrize("spec", [jq.QuantSpec(dtype="nvfp4", packed=True),
                                  jq.QuantSpec(dtype="nf4", block_size=32, double_quant=True)],
                         ids=["nvfp4", "nf4-double-quant"])
def test_two_level_scales_are_sharded_like_their_blocks(mesh, spec):
    x = _x(64, 128)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    q = jax.jit(lambda t: jq.quantize_tree(t, [("w", spec)]))({"w": xs})["w"]
    assert _spec(q.qvalue) == P("data", "model")
    assert _spec(q.scale.qvalue) == P("data", "model")  # float8 block scales
    ref = spec(x)
    np.testing.assert_array_equal(np.asarray(q.scale.qvalue).view(np.uint8),
                                  np.asarray(ref.scale.qvalue).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.scale.scale), np.asarray(ref.scale.scale))
    np.testing.assert_array_equal(np.asarray(jq.dequantize(q)), np.asarray(ref.dequantize()))


def test_three_dim_leaf_per_channel_and_blocked(mesh):
    x = _x(8, 16, 32)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
    q = jax.jit(lambda t: jq.quantize_tree(t, [("a", jq.QuantSpec()),
                                               ("b", jq.QuantSpec(axis=2, block_size=4))]))(
        {"a": xs, "b": xs})
    assert _spec(q["a"].qvalue) == P("data", None, "model") and _spec(q["a"].scale) == P("model")
    assert _spec(q["b"].scale) == P("data", None, "model") and q["b"].scale.shape == (8, 16, 8)


def _dense_dims():
    return (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("spec,act_quant", [
    (jq.QuantSpec(), None),
    (jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True), None),
    (jq.QuantSpec(), jq.ActQuant()),
], ids=["w8", "w4-block-packed", "w8a8"])
def test_qdot_general_sharded_matches_one_device(spec, act_quant):
    # Auto axes: XLA propagates the shardings (explicit axes: tests/test_sharding_review.py).
    mesh = _mesh(jax.sharding.AxisType.Auto)
    x, w = _x(16, 64, seed=1), _x(64, 128, seed=2)
    wq = spec(w)
    dot = jax.jit(lambda x, w: jq.qdot_general(x, w, _dense_dims(), act_quant=act_quant))
    want = dot(x, wq)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.jit(spec)(jax.device_put(w, NamedSharding(mesh, P(None, "model"))))
    with jax.set_mesh(mesh):
        got = dot(xs, ws)
    assert _spec(ws.scale) == (P("model") if spec.block_size is None else P(None, "model"))
    assert _spec(got) == P("data", "model")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _mlp_loss(params, batch):
    x, y = batch
    fq = lambda w: jq.fake_quant(w, dtype=jnp.int8, axis=1)
    h = jax.nn.relu(x @ fq(params["w1"]) + params["b1"][None, :])
    return jnp.mean((h @ fq(params["w2"]) - y) ** 2)


def test_fake_quant_train_step_fsdp_matches_one_device():
    mesh = _mesh(jax.sharding.AxisType.Auto)  # XLA inserts the FSDP all-gathers
    params = {"w1": _x(32, 64, seed=3) * 0.2, "b1": _x(64, seed=8) * 0.0,
              "w2": _x(64, 8, seed=4) * 0.2}
    batch = (_x(16, 32, seed=5), _x(16, 8, seed=6))
    opt = optax.sgd(0.1, momentum=0.9)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def run(params, batch):
        state = opt.init(params)
        losses = []
        for _ in range(4):
            params, state, loss = step(params, state, batch)
            losses.append(float(loss))
        return params, losses

    want, want_losses = run(params, batch)
    # FSDP: every parameter split over both mesh axes on its first dimension; batch over data
    fsdp = NamedSharding(mesh, P(("data", "model")))
    sp = jax.device_put(params, fsdp)
    sb = jax.device_put(batch, NamedSharding(mesh, P("data")))
    got, got_losses = run(sp, sb)
    assert got["w1"].sharding.is_equivalent_to(fsdp, 2)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert got_losses[-1] < got_losses[0]
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-6)


def test_safetensors_round_trip_onto_target_shardings(mesh, tmp_path):
    pytest.importorskip("safetensors")
    tree = {"dense": {"kernel": _x(64, 128), "bias": _x(128)}, "emb": _x(32, 64, seed=7)}
    rules = [("kernel", jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True)),
             ("emb", jq.QuantSpec(dtype=jnp.uint8, symmetric=False, axis=0))]
    placed = {"dense": {"kernel": jax.device_put(tree["dense"]["kernel"],
                                                 NamedSharding(mesh, P("data", "model"))),
                        "bias": jax.device_put(tree["dense"]["bias"],
                                               NamedSharding(mesh, P("model")))},
              "emb": jax.device_put(tree["emb"], NamedSharding(mesh, P("model", None)))}
    q = jax.jit(lambda t: jq.quantize_tree(t, rules))(placed)
    jq.save_safetensors(tmp_path / "m.safetensors", q)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), q)
    back = jq.load_safetensors(tmp_path / "m.safetensors", target)
    leaves = jax.tree_util.tree_leaves_with_path(q)
    back_leaves = jax.tree.leaves(back)
    assert len(leaves) == len(back_leaves) == 6  # bias; kernel bytes, scale; emb codes, scale, zp
    for (path, a), b in zip(leaves, back_leaves, strict=True):
        assert b.sharding == a.sharding, jax.tree_util.keystr(path)
        assert b.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    assert _spec(back["emb"].scale) == P("model")
    assert back["dense"]["kernel"].packed
    # onto a different layout: replicated codes, re-sharded from the same file
    other = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                        sharding=NamedSharding(mesh, P())), q)
    again = jq.load_safetensors(tmp_path / "m.safetensors", other)
    assert again["emb"].qvalue.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(jq.dequantize(again["emb"])),
                                  np.asarray(jq.dequantize(q["emb"])))


@pytest.mark.parametrize("act", [jq.ActQuant(), None], ids=["w8a8", "w8"])
@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(axis=0, block_size=16)],
                         ids=["channel", "block"])
def test_int8_qat_dot_gradient_on_explicit_mesh(mesh, spec, act):
    # regression: the CPU backward read the scale's first element (slicing a sharded scale)
    # and repeated blocked scales (a reshape of a sharded axis); both are rejected there
    x, w = _x(16, 64, seed=1), _x(64, 128, seed=2)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    loss = lambda x, w: jnp.sum(jnp.sin(jq.qat_dot_general(x, w, _dense_dims(), weight=spec,
                                                           act=act)))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    want = grad(x, w)
    with jax.set_mesh(mesh):
        got = grad(xs, ws)
    assert _spec(got[1]) == P(None, "model")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_blocked_qat_dot_takes_out_sharding(mesh):
    x, w = _x(16, 64, seed=1), _x(64, 128, seed=2)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
    out = NamedSharding(mesh, P("data", None))
    f = lambda x, w: jq.qat_dot_general(x, w, _dense_dims(), out_sharding=out,
                                        weight=jq.QuantSpec(axis=0, block_size=16))
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))
    want = grad(x, w)
    with jax.set_mesh(mesh):
        assert _spec(jax.jit(f)(xs, ws)) == P("data")
        got = grad(xs, ws)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", [jq.QuantSpec(axis=0, block_size=16),
                                  jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True)],
                         ids=["w8-block", "w4-block-packed"])
def test_blocked_int8_dot_fsdp_on_explicit_mesh(mesh, spec):
    # regression: the blocks of the scale sharded on "data" as the activation's rows
    x, w = _x(16, 64, seed=1), _x(64, 128, seed=2)
    dot = jax.jit(lambda x, w: jq.qdot_general(x, w, _dense_dims(), act_quant=jq.ActQuant()))
    want = dot(x, spec(w))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.jit(spec)(jax.device_put(w, NamedSharding(mesh, P("data", "model"))))
    with jax.set_mesh(mesh):
        got = dot(xs, ws)
    assert _spec(got) == P("data", "model")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_quantized_flax_kernels_keep_partition_specs():
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    from jaxquant.flax import QuantConfig, nnx_quantize, quantize_linen

    mesh = _mesh(jax.sharding.AxisType.Auto)
    init = nn.initializers.lecun_normal()
    with jax.set_mesh(mesh):
        m = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(init, (None, "model")),
                       rngs=nnx.Rngs(0))
        nnx_quantize(m, QuantConfig())
        st = nnx.state(m)
        specs = jax.tree.leaves(nnx.get_partition_spec(st))
        assert specs == [P(), P(None, "model"), P("model")]  # bias, codes, scale
        out = jax.jit(lambda s: jax.lax.with_sharding_constraint(s, nnx.get_partition_spec(s)))(st)
        assert _spec(out["kernel"][...].scale) == P("model")
        mod = nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, "model")))
        qm = quantize_linen(mod, QuantConfig(weight=jq.QuantSpec(axis=0, block_size=8)))
        x = jnp.ones((8, 32))
        q = qm.quantize_params(qm.init(jax.random.key(0), x), x)
    assert jax.tree.leaves(nn.get_partition_spec(q)) == [P(), P(None, "model"), P(None, "model")]
    np.testing.assert_allclose(qm.apply(q, x), qm.apply(nn.meta.unbox(q), x))


def test_partitioned_double_quant_kernels_load_into_their_own_shardings(tmp_path):
    # before: the second-level scale (one entry here) got the kernel's mesh axes, which
    # cannot split it: placing the params on nn.get_sharding, or loading the checkpoint
    # into the nnx.eval_shape model's own shardings, failed
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    from jaxquant.flax import QuantConfig, nnx_quantize, quantize_linen

    mesh = _mesh(jax.sharding.AxisType.Auto)
    cfg = QuantConfig(weight=jq.QuantSpec(dtype="nf4", axis=0, block_size=32, double_quant=True))
    init = nn.initializers.lecun_normal()
    model = nn.Dense(128, kernel_init=nn.with_partitioning(init, ("data", "model")))
    qm, x = quantize_linen(model, cfg), jnp.ones((2, 64))
    q = qm.quantize_params(model.init(jax.random.key(0), x), x)
    assert q["params"]["kernel"].scale.scale.names == (None, None)
    placed = jax.device_put(nn.meta.unbox(q), nn.get_sharding(q, mesh))
    np.testing.assert_allclose(np.asarray(jax.jit(qm.apply)(placed, x)),  # sharded sums
                               np.asarray(jax.jit(qm.apply)(nn.meta.unbox(q), x)), atol=1e-5)

    def make():
        layer = nnx.Linear(64, 128, rngs=nnx.Rngs(0),
                           kernel_init=nnx.with_partitioning(init, ("data", "model")))
        return nnx_quantize(layer, cfg)

    with jax.set_mesh(mesh):
        state = nnx.state(make())
        abstract = nnx.state(nnx.eval_shape(make))
        shardings = nnx.get_named_sharding(abstract, mesh)
    target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          abstract, shardings)
    jq.save_safetensors(tmp_path / "m.safetensors", nnx.to_pure_dict(state))
    back = jq.load_safetensors(tmp_path / "m.safetensors", nnx.to_pure_dict(target))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(nnx.to_pure_dict(state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back["kernel"].qvalue.sharding.spec == P("data", "model")


def test_linen_placeholders_under_set_mesh_convert():
    # before: unboxing applied Flax's sharding constraint to a ShapeDtypeStruct (TypeError)
    nn = pytest.importorskip("flax.linen")
    from jaxquant.flax import QuantConfig, quantize_linen

    mesh = _mesh(jax.sharding.AxisType.Auto)
    model = nn.Dense(128, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                           ("data", "model")))
    qm = quantize_linen(model, QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, packed=True)))
    x = jnp.ones((2, 64))
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(model.init, jax.random.key(0), x)
        target = qm.quantize_params(abstract, x)
        q = qm.quantize_params(model.init(jax.random.key(0), x), x)
    kernel = nn.meta.unbox(target)["params"]["kernel"]
    assert kernel.qvalue.dtype == jnp.int4 and kernel.qvalue.data.shape == (64, 64)
    assert jax.tree.structure(nn.meta.unbox(target)) == jax.tree.structure(nn.meta.unbox(q))


def test_weight_only_dot_vmapped_over_stacked_sharded_layers(mesh):
    # regression: the CPU scheduling lax.cond, its predicate batched by vmap over the
    # weights, became a select whose broadcast predicate JAX left unsharded (rejected)
    spec = jq.QuantSpec(dtype=jnp.int4, packed=True)
    x, w = _x(16, 64, seed=1), _x(4, 64, 128, seed=2)
    dot = jax.jit(jax.vmap(lambda x, w: jq.qdot_general(x, w, _dense_dims()), (None, 0)))
    want = dot(x, jax.vmap(spec)(w))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.jit(jax.vmap(spec))(jax.device_put(w, NamedSharding(mesh, P(None, None, "model"))))
    with jax.set_mesh(mesh):
        got = dot(xs, ws)
    assert _spec(got) == P(None, "data", "model")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", [jq.ActQuant(), None], ids=["w8a8", "w8"])
def test_qat_dot_gradient_vmapped_over_stacked_sharded_layers(mesh, act):
    x, w = _x(16, 64, seed=1), _x(4, 64, 128, seed=2)
    loss = lambda x, w: jnp.sum(jnp.sin(jq.qat_dot_general(x, w, _dense_dims(), act=act)))
    grad = jax.jit(jax.vmap(jax.grad(loss, argnums=1), (None, 0)))
    want = grad(x, w)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, None, "model")))
    with jax.set_mesh(mesh):
        got = grad(xs, ws)
    assert _spec(got) == P(None, None, "model")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x_spec,w_spec", [(P("data"), P(None, "model")),
                                           (P(("data", "model")), P(("data", "model")))],
                         ids=["tp", "fsdp"])
@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_int8_backward_with_sharded_output_channels(mesh, x_spec, w_spec, granularity):
    # regression: backward="int8" contracted the gradient with the weight's codes over
    # their sharded output axis without an out_sharding (rejected on explicit axes)
    x, w = _x(16, 64, seed=1), _x(64, 128, seed=2)
    f = lambda x, w: jq.qat_dot_general(x, w, _dense_dims(), backward="int8",
                                        act=jq.ActQuant(granularity=granularity))
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))
    want = grad(x, w)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ws = jax.device_put(w, NamedSharding(mesh, w_spec))
    with jax.set_mesh(mesh):
        got = grad(xs, ws)
    assert _spec(got[0]) == x_spec and _spec(got[1]) == w_spec
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_safetensors_loads_onto_eval_shape_target_of_explicit_mesh(mesh, tmp_path):
    # jax.eval_shape on explicit mesh axes gives NamedShardings on an AbstractMesh:
    # load_safetensors put them on the concrete mesh of jax.set_mesh (it passed them to
    # jax.device_put, which failed with "is_fully_addressable is not implemented")
    pytest.importorskip("safetensors")
    rules = [("w", jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True)),
             ("e", jq.QuantSpec(dtype=jnp.uint4, symmetric=False, axis=0))]
    tree = {"w": jax.device_put(_x(64, 128), NamedSharding(mesh, P("data", "model"))),
            "e": jax.device_put(_x(32, 64, seed=7), NamedSharding(mesh, P("model", None)))}
    q = jax.jit(lambda t: jq.quantize_tree(t, rules))(tree)
    jq.save_safetensors(tmp_path / "m.safetensors", q)
    target = jax.eval_shape(lambda t: jq.quantize_tree(t, rules), tree)
    assert isinstance(target["w"].scale.sharding.mesh, jax.sharding.AbstractMesh)
    with pytest.raises(ValueError, match=r"'e/qvalue': the target's sharding is on an abstract "
                                         r"mesh .*jax.set_mesh.*got Mesh\(\)"):
        jq.load_safetensors(tmp_path / "m.safetensors", target)
    with jax.set_mesh(mesh):
        back = jq.load_safetensors(tmp_path / "m.safetensors", target)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(back), strict=True):
        assert b.sharding == a.sharding
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    assert _spec(back["e"].qvalue) == P("model") and _spec(back["e"].scale) == P("model")
    other = host_mesh((4, 2), ("data", "model"), jax.sharding.AxisType.Explicit)
    with jax.set_mesh(other), pytest.raises(ValueError, match=r"abstract mesh"):
        jq.load_safetensors(tmp_path / "m.safetensors", target)


@pytest.mark.parametrize("x_spec,scale_spec,block_size", [
    (P("data", None), P("model"), None),  # the codes' channels are not split: select mismatch
    (P("data", "model"), P("data"), None),  # the scale on another mesh axis than its channel
    (P("data", "model"), P("model", "data"), 8),  # blocks of the scale transposed on the mesh
], ids=["channel-split-elsewhere", "channel-other-axis", "blocks-transposed"])
def test_given_scale_sharded_unlike_x_on_explicit_mesh(mesh, x_spec, scale_spec, block_size):
    # regression: the elementwise selects of the quotient rejected a given scale sharded
    # unlike the channels (or blocks) of x; it is resharded to x's groups
    x = _x(64, 128)
    scale = np.abs(_x(*((8, 128) if block_size else (128,)), seed=5)) + 0.1
    axis = 0 if block_size else 1
    want = jq.quantize(x, scale, axis=axis, block_size=block_size)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ss = jax.device_put(scale, NamedSharding(mesh, scale_spec))
    q = jax.jit(lambda x, s: jq.quantize(x, s, axis=axis, block_size=block_size))(xs, ss)
    assert _spec(q.qvalue) == _spec(xs)
    np.testing.assert_array_equal(np.asarray(q.qvalue), np.asarray(want.qvalue))
    back = jax.jit(jq.dequantize)(q)
    assert _spec(back) == _spec(xs)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(want.dequantize()))
