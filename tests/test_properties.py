"""Hypothesis properties: error bound, packing round trip, idempotence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxquant as jq

INT_FORMATS = ["int4", "uint4", "int8", "uint8", "int16", "uint16"]
finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
arrays = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9), elements=finite)
settings.register_profile("ci", max_examples=30, deadline=None)
settings.load_profile("ci")


def _granularity(x, data):
    kind = data.draw(st.sampled_from(["tensor", "axis", "block"]))
    if kind == "tensor":
        return {}
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    if kind == "axis":
        return dict(axis=axis)
    return dict(axis=axis, block_size=data.draw(st.integers(1, 5)))


@given(x=arrays, fmt=st.sampled_from(INT_FORMATS), symmetric=st.booleans(), data=st.data())
def test_error_within_half_scale_inside_range(x, fmt, symmetric, data):
    gran = _granularity(x, data)

    @jax.jit  # quantize and both dequantizes in one compiled program per example
    def run(x):
        qt = jq.quantize(x, dtype=fmt, symmetric=symmetric, **gran)
        ones = jq.QTensor(jnp.ones(x.shape, jnp.int8), qt.scale, axis=qt.axis,
                          block_size=qt.block_size)
        return qt.dequantize(), jq.dequantize(ones)

    values, scales = run(x)
    # computed scales cover the data, so nothing clips: |error| <= scale / 2 (+ float32 slack)
    s = np.broadcast_to(np.asarray(scales), x.shape)
    err = np.abs(np.asarray(values, np.float64) - x.astype(np.float64))
    slack = 4 * np.finfo(np.float32).eps * (np.abs(x) + s)
    assert (err <= s / 2 + slack).all()


@given(x=arrays, fmt=st.sampled_from(INT_FORMATS + ["float8_e4m3fn", "float8_e5m2",
                                                      "float4_e2m1fn"]), data=st.data())
def test_quantize_is_idempotent_on_its_own_values(x, fmt, data):
    gran = _granularity(x, data)

    @jax.jit  # both quantizes in one compiled program per example
    def run(x):
        qt = jq.quantize(x, dtype=fmt, **gran)
        again = jq.quantize(qt.dequantize(), qt.scale, qt.zero_point, dtype=fmt, axis=qt.axis,
                            block_size=qt.block_size)
        return qt.qvalue, again.qvalue

    codes, again = run(x)
    np.testing.assert_array_equal(np.asarray(again).view(np.uint8) if jq.get_format(fmt).bits <= 8
                                  else np.asarray(again), np.asarray(codes).view(np.uint8)
                                  if jq.get_format(fmt).bits <= 8 else np.asarray(codes))


@given(codes=hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9),
                        elements=st.integers(0, 255)),
       fmt=st.sampled_from(["int2", "uint2", "int4", "uint4", "float4_e2m1fn"]), data=st.data())
def test_pack_unpack_round_trip(codes, fmt, data):
    bits = jq.get_format(fmt).bits
    import ml_dtypes
    unsigned = {2: ml_dtypes.uint2, 4: ml_dtypes.uint4}[bits]
    c = (codes % (1 << bits)).astype(unsigned).view(np.dtype(getattr(ml_dtypes, fmt)))
    axis = data.draw(st.integers(-c.ndim, c.ndim - 1))
    # one compiled program per example (eager, each of the dozen ops compiles on its own)
    back = jax.jit(lambda c: jq.unpack(jq.pack(c, axis=axis)))(jnp.asarray(c))
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), c.view(np.uint8))


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_every_code_survives_dequantize_quantize(fmt):
    f = jq.get_format(fmt)
    codes = jnp.arange(f.qmin, f.qmax + 1, dtype=jnp.int32).astype(f.dtype)
    scale = jnp.float32(0.0123)
    zp = jnp.asarray(np.array((f.qmin + f.qmax) // 3, dtype=f.dtype))
    qt = jq.QTensor(codes, scale, zp)
    again = jq.quantize(qt.dequantize(), scale, zp, dtype=fmt)
    np.testing.assert_array_equal(again.qvalue, codes)
