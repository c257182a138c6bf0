"""quantize / dequantize: computed mode, transformations, retracing, and every error branch."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxpr_utils import find_eqns

import jaxquant as jq
from jaxquant import _quantize

INT_FORMATS = ["int2", "uint2", "int4", "uint4", "int8", "uint8", "int16", "uint16", "int32"]
FLOAT_FORMATS = ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"]
GRANULARITIES = [dict(), dict(axis=0), dict(axis=-1), dict(axis=1, block_size=5)]


def _x(shape=(6, 13), seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _groups(x, axis=None, block_size=None):
    """Yields index tuples of the groups sharing a scale (numpy, independent of the library)."""
    if axis is None:
        yield (slice(None),) * x.ndim
        return
    a = axis % x.ndim
    step = block_size or 1
    for start in range(0, x.shape[a], step):
        idx = [slice(None)] * x.ndim
        idx[a] = slice(start, start + step)
        yield tuple(idx)


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("gran", GRANULARITIES)
def test_computed_symmetric_int_maps_absmax_to_qmax_and_zero_to_zero(fmt, gran):
    x = _x().at[0, 0].set(0.0)
    qt = jq.quantize(x, dtype=fmt, **gran)
    f = jq.get_format(fmt)
    codes = np.asarray(qt.qvalue).astype(np.int64)
    assert codes[0, 0] == (0 if f.signed else (int(f.qmax) + 1) // 2)
    xd = np.asarray(qt.dequantize())
    assert xd[0, 0] == 0.0
    # every group's absmax lands on the largest symmetric code, so it comes back (nearly) exactly
    for idx in _groups(np.asarray(x), **gran):
        g, gd = np.asarray(x)[idx], xd[idx]
        i = np.unravel_index(np.argmax(np.abs(g)), g.shape)
        np.testing.assert_allclose(gd[i], g[i], rtol=1e-6)


@pytest.mark.parametrize("fmt,symmetric,reductions", [
    ("int8", True, {"reduce_max": 1}), ("uint4", True, {"reduce_max": 1}),
    ("float8_e4m3fn", True, {"reduce_max": 1}),
    ("uint8", False, {"reduce_max": 1, "reduce_min": 1})])
@pytest.mark.parametrize("gran", [dict(), dict(axis=0), dict(axis=-1)])
def test_computed_absmax_reads_the_array_once(fmt, symmetric, reductions, gran):
    # One reduction of |x| per computed symmetric scale (a max and a min would be two
    # passes over memory: GPT-2-small's tree took 1.13x a hand-written jit that way).
    jaxpr = jax.make_jaxpr(lambda x: jq.quantize(x, dtype=fmt, symmetric=symmetric, **gran))(
        _x()).jaxpr
    counts = {name: len(list(find_eqns(jaxpr, name))) for name in ("reduce_max", "reduce_min")}
    assert counts == {"reduce_max": 0, "reduce_min": 0, **reductions}


@pytest.mark.parametrize("fmt", ["int4", "uint4", "int8", "uint8", "int16"])
@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_computed_error_within_half_scale(fmt, gran, symmetric):
    x = np.asarray(_x(seed=1))
    qt = jq.quantize(x, dtype=fmt, symmetric=symmetric, **gran)
    xd = np.asarray(qt.dequantize())
    scales = np.asarray(qt.scale).reshape(-1) if qt.block_size is None else np.asarray(qt.scale)
    for k, idx in enumerate(_groups(x, **gran)):
        if qt.block_size:
            a = qt.axis
            s = np.expand_dims(np.take(scales, k, axis=a), a)
        elif qt.axis is not None:
            s = scales[k]
        else:
            s = scales[0]
        err = np.abs(xd[idx] - x[idx])
        assert (err <= s / 2 * (1 + 1e-5) + 1e-7).all()


def test_asymmetric_range_uses_all_codes_and_represents_zero():
    x = jnp.linspace(-1.0, 3.0, 256, dtype=jnp.float32)
    qt = jq.quantize(x, dtype=jnp.uint8, symmetric=False)
    # torch MinMaxObserver formula: scale = (max - min) / 255, zp = 0 - round(min / scale)
    scale = np.float32(4.0) / np.float32(255)
    assert np.asarray(qt.scale) == pytest.approx(scale, rel=1e-7)
    assert int(qt.zero_point) == 0 - round(-1.0 / float(scale))
    assert int(qt.qvalue.min()) == 0 and int(qt.qvalue.max()) == 255
    assert float(jq.dequantize(jq.quantize(jnp.zeros(3), qt.scale, qt.zero_point, dtype=jnp.uint8))[0]) == 0.0


@pytest.mark.parametrize("fmt", INT_FORMATS + FLOAT_FORMATS)
@pytest.mark.parametrize("gran", GRANULARITIES)
def test_all_zero_groups_give_zeros_not_nan(fmt, gran):
    x = _x().at[:, :5].set(0.0).at[:3].set(0.0)
    for symmetric in (True, False) if jq.get_format(fmt).is_integer else (True,):
        qt = jq.quantize(x, dtype=fmt, symmetric=symmetric, **gran)
        assert np.isfinite(np.asarray(qt.scale)).all() and (np.asarray(qt.scale) > 0).all()
        xd = np.asarray(qt.dequantize())
        assert np.isfinite(xd).all()
        assert (xd[np.asarray(x) == 0] == 0).all()
    assert (np.asarray(jq.quantize(jnp.zeros((4, 4)), dtype=fmt).dequantize()) == 0).all()


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
def test_float_formats_scale_from_largest_finite(fmt):
    x = _x()
    qt = jq.quantize(x, dtype=fmt, axis=0)
    fmax = float(ml_dtypes.finfo(np.dtype(getattr(jnp, fmt))).max)
    np.testing.assert_allclose(np.asarray(qt.scale), np.abs(np.asarray(x)).max(1) / fmax, rtol=1e-6)
    assert np.abs(np.asarray(qt.qvalue.astype(jnp.float32))).max() == fmax


def test_scale_of_unusual_input_dtypes_and_output_dtype():
    x = _x().astype(jnp.bfloat16)
    qt = jq.quantize(x)
    assert qt.dtype == jnp.bfloat16 and qt.scale.dtype == jnp.float32
    assert jq.dequantize(qt).dtype == jnp.bfloat16
    assert jq.dequantize(qt, jnp.float16).dtype == jnp.float16


def test_blocked_partial_last_block_scale_shape():
    x = _x((3, 10))
    qt = jq.quantize(x, dtype=jnp.int4, axis=-1, block_size=4)
    assert qt.scale.shape == (3, 3) and qt.axis == 1 and qt.block_size == 4
    last = np.abs(np.asarray(x)[:, 8:]).max(1) / 7
    np.testing.assert_allclose(np.asarray(qt.scale)[:, 2], last, rtol=1e-6)


def test_jit_vmap_and_grad_compose():
    x = _x((4, 8))
    s = jnp.float32(0.05)
    ref = jq.dequantize(jq.quantize(x, s))
    f = jax.jit(lambda x: jq.dequantize(jq.quantize(x, s)))
    np.testing.assert_array_equal(f(x), ref)
    v = jax.vmap(lambda row: jq.dequantize(jq.quantize(row, s)))(x)
    np.testing.assert_array_equal(v, ref)
    vc = jax.vmap(lambda row: jq.dequantize(jq.quantize(row)))(x)  # per-row computed scale
    np.testing.assert_array_equal(vc, jq.dequantize(jq.quantize(x, axis=0)))
    g = jax.grad(lambda x: jq.fake_quant(x, s).sum())(x)
    assert g.shape == x.shape


def test_qtensor_is_a_pytree_through_jit():
    qt = jq.quantize(_x(), dtype=jnp.int4, axis=1, block_size=4, symmetric=False)
    leaves, treedef = jax.tree.flatten(qt)
    assert len(leaves) == 3
    back = jax.tree.unflatten(treedef, leaves)
    assert back.axis == qt.axis and back.block_size == qt.block_size and back.dtype == qt.dtype
    out = jax.jit(lambda t: t)(qt)
    assert isinstance(out, jq.QTensor)
    np.testing.assert_array_equal(out.dequantize(), qt.dequantize())
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(qt)]
    assert paths == [".qvalue", ".scale", ".zero_point"]


def test_no_retrace_for_equal_shapes_and_metadata():
    traces = []

    @jax.jit
    def f(x, s):
        traces.append(1)
        return jq.dequantize(jq.quantize(x, s, axis=0))

    x1, x2 = _x((8, 4), 1), _x((8, 4), 2)
    s = jnp.full((8,), 0.1, jnp.float32)
    f(x1, s), f(x2, s * 2)
    assert len(traces) == 1
    before = _quantize._quantize_explicit._cache_size()
    jq.quantize(x1, s, axis=0), jq.quantize(x2, s * 3, axis=0)
    assert _quantize._quantize_explicit._cache_size() - before <= 1
    before = _quantize._quantize_explicit._cache_size()
    jq.quantize(x1, s, axis=0)
    assert _quantize._quantize_explicit._cache_size() == before
    f(x1.astype(jnp.float16), s)  # a new dtype is a new program
    assert len(traces) == 2


# --- every error branch -----------------------------------------------------------------


def test_error_wrong_scale_shape_per_axis():
    with pytest.raises(ValueError, match=r"scale must have shape \(13,\).*axis 1.*got \(6,\)"):
        jq.quantize(_x(), jnp.ones(6), axis=1)


def test_error_wrong_scale_shape_blocked():
    with pytest.raises(ValueError, match=r"scale must have shape \(6, 4\) for blocked.*got \(6, 3\)"):
        jq.quantize(_x(), jnp.ones((6, 3)), axis=1, block_size=4)


def test_error_scale_rank_without_block_size():
    with pytest.raises(ValueError, match=r"one element \(per-tensor\) or be 1-D"):
        jq.quantize(_x(), jnp.ones((6, 13)))


def test_error_axis_required_for_per_axis_scale():
    with pytest.raises(ValueError, match="axis is required"):
        jq.quantize(_x(), jnp.ones(13))


@pytest.mark.parametrize("axis", [2, -3])
def test_error_axis_out_of_range(axis):
    with pytest.raises(ValueError, match=rf"axis must be in \[-2, 2\) for an input of rank 2, got {axis}"):
        jq.quantize(_x(), axis=axis)
    with pytest.raises(ValueError, match="axis must be in"):
        jq.quantize(_x(), jnp.ones(6), axis=axis)


@pytest.mark.parametrize("block_size", [0, -4])
def test_error_block_size_not_positive(block_size):
    with pytest.raises(ValueError, match=f"block_size must be a positive integer, got {block_size}"):
        jq.quantize(_x(), axis=1, block_size=block_size)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        jq.QuantSpec(block_size=block_size)


def test_error_block_size_without_axis():
    with pytest.raises(ValueError, match="block_size requires axis"):
        jq.quantize(_x(), block_size=4)


@pytest.mark.parametrize("x", [jnp.arange(4), np.arange(4, dtype=np.uint8), [1, 2]])
def test_error_integer_input_to_quantize(x):
    with pytest.raises(TypeError, match="x must be a floating-point array, got dtype"):
        jq.quantize(x)
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        jq.fake_quant(x, jnp.float32(1))


@pytest.mark.parametrize("x, advice", [(jnp.ones(4, jnp.complex64), "quantize the real and "
                                        "imaginary parts"), (jnp.ones(4, bool), "cast it to a float"),
                                       (jnp.arange(4), "integer arrays are codes already")])
def test_error_for_a_non_float_input_says_what_to_do_with_it(x, advice):
    """A complex batch was told that integer arrays are codes (a calibration observer's too)."""
    with pytest.raises(TypeError, match=f"x must be a floating-point array, got dtype .*; {advice}"):
        jq.quantize(x)
    obs = jq.calibration.minmax()
    with pytest.raises(TypeError, match=advice):
        obs.update(obs.init(jnp.ones(4)), x)


def test_error_non_float_scale():
    with pytest.raises(TypeError, match="scale must be a float array, got dtype int32"):
        jq.quantize(_x(), jnp.int32(1))


@pytest.mark.parametrize("dtype", ["float32", jnp.bfloat16, "int64", "nf5", object])
def test_error_unknown_format(dtype):
    with pytest.raises(TypeError, match=r"dtype must be one of the quantized formats \[.*int8.*\], got"):
        jq.quantize(_x(), dtype=dtype)


def test_unknown_format_error_lists_the_schemes_dtype_also_takes():
    with pytest.raises(TypeError, match=r"or schemes \[.*'mxint8'.*'nvfp4'\], got 'mxfp5'\.$"):
        jq.quantize(_x(), dtype="mxfp5")


@pytest.mark.parametrize("name", ["float6_e2m3fn", "float6_e3m2fn"])
def test_numpy_float6_dtypes_name_their_codebooks(name):
    # as jnp.float4_e2m1fn names its format: jnp.float6_e2m3fn was refused, its string taken
    by_dtype = jq.quantize(_x(), dtype=getattr(ml_dtypes, name), axis=-1)
    by_name = jq.quantize(_x(), dtype=name, axis=-1)
    assert by_dtype.format == by_name.format == jq.CODEBOOKS[name]
    np.testing.assert_array_equal(np.asarray(by_dtype.qvalue), np.asarray(by_name.qvalue))


@pytest.mark.parametrize("dtype", ["nvfp4", "mxint8", jnp.int8])
def test_a_scalar_in_blocks_says_it_has_no_axis_to_split(dtype):
    kw = {} if isinstance(dtype, str) else dict(axis=-1, block_size=4)
    with pytest.raises(ValueError, match=r"^blocks of \d+ split an axis of the input; a scalar "
                                         r"\(rank 0\) has none"):
        jq.quantize(jnp.float32(1.0), dtype=dtype, **kw)


def test_error_mismatched_zero_point_dtype():
    with pytest.raises(TypeError, match="zero_point must have the code dtype int8, got uint8; pass dtype=jnp.uint8"):
        jq.quantize(_x(), jnp.float32(0.1), jnp.uint8(3))
    # a Python float was called "a weakly typed int, such as a Python int"
    with pytest.raises(TypeError, match=r"got float32 \(a weakly typed float, such as a Python "
                                        r"float: pass it as jnp.float8_e4m3fn codes\)"):
        jq.quantize(_x(), 1.0, 0.0, dtype=jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"got int32 \(a weakly typed int, such as a Python int "
                                        r"traced by jit: pass it as jnp.uint8 codes\)"):
        jax.jit(lambda z: jq.quantize(_x(), 1.0, z, dtype=jnp.uint8))(0)


def test_error_zero_point_shape():
    with pytest.raises(ValueError, match=r"zero_point must have the shape of scale, \(6,\); got \(\)"):
        jq.quantize(_x(), jnp.ones(6), jnp.int8(0), axis=0)


def test_error_non_zero_zero_point_for_float8():
    zp = jnp.asarray(np.float32(1.0).astype(ml_dtypes.float8_e4m3fn))
    with pytest.raises(ValueError, match="zero_point must be all zeros for the float format float8_e4m3fn"):
        jq.quantize(_x(), jnp.float32(0.1), zp, dtype=jnp.float8_e4m3fn)
    zero = jnp.zeros((), jnp.float8_e4m3fn)
    jq.quantize(_x(), jnp.float32(0.1), zero, dtype=jnp.float8_e4m3fn)  # zeros are fine


def test_non_zero_float8_zero_point_under_jit_is_caught_by_checkify():
    from jax.experimental import checkify

    def f(zp):
        return jq.quantize(_x(), jnp.float32(0.1), zp, dtype=jnp.float8_e4m3fn).qvalue

    err, _ = checkify.checkify(jax.jit(f))(jnp.ones((), jnp.float8_e4m3fn))
    with pytest.raises(checkify.JaxRuntimeError, match="zero_point must be all zeros"):
        err.throw()


def test_error_zero_point_without_scale_and_asymmetric_float():
    with pytest.raises(ValueError, match="zero_point was given without scale"):
        jq.quantize(_x(), zero_point=jnp.int8(1))
    with pytest.raises(ValueError, match="symmetric=False needs an integer format; float8_e5m2"):
        jq.quantize(_x(), dtype=jnp.float8_e5m2, symmetric=False)


def test_error_dequantize_non_qtensor_and_bad_dtype():
    with pytest.raises(TypeError, match="qt must be a jaxquant.QTensor, got ArrayImpl"):
        jq.dequantize(_x())
    with pytest.raises(TypeError, match="dtype must be a float dtype, got int8"):
        jq.dequantize(jq.quantize(_x()), jnp.int8)


def test_errors_raise_at_trace_time_under_jit():
    with pytest.raises(ValueError, match="axis must be in"):
        jax.jit(lambda x: jq.quantize(x, axis=5).qvalue)(_x())


def test_numpy_integer_axis_and_block_size_are_accepted_as_jax_does():
    """``axis=np.int64(1)`` (from shape arithmetic, or an ONNX attribute read with
    NumPy) means ``axis=1``, as in ``jnp.sum``; the static metadata holds Python ints."""
    x = _x()
    s = jnp.asarray(np.random.default_rng(2).uniform(0.01, 0.1, 13).astype(np.float32))
    qt = jq.quantize(x, s, axis=np.int64(-1))
    np.testing.assert_array_equal(qt.qvalue, jq.quantize(x, s, axis=-1).qvalue)
    assert type(qt.axis) is int and qt.axis == 1
    blocked = jq.quantize(x, axis=np.int32(1), block_size=np.int64(5))
    assert type(blocked.axis) is int and type(blocked.block_size) is int
    np.testing.assert_array_equal(blocked.qvalue, jq.quantize(x, axis=1, block_size=5).qvalue)
    assert jq.QTensor(qt.qvalue, s, axis=np.int8(1)).axis == 1
    with pytest.raises(TypeError, match="axis must be an int or None, got True"):
        jq.quantize(x, axis=True)
    with pytest.raises(TypeError, match="block_size must be a positive int or None, got 2.0"):
        jq.quantize(x, axis=0, block_size=2.0)


def test_error_float_zero_point_names_no_format_that_does_not_exist():
    with pytest.raises(TypeError, match=r"zero_point must have the code dtype int8, got float32\.$"):
        jq.quantize(_x(), jnp.float32(0.1), jnp.float32(0))


@pytest.mark.parametrize("call", [
    lambda: jq.quantize(jnp.ones(4), symmetric="no"),
    lambda: jq.quantize(jnp.ones((2, 4)), dtype=jnp.int4, axis=0, packed=1),
    lambda: jq.fake_quant(jnp.ones(4), lsq_grad_scale="yes"),
    lambda: jq.fake_quant(jnp.ones(4), saturate=None),
    lambda: jq.QuantSpec(symmetric="False"),
], ids=["quantize-symmetric", "quantize-packed", "fake-lsq", "fake-saturate", "spec"])
def test_flags_that_are_not_bools_are_type_errors(call):
    # a string such as "no" would otherwise read as True
    with pytest.raises(TypeError, match=r"must be a bool \(True or False\), got"):
        call()
