"""Int8-dot QAT: forward and gradients against the fake-quant reference (jq.fake_quant + float
dot), jit/vmap, the int8 x int8 -> int32 dot in the jaxpr, Flax injection, errors."""

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxpr_utils import find_eqns

import jaxquant as jq
from jaxquant._dot import ActQuant
from jaxquant._qat_dot import QATDotGeneral, _run, qat_dot_general

DN = (((1,), (0,)), ((), ()))  # x (batch, in) . w (in, out)
TOKEN, TENSOR = ActQuant(), ActQuant(granularity="tensor")


def _rand(*shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape, np.float32)
    x.flat[3] = 6.0  # an outlier
    return x


# Each case: lhs shape, rhs shape, dimension numbers, and the reference written out by hand:
# fq_lhs(x, per_token) and the weight's fake_quant axis for weight.axis=-1.
def _dense_ref(x, per_token):
    return jq.fake_quant(x, axis=0) if per_token else jq.fake_quant(x)


def _dense3_ref(x, per_token):  # (b, t, k): a token is (b, t)
    if not per_token:
        return jq.fake_quant(x)
    return jq.fake_quant(x.reshape(-1, x.shape[-1]), axis=0).reshape(x.shape)


def _bmm_ref(x, per_token):  # (k, b, t) contracted on 0, batch 1: a token is (b, t)
    if not per_token:
        return jq.fake_quant(x)
    t = jnp.transpose(x, (1, 2, 0)).reshape(-1, x.shape[0])
    return jnp.transpose(jq.fake_quant(t, axis=0).reshape(x.shape[1], x.shape[2], x.shape[0]),
                         (2, 0, 1))


CASES = {
    "dense": ((6, 96), (96, 40), DN, _dense_ref),
    "dense_3d": ((2, 5, 48), (48, 24), (((2,), (0,)), ((), ())), _dense3_ref),
    "batched_einsum": ((48, 3, 5), (3, 48, 16), (((0,), (1,)), ((1,), (0,))), _bmm_ref),
}


def _reference(x, w, case, per_token, weight_axis):
    _, _, dims, fq_lhs = CASES[case]
    wq = jq.fake_quant(w, axis=weight_axis)
    return lax.dot_general(fq_lhs(x, per_token), wq, dims)


def _values_and_grads(fns, x, w):
    """One jitted program: each ``f(x, w)`` and its ``(d x, d w)`` for one random cotangent."""
    cot = _rand(*jax.eval_shape(fns[0], x, w).shape, seed=2)

    @jax.jit
    def run(x, w):
        out = []
        for f in fns:
            y, vjp = jax.vjp(f, x, w)
            out.append((y, *vjp(jnp.asarray(cot, y.dtype))))
        return out

    return run(x, w)


def _tol(ref):
    return dict(rtol=1e-5, atol=2e-6 * float(np.max(np.abs(ref))))


@pytest.mark.parametrize("case,act,weight_axis", [
    ("dense", TOKEN, -1), ("dense", TENSOR, -1), ("dense", TOKEN, None), ("dense", TENSOR, None),
    ("dense_3d", TOKEN, -1), ("dense_3d", TENSOR, None),
    ("batched_einsum", TOKEN, -1), ("batched_einsum", TENSOR, None),
])
def test_forward_and_grads_match_fake_quant_reference(case, act, weight_axis):
    lshape, rshape, dims, _ = CASES[case]
    x, w = _rand(*lshape), _rand(*rshape, seed=1)
    per_token = act.granularity == "token"
    weight = jq.QuantSpec(axis=weight_axis)
    ref_fn = lambda x, w: _reference(x, w, case, per_token, weight_axis)  # noqa: E731
    qat = lambda fake: lambda x, w: qat_dot_general(  # noqa: E731
        x, w, dims, weight=weight, act=act, fake=fake)
    (ref, *expected), (y, *got), (fake, *got_fake) = _values_and_grads(
        [ref_fn, qat(False), qat(True)], x, w)
    assert y.shape == ref.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(y, ref, **_tol(ref))
    assert float(jnp.max(jnp.abs(ref - lax.dot_general(x, w, dims)))) > 1e-3  # it quantized
    np.testing.assert_allclose(fake, ref, rtol=1e-6, atol=1e-6)
    for g, gf, e in zip(got, got_fake, expected, strict=True):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, **_tol(e))
        np.testing.assert_allclose(gf, e, rtol=1e-6, atol=1e-6)
    # not jitted from outside: the same numbers
    np.testing.assert_allclose(qat(False)(x, w), y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_int8_backward_grad_lhs_within_bound_and_grad_rhs_exact(case):
    lshape, rshape, dims, _ = CASES[case]
    x, w = _rand(*lshape), _rand(*rshape, seed=1)
    ref_fn = lambda x, w: _reference(x, w, case, True, -1)  # noqa: E731
    cot = _rand(*jax.eval_shape(ref_fn, x, w).shape, seed=2)

    @jax.jit
    def grads(x, w):
        f = lambda x, w: qat_dot_general(x, w, dims, backward="int8")  # noqa: E731
        return jax.vjp(ref_fn, x, w)[1](cot), jax.vjp(f, x, w)[1](cot)

    (ex, ew), (gx, gw) = grads(x, w)
    np.testing.assert_allclose(gw, ew, **_tol(ew))  # the weight gradient stays float
    err = np.abs(np.asarray(gx, np.float64) - np.asarray(ex, np.float64))
    assert 0 < np.linalg.norm(err) / np.linalg.norm(ex) < 3e-2  # 8-bit rows with an outlier
    if case == "dense":  # |error| <= sum_n |g'_n - fq(g')_n| |codes_nk| <= s_g / 2 sum_n |codes_nk|
        codes = np.asarray(jq.quantize(w, axis=-1).qvalue, np.float64)
        gs = cot * np.asarray(jq.quantize(w, axis=-1).scale, np.float64)[None, :]
        s_g = np.abs(gs).max(1, keepdims=True) / 127
        bound = 0.5 * s_g * np.abs(codes).sum(1)[None, :]
        assert np.all(err <= bound * (1 + 1e-5) + 1e-5)


def test_grads_are_straight_through_not_float():
    """The STE gradient uses the quantized operands: d w = fq(x)^T g, not x^T g."""
    x, w = _rand(6, 96), _rand(96, 40, seed=1)
    gw = jax.grad(lambda w: qat_dot_general(x, w, DN).sum())(w)
    np.testing.assert_allclose(gw, jnp.broadcast_to(jq.fake_quant(x, axis=0).sum(0)[:, None],
                                                    w.shape), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(gw - x.sum(0)[:, None]))) > 1e-4


def test_weight_only_qat_act_none():
    x, w = _rand(6, 96), _rand(96, 40, seed=1)
    ref = lambda x, w: x @ jq.fake_quant(w, axis=-1)  # noqa: E731
    (e, *expected), (y, *got), (yf, *got_fake) = _values_and_grads(
        [ref, lambda x, w: qat_dot_general(x, w, DN, act=None),
         lambda x, w: qat_dot_general(x, w, DN, act=None, fake=True)], x, w)
    np.testing.assert_allclose(y, e, **_tol(e))
    np.testing.assert_allclose(yf, e, rtol=1e-6, atol=1e-6)
    for g, gf, ex in zip(got, got_fake, expected, strict=True):
        np.testing.assert_allclose(g, ex, **_tol(ex))
        np.testing.assert_allclose(gf, ex, rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(got[0] - _float_dx(x, w)))) > 0  # d x uses fq(w), not w


def _float_dx(x, w):
    return _values_and_grads([lambda x, w: x @ w], x, w)[0][1]


def test_blocked_weight_along_contraction():
    x, w = _rand(6, 100), _rand(100, 24, seed=1)  # a partial last block
    weight = jq.QuantSpec(axis=0, block_size=32)
    ref = lambda x, w: jq.fake_quant(x, axis=0) @ jq.fake_quant(w, axis=0, block_size=32)  # noqa: E731
    (e, *expected), (y, *got) = _values_and_grads(
        [ref, lambda x, w: qat_dot_general(x, w, DN, weight=weight)], x, w)
    np.testing.assert_allclose(y, e, **_tol(e))
    for g, ex in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, ex, **_tol(ex))


def test_bfloat16_operands_and_preferred_element_type():
    x, w = _rand(6, 64).astype(jnp.bfloat16), _rand(64, 8, seed=1).astype(jnp.bfloat16)
    # bfloat16 values are float32 values: the same codes and scales, unrounded products
    ref = lambda x, w: (jq.fake_quant(x.astype(jnp.float32), axis=0)  # noqa: E731
                        @ jq.fake_quant(w.astype(jnp.float32), axis=-1))
    (e, *_), (y, gx, gw), (y32, *_) = _values_and_grads(
        [ref, lambda x, w: qat_dot_general(x, w, DN),
         lambda x, w: qat_dot_general(x, w, DN, preferred_element_type=jnp.float32)], x, w)
    assert y.dtype == jnp.bfloat16 and y32.dtype == jnp.float32
    assert gx.dtype == gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(jnp.float32), e, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(y32, e, **_tol(e))


def test_zero_activation_rows_and_zero_weights():
    x, w = _rand(4, 32), np.zeros((32, 8), np.float32)
    x[1] = 0.0
    w[:, 3] = _rand(32, seed=3)
    y = qat_dot_general(x, w, DN)
    assert np.all(np.isfinite(y)) and np.all(np.asarray(y)[1] == 0) and np.all(
        np.asarray(y)[:, [0, 1, 2, 4]] == 0)
    g = jax.grad(lambda x, w: qat_dot_general(x, w, DN).sum(), (0, 1))(x, w)
    assert all(np.all(np.isfinite(v)) for v in g)


def test_forward_is_an_int8_dot_and_backward_float():
    x, w = _rand(6, 96), _rand(96, 40, seed=1)

    def dots(fn, *args):
        return [([v.aval.dtype for v in e.invars], e.outvars[0].aval.dtype)
                for e in find_eqns(jax.make_jaxpr(fn)(*args).jaxpr)]

    fwd = dots(lambda x, w: qat_dot_general(x, w, DN), x, w)
    assert fwd == [([jnp.int8, jnp.int8], jnp.int32)]
    grad = dots(jax.grad(lambda x, w: qat_dot_general(x, w, DN).sum(), (0, 1)), x, w)
    # the backward sits in (identical) conditional branches, each holding its two dots
    i8, f32 = ([jnp.int8, jnp.int8], jnp.int32), ([jnp.float32, jnp.float32], jnp.float32)
    assert grad.count(i8) == 1 and grad.count(f32) >= 2 and len(grad) == 1 + grad.count(f32)
    grad8 = dots(jax.grad(lambda x, w: qat_dot_general(x, w, DN, backward="int8").sum(), (0, 1)),
                 x, w)
    # each backward: one float dot (d w) and SwitchBack's int8 dot, in two platform branches
    # (the CPU's reads the weight's codes in place, the others' transposes them)
    assert grad8.count(f32) >= 1 and grad8.count(i8) == 1 + 2 * grad8.count(f32)
    assert len(grad8) == grad8.count(i8) + grad8.count(f32)
    fake = dots(lambda x, w: qat_dot_general(x, w, DN, fake=True), x, w)
    assert fake == [([jnp.float32, jnp.float32], jnp.float32)]


def test_jit_vmap_and_no_retrace():
    x, w = _rand(3, 6, 32), _rand(32, 8, seed=1)
    f = lambda x, w: qat_dot_general(x, w, DN)  # noqa: E731
    per_example = jnp.stack([f(x[i], w) for i in range(3)])
    np.testing.assert_allclose(jax.vmap(f, (0, None))(x, w), per_example, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(f, (0, None)))(x, w), per_example, rtol=1e-6,
                               atol=1e-5)
    ws = jnp.stack([w, 2 * w, -w])
    np.testing.assert_allclose(jax.vmap(f)(x, ws), jnp.stack([f(x[i], ws[i]) for i in range(3)]),
                               rtol=1e-6, atol=1e-6)
    gv = jax.vmap(jax.grad(lambda x, w: f(x, w).sum(), 1), (0, None))(x, w)
    np.testing.assert_allclose(gv, jnp.stack([jax.grad(lambda w, i=i: f(x[i], w).sum())(w)
                                              for i in range(3)]), rtol=1e-6, atol=1e-6)
    before = _run._cache_size()
    f(x[0] + 1, w)
    f(x[1], w * 2)
    assert _run._cache_size() == before  # equal shapes and config: no new trace


def test_qat_dot_general_class_is_hashable_and_works_in_flax():
    nn = pytest.importorskip("flax.linen")
    dot = QATDotGeneral()
    assert hash(dot) == hash(QATDotGeneral()) and dot == QATDotGeneral()
    assert dot != QATDotGeneral(fake=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dot.fake = True
    x = _rand(4, 32)
    model = nn.Dense(16, dot_general=dot)
    params = model.init(jax.random.key(0), x)
    kernel, bias = params["params"]["kernel"], params["params"]["bias"]
    np.testing.assert_allclose(model.apply(params, x), qat_dot_general(x, kernel, DN) + bias[None, :],
                               rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda p: model.apply(p, x).sum())(params)["params"]["kernel"]
    np.testing.assert_allclose(g, jnp.broadcast_to(jq.fake_quant(x, axis=0).sum(0)[:, None],
                                                   kernel.shape), rtol=1e-5, atol=1e-5)
    int8_bwd = nn.Dense(16, dot_general=QATDotGeneral(backward="int8"))
    np.testing.assert_allclose(int8_bwd.apply(params, x), model.apply(params, x), rtol=1e-6,
                               atol=1e-6)
    nnx = pytest.importorskip("flax.nnx")
    layer = nnx.Linear(32, 16, dot_general=dot, rngs=nnx.Rngs(0))  # passes out_sharding=
    np.testing.assert_allclose(layer(x), qat_dot_general(x, layer.kernel[...], DN)
                               + layer.bias[...][None, :], rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['foo'\]"):
        dot(x, kernel, DN, foo=1)


@pytest.mark.parametrize("kwargs,lhs,rhs,dims,exc,match", [
    ({}, jnp.ones((2, 4)), jq.quantize(jnp.ones((4, 3))), DN, TypeError,
     "rhs must be a float array, got a jaxquant.QTensor"),
    ({}, jnp.ones((2, 4), jnp.int32), jnp.ones((4, 3)), DN, TypeError,
     "lhs must be a float array, got dtype int32"),
    ({}, jnp.ones((2, 4), jnp.bfloat16), jnp.ones((4, 3)), DN, TypeError,
     "same dtype, got bfloat16 and float32"),
    ({}, jnp.ones((2, 4)), jnp.ones((4, 3)), ((1,), (0,)), ValueError,
     "dimension_numbers must be"),
    ({"weight": "int8"}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN, TypeError,
     "weight must be a jaxquant.QuantSpec, got str"),
    ({"weight": jq.QuantSpec(dtype=jnp.int4)}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN,
     ValueError, "weight must quantize to int8.*got dtype=int4"),
    ({"weight": jq.QuantSpec(symmetric=False)}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN,
     ValueError, "weight must be symmetric"),
    ({"weight": jq.QuantSpec(axis=0)}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN, ValueError,
     r"constant along the contraction, but weight.axis=0 is the contracting dimension 0"),
    ({"weight": jq.QuantSpec(axis=2)}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN, ValueError,
     r"weight.axis must be in \[-2, 2\)"),
    ({"weight": jq.QuantSpec(axis=1, block_size=2)}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN,
     ValueError, r"blocked along its single contracting dimension; weight.axis=1"),
    ({"act": "token"}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN, TypeError,
     "act must be None or a jaxquant.ActQuant, got str"),
    ({"backward": "int4"}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN, ValueError,
     "backward must be 'float' or 'int8', got 'int4'"),
    ({"backward": "int8", "act": None}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN, ValueError,
     "backward='int8' needs the int8 forward path.*act=None"),
    ({"backward": "int8", "weight": jq.QuantSpec(axis=0, block_size=2)}, jnp.ones((2, 4)),
     jnp.ones((4, 3)), DN, ValueError, "backward='int8' needs.*block_size=2"),
    ({"preferred_element_type": jnp.int32}, jnp.ones((2, 4)), jnp.ones((4, 3)), DN, ValueError,
     "preferred_element_type must be a float dtype.*got int32"),
])
def test_errors(kwargs, lhs, rhs, dims, exc, match):
    with pytest.raises(exc, match=match):
        qat_dot_general(lhs, rhs, dims, **kwargs)
