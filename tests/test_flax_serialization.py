"""`flax.serialization` (state dicts, msgpack ``to_bytes`` / ``from_bytes``) of trees with
`QTensor` leaves: bit for bit, and arrays that do not fit the target are refused."""

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
    assert set(state["layer"]["kernel"]) == {"qvalue", "scale", "zero_point"}
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
    with pytest.raises(ValueError, match=r"scale has shape \(3,\); codes of shape \(16, 64\)"):
        serialization.from_state_dict(tree, wrong_scale)
    with pytest.raises(ValueError, match=r"a QTensor state dict has the keys "
                                         r"\['qvalue', 'scale', 'zero_point'\], got \['qvalue'\]"):
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
