"""`qat_dot_general` and `scaled_matmul` against references written independently of jaxquant:
NumPy float64 (absmax / 127 scales, ``rint`` codes, int64 sums), PyTorch's fake-quantization
ops and autograd, ml_dtypes' decoding of MX / NVFP4 codes and scales."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant._int_dot import ActQuant
from jaxquant._qat_dot import QATDotGeneral, qat_dot_general

torch = pytest.importorskip("torch")

DN = (((1,), (0,)), ((), ()))
ULP = 2.0 ** -24  # float32's unit roundoff


def _rand(*shape, seed=0, outlier=True):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if outlier:
        x.flat[3] = 9.0
    return x


def _codes_np(x, keep):
    """float64 int8 codes and float32 scales of ``x``: one absmax / 127 scale per index of the
    ``keep`` axes (all-zero groups: 1; at least the smallest normal), ``rint`` of ``x / s``."""
    x = np.asarray(x, np.float32)
    red = tuple(d for d in range(x.ndim) if d not in keep)
    amax = np.abs(x).max(axis=red, keepdims=True, initial=0).astype(np.float32)
    s = (amax / np.float32(127)).astype(np.float32)
    s = np.where(amax > 0, np.maximum(s, np.float32(2.0 ** -126)), np.float32(1)).astype(np.float32)
    return np.clip(np.rint(x.astype(np.float64) / s), -127, 127), s.astype(np.float64)


def _vjp(f, g, *args):
    """``f(*args)`` and its vjp for the cotangent ``g``, in one jitted program."""
    def run(g, *args):
        y, vjp = jax.vjp(f, *args)
        return y, *vjp(g.astype(y.dtype))

    return jax.jit(run)(jnp.asarray(g), *args)


def test_act_given_the_class_instead_of_an_instance_is_named():
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    match = r"act must be None or a jaxquant.ActQuant, got the class ActQuant itself.*ActQuant\(\)"
    with pytest.raises(TypeError, match=match):
        qat_dot_general(x, w, DN, act=ActQuant)
    with pytest.raises(TypeError, match=match):
        QATDotGeneral(act=ActQuant)(x, w, DN)
    with pytest.raises(TypeError, match=r"act must be None or a jaxquant.ActQuant, got str 'tok'"):
        qat_dot_general(x, w, DN, act="tok")


@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_dense_matches_torch_fake_quantize_and_autograd(granularity):
    """Values and STE gradients against torch.fake_quantize_per_{channel,tensor}_affine on both
    operands (same scales), autograd through the torch product; the int8 forward against the
    int64 product of the codes times the scales: at most 3 roundings (int32 sum to float32, two
    scale products), so |y - exact| <= 3 ulp |exact|."""
    x, w = _rand(5, 70), _rand(70, 9, seed=1)
    g = _rand(5, 9, seed=2, outlier=False)
    per_token = granularity == "token"
    qx, sx = _codes_np(x, (0,) if per_token else ())
    qw, sw = _codes_np(w, (1,))
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    if per_token:
        xf = torch.fake_quantize_per_channel_affine(
            tx, torch.tensor(sx.ravel(), dtype=torch.float32), torch.zeros(5, dtype=torch.int32),
            0, -127, 127)
    else:
        xf = torch.fake_quantize_per_tensor_affine(tx, float(sx.ravel()[0]), 0, -127, 127)
    wf = torch.fake_quantize_per_channel_affine(
        tw, torch.tensor(sw.ravel(), dtype=torch.float32), torch.zeros(9, dtype=torch.int32),
        1, -127, 127)
    yt = xf @ wf
    yt.backward(torch.tensor(g))
    act = ActQuant(granularity=granularity)
    for bw in ("float", "int8"):
        y, gx, gw = _vjp(lambda a, b, bw=bw: qat_dot_general(a, b, DN, act=act, backward=bw),
                         g, x, w)
        np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-5, atol=1e-5)
        exact = (qx.astype(np.int64) @ qw.astype(np.int64)) * sx * sw
        assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= 3 * ULP * np.abs(exact))
        np.testing.assert_allclose(gw, tw.grad.numpy(), rtol=1e-5, atol=1e-5)
        if bw == "float":
            np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    gx8 = gx
    # SwitchBack: g * s_w quantized per row to int8, times the weight's codes
    gs = g.astype(np.float64) * sw
    qg, sg = _codes_np(gs.astype(np.float32), (0,))
    ref8 = (qg @ qw.T) * sg
    np.testing.assert_allclose(gx8, ref8, rtol=1e-5, atol=1e-6 * np.abs(ref8).max())


# lhs shape, rhs shape, dimension numbers, weight axis, einsum of x, w -> y
GENERAL = [
    ((3, 7, 5), (5, 7, 4), (((1, 2), (1, 0)), ((), ())), -1, "mab,ban->mn"),
    ((9, 2, 6), (2, 4, 9), (((0,), (2,)), ((1,), (0,))), 0, "kbt,bnk->btn"),
    ((2, 6, 3, 9), (9, 2, 4, 5), (((3,), (0,)), ((0,), (1,))), 2, "bijk,kbnp->bijnp"),
]


@pytest.mark.parametrize("lshape,rshape,dims,axis,spec", GENERAL)
def test_general_dimension_numbers_against_float64_einsum(lshape, rshape, dims, axis, spec):
    """Several and reordered contracting dims, batch dims, contraction not last, a weight scale
    along a batch dim: values and STE gradients (float64 einsums of the fake-quantized
    operands), the int8 forward within 3 ulp of the exact product."""
    x, w = _rand(*lshape), _rand(*rshape, seed=1)
    contract = dims[0][0]
    qx, sx = _codes_np(x, tuple(d for d in range(x.ndim) if d not in contract))
    qw, sw = _codes_np(w, (axis % w.ndim,))
    xf, wf = qx * sx, qw * sw
    ins, out = spec.split("->")
    sx_, sw_ = ins.split(",")
    exact = np.einsum(spec, xf, wf)
    g = _rand(*exact.shape, seed=2, outlier=False)
    y, gx, gw = _vjp(lambda a, b: qat_dot_general(a, b, dims, weight=jq.QuantSpec(axis=axis)),
                     g, x, w)
    assert y.shape == exact.shape
    assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= 3 * ULP * np.abs(exact) + 1e-30)
    ex, ew = np.einsum(f"{out},{sw_}->{sx_}", g, wf), np.einsum(f"{out},{sx_}->{sw_}", g, xf)
    np.testing.assert_allclose(gx, ex, rtol=1e-5, atol=1e-5 * np.abs(ex).max())
    np.testing.assert_allclose(gw, ew, rtol=1e-5, atol=1e-5 * np.abs(ew).max())


def test_blocked_weight_with_a_batch_dim_and_a_partial_block():
    """x (K, B, T) contracted on 0, w (B, N, K) blocked by 16 along K = 50: values and STE
    gradients against float64 einsums of NumPy's blocked fake quantization."""
    x, w = _rand(50, 2, 3), _rand(2, 4, 50, seed=1)
    dims = (((0,), (2,)), ((1,), (0,)))
    qx, sx = _codes_np(x, (1, 2))
    wp = np.concatenate([w, np.zeros((2, 4, 14), np.float32)], -1).reshape(2, 4, 4, 16)
    qw, sw = _codes_np(wp, (0, 1, 2))
    xf, wf = qx * sx, (qw * sw).reshape(2, 4, 64)[..., :50]
    exact = np.einsum("kbt,bnk->btn", xf, wf)
    g = _rand(*exact.shape, seed=2, outlier=False)
    y, gx, gw = _vjp(lambda a, b: qat_dot_general(
        a, b, dims, weight=jq.QuantSpec(axis=2, block_size=16)), g, x, w)
    np.testing.assert_allclose(y, exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())
    ex, ew = np.einsum("btn,bnk->kbt", g, wf), np.einsum("btn,kbt->bnk", g, xf)
    np.testing.assert_allclose(gx, ex, rtol=1e-5, atol=1e-6 * np.abs(ex).max())
    np.testing.assert_allclose(gw, ew, rtol=1e-5, atol=1e-6 * np.abs(ew).max())


def test_bfloat16_operands_float32_output_are_exact_products():
    x, w = _rand(4, 40).astype(jnp.bfloat16), _rand(40, 6, seed=1).astype(jnp.bfloat16)
    qx, sx = _codes_np(np.asarray(x, np.float32), (0,))
    qw, sw = _codes_np(np.asarray(w, np.float32), (1,))
    exact = (qx @ qw) * sx * sw
    g = _rand(4, 6, seed=2, outlier=False)
    y, gx, gw = _vjp(lambda a, b: qat_dot_general(a, b, DN, preferred_element_type=jnp.float32),
                     g, x, w)
    assert y.dtype == jnp.float32 and gx.dtype == gw.dtype == jnp.bfloat16
    assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= 3 * ULP * np.abs(exact))
    ex, ew = g @ (qw * sw).T, (qx * sx).T @ g  # one bfloat16 rounding of each fq and result
    np.testing.assert_allclose(np.asarray(gx, np.float32), ex, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(gw, np.float32), ew, rtol=2e-2, atol=2e-2)


_PATHS = [{}, {"backward": "int8"}, {"fake": True}, {"act": None},
          {"weight": jq.QuantSpec(axis=0, block_size=2)}]


def test_zero_size_and_all_zero_operands():
    for ls, rs, paths in [((0, 4), (4, 3), _PATHS[:1]), ((2, 0), (0, 3), _PATHS[:3]),
                          ((2, 4), (4, 0), _PATHS[:1])]:
        for kw in paths:
            x, w = jnp.ones(ls), jnp.ones(rs)
            y, gx, gw = _vjp(lambda a, b, kw=kw: qat_dot_general(a, b, DN, **kw),
                             np.ones((ls[0], rs[1]), np.float32), x, w)
            assert y.shape == (ls[0], rs[1]) and np.all(np.asarray(y) == 0)
            assert gx.shape == ls and gw.shape == rs
    x, w, g = np.zeros((3, 8), np.float32), _rand(8, 5, seed=1), _rand(3, 5, seed=2)
    for kw in _PATHS[:1]:
        y, gx, gw = _vjp(lambda a, b, kw=kw: qat_dot_general(a, b, DN, **kw), g, x, w)
        assert np.all(np.asarray(y) == 0) and np.all(np.asarray(gw) == 0)
        assert np.all(np.isfinite(gx)) and np.any(np.asarray(gx) != 0)


def test_non_finite_row_stays_in_its_row():
    """A NaN (an inf) in one activation row leaves every other row of the output and of d x as
    without it (a per-token scale); d w sums over all rows, so it is allowed to be NaN. A
    NaN (an inf) in one row of the cotangent stays in that row of d x (also the int8 backward)."""
    x, w, g = _rand(5, 40), _rand(40, 6, seed=1), _rand(5, 6, seed=2, outlier=False)
    xb = x.copy()
    xb[1, 7], xb[3, 2] = np.nan, np.inf
    rows = [0, 2, 4]
    for kw in _PATHS[:2] + _PATHS[4:]:  # the int8 forward paths
        def run(a, b, kw=kw):
            y, vjp = jax.vjp(lambda a, b: qat_dot_general(a, b, DN, **kw), a, b)
            return y, vjp(jnp.asarray(g))[0]

        (y, gx), (yb, gxb) = jax.jit(run)(x, w), jax.jit(run)(xb, w)
        np.testing.assert_array_equal(np.asarray(yb)[rows], np.asarray(y)[rows])
        np.testing.assert_array_equal(np.asarray(gxb)[rows], np.asarray(gx)[rows])
        assert not np.isfinite(np.asarray(yb)[[1, 3]]).all(axis=1).any()
    gb = g.copy()
    gb[2, 1], gb[4, 0] = np.nan, np.inf
    for kw in _PATHS[:2]:
        _, gx, gw = _vjp(lambda a, b, kw=kw: qat_dot_general(a, b, DN, **kw), gb, x, w)
        fin = np.isfinite(np.asarray(gx))
        assert fin[[0, 1, 3]].all() and not fin[[2, 4]].any()
        assert np.isfinite(np.asarray(gw)[:, 2:]).all()


@pytest.mark.parametrize("mx,mw", [(1e-36, 1.0), (1e36, 1e-36), (1.0, np.finfo(np.float32).eps),
                                   (1e-30, 1e-6)])
def test_tiny_and_huge_scales_against_exact_products(mx, mw):
    """Scales down to the smallest normal (absmax / 127 below it is raised to it) and up to
    1e34: the int8 forward stays within 3 ulp of the exact product of codes and scales."""
    x, w = _rand(4, 33) * np.float32(mx), _rand(33, 5, seed=1) * np.float32(mw)
    qx, sx = _codes_np(x, (0,))
    qw, sw = _codes_np(w, (1,))
    exact = (qx @ qw) * sx * sw
    assert np.all(np.abs(exact) > 1e-37)  # a float32 normal: no flush to zero in the reference
    y = qat_dot_general(x, w, DN)
    assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= 3 * ULP * np.abs(exact))


def test_contraction_longer_than_int32_sums_allow():
    """K * 127 * 127 > 2**31: the int32 sums are cut; forward and the int8 backward exact."""
    k = 140_000
    x = np.ones((2, k), np.float32)
    x[1] = -1
    y = qat_dot_general(x, np.ones((k, 3), np.float32), DN)
    np.testing.assert_array_equal(y, np.array([[k] * 3, [-k] * 3], np.float32))
    _, gx, _ = _vjp(lambda a, b: qat_dot_general(a, b, DN, backward="int8"),
                    np.ones((2, k), np.float32), np.ones((2, 4), np.float32),
                    np.ones((4, k), np.float32))
    np.testing.assert_array_equal(gx, np.full((2, 4), k, np.float32))


def test_learned_scales_through_a_dot_match_torch_learnable_ops():
    """The chain rule through fake_quant with learned scales / zero points on both operands
    of a dot (clipped elements included) against torch's learnable ops (grad_factor=1)."""
    x, w = _rand(6, 20) * 2, _rand(20, 4, seed=1)
    g = _rand(6, 4, seed=2, outlier=False)
    sx, zx = np.float32(0.011), np.float32(3.0)
    sw = np.array([0.004, 0.01, 0.02, 0.008], np.float32)
    zw = np.array([0.0, 2.0, -1.0, 5.0], np.float32)
    assert np.any(np.rint(x / sx) + zx > 127) and np.any(np.abs(np.rint(w / sw) + zw) > 127)
    y, *grads = _vjp(lambda x, w, sx, zx, sw, zw: jq.fake_quant(x, sx, zx)
                     @ jq.fake_quant(w, sw, zw, axis=1), g, x, w, sx, zx, sw, zw)
    t = [torch.tensor(np.atleast_1d(v), requires_grad=True) for v in (x, w, sx, zx, sw, zw)]
    yt = (torch._fake_quantize_learnable_per_tensor_affine(t[0], t[2], t[3], -128, 127, 1.0)
          @ torch._fake_quantize_learnable_per_channel_affine(t[1], t[4], t[5], 1, -128, 127,
                                                              1.0))
    yt.backward(torch.tensor(g))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, t, strict=True):
        ref = ref.grad.numpy().reshape(np.shape(got))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(ref).max()))


def _decode(qt):
    """float64 values of a blocked QTensor from its stored codes and scales (ml_dtypes casts),
    a two-level scale as its float8 codes times its float32 tensor scale."""
    codes, s = np.asarray(qt.qvalue).astype(np.float64), qt.scale
    if jq.is_qtensor(s):
        s = np.asarray(s.qvalue).astype(np.float64) * np.float64(np.asarray(s.scale))
    s = np.asarray(s).astype(np.float64)
    return codes * np.repeat(s, qt.block_size, axis=-1)[..., :codes.shape[-1]]


@pytest.mark.parametrize("scheme", ["mxfp8_e4m3", "mxfp4", "nvfp4"])
def test_scaled_matmul_against_numpy_block_scaled_product(scheme):
    """Both ranks, a partial last block (K = 50), bfloat16 output: the float64 product of the
    decoded operands, to float32 rounding of the sums."""
    rng = np.random.default_rng(0)
    for shape_a, shape_b in [((3, 64), (4, 64)), ((2, 3, 50), (2, 5, 50))]:
        a = (rng.standard_normal(shape_a) * 3).astype(np.float32)
        b = rng.standard_normal(shape_b).astype(np.float32)
        qa, qb = jq.quantize(a, dtype=scheme), jq.quantize(b, dtype=scheme)
        ref = np.einsum("...mk,...nk->...mn", _decode(qa), _decode(qb))
        y = jq.scaled_matmul(qa, qb)
        assert y.dtype == jnp.float32 and y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
        y16 = jq.scaled_matmul(qa, qb, preferred_element_type=jnp.bfloat16)
        assert y16.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y16, np.float32), ref, rtol=1e-2, atol=1e-2)


def _mx(*shape, scheme="mxfp4"):
    return jq.quantize(np.ones(shape, np.float32), dtype=scheme)


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((np.ones((3, 64)), _mx(4, 64)), {}, TypeError, "lhs must be a jaxquant.QTensor, got ndarray"),
    ((_mx(64), _mx(4, 64)), {}, ValueError, "lhs must be of rank 2 or 3 and blocked"),
    ((_mx(3, 64), jq.quantize(np.ones((4, 64), np.float32), axis=0)), {}, ValueError,
     "rhs must be of rank 2 or 3 and blocked along its last"),
    ((_mx(3, 32), _mx(4, 64)), {}, ValueError, r"got shapes \(3, 32\) and \(4, 64\)"),
    ((_mx(2, 3, 64), _mx(3, 4, 64)), {}, ValueError, r"\(2, 3, 64\) and \(3, 4, 64\)"),
    ((_mx(3, 64, scheme="nvfp4"), _mx(4, 64)), {}, ValueError,
     "share one block size, got 16 and 32"),
    ((jq.quantize(np.ones((3, 64), np.float32), dtype=jnp.uint8, axis=1, block_size=32,
                  symmetric=False), _mx(4, 64)), {}, ValueError, "without a zero point"),
    ((_mx(3, 64), _mx(4, 64)), {"preferred_element_type": jnp.int32}, ValueError,
     "preferred_element_type must be a float dtype, got int32"),
    ((_mx(3, 64), _mx(4, 64)), {"preferred_element_type": None}, TypeError,
     "preferred_element_type must be a float dtype, got None"),
    ((_mx(3, 64), _mx(4, 64)), {"implementation": "triton"}, ValueError,
     "implementation must be None, 'cudnn' or 'xla', got 'triton'"),
    ((_mx(3, 50, scheme="mxfp8_e4m3"), _mx(4, 50, scheme="mxfp8_e4m3")),
     {"implementation": "cudnn"}, ValueError, "implementation='cudnn' needs a GPU"),
])
def test_scaled_matmul_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jq.scaled_matmul(*args, **kwargs)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(act="x"), TypeError, r"^act\b"),
    (dict(backward="bogus"), ValueError, r"backward must be 'float' or 'int8', got 'bogus'"),
    (dict(fake=1), TypeError, r"fake"),
    (dict(weight="int8"), TypeError, r"weight must be a jaxquant.QuantSpec, got str"),
])
def test_qat_dot_general_module_checks_its_options_when_built(kw, exc, match):
    # before: accepted, and the first call failed (inside a Flax model's apply)
    with pytest.raises(exc, match=match):
        jq.QATDotGeneral(**kw)
