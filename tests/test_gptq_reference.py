"""GPTQ against an independent float64 NumPy transcription of the reference ``fasterquant``
(IST-DASLab/gptq: damping by a fraction of the mean diagonal, dead inputs decoupled, act_order
by decreasing ``H[i, i]`` with static groups, the upper Cholesky factor of ``H^-1``, lazy
batches, group scales from the updated rows), with jaxquant's scale conventions; Hessians that
must be refused, and the Flax wrappers' Gram matrices and errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxquant as jq
from jaxquant.flax import QuantConfig, nnx_input_grams, nnx_quantize, quantize_linen

_INT = {"int8": (-128, 127), "int4": (-8, 7), "uint4": (0, 15)}


def _find_params(x, fmt, symmetric):
    """Per-column scale and zero point of the rows ``x``, as `jaxquant.quantize` chooses them."""
    amax = np.abs(x).max(0)
    if fmt == "float8_e4m3fn":
        return np.where(amax > 0, amax / 448.0, 1.0), np.zeros(x.shape[1])
    qmin, qmax = _INT[fmt]
    if symmetric and qmin < 0:
        return np.where(amax > 0, amax / qmax, 1.0), np.zeros(x.shape[1])
    if symmetric:
        mid = (qmax + 1) // 2
        return np.where(amax > 0, amax / (qmax - mid), 1.0), np.full(x.shape[1], float(mid))
    lo, hi = np.minimum(x.min(0), 0), np.maximum(x.max(0), 0)
    s = np.where(hi > lo, (hi - lo) / (qmax - qmin), 1.0)
    return s, np.clip(qmin - np.round(lo / s), qmin, qmax)


def _codes(x, s, z, fmt):
    if fmt == "float8_e4m3fn":
        c = np.clip(x / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        return c, c * s
    qmin, qmax = _INT[fmt]
    c = np.clip(np.rint(x / s) + z, qmin, qmax)
    return c, (c - z) * s


def _fasterquant(w, h, fmt, symmetric=True, groupsize=None, damp=0.01, act_order=False,
                 blocksize=128):
    """``fasterquant`` in float64 on ``w`` of shape ``(in, out)`` (its columns are our rows).

    Group scales come from the rows as updated when the group starts (Algorithm 1). The
    reference code reads them from ``W``, which lags inside a lazy batch: the same where
    groups start batches. Dead inputs keep their rounded weights (the reference zeroes them).
    Returns ``(codes, dequantized)``, both ``(in, out)``.
    """
    W, H = np.asarray(w, np.float64).T.copy(), np.asarray(h, np.float64).copy()
    k = W.shape[1]
    s, z = _find_params(W.T, fmt, symmetric)
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    groups = None
    if groupsize and act_order:  # static groups
        groups = [_find_params(W[:, i:i + groupsize].T, fmt, symmetric)
                  for i in range(0, k, groupsize)]
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(k)
    W, H = W[:, perm], H[np.ix_(perm, perm)]
    H[np.arange(k), np.arange(k)] += damp * np.mean(np.diag(H))
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    C, Q = np.zeros_like(W), np.zeros_like(W)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1, Err1 = W[:, i1:i2].copy(), np.zeros((W.shape[0], i2 - i1))
        for i in range(i2 - i1):
            if groups is not None:
                s, z = groups[perm[i1 + i] // groupsize]
            elif groupsize and (i1 + i) % groupsize == 0:
                s, z = _find_params(W[:, i1 + i:i1 + i + groupsize].T, fmt, symmetric)
            C[:, i1 + i], Q[:, i1 + i] = _codes(W1[:, i], s, z, fmt)
            Err1[:, i] = (W1[:, i] - Q[:, i1 + i]) / U[i1 + i, i1 + i]
            W1[:, i:] -= np.outer(Err1[:, i], U[i1 + i, i1:i2][i:])
            W[:, i1 + i:i2] = W1[:, i:]  # the updated rows, for a group starting next
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    inv = np.argsort(perm)
    return C[:, inv].T, Q[:, inv].T


def _rtn(w, fmt, symmetric=True, groupsize=None):
    w = np.asarray(w, np.float64)
    g = groupsize or w.shape[0]
    return np.concatenate([_codes(w[i:i + g], *_find_params(w[i:i + g], fmt, symmetric), fmt)[1]
                           for i in range(0, w.shape[0], g)])


def _problem(k, n, seed, dead=(), rank=None):
    rng = np.random.default_rng(seed)
    if rank is None:  # correlated inputs, one outlier feature
        x = rng.standard_normal((4 * k, k)) @ (np.eye(k) + 0.5 * rng.standard_normal((k, k))
                                               / np.sqrt(k))
    else:  # fewer calibration rows than inputs: a singular Hessian
        x = rng.standard_normal((k // 2, rank)) @ rng.standard_normal((rank, k))
    x[:, 1] *= 10
    x[:, list(dead)] = 0
    x = x.astype(np.float32)
    return x, rng.standard_normal((k, n)).astype(np.float32)


def _err(x, w, q):
    return float(np.sum((x.astype(np.float64) @ (w - np.asarray(q, np.float64))) ** 2))


_CASES = [  # (in, out, dtype, symmetric, block_size, act_order, hessian)
    (64, 16, "int4", True, 16, False, "dead"),
    (96, 16, "uint4", False, 32, True, "rank"),
    (64, 16, "float8_e4m3fn", True, None, True, "dead"),
    (160, 8, "int4", False, 40, False, "full"),  # a group across the reference's 128-row batches
]


def test_codes_match_the_reference_and_beat_round_to_nearest():
    for k, n, fmt, sym, gs, act, kind in _CASES:
        x, w = _problem(k, n, seed=k + n, dead=(5, 9) if kind == "dead" else (),
                        rank=k // 4 if kind == "rank" else None)
        h = x.T @ x
        kw = dict(axis=0, block_size=gs) if gs else {}
        qt = jq.gptq(w, h, dtype=fmt, symmetric=sym, act_order=act, **kw)
        codes, ref = _fasterquant(w, h, fmt, sym, gs, act_order=act, blocksize=k)
        ours = np.asarray(qt.dequantize(jnp.float32), np.float64)
        case = (k, n, fmt, sym, gs, act, kind)
        # float32 here: a rounding tie may go the other way (then its error propagates)
        assert np.mean(np.asarray(qt.qvalue).astype(np.float64) != codes) < 0.01, case
        assert _err(x, w, ours) <= 1.01 * _err(x, w, ref), case
        assert _err(x, w, ours) < 0.9 * _err(x, w, _rtn(w, fmt, sym, gs)), case


def test_lazy_batches_of_the_reference_give_the_same_codes_when_groups_align():
    x, w = _problem(160, 8, seed=7)
    qt = jq.gptq(w, x.T @ x, dtype=jnp.int4, symmetric=False, axis=0, block_size=40)
    codes, _ = _fasterquant(w, x.T @ x, "int4", False, groupsize=40, blocksize=40)
    assert np.mean(np.asarray(qt.qvalue).astype(np.float64) != codes) < 0.01


def test_dead_inputs_do_not_make_the_result_depend_on_the_hessians_magnitude():
    # A dead input's diagonal entry is set to 1 whatever H's scale: counted in the damping's
    # mean it made a small-magnitude H (an average Gram of small activations) damped toward
    # round to nearest.
    x, w = _problem(64, 16, seed=3, dead=(3, 7, 11, 20))
    h = x.T @ x
    for kw in (dict(axis=0, block_size=16), dict(dtype="float8_e4m3fn", act_order=True)):
        kw = dict(dict(dtype="int4"), **kw)
        got = jq.gptq(w, h * np.float32(1e-6), **kw)
        np.testing.assert_array_equal(np.asarray(got.qvalue), np.asarray(jq.gptq(w, h, **kw).qvalue))
        rtn = _rtn(w, kw["dtype"], groupsize=kw.get("block_size"))
        assert _err(x, w, got.dequantize()) < 0.9 * _err(x, w, rtn)


def test_indefinite_hessian_with_a_zero_diagonal_entry_is_refused():
    x, w = _problem(64, 16, seed=0)
    h = x.T @ x
    h[3, 3] = 0  # row 3 still couples: not an input never seen, an indefinite matrix
    damped = h.astype(np.float64) + 0.01 * np.mean(np.diag(h)) * np.eye(64)
    assert np.linalg.eigvalsh(damped).min() < 0
    for c in (1.0, 1e-4):  # at any magnitude (a diagonal 1 made a small one definite)
        with pytest.raises(ValueError, match="not positive definite"):
            jq.gptq(w, h * np.float32(c), dtype="float8_e4m3fn", act_order=True)


def test_only_the_symmetric_part_is_used_and_vmap_is_per_item():
    x, w = _problem(64, 16, seed=1)
    h = x.T @ x
    a = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    want = jq.gptq(w, h, dtype=jnp.int4, axis=0, block_size=16)
    got = jq.gptq(w, h + (a - a.T), dtype=jnp.int4, axis=0, block_size=16)
    np.testing.assert_array_equal(np.asarray(got.qvalue), np.asarray(want.qvalue))
    batched = jax.vmap(lambda w: jq.gptq(w, h, dtype=jnp.int4, axis=0, block_size=16).qvalue)(
        np.stack([2 * w, w]))
    np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(want.qvalue))


class _MLP(nn.Module):
    keyword: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        up = nn.Dense(64, name="up")
        h = nn.gelu(up(inputs=x) if self.keyword else up(x))
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(16, name="down")(h))


def _batch(n, seed):
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(0).standard_normal((8, 32))
    x = rng.standard_normal((n, 10, 8)) @ mix + 0.1 * rng.standard_normal((n, 10, 32))
    return jnp.asarray(x.astype(np.float32))  # (batch, sequence, features)


INT4 = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=16))


def test_linen_grams_of_sequences_keyword_inputs_and_flags_beat_rtn_on_held_out_data():
    x, held_out = _batch(32, 1), _batch(32, 2)
    qm = quantize_linen(_MLP(keyword=True), INT4)
    params = _MLP().init(jax.random.key(0), x)
    grams = qm.input_grams(params, x, False)  # Dense(inputs=x); a Python flag positionally
    rows = np.asarray(x, np.float64).reshape(-1, 32)
    np.testing.assert_allclose(grams["up"], rows.T @ rows, rtol=1e-5, atol=1e-3)
    up = params["params"]["up"]
    hidden = jax.nn.gelu(x @ up["kernel"] + up["bias"][None, None])
    hidden = np.asarray(hidden, np.float64).reshape(-1, 64)
    np.testing.assert_allclose(grams["down"], hidden.T @ hidden, rtol=1e-5, atol=1e-3)
    y = _MLP().apply(params, held_out)
    gptq, rtn = qm.quantize_params(params, x, grams=grams), qm.quantize_params(params, x)
    err = [float(jnp.linalg.norm(qm.apply(p, held_out) - y)) for p in (gptq, rtn)]
    assert err[0] < 0.7 * err[1]


def test_flax_gptq_takes_codebooks_and_axis_minus_two_and_names_the_layer_in_errors():
    x = _batch(8, 3)
    model = nnx.Sequential(nnx.Linear(32, 48, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(48, 8, rngs=nnx.Rngs(1)))
    spec = jq.QuantSpec(dtype="nf4", axis=-2, block_size=16)  # a codebook; the input axis, -2
    grams = nnx_input_grams(model, (("layers/0", QuantConfig(weight=spec)), (".*", None)), x)
    rows = np.asarray(x, np.float64).reshape(-1, 32)
    np.testing.assert_allclose(grams["layers/0"], rows.T @ rows, rtol=1e-5, atol=1e-3)
    q = nnx_quantize(nnx.clone(model), (("layers/0", QuantConfig(weight=spec)), (".*", None)),
                     grams=grams)
    want = jq.gptq(model.layers[0].kernel[...], grams["layers/0"], dtype="nf4", axis=0,
                   block_size=16)
    np.testing.assert_array_equal(np.asarray(q.layers[0].kernel[...].qvalue),
                                  np.asarray(want.qvalue))
    spec = QuantConfig(weight=jq.QuantSpec(dtype=jnp.int4, axis=0, block_size=24))
    with pytest.raises(ValueError, match=r"grams\['layers/0'\] cannot be used: block_size"):
        nnx_quantize(nnx.clone(model), spec, grams={"layers/0": jnp.eye(32)})
    spec = QuantConfig(weight=jq.QuantSpec(dtype="nf4"))
    with pytest.raises(ValueError, match=r"grams\['layers/0'\].*nf4 codes need blocks"):
        nnx_quantize(nnx.clone(model), spec, grams={"layers/0": jnp.eye(32)})
