"""GPTQ against a float64 NumPy transcription of the paper's Algorithm 1, and its properties:
round to nearest when inputs are uncorrelated, less output error than round to nearest
otherwise, the same QTensor layout as `quantize`, clear argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_utils import find_eqns

import jaxquant as jq


def _paper_gptq(w, h, qmin, qmax, block_size=None, damp=0.01, act_order=False):
    """Frantar et al. 2023, Algorithm 1 (no lazy batches), float64, symmetric absmax scales.

    ``w`` is ``(in, out)``; the paper's columns are its rows here. Block scales come from
    the rows as updated when a block starts (from ``w`` itself with ``act_order``).
    """
    w0 = w.astype(np.float64)
    h = h.astype(np.float64).copy()
    h[np.diag(h) == 0, np.diag(h) == 0] = 1
    k = w.shape[0]
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    wk, h = w0[perm].copy(), h[np.ix_(perm, perm)]
    h += damp * np.mean(np.diag(h)) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(wk)
    scale = np.abs(w0).max(0) / qmax
    for i in range(k):
        if block_size is not None:
            g = perm[i] // block_size
            if act_order:
                scale = np.abs(w0[g * block_size:(g + 1) * block_size]).max(0) / qmax
            elif i % block_size == 0:
                scale = np.abs(wk[i:i + block_size]).max(0) / qmax
        q[i] = np.clip(np.round(wk[i] / scale), qmin, qmax) * scale
        e = (wk[i] - q[i]) / u[i, i]
        wk[i:] -= np.outer(u[i, i:], e)
    return q[np.argsort(perm)]


def _data(k=256, n=96, rows=1024, seed=0):
    rng = np.random.default_rng(seed)
    mix = np.eye(k) + 0.3 * rng.standard_normal((k, k)) / np.sqrt(k)
    x = (rng.standard_normal((rows, k)) @ mix).astype(np.float32)
    x[:, 3] *= 20  # an outlier input feature
    return x, rng.standard_normal((k, n)).astype(np.float32)


def _output_error(x, w, q):
    return float(np.sum((x.astype(np.float64) @ (w - np.asarray(q, np.float64))) ** 2))


@pytest.mark.parametrize("dtype,qmin,qmax,kw", [
    (jnp.int8, -127, 127, dict()),
    (jnp.int4, -7, 7, dict()),
    (jnp.int4, -7, 7, dict(axis=0, block_size=32)),
    (jnp.int4, -7, 7, dict(axis=0, block_size=32, act_order=True)),
    (jnp.int4, -7, 7, dict(act_order=True)),
])
def test_matches_the_papers_algorithm(dtype, qmin, qmax, kw):
    x, w = _data()
    qt = jq.gptq(w, x.T @ x, dtype=dtype, **kw)
    ours = np.asarray(jq.dequantize(qt))
    ref = _paper_gptq(w, x.T @ x, qmin, qmax, kw.get("block_size"),
                      act_order=kw.get("act_order", False))
    # float32 here, float64 there: a few rows round the other way, and the errors then
    # propagate; the output error stays the same.
    assert np.mean(np.abs(ours - ref) > 1e-5 * np.abs(ref).max()) < 0.01
    assert _output_error(x, w, ours) == pytest.approx(_output_error(x, w, ref), rel=5e-3)


@pytest.mark.parametrize("kw", [
    dict(dtype=jnp.int8), dict(dtype=jnp.int4, axis=0, block_size=16),
    dict(dtype=jnp.uint8, symmetric=False), dict(dtype=jnp.float8_e4m3fn),
    dict(dtype=jnp.int4, axis=0, block_size=16, act_order=True),
])
def test_uncorrelated_inputs_give_round_to_nearest(kw):
    # A diagonal H couples no rows: nothing to compensate, the codes are quantize's.
    _, w = _data(k=64, n=24)
    h = np.diag(np.random.default_rng(1).uniform(0.5, 2.0, 64)).astype(np.float32)
    qt = jq.gptq(w, h, damp=0.0, **kw)
    rtn = jq.quantize(w, dtype=kw["dtype"], axis=kw.get("axis", -1),
                      block_size=kw.get("block_size"), symmetric=kw.get("symmetric", True))
    np.testing.assert_array_equal(np.asarray(qt.qvalue), np.asarray(rtn.qvalue))
    np.testing.assert_array_equal(np.asarray(qt.scale), np.asarray(rtn.scale))


@pytest.mark.parametrize("kw", [
    dict(dtype=jnp.int8), dict(dtype=jnp.int4, axis=0, block_size=32),
    dict(dtype=jnp.uint4, symmetric=False), dict(dtype=jnp.float8_e4m3fn),
    dict(dtype="nf4", axis=0, block_size=64), dict(dtype=jnp.int4, act_order=True),
])
def test_less_output_error_than_round_to_nearest(kw):
    x, w = _data(seed=2)
    qt = jq.gptq(w, x.T @ x, **kw)
    rtn = jq.quantize(w, dtype=kw["dtype"], axis=kw.get("axis", -1),
                      block_size=kw.get("block_size"), symmetric=kw.get("symmetric", True))
    assert _output_error(x, w, qt.dequantize()) < 0.8 * _output_error(x, w, rtn.dequantize())


def test_same_layout_as_quantize_and_usable_everywhere():
    x, w = _data(k=128, n=64)
    wb = jnp.asarray(w, jnp.bfloat16)
    qt = jq.gptq(wb, x.T @ x, dtype=jnp.int4, axis=0, block_size=32)
    rtn = jq.quantize(wb, dtype=jnp.int4, axis=0, block_size=32)
    assert (qt.shape, qt.axis, qt.block_size, qt.scale.shape, qt.dtype) == \
        (rtn.shape, rtn.axis, rtn.block_size, rtn.scale.shape, jnp.bfloat16)
    packed = jq.pack(qt, axis=0)
    y = jq.qdot_general(jnp.asarray(x[:8]), packed, (((1,), (0,)), ((), ())))
    np.testing.assert_allclose(np.asarray(y), x[:8] @ np.asarray(qt.dequantize(jnp.float32)),
                               rtol=1e-4, atol=1e-3)
    per_channel = jq.gptq(w, x.T @ x)  # scales: quantize's own, per output channel
    np.testing.assert_array_equal(np.asarray(per_channel.scale),
                                  np.asarray(jq.quantize(w, axis=-1).scale))


@pytest.mark.parametrize("kw", [dict(), dict(axis=0, block_size=32),
                                dict(axis=0, block_size=32, act_order=True)])
def test_lazy_batches_are_one_loop_whatever_the_input_width(kw):
    """The program does not grow with the rows (a loop over lazy batches, not one traced
    copy per batch: compile time stays flat for wide layers), and the batch update is a
    float32 product on every platform (not TF32, the GPU default)."""
    def program(k):
        w, h = jax.ShapeDtypeStruct((k, 8), jnp.float32), jax.ShapeDtypeStruct((k, k), jnp.float32)
        return jax.make_jaxpr(lambda w, h: jq.gptq(w, h, dtype=jnp.int4, **kw))(w, h).jaxpr

    def size(jaxpr):
        return sum(1 + sum(size(sub) for sub in jax.extend.core.jaxprs_in_params(e.params))
                   for e in jaxpr.eqns)

    assert size(program(2048)) == size(program(256))  # 16 and 2 batches of 128 rows
    assert size(program(1056)) == size(program(288))  # 9 and 3 batches, the last one padded
    dots = list(find_eqns(program(256)))
    assert dots and all(d.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2 for d in dots)


def test_inputs_never_seen_stay_finite():
    x, w = _data(k=64, n=16)
    x[:, 5] = 0.0  # H[5, :] = H[:, 5] = 0
    qt = jq.gptq(w, x.T @ x, dtype=jnp.int4)
    assert np.all(np.isfinite(np.asarray(qt.dequantize())))


@pytest.mark.parametrize("kw,match", [
    (dict(hessian=np.eye(5)), r"hessian must have shape \(in, in\) = \(8, 8\).*\(5, 5\)"),
    (dict(w=np.ones((2, 4, 4))), "w must be a 2-D float kernel.*got shape"),
    (dict(w=np.ones((8, 4), np.int32)), "w must be a 2-D float kernel.*int32"),
    (dict(axis=0), "axis must be -1 or 1.*got axis=0"),
    (dict(axis=1, block_size=4), "with block_size, axis must be 0.*got axis=1"),
    (dict(axis=0, block_size=3), "block_size must be a positive int dividing in=8, got 3"),
    (dict(damp=-0.1), "damp must be a finite non-negative number, got -0.1"),
])
def test_argument_errors(kw, match):
    args = dict(w=np.ones((8, 4), np.float32), hessian=np.eye(8, dtype=np.float32))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        jq.gptq(args.pop("w"), args.pop("hessian"), **args)


@pytest.mark.parametrize("damp, got", [("a", "str 'a'"), (True, "bool True"),
                                       (None, "NoneType None")])
def test_damp_that_is_not_a_number_is_a_type_error(damp, got):
    with pytest.raises(TypeError, match=f"damp must be a number, got {got}"):
        jq.gptq(np.ones((8, 4), np.float32), np.eye(8, dtype=np.float32), damp=damp)


def test_traced_damp_is_a_type_error_asking_for_a_static_value():
    with pytest.raises(TypeError, match="damp must be a number, got .*Tracer.*a static value"):
        jax.jit(lambda d: jq.gptq(np.ones((8, 4), np.float32), np.eye(8), damp=d))(0.01)


@functools.cache
def _traced_gptq(damp):  # one compiled program per damp, shared by the cases below
    return jax.jit(lambda w, h: jq.gptq(w, h, damp=damp))


@pytest.mark.parametrize("hessian, damp", [
    ("rank_deficient", 0.0),  # 8 calibration rows for 64 inputs, undamped
    ("negative", 0.01),
    ("nan", 0.01),
])
def test_hessian_that_cannot_be_factored_is_an_error_not_zero_codes(hessian, damp):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    h = {"rank_deficient": x.T @ x, "negative": -np.eye(64, dtype=np.float32),
         "nan": np.full((64, 64), np.nan, np.float32)}[hessian]
    with pytest.raises(ValueError, match="not positive definite.*larger damp"):
        jq.gptq(w, jnp.asarray(h), damp=damp)
    traced = _traced_gptq(damp)(w, jnp.asarray(h))
    assert np.isnan(np.asarray(traced.dequantize())).all()  # never a plausible kernel


def test_codebook_needs_blocks_and_numpy_scalars_are_accepted():
    w, h = jnp.ones((64, 8)), jnp.eye(64)
    with pytest.raises(ValueError, match="nf4 scales blocks of input rows: pass axis=0"):
        jq.gptq(w, h, dtype="nf4")
    with pytest.raises(ValueError, match="finite non-negative number, got inf"):
        jq.gptq(w, h, damp=float("inf"))
    qt = jq.gptq(w, h, dtype="nf4", axis=0, block_size=np.int64(32), damp=np.float32(0.01))
    assert qt.block_size == 32 and qt.codebook == "nf4"


def test_negative_axis_names_the_input_rows_as_quantize_does():
    x, w = _data(k=64, n=8)
    want = jq.gptq(w, x.T @ x, dtype=jnp.int4, axis=0, block_size=16)
    got = jq.gptq(w, x.T @ x, dtype=jnp.int4, axis=-2, block_size=16)
    assert jq.quantize(w, dtype=jnp.int4, axis=-2, block_size=16).scale.shape == (4, 8)
    np.testing.assert_array_equal(np.asarray(got.qvalue), np.asarray(want.qvalue))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
    with pytest.raises(ValueError, match="got axis=-1"):
        jq.gptq(w, x.T @ x, axis=-1, block_size=16)


def test_complex_hessian_is_a_type_error():
    w = np.ones((8, 4), np.float32)
    with pytest.raises(TypeError, match="hessian must be a real array, got dtype complex64"):
        jq.gptq(w, np.eye(8, dtype=np.complex64))


@pytest.mark.parametrize("w_spec,h_spec", [((None, "d"), ()), (("d", None), ()),
                                           ((None, None), ("d", None)), (("d", None), (None, "d"))])
@pytest.mark.parametrize("kw", [dict(dtype=jnp.int4), dict(dtype=jnp.int4, axis=0, block_size=16),
                                dict(dtype=jnp.uint4, symmetric=False, act_order=True)],
                         ids=["per-channel", "blocks", "act-order"])
def test_explicit_mesh_axes_give_the_one_device_codes(w_spec, h_spec, kw):
    from host_mesh import host_mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    # before: JAX's ShardingTypeError from the sweep's gathers and scatters
    mesh = host_mesh((8,), ("d",), jax.sharding.AxisType.Explicit)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    w, h = rng.standard_normal((64, 32)).astype(np.float32), x.T @ x
    want = jq.gptq(w, h, **kw)
    ws = jax.device_put(w, NamedSharding(mesh, P(*w_spec)))
    hs = jax.device_put(h, NamedSharding(mesh, P(*h_spec)))
    got = jq.gptq(ws, hs, **kw)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert got.qvalue.sharding.spec == ws.sharding.spec
