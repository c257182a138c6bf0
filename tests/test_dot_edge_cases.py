"""Quantized dots at their edges, against NumPy float64 / int64 references: gradients of the
int8 x int8 path, NaN operands, empty dimensions, operand shapes that do not match, bad
dimension numbers; the Hadamard transform and `scaled_matmul` on unusual arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import jaxquant as jq

DN = (((1,), (0,)), ((), ()))  # x (batch, in) . w (in, out)


def _act_codes(x, axis):
    """Symmetric int8 codes and scales of ``x`` written with NumPy (absmax / 127 over ``axis``)."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=axis, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.rint(x / s), -127, 127).astype(np.int64), s.astype(np.float64)


def _weight_values(qt):
    """``(codes - zero point) * scale`` in float64 for per-tensor, per-axis or blocked (axis 0)
    integer QTensors, from the stored codes and scales."""
    q = np.asarray(qt.qvalue).astype(np.int64)
    z = 0 if qt.zero_point is None else np.asarray(qt.zero_point).astype(np.int64)
    s = np.asarray(qt.scale, np.float64)
    kind = qt.layout.kind
    if kind == "block":
        assert qt.axis == 0
        rep = [np.repeat(v, qt.block_size, axis=0)[:q.shape[0]] if np.ndim(v) else v
               for v in (z, s)]
        return (q - rep[0]) * rep[1]
    if kind == "axis":
        shape = [1] * q.ndim
        shape[qt.axis] = -1
        return (q - np.reshape(z, shape if np.ndim(z) else ())) * s.reshape(shape)
    return (q - z) * s


def _data(m=6, k=48, n=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("granularity", ["token", "tensor"])
@pytest.mark.parametrize("spec", [dict(axis=1), dict(), dict(axis=0, block_size=16),
                                  dict(dtype=jnp.uint8, axis=1, symmetric=False)],
                         ids=["axis", "tensor", "block", "uint8-zp"])
def test_int8_dot_gradient_wrt_the_float_operand_is_straight_through(granularity, spec):
    """d x = g . dequantize(w)^T, as for fake_quant (an absmax scale clips nothing)."""
    x, w = _data()
    qt = jq.quantize(jnp.asarray(w), **spec)
    g = np.random.default_rng(1).standard_normal((6, 10))
    act = jq.ActQuant(granularity=granularity)
    gx = jax.grad(lambda x: jnp.sum(jq.qdot_general(x, qt, DN, act_quant=act) * g))(x)
    ref = g @ _weight_values(qt).T
    np.testing.assert_allclose(np.asarray(gx, np.float64), ref, rtol=1e-5, atol=1e-5)
    assert np.abs(ref).min() > 1e-3  # every entry is a real gradient, not a zero


def test_int8_dot_gradients_with_the_qtensor_on_the_left():
    x, w = _data()
    qx = jq.quantize(jnp.asarray(x), axis=0)
    g = np.random.default_rng(2).standard_normal((6, 10))
    gw = jax.grad(lambda w: jnp.sum(jq.qdot_general(qx, w, DN, act_quant=jq.ActQuant()) * g))(w)
    np.testing.assert_allclose(np.asarray(gw, np.float64), _weight_values(qx).T @ g,
                               rtol=1e-5, atol=1e-5)


def test_int8_dot_gradient_wrt_the_weight_scale():
    """y = sum_k a_k s_a q_kn s_n is linear in the weight's scale s_n."""
    x, w = _data()
    qt = jq.quantize(jnp.asarray(w), axis=1)
    g = np.random.default_rng(3).standard_normal((6, 10))

    def loss(s):
        q = jq.QTensor(qt.qvalue, s, axis=1)
        return jnp.sum(jq.qdot_general(x, q, DN, act_quant=jq.ActQuant()) * g)

    a, sa = _act_codes(x, 1)
    ref = np.sum(g * ((a * sa) @ np.asarray(qt.qvalue).astype(np.float64)), axis=0)
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(qt.scale)), ref, rtol=1e-5, atol=1e-5)


def test_int8_dot_gradient_under_jit_and_vmap():
    x, w = _data()
    qt = jq.quantize(jnp.asarray(w), axis=1)
    xs = np.stack([x, 2 * x])
    f = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(jq.qdot_general(x, qt, DN,
                                                                    act_quant=jq.ActQuant())))))
    ref = np.broadcast_to(_weight_values(qt).sum(1), x.shape)
    np.testing.assert_allclose(np.asarray(f(xs), np.float64), np.stack([ref, ref]), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("spec", [dict(axis=1), dict(axis=0, block_size=16)],
                         ids=["axis", "block"])
def test_int8_dot_gradient_on_an_explicit_mesh(spec):
    from host_mesh import host_mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = host_mesh((2, 4), ("data", "model"))
    x, w = _data(m=16, k=64, n=32)
    with jax.set_mesh(mesh):
        q = jax.jit(lambda w: jq.quantize(w, **spec))(
            jax.device_put(w, NamedSharding(mesh, P(None, "model"))))
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        g = jax.jit(jax.grad(lambda x, q: jq.qdot_general(
            x, q, DN, act_quant=jq.ActQuant(), out_sharding=P("data", "model")).sum()))(xs, q)
    ref = np.broadcast_to(_weight_values(jax.device_get(q)).sum(1), x.shape)
    np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- NaN and inf


@pytest.mark.parametrize("spec", [dict(axis=1), dict(axis=0, block_size=16)],
                         ids=["axis", "block"])
def test_int8_dot_nan_activation_is_not_dropped(spec):
    """A NaN activation makes its row NaN (its token's scale is NaN), as in the float dot;
    per tensor, every row shares the NaN scale. It never yields finite values."""
    x, w = _data()
    x[2, 5] = np.nan
    qt = jq.quantize(jnp.asarray(w), **spec)
    y = np.asarray(jq.qdot_general(x, qt, DN, act_quant=jq.ActQuant()))
    assert np.isnan(y[2]).all()
    keep = [0, 1, 3, 4, 5]
    a, sa = _act_codes(x[keep], 1)
    ref = a @ (np.asarray(qt.qvalue).astype(np.int64)) * sa
    ref = ref * (np.asarray(qt.scale, np.float64)[None] if qt.layout.kind == "axis" else 1)
    if qt.layout.kind == "axis":
        np.testing.assert_allclose(y[keep], ref, rtol=1e-5, atol=1e-5)
    assert np.isfinite(y[keep]).all()
    y = np.asarray(jq.qdot_general(x, qt, DN, act_quant=jq.ActQuant(granularity="tensor")))
    assert np.isnan(y).all()


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_int8_dot_inf_activation_is_not_finite(value):
    x, w = _data()
    x[1, 0] = value
    y = np.asarray(jq.qdot_general(x, jq.quantize(jnp.asarray(w), axis=1), DN,
                                   act_quant=jq.ActQuant()))
    assert not np.isfinite(y[1]).any() and np.isfinite(np.delete(y, 1, axis=0)).all()


@pytest.mark.parametrize("weight", [jq.QuantSpec(axis=-1), jq.QuantSpec(axis=None),
                                    jq.QuantSpec(axis=0, block_size=16)],
                         ids=["axis", "tensor", "block"])
def test_qat_int8_dot_nan_operands_are_not_dropped(weight):
    """The fake-quant reference (float dot of fake_quant values) is NaN where an operand is."""
    x, w = _data()
    xn, wn = x.copy(), w.copy()
    xn[3, 7] = np.nan
    wn[9, 4] = np.nan
    y = np.asarray(jq.qat_dot_general(xn, w, DN, weight=weight))
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()
    y = np.asarray(jq.qat_dot_general(x, wn, DN, weight=weight))
    cols = np.isnan(y).all(axis=0)
    assert cols[4] and (cols.all() if weight.axis is None else cols.sum() == 1)


def test_qat_int8_backward_nan_cotangent_is_not_dropped():
    x, w = _data()
    g = np.ones((6, 10), np.float32)
    g[4, 2] = np.nan
    _, vjp = jax.vjp(lambda x: jq.qat_dot_general(x, w, DN, backward="int8"), x)
    (dx,) = vjp(g)
    dx = np.asarray(dx)
    assert np.isnan(dx[4]).all() and np.isfinite(np.delete(dx, 4, axis=0)).all()


# ----------------------------------------------------------------------------- empty dims


@pytest.mark.parametrize("act", [None, jq.ActQuant(), jq.ActQuant(granularity="tensor")],
                         ids=["weight-only", "token", "tensor"])
@pytest.mark.parametrize("shapes", [((0, 8), (8, 6)), ((4, 0), (0, 6)), ((4, 8), (8, 0))],
                         ids=["no-rows", "no-contraction", "no-columns"])
def test_empty_dimensions_give_numpys_result(act, shapes):
    """NumPy: an empty contraction sums to zeros; empty free dimensions give empty arrays."""
    (sx, sw), rng = shapes, np.random.default_rng(0)
    x, w = rng.standard_normal(sx, np.float32), rng.standard_normal(sw, np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    for qt in (jq.quantize(jnp.asarray(w), axis=1), jq.quantize(jnp.asarray(w)),
               jq.quantize(jnp.asarray(w), axis=0, block_size=4)):
        y = jq.qdot_general(x, qt, DN, act_quant=act)
        assert y.shape == ref.shape and y.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(y), ref)


@pytest.mark.parametrize("kw", [dict(), dict(act=None), dict(weight=jq.QuantSpec(axis=None)),
                                dict(backward="int8"), dict(fake=True),
                                dict(weight=jq.QuantSpec(axis=0, block_size=4))],
                         ids=["int8", "weight-only", "per-tensor", "int8-backward", "fake",
                              "blocked"])
@pytest.mark.parametrize("shapes", [((0, 8), (8, 6)), ((4, 0), (0, 6)), ((4, 8), (8, 0))],
                         ids=["no-rows", "no-contraction", "no-columns"])
def test_qat_empty_dimensions_give_numpys_result(kw, shapes):
    sx, sw = shapes
    x, w = np.ones(sx, np.float32), np.ones(sw, np.float32)
    ref = x @ w
    y = jq.qat_dot_general(x, w, DN, **kw)
    np.testing.assert_array_equal(np.asarray(y), ref)
    gx, gw = jax.grad(lambda x, w: jq.qat_dot_general(x, w, DN, **kw).sum(), (0, 1))(x, w)
    np.testing.assert_array_equal(np.asarray(gx), np.ones((sx[0], sw[1])) @ w.T)
    np.testing.assert_array_equal(np.asarray(gw), x.T @ np.ones((sx[0], sw[1])))


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("case", ["int8", "int8-blocked", "packed-int4", "weight-only"])
@pytest.mark.parametrize("k", [5, 7, 9])
def test_contracting_sizes_that_differ_raise(case, k):
    """lax.dot_general rejects them; the int8 path used to slice the longer operand and the
    packed weight-only path padded the shorter one, returning a wrong (4, 6) result."""
    w = jnp.ones((8, 6))
    qt, act = {
        "int8": (jq.quantize(w, axis=1), jq.ActQuant()),
        "int8-blocked": (jq.quantize(w, axis=0, block_size=4), jq.ActQuant()),
        "packed-int4": (jq.pack(jq.quantize(w, dtype=jnp.int4, axis=1), axis=0), None),
        "weight-only": (jq.quantize(w, axis=1), None),
    }[case]
    with pytest.raises(ValueError, match=rf"contracting .*lhs .*\({k},\).* rhs .*\(8,\)"):
        jq.qdot_general(jnp.ones((4, k)), qt, DN, act_quant=act)
    if case == "int8":
        with pytest.raises(ValueError, match=rf"contracting .*\({k},\).*\(8,\)"):
            jq.qat_dot_general(jnp.ones((4, k)), w, DN)


def test_batch_sizes_that_differ_raise():
    qt = jq.quantize(jnp.ones((2, 8, 6)), axis=2)
    with pytest.raises(ValueError, match=r"batch .*\(3,\).*\(2,\)"):
        jq.qdot_general(jnp.ones((3, 4, 8)), qt, (((2,), (1,)), ((0,), (0,))),
                        act_quant=jq.ActQuant())


@pytest.mark.parametrize("dims", [(((1.5,), (0,)), ((), ())), (((True,), (0,)), ((), ())),
                                  (((1,), ("0",)), ((), ()))])
def test_non_integer_dimension_numbers_raise(dims):
    with pytest.raises(TypeError, match="dimension"):
        jq.qdot_general(jnp.ones((4, 8)), jq.quantize(jnp.ones((8, 6))), dims)


@pytest.mark.parametrize("dims", [((1, 0), ((), ())), (((1,), 0), ((), ())), "ab,bc"])
def test_malformed_dimension_numbers_raise(dims):
    with pytest.raises(ValueError, match="dimension_numbers must be"):
        jq.qdot_general(jnp.ones((4, 8)), jq.quantize(jnp.ones((8, 6))), dims)


def test_numpy_integer_dimension_numbers_are_accepted():
    x, w = _data()
    qt = jq.quantize(jnp.asarray(w), axis=1)
    dims = (((np.int64(1),), (np.int32(0),)), ((), ()))
    np.testing.assert_allclose(np.asarray(jq.qdot_general(x, qt, dims)),
                               x.astype(np.float64) @ _weight_values(qt), rtol=1e-5, atol=1e-5)


def test_scaled_matmul_integer_output_dtype_raises():
    a = jq.quantize(jnp.ones((2, 64)), dtype="mxfp8_e4m3")
    with pytest.raises(ValueError, match="preferred_element_type must be a float dtype.*int32"):
        jq.scaled_matmul(a, a, preferred_element_type=jnp.int32)


# ----------------------------------------------------------------------------- Hadamard


def test_hadamard_of_an_empty_axis_is_empty():
    for shape, axis in (((3, 0), 1), ((0, 8), 0), ((0, 8), 1)):
        x = jnp.ones(shape)
        y = jq.hadamard_transform(x, axis)
        assert y.shape == shape and y.dtype == x.dtype


def test_hadamard_takes_numpy_integers():
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    h = scipy.linalg.hadamard(8) / np.sqrt(8)
    ref = (x.astype(np.float64).reshape(3, 2, 8) @ h).reshape(3, 16)
    y = jq.hadamard_transform(x, np.int64(-1), block_size=np.int64(8))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dims", [
    (((0, 0), (0, 1)), ((), ())),         # lhs contracts axis 0 twice (LinearGeneral of a rank-1 input)
    (((1,), (1,)), ((1,), (0,))),         # lhs axis 1 both contracted and batch
])
def test_repeated_dimensions_are_refused_as_lax_refuses_them(dims):
    x = jnp.ones((4, 4), jnp.float32)
    w = jq.quantize(jnp.ones((4, 4), jnp.float32), axis=1)
    with pytest.raises(TypeError):  # lax's own check, on float operands
        jax.lax.dot_general(x, jnp.ones((4, 4), jnp.float32), dims)
    with pytest.raises(ValueError, match=r"lhs: a dimension may appear once.*\(4, 4\)"):
        jq.qdot_general(x, w, dims)
