"""Eager calls of the public functions run one compiled program each, not one dispatch (and one
compilation) per operation: `fake_quant` of a 2048 x 2048 array took 32 ms eagerly against 2 ms
jitted before its array work became one program."""

import logging

import jax
import jax.numpy as jnp
import pytest

import jaxquant as jq


def _programs(caplog, fn):
    """The names of the programs compiled while ``fn()`` runs (a fresh shape each time)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        jax.block_until_ready(fn())
    return [r.getMessage().split(" ")[4] for r in caplog.records
            if r.getMessage().startswith("Finished XLA compilation")]


@pytest.mark.parametrize("call", [
    lambda x: jq.fake_quant(x),
    lambda x: jq.fake_quant(x, dtype=jnp.int4, axis=0, block_size=8),
    lambda x: jq.fake_quant(x, dtype="mxfp4", axis=1),
    lambda x: jq.fake_quant(x, jnp.float32(0.05), jnp.float32(3.0), dtype=jnp.uint8),
    lambda x: jq.fake_quant(x, jnp.float32(0.05), key=jax.random.key(0)),
], ids=["computed", "int4-blocks", "mxfp4", "learned-zero-point", "stochastic"])
def test_eager_fake_quant_is_one_program(caplog, call):
    x = jnp.linspace(-3, 3, 41 * 64, dtype=jnp.float32).reshape(41, 64)  # a shape used nowhere
    jax.block_until_ready(x)
    jax.block_until_ready(jnp.float32(0.05))
    jax.block_until_ready(jax.random.key(0))
    names = _programs(caplog, lambda: call(x))
    assert names == ["jit(_fake_quant_program)"], names


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint2])
def test_eager_pack_and_unpack_are_one_program_each(caplog, dtype):
    qt = jq.quantize(jnp.linspace(-1, 1, 43 * 66).reshape(43, 66), dtype=dtype, axis=0,
                     symmetric=dtype == jnp.int4)
    jax.block_until_ready(qt)
    packed = None

    def pack():
        nonlocal packed
        packed = jq.pack(qt, axis=1)
        return packed.qvalue.data

    assert _programs(caplog, pack) == ["jit(_pack_codes)"]
    assert _programs(caplog, lambda: jq.unpack(packed).qvalue) == ["jit(_unpack_codes)"]
    assert (jq.unpack(packed).qvalue == qt.qvalue).all()
