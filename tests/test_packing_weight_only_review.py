"""Packing and weight-only dots against NumPy float64 references written here from the spec:
ONNX's bit layout (code i of the packed axis in bits ``i * bits`` upward of the little-endian
bit stream), codes' values from ml_dtypes and the published codebook tables, and float
weights streamed chunk by chunk (chunks that do not divide the rows included)."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import _weight_only
from jaxquant._weight_only import stream_rows

BITS = {"int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "float4_e2m1fn": 4}
DN = (((1,), (0,)), ((), ()))  # x (batch, in) . w (in, out)


def _np_fields(data, bits, n, axis):
    """The ``n`` bit fields along ``axis`` of packed bytes, one at a time in int64."""
    d = np.moveaxis(np.asarray(data).astype(np.int64), axis, -1)
    out = np.zeros(d.shape[:-1] + (n,), np.int64)
    for i in range(n):
        bit = i * bits
        v = d[..., bit // 8] >> (bit % 8)
        if bit % 8 + bits > 8:  # 6-bit codes straddle two bytes
            v = v | (d[..., bit // 8 + 1] << (8 - bit % 8))
        out[..., i] = v & ((1 << bits) - 1)
    return np.moveaxis(out, -1, axis)


def _np_codes(qt):
    """float64 values of ``qt``'s codes, read from its (packed or not) storage."""
    fmt, q = qt.format, qt.qvalue
    name = np.dtype(q.dtype).name
    if isinstance(q, jq.PackedArray):
        bits = q.bits or fmt.bits
        f = _np_fields(q.data, bits, q.shape[q.axis], q.axis)
        if fmt.is_codebook:
            return np.asarray(fmt.values, np.float64)[f]
        if name.startswith("int"):
            return np.where(f >= 1 << (bits - 1), f - (1 << bits), f).astype(np.float64)
        if name.startswith("uint"):
            return f.astype(np.float64)
        return f.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    if fmt.is_codebook:
        return np.asarray(fmt.values, np.float64)[np.asarray(q).astype(np.int64)]
    return np.asarray(q).astype(np.float64)


def _np_expand(v, qt):
    """A scale-shaped array broadcast to ``qt.shape`` (per tensor, per axis or blocked)."""
    if isinstance(qt.block_size, tuple):  # n-D tiles
        for axis, size in enumerate(qt.block_size):
            v = np.repeat(v, size, axis=axis)
        return v[tuple(slice(0, n) for n in qt.shape)]
    if qt.axis is None:
        return np.broadcast_to(v.reshape(()), qt.shape)
    if qt.block_size is None:
        shape = [1] * qt.ndim
        shape[qt.axis] = qt.shape[qt.axis]
        return np.broadcast_to(v.reshape(shape), qt.shape)
    v = np.repeat(v, qt.block_size, axis=qt.axis)
    return np.take(v, np.arange(qt.shape[qt.axis]), axis=qt.axis)


def _np_dequantize(qt):
    s = _np_dequantize(qt.scale) if jq.is_qtensor(qt.scale) else np.asarray(qt.scale, np.float64)
    c = _np_codes(qt)
    if qt.zero_point is not None:
        c = c - _np_expand(np.asarray(qt.zero_point).astype(np.float64), qt)
    return c * _np_expand(s, qt)


def _np_dot_general(x, w, dims):
    (lc, rc), (lb, rb) = dims
    names = iter("abcdefghijklmnopqrstuvwxyz")
    ls, rs = [None] * x.ndim, [None] * w.ndim
    for a, b in [*zip(lb, rb, strict=True), *zip(lc, rc, strict=True)]:
        ls[a] = rs[b] = next(names)
    ls = [s or next(names) for s in ls]
    rs = [s or next(names) for s in rs]
    out = [ls[a] for a in lb] + [s for i, s in enumerate(ls) if i not in lc + lb] \
        + [s for i, s in enumerate(rs) if i not in rc + rb]
    return np.einsum(f"{''.join(ls)},{''.join(rs)}->{''.join(out)}",
                     np.asarray(x, np.float64), np.asarray(w, np.float64))


def _assert_dot(y, x, w, dims, rtol=1e-5):
    ref = _np_dot_general(x, w, dims)
    bound = rtol * _np_dot_general(np.abs(np.asarray(x, np.float64)), np.abs(w), dims)
    assert y.shape == ref.shape
    assert (np.abs(np.asarray(y, np.float64) - ref) <= bound).all()


# ----------------------------------------------------------------------------- float6 packing


def _float6(codes, codebook="float6_e2m3fn"):
    """A float6 QTensor built under jit (the constructor refuses concrete codes of 64 or more;
    traced ones, as a jitted function returns them, reach pack)."""
    make = jax.jit(lambda c: jq.QTensor(c, jnp.float32(1.0), codebook=codebook))
    return make(jnp.asarray(np.asarray(codes, np.uint8)))


@pytest.mark.parametrize("codebook", ["float6_e2m3fn", "float6_e3m2fn"])
def test_pack_refuses_float6_codes_that_do_not_fit_six_bits(codebook):
    qt = _float6([200, 0, 5, 9, 63], codebook)
    with pytest.raises(ValueError, match=r"x: float6_e\dm\dfn codes are 6-bit .*\(0 to 63\).* largest code 200"):
        jq.pack(qt)
    with pytest.raises(ValueError, match="64"):
        jq.pack(_float6([[1, 2], [64, 3]], codebook), axis=0)
    edge = np.array([63, 0, 63, 1, 62])  # the largest code that fits: packed as is
    back = jq.unpack(jq.pack(_float6(edge, codebook))).qvalue
    np.testing.assert_array_equal(np.asarray(back), edge)


def test_traced_float6_codes_never_spill_into_their_neighbours():
    codes = np.array([200, 0, 5, 255, 7, 64])
    packed = jax.jit(jq.pack)(_float6(codes))
    np.testing.assert_array_equal(_np_fields(packed.qvalue.data, 6, 6, 0), codes & 63)
    np.testing.assert_array_equal(np.asarray(jq.unpack(packed).qvalue), codes & 63)


def test_pack_of_a_scalar_float6_qtensor_names_the_problem():
    with pytest.raises(ValueError, match="at least one dimension"):
        jq.pack(jq.quantize(jnp.float32(1.5), dtype="float6_e2m3fn"))


def test_float6_layout_on_every_axis_pads_with_zero_codes():
    codes = np.random.default_rng(0).integers(0, 64, (5, 3, 6))
    qt = _float6(codes, "float6_e3m2fn")
    for axis in range(-3, 3):
        p = jax.jit(lambda q, axis=axis: jq.pack(q, axis))(qt).qvalue
        n = codes.shape[axis]
        assert p.data.shape[axis % 3] == 3 * -(-n // 4)
        fields = _np_fields(p.data, 6, 4 * -(-n // 4), axis % 3)  # padding codes included
        np.testing.assert_array_equal(np.take(fields, np.arange(n), axis=axis), codes)
        assert not np.take(fields, np.arange(n, fields.shape[axis]), axis=axis).any()
        np.testing.assert_array_equal(np.asarray(jq.unpack(p)), codes)


# ----------------------------------------------------------------------------- 2/4-bit packing


def test_unpack_ignores_nonzero_padding_bits_in_dots_and_dequantize():
    rng = np.random.default_rng(1)
    for (fmt, bits), axis in zip(BITS.items(), (0, 1, 1, 0, 1), strict=True):
        fields = rng.integers(0, 1 << bits, (7, 5)).astype(np.uint8)
        unsigned = {2: ml_dtypes.uint2, 4: ml_dtypes.uint4}[bits]
        codes = jnp.asarray(fields.astype(unsigned).view(getattr(ml_dtypes, fmt)))
        zp = jnp.asarray(np.array(1, unsigned)) if fmt.startswith("uint") else None
        qt = jq.pack(jq.QTensor(codes, jnp.float32(0.5), zp), axis)
        w = _np_dequantize(qt)
        data = np.array(qt.qvalue.data)
        per, n = 8 // bits, qt.shape[axis]
        last = np.take(data, [-1], axis=axis) | (0xFF << (bits * (n % per)) & 0xFF)
        data[(slice(None),) * axis + (-1,)] = np.squeeze(last, axis)
        dirty = dataclasses.replace(qt, qvalue=dataclasses.replace(qt.qvalue,
                                                                   data=jnp.asarray(data)))
        np.testing.assert_array_equal(np.asarray(jq.unpack(dirty).qvalue).view(np.uint8)
                                      & ((1 << bits) - 1), fields)
        np.testing.assert_array_equal(np.asarray(jq.dequantize(dirty)), w)
        x = rng.standard_normal((3, 7)).astype(np.float32)
        _assert_dot(jq.qdot_general(x, dirty, DN), x, w, DN)  # padding along the contraction


def test_pack_under_vmap_matches_the_reference_row_by_row():
    fields = np.random.default_rng(2).integers(0, 16, (4, 7)).astype(np.uint8)
    codes = jnp.asarray(fields.astype(ml_dtypes.uint4).view(ml_dtypes.float4_e2m1fn))
    data = jax.vmap(lambda c: jq.pack(c).data)(codes)
    assert data.shape == (4, 4)
    np.testing.assert_array_equal(_np_fields(data, 4, 8, 1)[:, :7], fields)
    assert not _np_fields(data, 4, 8, 1)[:, 7].any()  # the padding nibble is zero


# ----------------------------------------------------------------------------- weight-only dots


LAYOUTS = [  # (quantize kwargs, pack axis)
    (dict(dtype=jnp.int4, axis=1), 0),  # packed along the contraction
    (dict(dtype=jnp.uint4, axis=0, symmetric=False), 1),  # packed across it, zero points
    (dict(dtype=jnp.int4, axis=0, block_size=4), 0),
    (dict(dtype=jnp.int2, axis=1, block_size=3), 1),  # blocks of 3 do not hold whole bytes
    (dict(dtype="nf4", axis=0, block_size=4), 0),
    (dict(dtype=jnp.float4_e2m1fn, axis=1), 1),
    (dict(dtype="mxfp6_e2m3", axis=0), 0),
    (dict(dtype="nvfp4", axis=0), 1),  # a float8 scale with its float32 tensor scale
    (dict(dtype=jnp.int8, axis=0, block_size=4, double_quant=True), None),
]


def test_weight_only_dot_equals_float64_reference_on_every_contraction():
    rng = np.random.default_rng(3)
    cases = [
        (rng.standard_normal((2, 3, 7)), (((2,), (0,)), ((), ()))),  # on axis 0
        (rng.standard_normal((3, 5, 6)), (((2,), (2,)), ((1,), (1,)))),  # last axis, batch
        (rng.standard_normal((4, 7, 5)), (((1, 2), (0, 1)), ((), ()))),  # two axes
    ]
    for n, (spec, pack_axis) in enumerate(LAYOUTS):
        qt = jq.quantize(rng.standard_normal((7, 5, 6)).astype(np.float32), **spec)
        qt = qt if pack_axis is None else jq.pack(qt, pack_axis)
        w = _np_dequantize(qt)
        for x, dims in (cases[n % 3], cases[(n + 1) % 3]):  # each case for most layouts
            x = x.astype(np.float32)
            _assert_dot(jq.qdot_general(x, qt, dims), x, w, dims)
        x, ((lc, rc), (lb, rb)) = cases[n % 3]  # the QTensor as lhs: its free dims first
        x = x.astype(np.float32)
        y = np.asarray(jq.qdot_general(qt, x, ((rc, lc), (rb, lb))))
        nb, nx = len(lb), x.ndim - len(lc) - len(lb)
        y = np.moveaxis(y, list(range(y.ndim - nx, y.ndim)), list(range(nb, nb + nx)))
        _assert_dot(y, x, w, cases[n % 3][1])
    x = np.zeros((0, 7, 5), np.float32)  # an empty batch
    assert jq.qdot_general(x, qt, (((1, 2), (0, 1)), ((), ()))).shape == (0, 6)


def test_half_precision_activations_and_gradients():
    rng = np.random.default_rng(4)
    for dtype, (spec, pack_axis) in [(jnp.bfloat16, LAYOUTS[0]), (jnp.float16, LAYOUTS[1])]:
        qt = jq.pack(jq.quantize(rng.standard_normal((9, 6)).astype(np.float32), **spec),
                     pack_axis)
        w = np.asarray(np.asarray(_np_dequantize(qt), np.float32).astype(dtype), np.float64)
        x = jnp.asarray(rng.standard_normal((3, 9)), dtype)
        y = jq.qdot_general(x, qt, DN, preferred_element_type=jnp.float32)
        assert y.dtype == jnp.float32  # the weight in x's dtype, the sum in float32
        _assert_dot(y, x, w, DN, rtol=1e-5)
        y = jq.qdot_general(x, qt, DN)
        assert y.dtype == dtype
        _assert_dot(y, x, w, DN, rtol=2.0 ** -7)
        g = rng.standard_normal((3, 6))
        loss = lambda x, qt=qt, g=g: jnp.sum(jq.qdot_general(x, qt, DN).astype(jnp.float32) * g)
        gx = jax.grad(loss)(x)
        assert gx.dtype == dtype
        np.testing.assert_allclose(np.asarray(gx, np.float64), g @ w.T, rtol=2.0 ** -6,
                                   atol=2.0 ** -6 * np.abs(g @ w.T).max())


# ----------------------------------------------------------------------------- streaming


def test_rows_that_split_unevenly_are_streamed_in_large_chunks():
    prime = jq.quantize(jnp.ones((1031, 1024)), axis=1)  # 4 MiB of float32, 1031 is prime
    rows = stream_rows(prime, (0,), (), 32)
    assert rows is not None and rows * 4096 <= _weight_only.STREAM_BYTES
    assert -(-1031 // rows) <= 3  # not 1031 chunks of one row
    packed = jq.quantize(jnp.ones((2049, 1024)), dtype=jnp.int4, axis=1, packed=True)
    packed = jq.pack(jq.unpack(packed), axis=0)  # an odd number of rows packed along them
    rows = stream_rows(packed, (0,), (), 32)
    assert rows is not None and rows % 2 == 0 and -(-2049 // rows) <= 3


@pytest.mark.usefixtures("small_chunks")
class TestRaggedChunks:
    """Weights streamed in small chunks whose number does not divide the rows."""

    @pytest.mark.parametrize("spec,pack_axis,k,grad", [
        (dict(dtype=jnp.uint8, axis=0, block_size=5, symmetric=False), None, 1001, False),  # 33 + 1
        (dict(dtype=jnp.int4, axis=1), 0, 97, True),  # the last chunk ends in half a byte
        (dict(dtype="nf4", axis=0, block_size=16), 0, 97, False),  # ... and in a partial block
    ])
    def test_ragged_streamed_chunks_equal_the_reference(self, spec, pack_axis, k, grad):
        rng = np.random.default_rng(k)
        qt = jq.quantize(rng.standard_normal((k, 64)).astype(np.float32), **spec)
        qt = qt if pack_axis is None else jq.pack(qt, pack_axis)
        rows = stream_rows(qt, (0,), (), 20)
        assert rows is not None and k % rows  # streamed, the rows not a multiple of the chunk
        w = _np_dequantize(qt)
        x = rng.standard_normal((20, k)).astype(np.float32)
        _assert_dot(jq.qdot_general(x.T, qt, (((0,), (0,)), ((), ()))), x, w, DN)
        if not grad:
            return
        g = jax.grad(lambda x: jnp.sum(jq.qdot_general(x, qt, DN) ** 2))(x)
        ref = 2 * (x.astype(np.float64) @ w) @ w.T
        np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
