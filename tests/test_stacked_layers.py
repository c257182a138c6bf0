"""`QuantSpec(stacked=N)`: a stack of layers in one array (``nn.scan`` kernels, a scanned
checkpoint) quantized with one scale set per layer, into the stacked `QTensor` that
``lax.scan`` and ``jax.vmap`` slice layer by layer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_mesh import host_mesh, spec_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant._cli_rules import parse_spec
from jaxquant.flax.linen import QuantConfig

DENSE = (((1,), (0,)), ((), ()))
SPECS = [
    jq.QuantSpec(stacked=1),
    jq.QuantSpec(dtype=jnp.uint8, axis=0, symmetric=False, stacked=1),
    jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=8, packed=True, stacked=1),
    jq.QuantSpec(dtype=jnp.float8_e4m3fn, stacked=1),
    jq.QuantSpec(dtype="nvfp4", axis=0, packed=True, stacked=1),
    jq.QuantSpec(dtype="nf4", axis=0, block_size=16, double_quant=True, stacked=1),
]


def _kernels(*shape, seed=0):
    rng = np.random.default_rng(seed)
    # layers of very different magnitudes: one scale set for all would show
    return (rng.standard_normal(shape) * np.logspace(-2, 2, shape[0])[:, None, None]
            ).astype(np.float32)


def _one_layer(spec):
    return jq.QuantSpec(**{**spec.__dict__, "stacked": 0})


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), y)
                                      for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: str(s.dtype))
def test_each_layer_is_quantized_as_it_would_be_alone(spec):
    k = _kernels(3, 32, 8)
    q = jq.quantize_tree({"layers": {"kernel": k}}, [("kernel", spec)])["layers"]["kernel"]
    assert q.shape == k.shape and q.packed == spec.packed
    alone = [_one_layer(spec)(k[i]) for i in range(3)]
    for i, qt in enumerate(alone):
        assert _leaves_equal(jax.tree.map(lambda a, i=i: a[i], q), qt)
    stacked_back = jq.dequantize_tree({"k": q})["k"]
    np.testing.assert_array_equal(stacked_back, np.stack([jq.dequantize(a) for a in alone]))
    assert jq.tree_nbytes(q) == sum(a.nbytes for a in alone)


def test_per_channel_scales_are_each_layers_absmax():
    k = _kernels(4, 16, 8)
    q = jq.QuantSpec(axis=-1, stacked=1)(k)
    assert q.scale.shape == (4, 8) and q.axis == 1
    np.testing.assert_allclose(q.scale, np.abs(k).max(axis=1) / 127, rtol=1e-6)
    unstacked = jq.QuantSpec(axis=-1)(k)  # one scale per column, shared by the layers
    assert unstacked.scale.shape == (8,)
    error = lambda qt: np.abs(jq.dequantize_tree(qt) - k)[0].max()  # noqa: E731
    assert error(q) < error(unstacked) / 100  # the smallest layer keeps its precision


@pytest.mark.parametrize("spec", SPECS[:3] + SPECS[4:5], ids=lambda s: str(s.dtype))
def test_lax_scan_runs_one_layer_at_a_time(spec):
    k, x = _kernels(3, 32, 8), np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
    q = spec(k)

    @jax.jit
    def forward(q, x):
        return jax.lax.scan(lambda h, w: (h, jq.qdot_general(h, w, DENSE)), x, q)[1]

    want = np.einsum("bi,lio->lbo", x.astype(np.float64),
                     np.asarray(jax.vmap(jq.dequantize)(q), np.float64))
    np.testing.assert_allclose(forward(q, x), want, rtol=1e-5, atol=1e-5)


def test_int8_activations_under_vmap_over_stacked_layers():
    k, x = _kernels(2, 64, 16), np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    q = jq.QuantSpec(stacked=1)(k)
    dot = jax.vmap(lambda w: jq.qdot_general(x, w, DENSE, act_quant=jq.ActQuant()))
    assert "preferred_element_type=int32" in str(jax.make_jaxpr(dot)(q))
    for i in range(2):
        layer = jax.tree.map(lambda a, i=i: a[i], q)
        np.testing.assert_array_equal(dot(q)[i], jq.qdot_general(x, layer, DENSE,
                                                                 act_quant=jq.ActQuant()))


def test_two_stacked_axes():
    k = _kernels(6, 16, 8).reshape(2, 3, 16, 8)
    q = jq.QuantSpec(dtype=jnp.int4, packed=True, stacked=2)(k)
    assert q.scale.shape == (2, 3, 8)
    want = jq.quantize(k[1, 2], dtype=jnp.int4, axis=-1, packed=True)
    assert _leaves_equal(jax.tree.map(lambda a: a[1, 2], q), want)
    rows = jq.quantization_report({"k": k}, {"k": q})
    assert rows[0].granularity == "stacked=2 axis=1" and rows[0].nbytes_after == q.nbytes


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: str(s.dtype))
def test_safetensors_round_trip_is_bit_exact(tmp_path, spec):
    tree = {"blocks": {"kernel": spec(_kernels(3, 32, 8)), "bias": np.ones((3, 8), np.float32)}}
    jq.save_safetensors(tmp_path / "m.safetensors", tree)
    back = jq.load_safetensors(tmp_path / "m.safetensors")
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert _leaves_equal(back, tree)
    assert back["blocks"]["kernel"].packed == spec.packed


@pytest.mark.parametrize("pspec", [P("l", None, "m"), P(None, "m"), P("l", "m")])
def test_sharded_stack_keeps_shardings_through_quantize_and_load(tmp_path, pspec):
    mesh = host_mesh((2, 4), ("l", "m"))
    k = jax.device_put(_kernels(4, 16, 8), NamedSharding(mesh, pspec))
    spec = jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=4, packed=True, stacked=1)
    rules = [("kernel", spec)]
    q = jax.jit(lambda t: jq.quantize_tree(t, rules))({"kernel": k})["kernel"]
    assert spec_of(q.qvalue) == spec_of(k)
    assert spec_of(q.scale) == spec_of(k)  # (layers, blocks, out): the kernel's axes
    per_channel = jq.quantize_tree({"kernel": k}, [("kernel", jq.QuantSpec(stacked=1))])
    layers_axis, out_axis = (tuple(pspec) + (None,) * 3)[0], (tuple(pspec) + (None,) * 3)[2]
    assert spec_of(per_channel["kernel"].scale) == spec_of(
        jax.device_put(np.zeros((4, 8)), NamedSharding(mesh, P(layers_axis, out_axis))))
    jq.save_safetensors(tmp_path / "q.safetensors", {"kernel": q})
    target = jq.quantize_tree({"kernel": jax.ShapeDtypeStruct(k.shape, k.dtype,
                                                              sharding=k.sharding)}, rules)
    with jax.set_mesh(mesh):
        back = jq.load_safetensors(tmp_path / "q.safetensors", target)["kernel"]
    assert _leaves_equal(back, q)
    assert spec_of(back.scale) == spec_of(q.scale) and spec_of(back.qvalue) == spec_of(q.qvalue)


def test_cli_spec_takes_stacked():
    assert parse_spec("int4:axis=0:block=32:packed:stacked=1").stacked == 1
    with pytest.raises(ValueError, match="stacked=x"):
        parse_spec("int8:stacked=x")
    with pytest.raises(ValueError, match="stacked must be 0 or more"):
        parse_spec("int8:stacked=-1")


def test_bad_stacked_values_and_arrays_name_the_problem():
    with pytest.raises(TypeError, match="stacked must be an int.*True"):
        jq.QuantSpec(stacked=True)
    with pytest.raises(TypeError, match="stacked must be an int.*1.0"):
        jq.QuantSpec(stacked=1.0)
    with pytest.raises(ValueError, match="stacked must be 0 or more.*-1"):
        jq.QuantSpec(stacked=-1)
    assert jq.QuantSpec(stacked=np.int64(1)).stacked == 1
    with pytest.raises(ValueError, match=r"leaf 'w'.*stacked=2 needs an array with more axes.*"
                                         r"\(3, 8\)"):
        jq.quantize_tree({"w": jnp.ones((3, 8))}, [("w", jq.QuantSpec(stacked=2))])
    with pytest.raises(ValueError, match=r"leaf 'w'.*axis.*each layer has shape \(8, 6\)"):
        jq.quantize_tree({"w": jnp.ones((3, 8, 6))}, jq.QuantSpec(axis=2, stacked=1))


def test_layer_configurations_refuse_a_stacked_weight_spec():
    with pytest.raises(ValueError, match="QuantConfig.weight.*stacked=0.*got stacked=1"):
        QuantConfig(weight=jq.QuantSpec(stacked=1))
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    with pytest.raises(ValueError, match="weight must describe rhs itself.*got 1"):
        jq.qat_dot_general(x, w, DENSE, weight=jq.QuantSpec(stacked=1))


def test_a_stack_quantized_as_one_array_points_to_stacked_when_scanned():
    q = jq.QuantSpec(dtype=jnp.int4, axis=1, block_size=8)(jnp.ones((3, 16, 8)))
    with pytest.raises(ValueError, match=r"QuantSpec\(stacked=1\)"):
        jax.lax.scan(lambda c, w: (c, jq.dequantize(w)), None, q)


def test_command_line_quantizes_a_scanned_checkpoint_per_layer(tmp_path, capsys):
    from safetensors.numpy import save_file

    from jaxquant import _cli

    k = _kernels(3, 32, 8)
    save_file({"layers.kernel": k, "layers.bias": np.ones((3, 8), np.float32)},
              str(tmp_path / "in.safetensors"))
    rule = "kernel=int4:axis=0:block=16:packed:stacked=1"
    assert _cli.main(["quantize", str(tmp_path / "in.safetensors"),
                      str(tmp_path / "out.safetensors"), "--quiet", "--rules", rule]) == 0
    q = jq.load_safetensors(tmp_path / "out.safetensors")["layers.kernel"]
    want = jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16, packed=True, stacked=1)(k)
    assert _leaves_equal(q, want)
    capsys.readouterr()
    assert _cli.main(["report", str(tmp_path / "out.safetensors")]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("layers.kernel"))
    assert "stacked=1 axis=0 block=16" in row


def test_a_bare_tree_of_nn_scan_layers_gets_what_quantize_params_makes():
    import flax.linen as nn

    from jaxquant.flax.linen import quantize_linen

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.relu(nn.Dense(16)(x)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(Block, variable_axes={"params": 0},
                             split_rngs={"params": True}, length=3)
            return layers()(x, None)[0]

    model, x = Model(), jnp.asarray(_kernels(3, 2, 16)[1])
    params = model.init(jax.random.key(0), x)
    qm = quantize_linen(model, [("", QuantConfig())])
    by_model = qm.quantize_params(params, x)
    by_rules = jq.quantize_tree(params, [("kernel", jq.QuantSpec(stacked=1))])
    assert by_rules["params"]["ScanBlock_0"]["Dense_0"]["kernel"].scale.shape == (3, 16)
    assert jax.tree.structure(by_rules) == jax.tree.structure(by_model)
    assert _leaves_equal(by_rules, by_model)
    np.testing.assert_array_equal(jax.jit(qm.apply)(by_rules, x), jax.jit(qm.apply)(by_model, x))
    # One stacked spec for the whole tree selects what QuantSpec() selects in one layer: the
    # kernels, not the (layers, features) biases (one scale per element, and no runnable tree).
    by_spec = jq.quantize_tree(params, jq.QuantSpec(stacked=1))
    assert jax.tree.structure(by_spec) == jax.tree.structure(by_model)
    assert _leaves_equal(by_spec, by_model)


def test_a_stacked_spec_counts_dimensions_within_one_layer():
    tree = {"bias": jnp.zeros((3, 16)), "kernel": jnp.ones((3, 16, 8)), "deep": jnp.ones((2, 3, 16))}
    assert jq.match_rules(tree, jq.QuantSpec(stacked=1)) == {
        "bias": None, "deep": jq.QuantSpec(stacked=1), "kernel": jq.QuantSpec(stacked=1)}
    assert jq.match_rules(tree, jq.QuantSpec(stacked=2)) == {
        "bias": None, "deep": None, "kernel": None}
    assert jq.match_rules(tree, None) == dict.fromkeys(tree, jq.QuantSpec())


@pytest.mark.parametrize("kw", [dict(dtype=jnp.int4, axis=1), dict(dtype=jnp.int4, axis=1, block_size=8),
                                dict(dtype="nvfp4"), dict(dtype="float6_e2m3fn", axis=1)],
                         ids=["int4 per channel", "int4 blocks", "nvfp4", "float6"])
def test_pack_and_unpack_take_stacked_layers(kw):
    # Before: pack / unpack of a scanned model's QTensor rebuilt it through the constructor,
    # which read the stacked scales as one layer's and refused them.
    w = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 16, 8)), jnp.float32)
    qs = jq.quantize_tree({"k": w}, jq.QuantSpec(stacked=2, **kw))["k"]
    packed = jq.pack(qs)
    want = jax.vmap(jax.vmap(jq.pack))(qs)
    assert jax.tree.structure(packed) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    unpacked = jq.unpack(packed)
    assert jax.tree.structure(unpacked) == jax.tree.structure(qs)
    np.testing.assert_array_equal(unpacked.qvalue, qs.qvalue)
    np.testing.assert_array_equal(jq.dequantize_tree({"k": packed})["k"],
                                  jq.dequantize_tree({"k": qs})["k"])


def test_replace_on_stacked_layers_says_how_to_build_a_stack():
    w = jnp.ones((3, 16, 8))
    qs = jq.quantize_tree({"k": w}, jq.QuantSpec(axis=1, stacked=1))["k"]
    with pytest.raises(ValueError, match=r"got shape \(3, 8\)\. A QTensor stacked by jax\.vmap"):
        dataclasses.replace(qs, dtype=jnp.bfloat16)
    relabelled = jax.vmap(lambda q: dataclasses.replace(q, dtype=jnp.bfloat16))(qs)
    assert jq.dequantize_tree({"k": relabelled})["k"].dtype == jnp.bfloat16
