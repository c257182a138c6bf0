"""Quantized dot products: int8 x int8 -> int32 against NumPy int32 arithmetic, weight-only
against dequantize-then-dot, jaxpr dtypes, packed codes, layouts that must raise, Flax."""

import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from host_mesh import host_mesh
from jaxpr_utils import find_eqns

import jaxquant as jq
from jaxquant._dot import ActQuant, QDotGeneral, promote_dtype, qdot_general
from jaxquant._einsum import qeinsum

DN = (((1,), (0,)), ((), ()))  # x (batch, in) . w (in, out)
W8A8 = ActQuant()


def _data(b=6, k=96, n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, k), np.float32)
    x[1] = 0.0  # an all-zero row: scale 1, codes 0
    x[2, 3] = 9.0  # an outlier
    return x, rng.standard_normal((k, n), np.float32)


def _np_act_codes(x, per_token=True):
    """Symmetric int8 codes and scales written with NumPy: absmax / 127, round half to even."""
    amax = np.max(np.abs(x), axis=1, keepdims=True) if per_token else np.max(np.abs(x)).reshape(1, 1)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.rint(x / s), -127, 127).astype(np.int32), s


# ----------------------------------------------------------------------------- int8 x int8


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("fmt,symmetric", [("int8", True), ("int8", False), ("uint8", False)])
def test_w8a8_equals_numpy_int32_reference(per_token, fmt, symmetric):
    x, w = _data()
    qt = jq.quantize(w, dtype=fmt, axis=1, symmetric=symmetric)
    y = qdot_general(x, qt, DN, act_quant=ActQuant(granularity="token" if per_token else "tensor"))

    xq, sx = _np_act_codes(x, per_token)
    wq = np.asarray(qt.qvalue).astype(np.int32)
    zp = 0 if qt.zero_point is None else np.asarray(qt.zero_point).astype(np.int32)
    acc = xq @ (wq - zp)  # exact int32 sums
    expected = acc.astype(np.float32) * sx * np.asarray(qt.scale)[None, :]
    np.testing.assert_array_equal(np.asarray(y), expected)


@pytest.mark.parametrize("k,block", [(96, 32), (100, 32)])
def test_w8a8_blocked_along_contraction_matches_numpy(k, block):
    x, w = _data(k=k)
    qt = jq.quantize(w, axis=0, block_size=block)
    y = qdot_general(x, qt, DN, act_quant=W8A8)
    xq, sx = _np_act_codes(x)
    wq, sw = np.asarray(qt.qvalue).astype(np.int32), np.asarray(qt.scale)
    expected = sum((xq[:, g * block:(g + 1) * block] @ wq[g * block:(g + 1) * block]).astype(np.float32)
                   * sx * sw[g] for g in range(sw.shape[0]))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("blocks", [1, 2, 5, 7, 8])
def test_w8a8_blocked_sums_every_block_once(blocks):
    # the blocks' scaled sums are added pairwise (halves, plus the odd block out)
    x, w = _data(k=16 * blocks)
    qt = jq.quantize(w, axis=0, block_size=16)
    y = np.asarray(jax.jit(lambda x, w: qdot_general(x, w, DN, act_quant=W8A8))(x, qt))
    xq, sx = _np_act_codes(x)
    wq, sw = np.asarray(qt.qvalue).astype(np.int32), np.asarray(qt.scale)
    per_block = [(xq[:, g * 16:(g + 1) * 16] @ wq[g * 16:(g + 1) * 16]).astype(np.float64)
                 * sx * sw[g] for g in range(blocks)]
    np.testing.assert_allclose(y, sum(per_block), rtol=1e-6, atol=1e-5)


def test_w8a8_blocked_adds_blocks_without_a_float_reduction():
    # XLA:CPU reduces the dot's major axis of blocks far slower than the int8 dot itself
    x, w = _data(k=128)
    qt = jq.quantize(w, axis=0, block_size=16)
    jaxpr = jax.make_jaxpr(lambda x, w: qdot_general(x, w, DN, act_quant=W8A8))(x, qt)
    sums = [e.invars[0].aval for e in find_eqns(jaxpr.jaxpr, "reduce_sum")]
    assert not [a for a in sums if a.dtype == jnp.float32 and 8 in a.shape], sums
    assert [e.outvars[0].aval.shape for e in find_eqns(jaxpr.jaxpr)] == [(8, 6, 40)]


def test_w8a8_error_within_quantization_bound():
    x, w = _data()
    qt = jq.quantize(w, axis=1)
    y = np.asarray(qdot_general(x, qt, DN, act_quant=W8A8), np.float64)
    _, sx = _np_act_codes(x)
    sw = np.asarray(qt.scale, np.float64)
    # |x^ w^ - x w| <= sum_k |x_k - x^_k| |w_k| + |x^_k| |w_k - w^_k|, each code error <= scale / 2
    bound = 0.5 * sx @ np.abs(w).sum(0, keepdims=True) + 0.5 * np.abs(x).sum(1, keepdims=True) * 1.01 * sw
    err = np.abs(y - x.astype(np.float64) @ w)
    assert np.all(err <= bound + 1e-4)
    assert err.max() > 0  # it did quantize


def test_w8a8_lhs_qtensor_and_batch_dims():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 5, 24), np.float32)  # quantized per row (axis 1)
    b = rng.standard_normal((3, 24, 7), np.float32)
    dims = (((2,), (1,)), ((0,), (0,)))
    qa = jq.quantize(a, axis=1)
    y = qdot_general(qa, b, dims, act_quant=W8A8)
    # NumPy: b quantized per token = per (batch, column of b) over the contraction
    amax = np.max(np.abs(b), axis=1, keepdims=True)
    sb = (amax / np.float32(127)).astype(np.float32)
    bq = np.clip(np.rint(b / sb), -127, 127).astype(np.int32)
    acc = np.einsum("bik,bkj->bij", np.asarray(qa.qvalue).astype(np.int32), bq)
    expected = acc.astype(np.float32) * np.asarray(qa.scale)[None, :, None] * sb
    np.testing.assert_array_equal(np.asarray(y), expected)


@pytest.mark.parametrize("case", ["per-axis", "zero-point", "one-long-block", "two-axes"])
def test_w8a8_contraction_too_long_for_int32_sums(case):
    # int8 codes -128 (-255 with zero point 127) times activation codes 127 summed
    # over K: K * 127 * 128 >= 2**31 beyond K = 132,104 (66,307 with the zero point).
    k, v, zp, spec = 147_456, -128.0, None, {}
    if case == "zero-point":
        k, v, zp = 70_000, -255.0, jnp.int8(127)
    if case == "one-long-block":
        spec = {"axis": 0, "block_size": k}
    scale = jnp.ones((1, 3) if spec else (), jnp.float32)
    w = jq.quantize(jnp.full((k, 3), v), scale, zp, **spec)
    x = np.full((2, k), 127.0, np.float32)
    x[1, ::2] = -127.0
    dims = DN
    if case == "two-axes":  # contract (384, 384) = 147,456 entries
        x, w, dims = x.reshape(2, 384, 384), jq.quantize(jnp.full((384, 384, 3), v), scale), \
            (((1, 2), (0, 1)), ((), ()))
    y = qdot_general(x, w, dims, act_quant=W8A8)
    exact = np.sign(x.reshape(2, -1)).sum(axis=1, dtype=np.int64) * 127 * int(v)
    np.testing.assert_allclose(np.asarray(y), np.broadcast_to(exact[:, None], (2, 3)),
                               rtol=1e-6)


def test_int8_backward_contraction_too_long_for_int32_sums():
    # d lhs = g . fq(w)^T contracts the 140,000 output features: 127 * 127 * 140,000 > 2**31.
    n = 140_000
    x, w = jnp.ones((2, 4)), -jnp.ones((4, n))

    def loss(x):
        return jq.qat_dot_general(x, w, DN, backward="int8").sum()

    np.testing.assert_allclose(np.asarray(jax.grad(loss)(x)), np.full((2, 4), -float(n)),
                               rtol=1e-6)


def test_w8a8_two_qtensors():
    x, w = _data()
    qx, qw = jq.quantize(x, axis=1, block_size=32), jq.quantize(w, axis=0, block_size=32)
    y = qdot_general(qx, qw, DN, act_quant=W8A8)  # int8 codes of both, blocks of both scales
    np.testing.assert_allclose(np.asarray(y), np.asarray(qx.dequantize()) @ np.asarray(qw.dequantize()),
                               rtol=1e-5, atol=1e-4)


def _mlp(dot):
    def f(x, ws):
        for w in ws:
            x = jax.nn.relu(dot(x, w))
        return x
    return f


@pytest.mark.parametrize("spec", [dict(axis=1), dict(axis=0, block_size=32),
                                  dict(dtype=jnp.int4, axis=1, packed=True),
                                  dict(dtype=jnp.uint8, axis=1, symmetric=False)])
def test_jaxpr_w8a8_dots_take_int8_and_return_int32(spec):
    x, w = _data()
    ws = [jq.quantize(w[:40, :40] if i else w[:, :40], **spec) for i in range(3)]
    f = jax.jit(_mlp(lambda x, w: qdot_general(x, w, DN, act_quant=W8A8)))
    dots = list(find_eqns(jax.make_jaxpr(f)(x, ws).jaxpr))
    assert len(dots) == 3
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.int8, jnp.int8]
        assert eqn.outvars[0].aval.dtype == jnp.int32


def test_jaxpr_weight_only_dots_are_float():
    x, w = _data()
    f = jax.jit(_mlp(lambda x, w: qdot_general(x, w, DN)))
    dots = list(find_eqns(jax.make_jaxpr(f)(x, [jq.quantize(w[:, :40], axis=1)]).jaxpr))
    assert dots and all(v.aval.dtype == jnp.float32 for e in dots for v in e.invars)


def test_no_retrace_and_jit_inference():
    x, w = _data()
    traces = []

    @jax.jit
    def f(x, qt):
        traces.append(1)
        return qdot_general(x, qt, DN, act_quant=W8A8), qdot_general(x, qt, DN)

    qt = jq.quantize(w, axis=1)
    a = f(x, qt)
    b = f(x + 1, jq.quantize(w * 2, axis=1))
    assert len(traces) == 1 and a[0].shape == b[1].shape == (6, 40)
    eager = qdot_general(x, qt, DN, act_quant=W8A8)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(eager))


# ----------------------------------------------------------------------------- weight-only


@pytest.mark.parametrize("spec", [
    dict(), dict(axis=1), dict(axis=0), dict(axis=0, block_size=32), dict(axis=1, symmetric=False),
    dict(dtype=jnp.int4, axis=0, block_size=32), dict(dtype=jnp.uint4, axis=1, symmetric=False),
    dict(dtype=jnp.float8_e4m3fn, axis=1), dict(dtype=jnp.float8_e5m2, axis=0, block_size=16),
])
def test_weight_only_is_dequantize_then_dot(spec):
    x, w = _data()
    qt = jq.quantize(w, **spec)
    y = qdot_general(x, qt, DN)
    np.testing.assert_allclose(np.asarray(y), x @ np.asarray(qt.dequantize()), rtol=1e-5, atol=1e-5)
    # |x w^ - x w| <= sum_k |x_k| |w_k - w^_k|
    bound = np.abs(x) @ np.abs(np.asarray(qt.dequantize()) - w)
    assert np.all(np.abs(np.asarray(y, np.float64) - x.astype(np.float64) @ w) <= bound + 1e-4)


@pytest.mark.parametrize("fmt,symmetric,layout,kernel", [
    # kernel "in_out": packed along a free axis; "out_in": packed along the contracted axis
    ("int4", True, dict(), "in_out"),
    ("int4", True, dict(axis=0), "out_in"),
    ("int4", True, dict(axis=-1), "in_out"),
    ("int4", False, dict(axis=-1), "out_in"),  # per-axis along the packed axis, zero points
    ("uint4", False, dict(axis=0, block_size=16), "in_out"),
    ("uint4", False, dict(axis=-1, block_size=8), "out_in"),  # blocked along the packed axis
    ("int4", True, dict(axis=-1, block_size=6), "in_out"),
    ("int2", True, dict(axis=-1, block_size=6), "out_in"),  # 6 % 4 != 0: unpacked path
    ("int2", True, dict(axis=0), "in_out"),
    ("uint2", False, dict(axis=-1), "out_in"),
])
def test_packed_weight_only_equals_unpacked(fmt, symmetric, layout, kernel):
    rng = np.random.default_rng(7)
    k, n = 70, 33  # odd: a partial last byte
    x = rng.standard_normal((5, k), np.float32)
    w = rng.standard_normal((k, n) if kernel == "in_out" else (n, k), np.float32)
    packed = jq.quantize(w, dtype=fmt, symmetric=symmetric, packed=True, **layout)
    unpacked = jq.unpack(packed)
    dims = DN if kernel == "in_out" else (((1,), (1,)), ((), ()))
    y = qdot_general(x, packed, dims)
    ref = np.asarray(qdot_general(x, unpacked, dims))
    tol = 1e-6 * np.abs(ref).max()  # float sums in another order when packed along k
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-6, atol=tol)
    # as lhs too: (w . x) with the QTensor first
    yt = qdot_general(packed, x, ((dims[0][1], dims[0][0]), ((), ())))
    np.testing.assert_allclose(np.asarray(yt), ref.T, rtol=1e-6, atol=tol)


def test_packed_w4a8_equals_unpacked():
    x, w = _data()
    packed = jq.quantize(w, dtype=jnp.int4, axis=1, packed=True)
    np.testing.assert_array_equal(np.asarray(qdot_general(x, packed, DN, act_quant=W8A8)),
                                  np.asarray(qdot_general(x, jq.unpack(packed), DN, act_quant=W8A8)))


def test_dtypes_and_vmap():
    x, w = _data()
    qt = jq.quantize(w, axis=1)
    xb = jnp.asarray(x, jnp.bfloat16)
    assert qdot_general(xb, qt, DN, act_quant=W8A8).dtype == jnp.bfloat16
    assert qdot_general(x, qt, DN, preferred_element_type=jnp.bfloat16).dtype == jnp.bfloat16
    row = jax.vmap(lambda r: qdot_general(r, qt, (((0,), (0,)), ((), ()))))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(row), np.asarray(qdot_general(x, qt, DN)), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU scheduling")
def test_weight_only_mlp_holds_one_float_weight_at_a_time():
    rng = np.random.default_rng(0)
    ws = [jq.quantize(rng.standard_normal((256, 256), np.float32), axis=1) for _ in range(4)]
    x = jnp.ones((8, 256))
    mem = jax.jit(_mlp(lambda x, w: qdot_general(x, w, DN))).lower(x, ws).compile().memory_analysis()
    one_layer = 256 * 256 * 4
    assert mem.temp_size_in_bytes < 2 * one_layer  # not 4 layers' float weights


def test_qeinsum_matches_einsum_of_dequantized():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 24), np.float32)
    w = rng.standard_normal((3, 24), np.float32)
    qt = jq.quantize(w, axis=0)
    for subs in ["bsk,nk->bsn", "bsk,nk->nbs", "nk,bsk"]:
        ops = (x, qt) if subs.startswith("b") else (qt, x)
        deq = [np.asarray(o.dequantize()) if isinstance(o, jq.QTensor) else o for o in ops]
        np.testing.assert_allclose(np.asarray(qeinsum(subs, *ops)), np.einsum(subs, *deq), rtol=1e-5, atol=1e-5)
    y = qeinsum("bsk,nk->bsn", x, qt, act_quant=W8A8)
    np.testing.assert_allclose(np.asarray(y), np.einsum("bsk,nk->bsn", x, w), atol=0.1)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("spec,match", [
    (dict(axis=0), "constant along the contracting dimensions .* per-axis along axis 0"),
    (dict(axis=1, block_size=8), r"blocked along axis 1 \(block_size=8\)"),
    (dict(dtype=jnp.float8_e4m3fn, axis=1), "integer format of at most 8 bits, got float8_e4m3fn"),
    (dict(dtype=jnp.int16, axis=1), "at most 8 bits, got int16"),
])
def test_w8a8_bad_layouts_raise(spec, match):
    x, w = _data()
    with pytest.raises(ValueError, match=match):
        qdot_general(x, jq.quantize(w, **spec), DN, act_quant=W8A8)
    qdot_general(x, jq.quantize(w, **spec), DN)  # weight-only takes every layout


def test_argument_errors():
    x, w = _data()
    qt = jq.quantize(w, axis=1)
    with pytest.raises(ValueError, match="as many contracting dimensions"):
        qdot_general(x, qt, (((1,), ()), ((), ())))
    with pytest.raises(ValueError, match=re.escape("rhs contracting dimension must be in [-2, 2)")):
        qdot_general(x, qt, (((1,), (5,)), ((), ())))
    with pytest.raises(ValueError, match="dimension_numbers must be"):
        qdot_general(x, qt, (1, 0))
    with pytest.raises(TypeError, match="lhs must be a float array"):
        qdot_general(jnp.ones((2, 96), jnp.int32), qt, DN)
    with pytest.raises(TypeError, match="act_quant must be None or a jaxquant.ActQuant"):
        qdot_general(x, qt, DN, act_quant="int8")
    with pytest.raises(ValueError, match="preferred_element_type must be a float dtype"):
        qdot_general(x, qt, DN, act_quant=W8A8, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="granularity must be 'token' or 'tensor'"):
        ActQuant(granularity="channel")
    asym = jq.quantize(w, axis=1, symmetric=False)
    with pytest.raises(ValueError, match="zero point .* on one operand only"):
        qdot_general(jq.quantize(x, axis=0, symmetric=False), asym, DN, act_quant=W8A8)
    with pytest.raises(ValueError, match=r"different block sizes \[16, 32\]"):
        qdot_general(jq.quantize(x, axis=1, block_size=16), jq.quantize(w, axis=0, block_size=32),
                     DN, act_quant=W8A8)
    with pytest.raises(ValueError, match="two operands, letters only"):
        qeinsum("...k,kn->...n", x, qt)
    with pytest.raises(ValueError, match="name 3 axes, but lhs has rank 2"):
        qeinsum("abk,kn->abn", x, qt)


# ----------------------------------------------------------------------------- Flax


def test_flax_linen_dense_injection():
    nn = pytest.importorskip("flax.linen")
    x, _ = _data(k=16)

    class MLP(nn.Module):
        dot: QDotGeneral | None = None

        @nn.compact
        def __call__(self, x):
            kw = {} if self.dot is None else dict(dot_general=self.dot, promote_dtype=promote_dtype)
            return nn.Dense(8, **kw)(nn.relu(nn.Dense(32, **kw)(x)))

    params = MLP().init(jax.random.key(0), x)
    ref = np.asarray(MLP().apply(params, x))
    qparams = jq.quantize_tree(params, [("Dense_0/kernel", jq.QuantSpec()), ("Dense_1", None)])
    assert isinstance(qparams["params"]["Dense_0"]["kernel"], jq.QTensor)
    for dot in (QDotGeneral(), QDotGeneral(act_quant=W8A8)):
        assert hash(dot) == hash(QDotGeneral(act_quant=dot.act_quant))
        y = jax.jit(MLP(dot).apply)(qparams, x)
        np.testing.assert_allclose(np.asarray(y), ref, atol=0.05 * np.abs(ref).max())


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32),
                                  jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=32, packed=True)],
                         ids=["int8", "int4-block", "int4-block-packed"])
def test_weight_only_on_explicitly_sharded_mesh(spec):
    """jax.make_mesh's default (Explicit) axes: sharded weights need no gather of the scale."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = host_mesh((2, 4), ("data", "model"))
    w = jax.random.normal(jax.random.key(0), (64, 256))
    x = jax.random.normal(jax.random.key(1), (16, 64))
    dims = (((1,), (0,)), ((), ()))
    with jax.set_mesh(mesh):
        q = jax.jit(spec)(jax.device_put(w, NamedSharding(mesh, P(None, "model"))))
        y = jax.jit(lambda x, q: qdot_general(x, q, dims))(
            jax.device_put(x, NamedSharding(mesh, P("data", None))), q)
        assert y.sharding.spec == P("data", "model")
    ref = np.asarray(x) @ np.asarray(jq.dequantize(jax.device_get(q)))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
