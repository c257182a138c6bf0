"""jaxquant against PyTorch's quantization ops (an implementation nobody on the project wrote).

Covered:
* ``torch.quantize_per_tensor`` / ``quantize_per_channel`` / ``int_repr`` /
  ``dequantize`` against `jq.quantize` codes and `jq.dequantize` values;
* ``torch.fake_quantize_per_{tensor,channel}_affine`` values and STE gradients
  against `jq.fake_quant` and ``jax.grad``;
* LSQ / LSQ+ (``torch._fake_quantize_learnable_per_{tensor,channel}_affine``,
  ``grad_factor=1``): values and gradients w.r.t. x, scale and zero point;
  jaxquant's ``lsq_grad_scale`` factor;
* blocked fake_quant gradients (no PyTorch counterpart) against a float64
  NumPy reference written from the formula in the docstring of
  ``jaxquant/_fake_quant.py``.

PyTorch computes ``x * (1 / scale)`` (two roundings) where ONNX and jaxquant use
the correctly rounded quotient ``x / scale``, and ``torch.quantize_per_*`` adds
the zero point before rounding (``rint(x * inv_scale + zero_point)``) where
ONNX rounds first. The codes can therefore differ only where ``x / scale`` lies
within a couple of ulps of a half-integer, and by one code; the quantize tests
allow exactly that, and the fake-quant tests keep their inputs away from ties.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

torch = pytest.importorskip("torch")

# PyTorch 2.13 deprecates the quantized dtypes (quint8/qint8/qint32) and warns on
# every quantized tensor it creates; only that warning is silenced.
_QUANTIZED_DEPRECATION = pytest.mark.filterwarnings(
    "ignore:torch.quantize_per_tensor, torch.quantize_per_channel and other quantized "
    "tensor creation functions:UserWarning"
)

# (torch quantized dtype, jaxquant format, code range, zero-point range used in the tests)
# qint32 quotients stay below 2**17 (and zero points small): PyTorch's int32 path works
# in float32, and far above that a float32 quotient has too few fraction bits for
# "near a tie" to mean anything (at 2**20 an ulp is 1/8 of a code).
QTYPES = [
    pytest.param(torch.quint8, jnp.uint8, (0, 255), (0, 255), id="quint8"),
    pytest.param(torch.qint8, jnp.int8, (-128, 127), (-128, 127), id="qint8"),
    pytest.param(torch.qint32, jnp.int32, (-(2**31), 2**31 - 1), (-1000, 1000), id="qint32"),
]

# Formats for fake_quant: (jaxquant format, quant_min, quant_max).
FQ_FORMATS = [
    pytest.param(jnp.int8, -128, 127, id="int8"),
    pytest.param(jnp.uint8, 0, 255, id="uint8"),
    pytest.param(jnp.int4, -8, 7, id="int4"),
    pytest.param(jnp.uint4, 0, 15, id="uint4"),
]


# ---------------------------------------------------------------------------------------------
# helpers


def _random_shape(rng, ndim, max_size=6000, min_size=8):
    """A random shape of rank ``ndim`` (sizes from 1) with min_size..max_size elements.

    At least 8 elements: the fake-quant inputs put the range edges in the first 8.
    """
    while True:
        shape = tuple(int(d) for d in rng.integers(1, 24, ndim))
        if min_size <= math.prod(shape) <= max_size:
            return shape


def _bcast(v, ndim, axis):
    """A per-channel vector reshaped to line up with ``axis`` of a rank-``ndim`` array."""
    shape = [1] * ndim
    shape[axis] = -1
    return np.reshape(v, shape)


def _near_tie(x, s, tol=1e-3):
    """Where the exact quotient x / s lies within ``tol`` of a half-integer k + 0.5."""
    q = x.astype(np.float64) / s.astype(np.float64)
    return np.abs(q - np.floor(q) - 0.5) < tol


def _away_from_ties(rng, x, s, tol=1e-3):
    """Moves every element of ``x`` whose quotient by ``s`` is within ``tol`` of a tie.

    PyTorch multiplies by ``1 / scale``; near ties that rounding may pick the other
    code than the correctly rounded division, so fake-quant comparisons avoid them.
    """
    x = np.array(x, dtype=np.float32)
    s = np.broadcast_to(s, x.shape).astype(np.float32)
    for _ in range(100):
        bad = _near_tie(x, s, tol)
        if not bad.any():
            return x
        shift = rng.uniform(0.05, 0.4, bad.sum()) * rng.choice([-1.0, 1.0], bad.sum())
        x[bad] = (x[bad].astype(np.float64) + shift * s[bad]).astype(np.float32)
    raise AssertionError("could not move the inputs away from ties")


def _assert_codes_match_torch(x, s_full, z_full, torch_codes, jq_codes):
    """Codes equal, except a one-code difference at near-ties of x / scale.

    jaxquant (as ONNX) computes ``rint(x / scale) + zero_point`` from the
    correctly rounded quotient (within 0.5 ulp of the exact one). PyTorch
    computes ``rint(zero_point + x * fl(1 / scale))`` in float32: the product is
    within ~1.5 ulps of the exact quotient, the sum with the zero point adds half
    an ulp of the sum, and adding the zero point before rounding sends exact ties
    to the even *code* rather than to the even quotient. The two can therefore
    disagree only where the exact quotient lies within ~2 float32 ulps (of the
    larger of the quotient and the code) of a half-integer, and then by one code.
    Anywhere else a difference is a bug.
    """
    tc = np.asarray(torch_codes).astype(np.int64)
    jc = np.asarray(jq_codes).astype(np.int64)
    assert tc.shape == jc.shape
    mismatch = tc != jc
    if not mismatch.any():
        return
    assert np.abs(tc - jc).max() <= 1, "codes differ by more than one"
    q = x[mismatch].astype(np.float64) / s_full[mismatch].astype(np.float64)
    half = np.floor(q) + 0.5
    mag = np.maximum(np.abs(half), np.abs(half + z_full[mismatch]))
    ulp = np.spacing(mag.astype(np.float32)).astype(np.float64)
    dist = np.abs(q - half)
    far = dist > 2 * ulp
    assert not far.any(), (
        f"codes differ away from ties: x={x[mismatch][far][:5]}, "
        f"x/scale={q[far][:5]}, torch={tc[mismatch][far][:5]}, jaxquant={jc[mismatch][far][:5]}"
    )


def _value_and_vjp(f, g, *args):
    """``f(*args)`` and its vector-Jacobian product with ``g`` (``jax.grad`` of
    ``vdot(f(*args), g)``), traced and compiled as one program."""

    def run(g, *args):
        y, vjp = jax.vjp(f, *args)
        return y, vjp(g)

    return jax.jit(run)(g, *args)


def _assert_close(actual, desired, rtol, atol):
    """|actual - desired| <= atol + rtol * |desired| elementwise (atol may be an array)."""
    actual = np.asarray(actual, np.float64)
    desired = np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, (actual.shape, desired.shape)
    err = np.abs(actual - desired)
    bound = np.broadcast_to(atol + rtol * np.abs(desired), err.shape)
    bad = err > bound
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} differ: actual={actual[bad][:5]}, "
        f"desired={desired[bad][:5]}, allowed={bound[bad][:5]}"
    )


def _quantize_inputs(rng, shape, s_full, qtype_range):
    """float32 inputs spread over the code range (and beyond it for 8-bit formats)."""
    qmin, qmax = qtype_range
    if qmax - qmin < 2**16:
        t = rng.uniform(qmin - 300, qmax + 300, shape)  # codes, clipping included
    else:
        t = rng.uniform(-70_000, 70_000, shape)  # |x / scale| < 2**17
    x = (t * s_full).astype(np.float32)
    # a few exact zeros
    flat = x.reshape(-1)
    flat[:: max(1, flat.size // 7)] = 0.0
    return x


# ---------------------------------------------------------------------------------------------
# 1. quantize / dequantize against torch.quantize_per_tensor / quantize_per_channel


@_QUANTIZED_DEPRECATION
@pytest.mark.parametrize("tdtype, jdtype, qrange, zrange", QTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_quantize_per_tensor_matches_torch(tdtype, jdtype, qrange, zrange, seed):
    rng = np.random.default_rng(1000 + seed)
    shape = _random_shape(rng, int(rng.integers(1, 5)))
    s = np.float32(rng.uniform(0.001, 2.0))
    z = int(rng.integers(zrange[0], zrange[1] + 1))
    x = _quantize_inputs(rng, shape, np.float32(s), qrange)

    tq = torch.quantize_per_tensor(torch.from_numpy(x), float(s), z, tdtype)
    qt = jq.quantize(x, jnp.float32(s), jnp.asarray(z, jdtype), dtype=jdtype)
    assert qt.qvalue.dtype == jdtype and qt.shape == shape
    _assert_codes_match_torch(x, np.full(shape, s, np.float32), np.full(shape, z),
                              tq.int_repr().numpy(), qt.qvalue)

    # dequantize: the same codes give bit-identical floats
    tcodes = tq.int_repr().numpy()
    qt_t = jq.QTensor(jnp.asarray(tcodes), jnp.float32(s), jnp.asarray(z, jdtype))
    np.testing.assert_array_equal(np.asarray(jq.dequantize(qt_t)), torch.dequantize(tq).numpy())
    # and where the codes agree, jaxquant's round trip equals torch's
    same = np.asarray(qt.qvalue).astype(np.int64) == tcodes.astype(np.int64)
    np.testing.assert_array_equal(
        np.asarray(jq.dequantize(qt))[same], torch.dequantize(tq).numpy()[same]
    )


@_QUANTIZED_DEPRECATION
@pytest.mark.parametrize("tdtype, jdtype, qrange, zrange", QTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_quantize_per_channel_matches_torch(tdtype, jdtype, qrange, zrange, seed):
    rng = np.random.default_rng(2000 + seed)
    ndim = int(rng.integers(1, 5))
    shape = _random_shape(rng, ndim)
    axis = int(rng.integers(-ndim, ndim))  # negative axes too (torch needs axis % ndim)
    n = shape[axis]
    s = rng.uniform(0.001, 2.0, n).astype(np.float32)
    z = rng.integers(zrange[0], zrange[1] + 1, n)
    s_full = np.broadcast_to(_bcast(s, ndim, axis), shape)
    x = _quantize_inputs(rng, shape, s_full, qrange)

    tq = torch.quantize_per_channel(
        torch.from_numpy(x), torch.from_numpy(s.astype(np.float64)), torch.from_numpy(z),
        axis % ndim, tdtype,
    )
    qt = jq.quantize(x, jnp.asarray(s), jnp.asarray(z.astype(jdtype)), dtype=jdtype, axis=axis)
    assert qt.qvalue.dtype == jdtype and qt.shape == shape
    tcodes = tq.int_repr().numpy()
    _assert_codes_match_torch(x, s_full, np.broadcast_to(_bcast(z, ndim, axis), shape), tcodes,
                              qt.qvalue)

    qt_t = jq.QTensor(jnp.asarray(tcodes), jnp.asarray(s), jnp.asarray(z.astype(jdtype)), axis=axis)
    np.testing.assert_array_equal(np.asarray(jq.dequantize(qt_t)), torch.dequantize(tq).numpy())


@_QUANTIZED_DEPRECATION
@pytest.mark.parametrize("tdtype, jdtype, qrange, zrange", QTYPES)
@pytest.mark.parametrize("z", [0, 6, 7])
def test_quantize_exact_ties_match_torch(tdtype, jdtype, qrange, zrange, z):
    # With a power-of-two scale both x / s and x * (1 / s) are exact, so the only
    # difference left at exact ties k + 0.5 is where the zero point is added:
    # ONNX/jaxquant round the quotient half to even, then add the zero point;
    # PyTorch adds the zero point, then rounds. With an even zero point the two
    # agree exactly; with an odd one PyTorch lands one code off at every tie.
    k = np.arange(-300, 300, dtype=np.float64)
    s = np.float32(2.0**-3)
    x = ((k + 0.5) * s).astype(np.float32)
    tq = torch.quantize_per_tensor(torch.from_numpy(x), float(s), z, tdtype)
    qt = jq.quantize(x, jnp.float32(s), jnp.asarray(z, jdtype), dtype=jdtype)
    jc = np.asarray(qt.qvalue).astype(np.int64)
    tc = tq.int_repr().numpy().astype(np.int64)
    expected = np.clip(np.round(k + 0.5) + z, *qrange)  # np.round: half to even
    np.testing.assert_array_equal(jc, expected.astype(np.int64))
    if z % 2 == 0:
        np.testing.assert_array_equal(jc, tc)
    else:
        assert np.abs(jc - tc).max() <= 1
        _assert_codes_match_torch(x, np.full(x.shape, s), np.full(x.shape, z), tc, jc)


@_QUANTIZED_DEPRECATION
def test_dequantize_int32_large_codes_vs_torch():
    # Beyond 2**24 int32 codes are not all float32 numbers, and the two references
    # part ways: torch.dequantize subtracts the zero point in integers and converts
    # once, float32(q - zp) * scale, while the ONNX reference (whose formula the
    # contract cites) converts the codes first, float32(q) - zp (in float64: NumPy's
    # float32 - int32), times the scale, rounded once to float32. jaxquant computes
    # (float32(q) - float32(zp)) * scale in float32, the same wherever the zero point
    # is a float32 number (|zp| <= 2**24, as here): (2**24 + 1) - 1 is 2**24 in torch
    # and 2**24 - 1 in ONNX/jaxquant.
    # Both must agree wherever the codes are exact in float32, and never be more
    # than two float32 ulps of the code (times the scale) apart.
    # (no -2**31: torch computes q - zp in int32 and wraps around there)
    q = np.array([2**24 + 1, 2**24 + 3, -(2**24) - 1, 2**30 + 1, 2**31 - 1, -(2**31) + 1,
                  2**24, 2**24 - 1, -(2**24), 5, 0], dtype=np.int32)
    z = np.int32(1)
    s = np.float32(0.75)
    tq = torch._make_per_tensor_quantized_tensor(torch.from_numpy(q), float(s), int(z))
    qt = jq.QTensor(jnp.asarray(q), jnp.float32(s), jnp.int32(z))
    got = np.asarray(jq.dequantize(qt))
    with np.errstate(over="ignore"):
        onnx_formula = (q.astype(np.float32) - np.float32(z)) * s
    np.testing.assert_array_equal(got, onnx_formula)
    ref = torch.dequantize(tq).numpy()
    exact = np.abs(q.astype(np.int64)) <= 2**24
    np.testing.assert_array_equal(got[exact], ref[exact])
    ulp = np.spacing(np.abs(q).astype(np.float32)).astype(np.float64) * np.float64(s)
    assert np.all(np.abs(got.astype(np.float64) - ref) <= 2 * ulp)


# ---------------------------------------------------------------------------------------------
# 2. fake_quantize_per_{tensor,channel}_affine: values and STE gradients


def _fake_quant_inputs(rng, shape, s_full, z_full, qmin, qmax):
    """Inputs in code units spread over [qmin - 20, qmax + 20], plus the exact edges."""
    t = rng.uniform(qmin - 20, qmax + 20, shape) - z_full
    x = (t * s_full).astype(np.float32)
    x = _away_from_ties(rng, x, s_full)
    flat = x.reshape(-1)  # a view: x is contiguous
    sf = np.broadcast_to(s_full, shape).reshape(-1)
    zf = np.broadcast_to(z_full, shape).reshape(-1)
    # exact range edges (inside: gradient 1), one code beyond them (outside: 0),
    # and codes that round onto / past the edges
    codes = [qmin, qmax, qmin - 1, qmax + 1, qmin + 0.3, qmax + 0.7, qmin - 0.7, qmax - 0.3]
    for i, code in enumerate(codes[: flat.size]):
        flat[i] = np.float32((code - zf[i]) * np.float64(sf[i]))
    return x


def _ste_mask(x, s_full, z_full, qmin, qmax):
    q = np.round(x.astype(np.float64) / s_full) + z_full
    return (q >= qmin) & (q <= qmax)


@pytest.mark.parametrize("jdtype, qmin, qmax", FQ_FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_fake_quantize_per_tensor_matches_torch(jdtype, qmin, qmax, seed):
    rng = np.random.default_rng(3000 + seed)
    shape = _random_shape(rng, int(rng.integers(1, 4)), max_size=3000)
    s = np.float32(rng.uniform(0.005, 0.5))
    z = int(rng.integers(qmin, qmax + 1))
    x = _fake_quant_inputs(rng, shape, s, z, qmin, qmax)
    g = rng.standard_normal(shape).astype(np.float32)

    xt = torch.tensor(x, requires_grad=True)
    yt = torch.fake_quantize_per_tensor_affine(xt, float(s), z, qmin, qmax)
    yt.backward(torch.from_numpy(g))

    def f(x):
        return jq.fake_quant(x, jnp.float32(s), jnp.asarray(z, jdtype), dtype=jdtype)

    y, (gx,) = _value_and_vjp(f, jnp.asarray(g), jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy())
    np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy())
    # the clip range is really exercised: both 0 and 1 in the mask, edges inside
    mask = _ste_mask(x, np.float64(s), z, qmin, qmax)
    assert mask.any() and (~mask).any()
    np.testing.assert_array_equal(np.asarray(gx), np.where(mask, g, 0.0))
    if x.size >= 4:
        assert mask.reshape(-1)[:2].all() and not mask.reshape(-1)[2:4].any()


@pytest.mark.parametrize("jdtype, qmin, qmax", FQ_FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_fake_quantize_per_channel_matches_torch(jdtype, qmin, qmax, seed):
    rng = np.random.default_rng(4000 + seed)
    ndim = int(rng.integers(1, 5))
    shape = _random_shape(rng, ndim, max_size=3000)
    axis = int(rng.integers(-ndim, ndim))
    n = shape[axis]
    s = rng.uniform(0.005, 0.5, n).astype(np.float32)
    z = rng.integers(qmin, qmax + 1, n)
    s_full = np.broadcast_to(_bcast(s, ndim, axis), shape)
    z_full = np.broadcast_to(_bcast(z, ndim, axis), shape)
    x = _fake_quant_inputs(rng, shape, s_full, z_full, qmin, qmax)
    g = rng.standard_normal(shape).astype(np.float32)

    xt = torch.tensor(x, requires_grad=True)
    yt = torch.fake_quantize_per_channel_affine(
        xt, torch.from_numpy(s), torch.from_numpy(z.astype(np.int32)), axis % ndim, qmin, qmax
    )
    yt.backward(torch.from_numpy(g))

    def f(x):
        return jq.fake_quant(x, jnp.asarray(s), jnp.asarray(z.astype(jdtype)), dtype=jdtype,
                             axis=axis)

    y, (gx,) = _value_and_vjp(f, jnp.asarray(g), jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy())
    np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy())
    mask = _ste_mask(x, s_full.astype(np.float64), z_full, qmin, qmax)
    np.testing.assert_array_equal(np.asarray(gx), np.where(mask, g, 0.0))


# ---------------------------------------------------------------------------------------------
# 3. LSQ / LSQ+: torch._fake_quantize_learnable_per_{tensor,channel}_affine, grad_factor=1


def _learnable_zero_points(rng, n, qmin, qmax):
    """Float zero points across and beyond ``[qmin, qmax]``: integer-valued, exact ties
    ``k + 0.5`` and others, negative ones included.

    PyTorch rounds the zero point half-to-even in the forward pass; its per-tensor backward
    pass reads it as ``(int64)(clamp(zero_point + 0.5))`` (truncation toward zero: -2.7 is
    -2, 2.5 is 3), its per-channel backward as the forward does. jaxquant follows both.
    """
    lo, hi = qmin, max(qmax, 1)
    z = rng.uniform(lo - 3.0, hi + 3.0, n)  # a few beyond the range: clamped in both
    kind = rng.random(n)
    z = np.where(kind < 0.3, np.round(z), np.where(kind < 0.5, np.floor(z) + 0.5, z))
    z[: min(2, n)] = [0.0, float(hi)][: min(2, n)]  # integer-valued, at the range ends
    return z.astype(np.float32)


def _group_tol(g, zr_full, qmin, qmax, axis_keep=None):
    """Absolute tolerance for the per-scale gradient sums.

    Each in-range term ``(fq - x) / s`` carries a float32 rounding error of a few
    ulps of ``|q - z|`` (<= max(|qmin - z|, |qmax - z|)); the sums then add their
    own. 1e-6 * sum(|g| * (that bound + 1)) covers both with margin, yet a single
    misclassified element (an error of order |g| >= 0.5) exceeds it.
    """
    bound = np.abs(g) * (np.maximum(np.abs(qmin - zr_full), np.abs(qmax - zr_full)) + 1.0)
    if axis_keep is None:
        return 1e-6 * bound.sum()
    other = tuple(i for i in range(g.ndim) if i != axis_keep)
    return 1e-6 * bound.sum(axis=other)


def _upstream(rng, shape):
    """Upstream gradients of magnitude in [0.5, 1.5] with random signs."""
    return (rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


@pytest.mark.parametrize("jdtype, qmin, qmax", FQ_FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_lsq_per_tensor_matches_torch(jdtype, qmin, qmax, seed):
    rng = np.random.default_rng(5000 + seed)
    shape = _random_shape(rng, int(rng.integers(1, 4)), max_size=3000)
    s = np.float32(rng.uniform(0.005, 0.5))
    z = _learnable_zero_points(rng, 1, qmin, qmax)[0] if seed else np.float32(0.0)
    zr = float(np.clip(np.round(z), qmin, qmax))
    x = _fake_quant_inputs(rng, shape, s, zr, qmin, qmax)
    g = _upstream(rng, shape)

    xt = torch.tensor(x, requires_grad=True)
    st = torch.tensor([s], requires_grad=True)
    zt = torch.tensor([z], requires_grad=True)
    yt = torch._fake_quantize_learnable_per_tensor_affine(xt, st, zt, qmin, qmax, grad_factor=1.0)
    yt.backward(torch.from_numpy(g))

    scale_shape = (1,) if seed % 2 else ()  # both one-element layouts

    def f(x, s, z):
        return jq.fake_quant(x, s, z, dtype=jdtype)

    y, (gx, gs, gz) = _value_and_vjp(f, jnp.asarray(g), jnp.asarray(x),
                                     jnp.full(scale_shape, s, jnp.float32),
                                     jnp.full(scale_shape, z, jnp.float32))
    assert gs.shape == scale_shape and gz.shape == scale_shape
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy())
    np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy())
    tol = _group_tol(g.astype(np.float64), zr, qmin, qmax)
    _assert_close(np.asarray(gs).reshape(1), st.grad.numpy(), rtol=1e-5, atol=tol)
    _assert_close(np.asarray(gz).reshape(1), zt.grad.numpy(), rtol=1e-5,
                  atol=1e-6 * float(s) * np.abs(g).sum())
    # the scale gradient is not trivially zero, and the clip range is exercised
    assert abs(float(st.grad[0])) > 0 and abs(float(zt.grad[0])) > 0


@pytest.mark.parametrize("jdtype, qmin, qmax", FQ_FORMATS)
@pytest.mark.parametrize("z", [-3.0, -2.6, -1.0, -0.5, 0.5, 2.5, 2.6, 3.0, 300.0, -300.0])
def test_lsq_per_tensor_zero_points_negative_ties_and_clamped_match_torch(jdtype, qmin, qmax, z):
    """PyTorch's per-tensor backward reads z as int(clamp(z + 0.5)), its forward as nearbyint:
    -1.0 is 0 in the backward pass, 2.5 is 3 (the random zero points above were all 0)."""
    rng = np.random.default_rng(int(abs(z) * 10) + qmax)
    s = np.float32(0.05)
    x = (rng.normal(size=1500) * 0.05 * (qmax - qmin) / 2).astype(np.float32)
    g = _upstream(rng, x.shape)
    xt, st = torch.tensor(x, requires_grad=True), torch.tensor([s], requires_grad=True)
    zt = torch.tensor([z], requires_grad=True)
    yt = torch._fake_quantize_learnable_per_tensor_affine(xt, st, zt, qmin, qmax, grad_factor=1.0)
    yt.backward(torch.from_numpy(g))
    y, (gx, gs, gz) = _value_and_vjp(lambda x, s, z: jq.fake_quant(x, s, z, dtype=jdtype),
                                     jnp.asarray(g), jnp.asarray(x), jnp.float32(s),
                                     jnp.float32(z))
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy())
    np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy())
    zb = float(np.trunc(np.clip(z + 0.5, qmin, qmax)))
    _assert_close(np.asarray(gs).reshape(1), st.grad.numpy(), rtol=1e-5,
                  atol=_group_tol(g.astype(np.float64), zb, qmin, qmax))
    _assert_close(np.asarray(gz).reshape(1), zt.grad.numpy(), rtol=1e-5,
                  atol=1e-6 * float(s) * np.abs(g).sum())


@pytest.mark.parametrize("jdtype, qmin, qmax", FQ_FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_lsq_per_channel_matches_torch(jdtype, qmin, qmax, seed):
    rng = np.random.default_rng(6000 + seed)
    # rank >= 2: for a 1-D input PyTorch's backward returns a 0-d scale gradient and
    # autograd rejects it ("returned an invalid gradient at index 1")
    ndim = int(rng.integers(2, 5))
    shape = _random_shape(rng, ndim, max_size=3000)
    axis = int(rng.integers(-ndim, ndim))
    n = shape[axis]
    s = rng.uniform(0.005, 0.5, n).astype(np.float32)
    z = _learnable_zero_points(rng, n, qmin, qmax)
    zr = np.clip(np.round(z), qmin, qmax)
    s_full = np.broadcast_to(_bcast(s, ndim, axis), shape)
    zr_full = np.broadcast_to(_bcast(zr, ndim, axis), shape)
    x = _fake_quant_inputs(rng, shape, s_full, zr_full, qmin, qmax)
    g = _upstream(rng, shape)

    xt = torch.tensor(x, requires_grad=True)
    st = torch.tensor(s, requires_grad=True)
    zt = torch.tensor(z, requires_grad=True)
    yt = torch._fake_quantize_learnable_per_channel_affine(
        xt, st, zt, axis % ndim, qmin, qmax, grad_factor=1.0
    )
    yt.backward(torch.from_numpy(g))

    def f(x, s, z):
        return jq.fake_quant(x, s, z, dtype=jdtype, axis=axis)

    y, (gx, gs, gz) = _value_and_vjp(f, jnp.asarray(g), jnp.asarray(x), jnp.asarray(s),
                                     jnp.asarray(z))
    assert gs.shape == (n,) and gz.shape == (n,)
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy())
    np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy())
    a = axis % ndim
    tol = _group_tol(g.astype(np.float64), zr_full, qmin, qmax, axis_keep=a)
    _assert_close(np.asarray(gs), st.grad.numpy(), rtol=1e-5, atol=tol)
    other = tuple(i for i in range(ndim) if i != a)
    ztol = 1e-6 * s.astype(np.float64) * np.abs(g).sum(axis=other)
    _assert_close(np.asarray(gz), zt.grad.numpy(), rtol=1e-5, atol=ztol)


# granularities for the lsq_grad_scale test: (shape, axis, block_size, scale shape)
_GS_CASES = [
    pytest.param((13, 11), None, None, (), id="tensor"),
    pytest.param((6, 10, 7), 1, None, (10,), id="axis"),
    pytest.param((6, 10, 7), -3, None, (6,), id="neg-axis"),
    pytest.param((5, 24), 1, 8, (5, 3), id="block-full"),
]


def _lsq_grads(x, s, z, g, jdtype, axis, block_size, lsq_grad_scale):
    def f(x, s, z):
        return jq.fake_quant(x, s, z, dtype=jdtype, axis=axis, block_size=block_size,
                             lsq_grad_scale=lsq_grad_scale)

    return _value_and_vjp(f, g, x, s, z)[1]


def _lsq_grad_scale_case(shape, axis, block_size, scale_shape, jdtype, qmin, qmax):
    rng = np.random.default_rng(7000)
    x = rng.uniform(-2.5, 2.5, shape).astype(np.float32)  # codes up to ~ +-300: clipping in every group
    s = jnp.asarray(rng.uniform(0.008, 0.012, scale_shape).astype(np.float32))
    z = jnp.asarray(np.full(scale_shape, 3.2, np.float32))
    g = jnp.asarray(_upstream(rng, shape))
    x = jnp.asarray(x)
    gx0, gs0, gz0 = _lsq_grads(x, s, z, g, jdtype, axis, block_size, False)
    gx1, gs1, gz1 = _lsq_grads(x, s, z, g, jdtype, axis, block_size, True)
    return (gx0, gs0, gz0), (gx1, gs1, gz1)


def _elements_per_scale(shape, axis, block_size, scale_shape):
    """N for each scale, counted directly from the layout.

    Per-tensor: every element; per-axis: all elements with that index along
    ``axis``; blocked: the scale has x's rank, so it is shared only by the
    elements of its block along ``axis`` (``block_size``, fewer in a partial
    last block).
    """
    if axis is None:
        return np.full(scale_shape, math.prod(shape), np.float64)
    a = axis % len(shape)
    if block_size is None:
        return np.full(scale_shape, math.prod(shape) // shape[a], np.float64)
    owner = np.arange(shape[a]) // block_size  # scale index of each position along axis
    per_block = np.bincount(owner, minlength=scale_shape[a]).astype(np.float64)
    return np.broadcast_to(_bcast(per_block, len(shape), a), scale_shape).copy()


@pytest.mark.parametrize("jdtype, qmin, qmax", [FQ_FORMATS[0], FQ_FORMATS[1]])
@pytest.mark.parametrize("shape, axis, block_size, scale_shape", _GS_CASES)
def test_lsq_grad_scale_factor(shape, axis, block_size, scale_shape, jdtype, qmin, qmax):
    # LSQ's gradient scale: the scale (and zero-point) gradients are multiplied by
    # 1 / sqrt(N * qmax), N = elements sharing the scale; the x gradient is unchanged.
    (gx0, gs0, gz0), (gx1, gs1, gz1) = _lsq_grad_scale_case(
        shape, axis, block_size, scale_shape, jdtype, qmin, qmax)
    n = _elements_per_scale(shape, axis, block_size, scale_shape)
    factor = 1.0 / np.sqrt(n * qmax)
    np.testing.assert_array_equal(np.asarray(gx1), np.asarray(gx0))
    assert np.all(np.asarray(gs0) != 0) and np.all(np.asarray(gz0) != 0)
    # two programs summing in their own orders (on a GPU, not the same): a few ulps of the
    # largest gradient, where a sum that cancels has no relative precision to compare
    for g1, g0 in ((gs1, gs0), (gz1, gz0)):
        want = np.asarray(g0) * factor
        _assert_close(np.asarray(g1), want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("jdtype, qmin, qmax", [FQ_FORMATS[0]])
def test_lsq_grad_scale_partial_block(jdtype, qmin, qmax):
    # A partial last block: its scale is shared by fewer elements (3 here, not 8),
    # and the module docstring defines N as the number of elements per scale.
    shape, axis, block_size, scale_shape = (5, 19), 1, 8, (5, 3)
    (gx0, gs0, gz0), (gx1, gs1, gz1) = _lsq_grad_scale_case(
        shape, axis, block_size, scale_shape, jdtype, qmin, qmax)
    n = _elements_per_scale(shape, axis, block_size, scale_shape)
    assert n[0].tolist() == [8.0, 8.0, 3.0]
    factor = 1.0 / np.sqrt(n * qmax)
    # two programs summing in their own orders (on a GPU, not the same): a few ulps of the
    # largest gradient, where a sum that cancels has no relative precision to compare
    for g1, g0 in ((gs1, gs0), (gz1, gz0)):
        want = np.asarray(g0) * factor
        _assert_close(np.asarray(g1), want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# 4. blocked fake_quant gradients against an independent float64 NumPy reference


def _blocked_reference(x, s, z, g, axis, bs, qmin, qmax):
    """Value and (dx, dscale, dzero_point) from the formula in _fake_quant's docstring.

    Per element, with ``q = rint(x / s) + round(z)`` unclipped: dx = g inside
    [qmin, qmax] else 0; d/ds = g * (fq - x) / s inside, g * (qmin - z) below,
    g * (qmax - z) above; d/dz = 0 inside, -g * s outside; summed per block.
    """
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    n = x.shape[axis]
    nb = s.shape[axis]
    idx = np.arange(n) // bs  # block index of each position along `axis`
    s_full = np.take(s.astype(np.float64), idx, axis=axis)
    zr = np.clip(np.round(z.astype(np.float64)), qmin, qmax)  # half to even, clamped
    z_full = np.take(zr, idx, axis=axis)
    q = np.round(x64 / s_full) + z_full
    inside = (q >= qmin) & (q <= qmax)
    fq = (np.clip(q, qmin, qmax) - z_full) * s_full
    dx = np.where(inside, g64, 0.0)
    ds_e = g64 * np.where(inside, (fq - x64) / s_full,
                          np.where(q < qmin, qmin - z_full, qmax - z_full))
    dz_e = np.where(inside, 0.0, -g64 * s_full)

    def per_block(v):
        sums = [np.take(v, np.arange(b * bs, min(n, (b + 1) * bs)), axis=axis).sum(axis=axis)
                for b in range(nb)]
        return np.stack(sums, axis=axis)

    return fq, dx, per_block(ds_e), per_block(dz_e), inside


_BLOCK_CASES = [
    pytest.param((6, 37), 1, 8, id="2d-partial"),
    pytest.param((12, 3, 7), 0, 5, id="3d-axis0-partial"),
    pytest.param((4, 5, 32), -1, 4, id="3d-neg-axis-full"),
    pytest.param((3, 50), -1, 50, id="one-block"),
    pytest.param((9, 4), 0, 1, id="block-size-1"),
]


@pytest.mark.parametrize("jdtype, qmin, qmax", [FQ_FORMATS[0], FQ_FORMATS[3]])
@pytest.mark.parametrize("shape, axis, bs", _BLOCK_CASES)
def test_blocked_fake_quant_gradients_match_numpy_reference(shape, axis, bs, jdtype, qmin, qmax):
    rng = np.random.default_rng(8000 + sum(shape) + bs)
    ndim = len(shape)
    a = axis % ndim
    scale_shape = list(shape)
    scale_shape[a] = -(-shape[a] // bs)
    scale_shape = tuple(scale_shape)
    s = rng.uniform(0.01, 0.3, scale_shape).astype(np.float32)
    z = rng.uniform(0.0, qmax + 2.0, scale_shape)
    z = np.where(np.abs(z - np.floor(z) - 0.5) < 0.05, z + 0.2, z).astype(np.float32)
    idx = np.arange(shape[a]) // bs
    s_full = np.take(s, idx, axis=a)
    z_full = np.take(np.clip(np.round(z), qmin, qmax), idx, axis=a)
    x = _fake_quant_inputs(rng, shape, s_full, z_full, qmin, qmax)
    g = _upstream(rng, shape)

    fq, dx, ds, dz, inside = _blocked_reference(x, s, z, g, a, bs, qmin, qmax)
    assert inside.any() and (~inside).any()

    def f(x, s, z):
        return jq.fake_quant(x, s, z, dtype=jdtype, axis=axis, block_size=bs)

    y, (gx, gs, gz) = _value_and_vjp(f, jnp.asarray(g), jnp.asarray(x), jnp.asarray(s),
                                     jnp.asarray(z))
    assert gs.shape == scale_shape and gz.shape == scale_shape
    # (q - z) is a small integer: the float32 value is the correctly rounded product
    np.testing.assert_array_equal(np.asarray(y), fq.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(gx), dx.astype(np.float32))
    bound = np.abs(g.astype(np.float64)) * (np.maximum(abs(qmin - z_full), abs(qmax - z_full)) + 1)
    tol = 1e-6 * np.stack(
        [np.take(bound, np.arange(b * bs, min(shape[a], (b + 1) * bs)), axis=a).sum(axis=a)
         for b in range(scale_shape[a])], axis=a)
    _assert_close(np.asarray(gs), ds, rtol=1e-5, atol=tol)
    _assert_close(np.asarray(gz), dz, rtol=1e-5, atol=1e-6 * np.abs(dz).max() + 1e-7)
