"""Scales over 2-D (and n-D) tiles: a tuple ``block_size`` with one tile length per axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq


def _tile_absmax(w: np.ndarray, tiles: tuple[int, int]) -> np.ndarray:
    """Reference: absmax of every (partial) tile, by explicit loops."""
    rows, cols = -(-w.shape[0] // tiles[0]), -(-w.shape[1] // tiles[1])
    out = np.zeros((rows, cols), np.float32)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = np.abs(w[i * tiles[0]:(i + 1) * tiles[0],
                                 j * tiles[1]:(j + 1) * tiles[1]]).max()
    return out


@pytest.mark.parametrize("shape", [(300, 200), (256, 256), (5, 7)])
def test_computed_tiles_with_partial_edges(shape):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[:3] *= 50  # tiles of very different ranges
    tiles = (128, 128) if shape[0] > 8 else (2, 3)
    qt = jq.quantize(w, block_size=tiles)
    assert qt.block_size == tiles and qt.axis is None
    np.testing.assert_allclose(np.asarray(qt.scale), _tile_absmax(w, tiles) / 127, rtol=1e-7)
    s = np.repeat(np.repeat(np.asarray(qt.scale), tiles[0], 0), tiles[1], 1)[:shape[0], :shape[1]]
    np.testing.assert_array_equal(np.asarray(qt.qvalue),
                                  np.clip(np.round(w / s), -127, 127).astype(np.int8))
    assert np.all(np.abs(np.asarray(qt.dequantize()) - w) <= s / 2 * (1 + 1e-6))


def test_tiles_on_three_axes_and_explicit_scales():
    w = np.random.default_rng(1).standard_normal((3, 10, 12)).astype(np.float32)
    qt = jq.quantize(w, dtype=jnp.int4, block_size=(1, 4, 8), packed=True)
    assert qt.scale.shape == (3, 3, 2)
    again = jq.quantize(w, qt.scale, dtype=jnp.int4, block_size=(1, 4, 8), packed=True)
    np.testing.assert_array_equal(np.asarray(again.qvalue.data), np.asarray(qt.qvalue.data))
    with pytest.raises(ValueError, match=r"scale must have shape \(3, 3, 2\) for tiles"):
        jq.quantize(w, jnp.ones((3, 3, 3)), block_size=(1, 4, 8))


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=(128,)), "one tile length per axis"),
    (dict(block_size=(128, 0)), "positive integer"),
    (dict(block_size=(128, 128), axis=0), "axis must be None"),
])
def test_bad_tiles_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jq.quantize(jnp.ones((4, 4)), **kwargs)


def test_tiles_through_fake_quant_tree_and_checkpoint(tmp_path):
    w = jax.random.normal(jax.random.key(0), (200, 300))
    y = jq.fake_quant(w, block_size=(64, 64))
    np.testing.assert_array_equal(np.asarray(y),
                                  np.asarray(jq.quantize(w, block_size=(64, 64)).dequantize()))
    g = jax.grad(lambda w: jq.fake_quant(w, block_size=(64, 64)).sum())(w)
    np.testing.assert_array_equal(np.asarray(g), np.ones(w.shape))
    tree = jq.quantize_tree({"k": w}, jq.QuantSpec(block_size=(128, 128)))
    assert tree["k"].block_size == (128, 128)
    jq.save_safetensors(tmp_path / "t.safetensors", tree)
    back = jq.load_safetensors(tmp_path / "t.safetensors", tree)
    assert back["k"].block_size == (128, 128)
    np.testing.assert_array_equal(np.asarray(back["k"].qvalue), np.asarray(tree["k"].qvalue))
    x = jnp.ones((2, 200))
    np.testing.assert_allclose(np.asarray(jq.qdot_general(x, back["k"], (((1,), (0,)), ((), ())))),
                               np.asarray(x @ tree["k"].dequantize()), rtol=1e-5)
    with pytest.raises(ValueError, match="tiled scales"):
        jq.qdot_general(x, back["k"], (((1,), (0,)), ((), ())), act_quant=jq.ActQuant())


@pytest.mark.parametrize("block_size", [2**40, (2**40, 2**40), (3, 2**40)])
def test_a_block_longer_than_its_axis_is_the_whole_axis_never_padded(block_size):
    # one block spanning the axis: the same codes as a block of the axis' length, and no
    # intermediate padded to the block's length (2**40 floats would not fit in memory)
    x = jax.random.normal(jax.random.key(0), (8, 5))
    whole = 5 if isinstance(block_size, int) else tuple(map(min, block_size, (8, 5)))
    kw = dict(axis=1) if isinstance(block_size, int) else {}
    q, ref = (jq.quantize(x, block_size=b, **kw) for b in (block_size, whole))
    np.testing.assert_array_equal(q.qvalue, ref.qvalue)
    np.testing.assert_array_equal(q.scale, ref.scale)
    np.testing.assert_array_equal(jq.dequantize(q), jq.dequantize(ref))
    fq = jax.jit(lambda x: jq.fake_quant(x, block_size=block_size, **kw))
    np.testing.assert_array_equal(fq(x), jq.dequantize(ref))
    assert str(2**40) not in str(jax.make_jaxpr(lambda q: jq.dequantize(q))(q))
