"""`fake_quant` against PyTorch's fake-quantization ops where the other torch tests do not go.

`tests/test_torch_reference.py` compares random inputs kept away from ties, with
scales in ``[0.005, 0.5]``. This file adds:

* exact ties ``k + 0.5`` (power-of-two scales, where ``x / s`` and torch's
  ``x * (1 / s)`` are both exact) with zero points at and next to the ends of
  the range, odd and even: values and STE gradients bit for bit against
  ``torch.fake_quantize_per_{tensor,channel}_affine``, LSQ gradients against
  ``torch._fake_quantize_learnable_per_channel_affine``;
* float16 / bfloat16 inputs (torch computes in float32 and rounds the value
  once to the input dtype, as jaxquant);
* ``jax.vmap`` over per-tensor scales equals per-channel fake quantization;
* LSQ gradients at tiny scales (``2**-126``, the smallest computed scale, up to
  ``2**-110``) and subnormal ones, against torch (normal scales) and a float64
  reference of the formula (subnormal scales: torch's ``1 / scale`` is inf there).

Torch's per-tensor *learnable* op is left out at ties and with negative or
half-integer zero points: its backward pass takes the zero point as
``(int64)(z + 0.5)`` (truncated toward zero) while its forward pass rounds half
to even, so its own gradients disagree with its own forward value there; its
per-channel op rounds consistently and is the reference used.

Scale and zero-point gradients are sums over each group; torch adds them in
another order (and computes ``(fq - x) * (1 / s)`` per element), so those are
compared to float32 rounding of the sums, not bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq

torch = pytest.importorskip("torch")

FORMATS = [
    pytest.param(jnp.int8, -128, 127, id="int8"),
    pytest.param(jnp.uint8, 0, 255, id="uint8"),
    pytest.param(jnp.int4, -8, 7, id="int4"),
    pytest.param(jnp.uint4, 0, 15, id="uint4"),
]


def _edge_zero_points(qmin, qmax):
    return sorted({qmin, qmin + 1, (qmin + qmax) // 2, (qmin + qmax) // 2 + 1, qmax - 1, qmax})


def _vjp(f, g, *args):
    def run(g, *args):
        y, vjp = jax.vjp(f, *args)
        return y, vjp(g)

    return jax.jit(run)(g, *args)


def _tie_inputs(zs, qmin, qmax, s):
    """Rows of x / s on every half-integer and integer from 3 codes below the range to 3 above."""
    rows = [(np.arange(2 * (qmin - z - 3), 2 * (qmax - z + 3) + 1) / 2.0) for z in zs]
    width = max(len(r) for r in rows)
    t = np.stack([np.pad(r, (0, width - len(r)), mode="edge") for r in rows])
    return (t * np.float64(s)).astype(np.float32)


@pytest.mark.parametrize("jdtype, qmin, qmax", FORMATS)
def test_exact_ties_per_tensor_match_torch(jdtype, qmin, qmax):
    # jaxquant rounds x / s half to even, then adds the zero point; so does torch's
    # fake_quantize_per_tensor_affine (z + nearbyint(x * inv_scale)): at exact ties
    # next to qmin / qmax the value and the STE mask must agree bit for bit.
    rng = np.random.default_rng(11)
    s = np.float32(2.0**-3)
    for z in _edge_zero_points(qmin, qmax):
        x = _tie_inputs([z], qmin, qmax, s)[0]
        g = rng.standard_normal(x.shape).astype(np.float32)
        xt = torch.tensor(x, requires_grad=True)
        yt = torch.fake_quantize_per_tensor_affine(xt, float(s), z, qmin, qmax)
        yt.backward(torch.from_numpy(g))
        zj = jnp.asarray(z, jdtype)
        y, (gx,) = _vjp(lambda x, zj=zj: jq.fake_quant(x, jnp.float32(s), zj, dtype=jdtype),
                        jnp.asarray(g), jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy(), err_msg=f"z={z}")
        np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy(), err_msg=f"z={z}")


def _per_channel_ties(zs, qmin, qmax, axis, rng):
    """3-D exact-tie inputs, channels along ``axis``; scales 2**-4 or 2**-3 per channel."""
    s = np.float32(2.0**-4)
    zr = np.clip(np.round(np.asarray(zs, np.float64)), qmin, qmax)
    base = _tie_inputs(zr, qmin, qmax, s)  # (channels, positions)
    x = np.stack([base, base[:, ::-1]], axis=1)  # (channels, 2, positions)
    n = len(zs)
    svec = (s * 2.0 ** rng.integers(0, 2, n)).astype(np.float32)
    x = x * np.reshape(svec / s, (n, 1, 1))  # still exact ties
    x = np.ascontiguousarray(np.moveaxis(x, 0, axis)).astype(np.float32)
    g = (rng.uniform(0.5, 1.5, x.shape) * rng.choice([-1.0, 1.0], x.shape)).astype(np.float32)
    return x, svec, g


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("jdtype, qmin, qmax", FORMATS)
def test_exact_ties_per_channel_match_torch(jdtype, qmin, qmax, axis):
    # torch.fake_quantize_per_channel_affine at exact ties, every zero point near the ends
    # of the range (odd and even): value and STE mask bit for bit.
    rng = np.random.default_rng(12)
    zs = _edge_zero_points(qmin, qmax)
    x, svec, g = _per_channel_ties(zs, qmin, qmax, axis, rng)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.fake_quantize_per_channel_affine(
        xt, torch.from_numpy(svec), torch.tensor(zs, dtype=torch.int32), axis % 3, qmin, qmax)
    yt.backward(torch.from_numpy(g))
    zj = jnp.asarray(np.asarray(zs), jdtype)
    y, (gx,) = _vjp(lambda x: jq.fake_quant(x, jnp.asarray(svec), zj, dtype=jdtype, axis=axis),
                    jnp.asarray(g), jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy())
    np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy())


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("jdtype, qmin, qmax", FORMATS)
def test_exact_ties_per_channel_learnable_match_torch(jdtype, qmin, qmax, axis):
    # Per-channel LSQ+ at exact ties. Torch's learnable backward decides the mask from
    # rint(x / s + z), its forward (and jaxquant, and the contract) from rint(x / s) + z:
    # the two agree at ties only for even (rounded, clamped) zero points, which these are:
    # the even ends of the range, half-integers that round to them, one clamped to qmin.
    rng = np.random.default_rng(17)
    even = [z for z in _edge_zero_points(qmin, qmax) if z % 2 == 0]
    zs = [float(z) for z in even] + [qmin + 0.5, qmax - 1.5, qmin - 2.3]
    x, svec, g = _per_channel_ties(zs, qmin, qmax, axis, rng)
    zf = np.asarray(zs, np.float32)
    xt = torch.tensor(x, requires_grad=True)
    st = torch.tensor(svec, requires_grad=True)
    zt = torch.tensor(zf, requires_grad=True)
    yt = torch._fake_quantize_learnable_per_channel_affine(xt, st, zt, axis % 3, qmin, qmax, 1.0)
    yt.backward(torch.from_numpy(g))
    y, (gx, gs, gz) = _vjp(lambda x, s, z: jq.fake_quant(x, s, z, dtype=jdtype, axis=axis),
                           jnp.asarray(g), jnp.asarray(x), jnp.asarray(svec), jnp.asarray(zf))
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy())
    np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy())
    # sums in another order: to float32 rounding of the sum of magnitudes
    other = tuple(i for i in range(3) if i != axis % 3)
    gabs = np.abs(g.astype(np.float64)).sum(axis=other)
    np.testing.assert_array_less(np.abs(np.asarray(gs) - st.grad.numpy()),
                                 1e-6 * (qmax - qmin) * gabs)
    np.testing.assert_array_less(np.abs(np.asarray(gz) - zt.grad.numpy()), 1e-6 * svec * gabs)


@pytest.mark.parametrize("tdtype, jdtype", [(torch.float16, jnp.float16),
                                            (torch.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_half_precision_inputs_match_torch(tdtype, jdtype, per_channel):
    rng = np.random.default_rng(13)
    x = torch.from_numpy(rng.uniform(-4, 4, (8, 3000)).astype(np.float32)).to(tdtype)
    g = torch.from_numpy(rng.standard_normal((8, 3000)).astype(np.float32)).to(tdtype)
    s = rng.uniform(0.01, 0.03, 8).astype(np.float32)
    z = rng.integers(-20, 20, 8)
    xt = x.clone().requires_grad_(True)
    if per_channel:
        yt = torch.fake_quantize_per_channel_affine(xt, torch.from_numpy(s),
                                                    torch.from_numpy(z.astype(np.int32)), 0,
                                                    -128, 127)
        sj, zj, axis = jnp.asarray(s), jnp.asarray(z, jnp.int8), 0
    else:
        yt = torch.fake_quantize_per_tensor_affine(xt, float(s[0]), int(z[0]), -128, 127)
        sj, zj, axis = jnp.float32(s[0]), jnp.int8(z[0]), None
    yt.backward(g)
    xj = jnp.asarray(x.float().numpy()).astype(jdtype)
    gj = jnp.asarray(g.float().numpy()).astype(jdtype)
    y, (gx,) = _vjp(lambda x: jq.fake_quant(x, sj, zj, axis=axis), gj, xj)
    assert y.dtype == jdtype and gx.dtype == jdtype and yt.dtype == tdtype
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), yt.detach().float().numpy())
    np.testing.assert_array_equal(np.asarray(gx.astype(jnp.float32)), xt.grad.float().numpy())


def test_vmap_over_per_tensor_scales_is_torch_per_tensor_on_each_slice():
    # vmap of per-tensor LSQ over a batch of scales and zero points (in and out axis 1 of a
    # 4-D input) equals torch's per-tensor op on each slice. (Its per-channel op reads the
    # zero point otherwise in the backward pass: nearbyint(z), not int(z + 0.5); negative
    # zero points tell the two apart.)
    rng = np.random.default_rng(14)
    shape = (3, 6, 5, 7)
    s = rng.uniform(0.02, 0.05, 6).astype(np.float32)
    z = rng.uniform(-3.4, 3.4, 6).astype(np.float32)
    x = rng.uniform(-5, 5, shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    want_y, want_gx = np.empty(shape, np.float32), np.empty(shape, np.float32)
    want_gs, want_gz = np.empty(6, np.float32), np.empty(6, np.float32)
    for c in range(6):
        xt = torch.tensor(x[:, c], requires_grad=True)
        st, zt = (torch.tensor([v[c]], requires_grad=True) for v in (s, z))
        yt = torch._fake_quantize_learnable_per_tensor_affine(xt, st, zt, -128, 127, 1.0)
        yt.backward(torch.from_numpy(g[:, c]))
        want_y[:, c], want_gx[:, c] = yt.detach().numpy(), xt.grad.numpy()
        want_gs[c], want_gz[c] = st.grad.item(), zt.grad.item()

    def per_tensor(x, s, z):
        return jq.fake_quant(x, s, z)

    f = jax.vmap(per_tensor, in_axes=(1, 0, 0), out_axes=1)
    y, (gx, gs, gz) = _vjp(f, jnp.asarray(g), jnp.asarray(x), jnp.asarray(s), jnp.asarray(z))
    np.testing.assert_array_equal(np.asarray(y), want_y)
    np.testing.assert_array_equal(np.asarray(gx), want_gx)
    np.testing.assert_allclose(np.asarray(gs), want_gs, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(gz), want_gz, rtol=1e-5, atol=1e-6)
    assert (z < -0.5).any()  # where the two torch ops differ


def _lsq_reference(x, s, z, g, qmin, qmax):
    """float64 value and (d/ds, d/dz) sums from the formula in _fake_quant's docstring."""
    x64, s64, g64 = x.astype(np.float64), np.float64(s), g.astype(np.float64)
    zr = np.clip(np.round(np.float64(z)), qmin, qmax)
    q = np.round(x64 / s64) + zr
    inside = (q >= qmin) & (q <= qmax)
    fq = (np.clip(q, qmin, qmax) - zr) * s64
    ds = g64 * np.where(inside, (fq - x64) / s64, np.where(q < qmin, qmin - zr, qmax - zr))
    dz = np.where(inside, 0.0, -g64 * s64)
    return fq, ds.sum(), dz.sum(), np.abs(g64).sum()


def _lsq_grads(x, s, z, g):
    return _vjp(lambda x, s, z: jq.fake_quant(x, s, z), jnp.asarray(g), jnp.asarray(x),
                jnp.float32(s), jnp.float32(z))


@pytest.mark.parametrize("log2_scale", [-126, -125, -120, -110])
def test_lsq_gradients_at_tiny_scales_match_torch(log2_scale):
    # Scales just above float32's smallest normal (computed scales are kept at or above
    # 2**-126): (fq - x) is then subnormal for most in-range elements and g * s for many,
    # and XLA:CPU flushes both to zero. Torch does not flush; its sums are the reference.
    rng = np.random.default_rng(15)
    s = np.float32(2.0**log2_scale) * np.float32(1.37)
    x = (rng.uniform(-140, 140, 4000) * np.float64(s)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    z = np.float32(5.3)
    xt, st, zt = (torch.tensor(v, requires_grad=True) for v in (x, [s], [z]))
    yt = torch._fake_quantize_learnable_per_tensor_affine(xt, st, zt, -128, 127, 1.0)
    yt.backward(torch.from_numpy(g))
    y, (gx, gs, gz) = _lsq_grads(x, s, z, g)
    fq, ds, dz, gabs = _lsq_reference(x, s, z, g, -128, 127)
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy())
    np.testing.assert_array_equal(np.asarray(gx), xt.grad.numpy())
    # float32 sums of 4000 terms of size <= 128 |g|: a few ulps of the sum of magnitudes
    assert abs(float(gs) - float(st.grad[0])) <= 1e-6 * 128 * gabs
    assert abs(float(gs) - ds) <= 1e-6 * 128 * gabs
    assert abs(float(gz) - float(zt.grad[0])) <= 1e-5 * float(s) * gabs
    assert abs(float(gz) - dz) <= 1e-5 * float(s) * gabs


def test_lsq_gradients_at_subnormal_scales_are_finite():
    # A subnormal scale (a learned scale that decays): the forward value is rounded as the
    # docstring of `jaxquant._cpu_division.scale_factors` says (products below 2**-126 flush to
    # zero), and the scale gradient is the formula's, not NaN. Torch's 1 / scale is inf
    # here, so the reference is float64.
    rng = np.random.default_rng(16)
    for s in (np.float32(1e-39), np.float32(2.0**-140)):
        x = (rng.uniform(-140, 140, 4000) * np.float64(s)).astype(np.float32)
        g = rng.standard_normal(x.shape).astype(np.float32)
        z = np.float32(5.3)
        y, (gx, gs, gz) = _lsq_grads(x, s, z, g)
        fq, ds, dz, gabs = _lsq_reference(x, s, z, g, -128, 127)
        normal = np.abs(fq) >= 2.0**-126
        np.testing.assert_array_equal(np.asarray(y)[normal], fq.astype(np.float32)[normal])
        # below 2**-126: flushed to zero on a CPU (XLA:CPU flushes subnormal results), the
        # exact subnormal value where subnormals are kept (a GPU)
        tiny, want = np.asarray(y)[~normal], fq.astype(np.float32)[~normal]
        assert np.all((tiny == 0) | (tiny == want)), tiny[(tiny != 0) & (tiny != want)]
        assert np.isfinite(float(gs)) and abs(float(gs) - ds) <= 1e-6 * 128 * gabs, (gs, ds)
        # the exact sum is itself subnormal here: flushed to zero or close to it
        assert abs(float(gz) - dz) <= max(1e-5 * float(s) * gabs, 2.0**-126)


def test_a_float64_input_gets_its_cotangent_through_unrounded():
    # the STE passes g * mask; before, g was rounded to float32 first (1 + 2**-40 -> 1.0)
    with jax.enable_x64():
        x = np.array([0.3, -1.2, 2.5, 100.0])
        g = np.array([1 / 3, 0.1, 1 + 2.0**-40, 7.0])
        _, vjp = jax.vjp(lambda v: jq.fake_quant(v, jnp.float64(0.25), dtype=jnp.int8),
                         jnp.asarray(x))
        (got,) = vjp(jnp.asarray(g))
        assert got.dtype == jnp.float64
    xt = torch.tensor(x, requires_grad=True)
    torch.fake_quantize_per_tensor_affine(xt, 0.25, 0, -128, 127).backward(torch.tensor(g))
    np.testing.assert_array_equal(np.asarray(got), xt.grad.numpy())


def test_int32_code_of_2_to_the_31_is_clipped_in_the_gradients():
    # float32(qmax) of int32 is 2**31: a code of 2**31 is above qmax, clipped by quantize,
    # so its x-gradient is 0 and its scale gradient qmax - z, as torch's learnable op
    x = np.array([2.0**31, 2.0**31 - 256, -(2.0**31)], np.float32)
    dx, ds = jax.grad(lambda v, s: jq.fake_quant(v, s, dtype=jnp.int32).sum(), (0, 1))(
        jnp.asarray(x), jnp.float32(1.0))
    assert int(jq.quantize(jnp.asarray(x), jnp.float32(1.0), dtype=jnp.int32).qvalue[0]) == 2**31 - 1
    xt, st, zt = (torch.tensor(v, requires_grad=True) for v in (x, [1.0], [0.0]))
    torch._fake_quantize_learnable_per_tensor_affine(xt, st, zt, -2**31, 2**31 - 1, 1.0).sum().backward()
    np.testing.assert_array_equal(np.asarray(dx), xt.grad.numpy())
    assert np.asarray(dx).tolist() == [0.0, 1.0, 1.0]
    assert float(ds) == float(st.grad[0])
