"""Every low-bit format through fake_quant (jit/vmap/grad), quantize_tree rules, the
report and checkpoints (safetensors and orbax, bit for bit, packed)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

SPECS = {
    "nf4": jq.QuantSpec(dtype="nf4", packed=True),
    "nf4_dq": jq.QuantSpec(dtype="nf4", packed=True, double_quant=True),
    "fp4": jq.QuantSpec(dtype="fp4"),
    "mxfp8_e4m3": jq.QuantSpec(dtype="mxfp8_e4m3"),
    "mxfp8_e5m2": jq.QuantSpec(dtype="mxfp8_e5m2"),
    "mxfp6_e2m3": jq.QuantSpec(dtype="mxfp6_e2m3", packed=True),
    "mxfp6_e3m2": jq.QuantSpec(dtype="mxfp6_e3m2", scale_rounding="ceil"),
    "mxfp4": jq.QuantSpec(dtype="mxfp4", packed=True),
    "mxint8": jq.QuantSpec(dtype="mxint8"),
    "nvfp4": jq.QuantSpec(dtype="nvfp4", packed=True),
    "tiles": jq.QuantSpec(dtype=jnp.int4, block_size=(32, 64), packed=True),
    "bf16_scales": jq.QuantSpec(dtype=jnp.int8, scale_dtype=jnp.bfloat16),
}
FAKE_QUANT_NAMES = ["nf4", "fp4", "mxfp8_e4m3", "mxfp6_e2m3", "mxfp4", "mxint8", "nvfp4"]


@pytest.mark.parametrize("name", FAKE_QUANT_NAMES)
def test_fake_quant_value_jit_vmap_grad(name):
    x = jax.random.normal(jax.random.key(0), (4, 8, 64)) * 3
    y = jq.fake_quant(x, dtype=name)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jq.quantize(x, dtype=name).dequantize()))

    def fq(x):
        return jq.fake_quant(x, dtype=name)

    @jax.jit
    def traced(x):  # one program: jit, vmap, the per-row loop and the gradient
        return (fq(x), jax.vmap(fq)(x), jnp.stack([fq(r) for r in x]),
                jax.grad(lambda x: (fq(x) * x).sum())(x))

    jitted, per_row, rows, g = traced(x)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(per_row), np.asarray(rows))
    assert g.shape == x.shape and bool(jnp.all(jnp.isfinite(g)))


def test_codebook_ste_mask_and_lsq_gradient():
    x = jnp.array([0.5, -0.9, 2.0, -3.0])
    s = jnp.float32(1.0)
    dx = jax.grad(lambda x: jq.fake_quant(x, s, dtype="nf4").sum())(x)
    np.testing.assert_array_equal(np.asarray(dx), [1, 1, 0, 0])  # |x / s| > 1 is clipped
    ds = jax.grad(lambda s: jq.fake_quant(x, s, dtype="nf4").sum())(s)
    # LSQ: inside, (fq - x) / s; outside, the clipped code (+1 above, -1 below).
    fq = np.asarray(jq.fake_quant(x, s, dtype="nf4"))
    expected = np.sum(np.where(np.abs(np.asarray(x)) <= 1, fq - np.asarray(x),
                               np.sign(np.asarray(x))))
    np.testing.assert_allclose(float(ds), expected, rtol=1e-6)


def test_fake_quant_trains_through_mxfp4_with_ceil_scales():
    """A least-squares fit with MXFP4 fake-quantized weights and the clipped STE.

    With OCP's floor scale rounding the largest weight of a block is usually beyond
    the element maximum, so the STE gives it no gradient and training stalls (here:
    1898 of 2188 after 300 steps); ``scale_rounding="ceil"`` never clips and trains
    (51, against 29 for the quantized true weights).
    """
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (256, 64))
    y = x @ jax.random.normal(k2, (64, 32))

    @functools.partial(jax.jit, static_argnames="mode")
    def fit(x, y, mode):  # 300 steps in one program; the loss after them over the first
        def loss(w):
            wq = jq.fake_quant(w, dtype="mxfp4", axis=0, scale_rounding=mode)
            return jnp.mean(jnp.sum((x @ wq - y) ** 2, -1))

        w0 = jnp.zeros((64, 32))
        w = jax.lax.fori_loop(0, 300, lambda _, w: w - 0.005 * jax.grad(loss)(w), w0)
        return loss(w) / loss(w0)

    final = {mode: float(fit(x, y, mode)) for mode in ("floor", "ceil")}
    assert final["ceil"] < 0.05
    assert final["floor"] > 0.5


def _tree():
    k = jax.random.split(jax.random.key(1), 3)
    return {"dense": {"kernel": jax.random.normal(k[0], (128, 256)), "bias": jnp.zeros(256)},
            "out": {"kernel": jax.random.normal(k[1], (256, 64))}}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tree_rules_report_and_safetensors_round_trip(name, tmp_path):
    spec = SPECS[name]
    tree = jq.quantize_tree(_tree(), [("kernel", spec)])
    leaf = tree["dense"]["kernel"]
    assert jq.is_qtensor(leaf) and not jq.is_qtensor(tree["dense"]["bias"])
    rows = {r.path: r for r in jq.quantization_report(_tree(), tree)}
    row = rows["dense/kernel"]
    assert row.nbytes_after == leaf.nbytes and row.sqnr_db > 15
    if name in jq.SCHEMES:
        assert row.format.startswith(name)
    path = tmp_path / "q.safetensors"
    jq.save_safetensors(path, tree)
    want_out = np.asarray(jq.dequantize_tree(tree)["out"]["kernel"])
    for target in (None, tree, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                            tree)):
        back = jq.load_safetensors(path, target)
        assert jax.tree.structure(back) == jax.tree.structure(tree)
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8)
                                          if np.dtype(a.dtype).itemsize == 1 else np.asarray(a),
                                          np.asarray(b).view(np.uint8)
                                          if np.dtype(b.dtype).itemsize == 1 else np.asarray(b))
        np.testing.assert_array_equal(np.asarray(jq.dequantize_tree(back)["out"]["kernel"]),
                                      want_out)


@pytest.mark.parametrize("name", ["nvfp4", "nf4_dq", "mxfp4"])
def test_orbax_round_trip(name, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    tree = jq.quantize_tree(_tree(), [("kernel", SPECS[name])])
    jq.save_orbax(tmp_path / "ckpt", tree)
    back = jq.load_orbax(tmp_path / "ckpt", tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8)
                                      if np.dtype(a.dtype).itemsize == 1 else np.asarray(a),
                                      np.asarray(b).view(np.uint8)
                                      if np.dtype(b.dtype).itemsize == 1 else np.asarray(b))


def test_loading_into_a_mismatched_target_is_refused(tmp_path):
    tree = jq.quantize_tree(_tree(), [("kernel", SPECS["nvfp4"])])
    path = tmp_path / "q.safetensors"
    jq.save_safetensors(path, tree)
    plain = jq.quantize_tree(_tree(), [("kernel", jq.QuantSpec(dtype=jnp.float4_e2m1fn,
                                                               block_size=16, packed=True))])
    with pytest.raises(TypeError, match="QTensor scale"):
        jq.load_safetensors(path, plain)
    nf4 = jq.quantize_tree(_tree(), [("kernel", SPECS["nf4"])])
    path2 = tmp_path / "n.safetensors"
    jq.save_safetensors(path2, nf4)
    uint4 = jax.tree.map(lambda q: q, nf4, is_leaf=jq.is_qtensor)
    uint4["dense"]["kernel"] = jq.QTensor(jq.unpack(nf4["dense"]["kernel"]).qvalue,
                                          nf4["dense"]["kernel"].scale, axis=1, block_size=64)
    uint4["out"]["kernel"] = jq.QTensor(jq.unpack(nf4["out"]["kernel"]).qvalue,
                                        nf4["out"]["kernel"].scale, axis=1, block_size=64)
    with pytest.raises(ValueError, match="codebook mismatch"):
        jq.load_safetensors(path2, uint4)


@pytest.mark.parametrize("name", ["nf4", "mxfp4", "nvfp4", "mxfp8_e4m3"])
def test_weight_only_dot_on_low_bit_weights(name):
    w = jax.random.normal(jax.random.key(2), (256, 64))
    qt = jq.quantize(w, dtype=name, axis=0, packed=name in ("nf4", "mxfp4", "nvfp4"))
    x = jax.random.normal(jax.random.key(3), (4, 256))
    y = jax.jit(lambda x, w: jq.qdot_general(x, w, (((1,), (0,)), ((), ()))))(x, qt)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ qt.dequantize()), rtol=1e-5,
                               atol=1e-4)
