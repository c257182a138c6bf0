"""`flax.serialization` (state dicts, msgpack ``to_bytes`` / ``from_bytes``) of trees with
`QTensor` leaves: bit for bit, and states whose arrays or metadata do not fit the target are
refused naming the path."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import jaxquant as jq
from jaxquant.flax import QuantConfig, quantize_linen

_W = jnp.asarray(np.random.default_rng(0).standard_normal((16, 64)), jnp.float32)
_KINDS = {
    "int8 per channel": dict(axis=1),
    "uint8 with a zero point": dict(dtype=jnp.uint8, axis=0, symmetric=False),
    "packed int4 blocks": dict(dtype=jnp.int4, axis=1, block_size=32, packed=True),
    "nvfp4 (two-level scales)": dict(dtype="nvfp4", packed=True),
    "nf4, packed": dict(dtype="nf4", axis=1, block_size=32, packed=True),
    "float6, packed": dict(dtype="float6_e3m2fn", axis=1, packed=True),
    "mxfp4 (e8m0 scales)": dict(dtype="mxfp4"),
}


def _bits(tree):
    return [(a.dtype, a.shape, np.asarray(a).reshape(-1).view(np.uint8).tobytes())
            for a in jax.tree.leaves(tree)]


@pytest.mark.parametrize("kind", list(_KINDS))
def test_msgpack_round_trip_is_bit_exact(kind):
    tree = {"layer": {"kernel": jq.quantize(_W, **_KINDS[kind]), "bias": jnp.ones(64)}}
    state = serialization.to_state_dict(tree)
    assert set(state["layer"]["kernel"]) == {"qvalue", "scale", "zero_point", "meta"}
    back = serialization.from_bytes(tree, serialization.to_bytes(tree))
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert _bits(back) == _bits(tree)


def test_stacked_layers_round_trip():
    w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 16, 8)), jnp.float32)
    tree = jq.quantize_tree({"k": w}, jq.QuantSpec(dtype=jnp.int4, axis=1, stacked=1,
                                                    packed=True))
    back = serialization.from_bytes(tree, serialization.to_bytes(tree))
    assert _bits(back) == _bits(tree)
    np.testing.assert_array_equal(jq.dequantize_tree(back)["k"], jq.dequantize_tree(tree)["k"])


def test_quantized_linen_parameters_round_trip_and_run():
    x = jnp.ones((2, 16))
    model = nn.Dense(8)
    params = model.init(jax.random.key(0), x)
    qmodel = quantize_linen(model, QuantConfig())
    q = qmodel.quantize_params(params, x)
    back = serialization.from_bytes(q, serialization.to_bytes(q))
    assert _bits(back) == _bits(q)
    np.testing.assert_array_equal(qmodel.apply(back, x), qmodel.apply(q, x))


def test_state_that_does_not_fit_the_target_is_refused():
    tree = {"w": jq.quantize(_W, axis=1)}
    state = serialization.to_state_dict(tree)
    wrong_scale = {"w": dict(state["w"], scale=np.ones(3, np.float32))}
    with pytest.raises(ValueError, match=r"^\./w: QTensor state: scale has shape \(3,\), the target \(64,\)"):
        serialization.from_state_dict(tree, wrong_scale)
    with pytest.raises(ValueError, match=r"^\./w: a QTensor state dict has the keys "
                                         r"\['qvalue', 'scale', 'zero_point'\] \(and 'meta'\), "
                                         r"got \['qvalue'\]"):
        serialization.from_state_dict(tree, {"w": {"qvalue": state["w"]["qvalue"]}})


def test_state_of_another_format_or_zero_point_is_refused():
    w = jnp.ones((6, 40))
    target = {"k": jq.quantize(w, axis=1)}
    for other in (jq.quantize(w, dtype=jnp.uint8, symmetric=False, axis=1),
                  jq.quantize(w, dtype=jnp.float8_e4m3fn, axis=1)):
        with pytest.raises(ValueError, match=r"QTensor state: qvalue holds \['(uint8|float8_"
                                             r"e4m3fn)'\], the target \['int8'\]"):
            serialization.from_bytes(target, serialization.to_bytes({"k": other}))
    with_zp = {"k": jq.quantize(w, dtype=jnp.uint8, symmetric=False, axis=1)}
    state = serialization.to_state_dict(with_zp)
    state["k"]["zero_point"] = None
    with pytest.raises(ValueError, match=r"QTensor state: zero_point holds \[\], the target "
                                         r"\['uint8'\]"):
        serialization.from_state_dict(with_zp, state)


@pytest.mark.parametrize("saved, target, held", [
    (dict(dtype=jnp.int4, packed=True), dict(dtype=jnp.int4),
     r"qvalue holds a PackedArray \(a state dict with keys \['data', 'meta'\]\), the target "
     r"\['int4'\]"),
    (dict(dtype="nf4", axis=-1, block_size=2, double_quant=True),
     dict(dtype="nf4", axis=-1, block_size=2),
     r"scale holds a QTensor \(a state dict with keys \['meta', 'qvalue', 'scale', "
     r"'zero_point'\]\), the target \['float32'\]"),
], ids=["packed-into-unpacked", "two-level-scale-into-array"])
def test_a_record_state_where_the_target_has_an_array_is_refused(saved, target, held):
    # before: AttributeError ('str' object has no attribute 'dtype': the meta string)
    w = jnp.arange(8.0).reshape(2, 4)
    data = serialization.to_bytes({"w": jq.quantize(w, **saved)})
    with pytest.raises(ValueError, match=rf"^\./w: QTensor state: {held}\.$"):
        serialization.from_bytes({"w": jq.quantize(w, **target)}, data)


@pytest.mark.parametrize("saved, target, field", [
    (dict(axis=0), dict(axis=1), "axis=0, the target axis=1"),
    (dict(dtype="nf4", packed=True), dict(dtype="fp4", packed=True),
     "codebook='nf4', the target codebook='fp4'"),
    (dict(axis=1, block_size=16), dict(axis=1, block_size=32), "block_size=16, the target"),
])
def test_state_of_other_metadata_is_refused_naming_the_path(saved, target, field):
    """The metadata was the target's, never stored: a square kernel saved per row loaded into
    a per-column target silently, and nf4 codes read as fp4 ones (same arrays, other values)."""
    w = jnp.asarray(np.random.default_rng(3).standard_normal((64, 64)), jnp.float32)
    data = serialization.to_bytes({"layer": {"w": jq.quantize(w, **saved)}})
    with pytest.raises(ValueError, match=rf"^\./layer/w: the state holds a QTensor with {field}"):
        serialization.from_bytes({"layer": {"w": jq.quantize(w, **target)}}, data)


def test_state_of_another_shape_is_refused():
    w = jnp.asarray(np.random.default_rng(4).standard_normal((64, 64)), jnp.float32)
    data = serialization.to_bytes({"w": jq.quantize(w, axis=0)})
    with pytest.raises(ValueError, match=r"^\./w: QTensor state: qvalue has shape \(64, 64\), "
                                         r"the target \(64, 32\)"):
        serialization.from_bytes({"w": jq.quantize(w[:, :32], axis=0)}, data)
    packed = serialization.to_bytes({"p": jq.pack(jq.quantize(w[:, :63], dtype=jnp.int4)).qvalue})
    with pytest.raises(ValueError, match=r"^\./p: the state holds a PackedArray with length=63, "
                                         r"the target length=64"):
        serialization.from_bytes({"p": jq.pack(jq.quantize(w, dtype=jnp.int4)).qvalue}, packed)


def test_state_without_meta_loads_checked_on_its_arrays():
    """A state written before ``meta`` was stored still loads; its arrays are checked."""
    tree = {"w": jq.quantize(_W, axis=1)}
    state = serialization.to_state_dict(tree)
    del state["w"]["meta"]
    assert _bits(serialization.from_state_dict(tree, state)) == _bits(tree)
    with pytest.raises(ValueError, match=r"a QTensor state's meta is a JSON object"):
        serialization.from_state_dict(tree, {"w": dict(state["w"], meta="not json")})


def test_partitioned_packed_linen_kernels_round_trip():
    # before: a packed kernel with its bytes in nn.Partitioned had no shape for its meta
    # (TypeError in to_bytes); tree_nbytes failed on the boxes too
    model = nn.Dense(16, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                          (None, "model")))
    qm = quantize_linen(model, QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, packed=True)))
    x = jnp.ones((2, 8))
    q = qm.quantize_params(model.init(jax.random.key(0), x), x)
    back = serialization.from_bytes(q, serialization.to_bytes(q))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(q), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(qm.apply(back, x)), np.asarray(qm.apply(q, x)))
    assert jq.tree_nbytes(q) == jq.tree_nbytes(nn.meta.unbox(q)) == 8 * 16 // 2 + 16 * 4 + 16 * 4
