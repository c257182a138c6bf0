"""Argument validation of the public functions: bad input gets a TypeError/ValueError at trace
time that names the argument, never an internal error (AttributeError, IndexError, NumPy's
"data type not understood") or a silently wrong result.

Regressions found by fuzzing every public function's arguments with wrong types.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

X = jnp.linspace(-2.0, 2.0, 4 * 64, dtype=jnp.float32).reshape(4, 64)
W = jnp.linspace(-1.0, 1.0, 64 * 8, dtype=jnp.float32).reshape(64, 8)
QW = jq.quantize(W, axis=1)
DIMS = (((1,), (0,)), ((), ()))
ONE = jnp.float32(0.5)


# ----------------------------------------------------------------------------- arrays

@pytest.mark.parametrize("call, argname", [
    (lambda: jq.quantize(None), "x"),
    (lambda: jq.quantize(X, "a"), "scale"),
    (lambda: jq.quantize(X, ONE, "0"), "zero_point"),
    (lambda: jq.fake_quant(None), "x"),
    (lambda: jq.fake_quant(X, "a"), "scale"),
    (lambda: jq.fake_quant(X, ONE, "0"), "zero_point"),
    (lambda: jq.hadamard_transform(None), "x"),
    (lambda: jq.gptq(None, jnp.eye(64)), "w"),
    (lambda: jq.gptq(W, "h"), "hessian"),
    (lambda: jq.qdot_general(None, QW, DIMS), "lhs"),
    (lambda: jq.qdot_general(QW, "r", (((0,), (0,)), ((), ()))), "rhs"),
    (lambda: jq.qeinsum("ab,bc->ac", None, QW), "lhs"),  # was IndexError
    (lambda: jq.qeinsum("ab,bc->ac", X, None), "rhs"),
    (lambda: jq.qat_dot_general(None, W, DIMS), "lhs"),
    (lambda: jq.pack(None), "x"),
    (lambda: jq.pack_bits(None), "codes"),  # was AttributeError
    (lambda: jq.pack_bits([1, 2]), "codes"),
    (lambda: jq.unpack_bits(None, jnp.int4, 3), "packed"),  # was AttributeError
], ids=lambda v: v if isinstance(v, str) else "")
def test_non_arrays_are_type_errors_naming_the_argument(call, argname):
    with pytest.raises(TypeError, match=rf"^{argname}\b"):
        call()


# ----------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("call, argname", [
    (lambda: jq.quantize(X, dtype="mxfp4", scale_dtype="foo"), "scale_dtype"),
    (lambda: jq.fake_quant(X, dtype="nvfp4", scale_dtype=3), "scale_dtype"),
    (lambda: jq.QuantSpec(scale_dtype="foo"), "scale_dtype"),
    (lambda: jq.QuantSpec(scale_dtype=3), "scale_dtype"),
    (lambda: jq.qdot_general(X, QW, DIMS, None, "foo"), "preferred_element_type"),
    (lambda: jq.qdot_general(X, QW, DIMS, None, True, act_quant=jq.ActQuant()),
     "preferred_element_type"),
    (lambda: jax.jit(lambda x: jq.qdot_general(x, QW, DIMS, None, "foo"))(X),
     "preferred_element_type"),
    (lambda: jq.qeinsum("ab,bc->ac", X, QW, preferred_element_type="foo"),
     "preferred_element_type"),
    (lambda: jq.qat_dot_general(X, W, DIMS, None, "foo"), "preferred_element_type"),
    (lambda: jq.promote_dtype(X, dtype="foo"), "dtype"),
    (lambda: jq.unpack_bits(jnp.zeros(2, jnp.uint8), "nf4", 3), "dtype"),  # a codebook name
    (lambda: jq.pack_bits(jnp.ones(3)), "codes"),  # said "dtype must be one of ..."
    # an array is no dtype (np.dtype would read its .dtype; jnp refuses it too)
    (lambda: jq.quantize(X, dtype=jnp.array(3, jnp.int8)), "dtype"),
    (lambda: jq.dequantize(QW, jnp.array(1.0, jnp.float16)), "dtype"),
    (lambda: jax.jit(lambda d: jq.QTensor(QW.qvalue, QW.scale, axis=1, dtype=d))(
        jnp.ones((), jnp.bfloat16)), "dtype"),
    (lambda: jq.promote_dtype(X, dtype=np.float32(1)), "dtype"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_dtypes_are_type_errors_naming_the_argument(call, argname):
    with pytest.raises(TypeError, match=rf"^{argname}\b"):
        call()


# ----------------------------------------------------------------------------- records

@pytest.mark.parametrize("call, match", [
    (lambda: jq.format_name(None), "qt"),  # was AttributeError
    (lambda: jq.format_name(X), "qt"),
    (lambda: jq.format_report(None), "rows"),  # was "'NoneType' object is not iterable"
    (lambda: jq.format_report("ab"), "rows"),  # was AttributeError
    (lambda: jq.format_report([1]), "rows"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_non_records_are_type_errors_naming_the_argument(call, match):
    with pytest.raises(TypeError, match=rf"^{match}\b"):
        call()


@pytest.mark.parametrize("metadata", [3, "ab", [("a", "b")]])
def test_save_safetensors_metadata_must_be_a_dict(tmp_path, metadata):
    # was "'int' object is not iterable" / dict("ab")'s ValueError / a list taken as a dict
    with pytest.raises(TypeError, match=r"^metadata must be a dict"):
        jq.save_safetensors(tmp_path / "m.safetensors", {"a": X}, metadata=metadata)
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- qat_dot_general

@pytest.mark.parametrize("spec", [
    jq.QuantSpec(dtype="mxint8"),  # was AttributeError: 'str' object has no attribute 'name'
    jq.QuantSpec(block_size=(16, 8), axis=None),  # was "'>' not supported between tuple, int"
    jq.QuantSpec(scale_dtype=jnp.bfloat16),  # was ignored: float32 scales, silently
    jq.QuantSpec(axis=0, block_size=16, double_quant=True),  # was ignored silently
], ids=["scheme", "tiles", "bf16-scales", "double-quant"])
@pytest.mark.parametrize("fake", [False, True])
def test_qat_weight_specs_the_int8_dot_cannot_honour_are_refused(spec, fake):
    with pytest.raises(ValueError, match=r"^weight must"):
        jq.qat_dot_general(X, W, DIMS, weight=spec, fake=fake)
    with pytest.raises(ValueError, match=r"^weight must"):
        jq.QATDotGeneral(weight=spec, fake=fake)(X, W, DIMS)


@pytest.mark.parametrize("fake", ["no", None, 0, 1])
def test_qat_fake_must_be_a_bool(fake):
    # "no" was read as True: the fake-quant graph ran instead of the int8 dot
    with pytest.raises(TypeError, match=r"^fake must be a bool"):
        jq.qat_dot_general(X, W, DIMS, fake=fake)


# ----------------------------------------------------------------------------- gptq, schemes

@pytest.mark.parametrize("kw", [dict(axis=1.0), dict(axis=-1.0), dict(axis=0.0, block_size=16)])
def test_gptq_axis_must_be_an_int(kw):
    # a float axis was accepted as the int it equals
    x = jnp.linspace(-1.0, 1.0, 128 * 64).reshape(128, 64)
    with pytest.raises(ValueError, match=r"axis"):
        jq.gptq(W, x.T @ x, **kw)


@pytest.mark.parametrize("dtype", ["nf4", "fp4"])
def test_codebook_scheme_takes_a_list_of_tile_lengths_as_a_tuple(dtype):
    # quantize/QuantSpec accept a list of tile lengths; for the "nf4"/"fp4" schemes a list
    # became axis=-1 and "a tuple block_size gives a tile along every axis, so axis must be
    # None; got axis=-1" for an axis the caller never passed
    want = jq.quantize(X, dtype=dtype, block_size=(2, 32))
    for got in (jq.quantize(X, dtype=dtype, block_size=[2, 32]),
                jax.jit(lambda x: jq.quantize(x, dtype=dtype, block_size=[2, 32]))(X)):
        np.testing.assert_array_equal(np.asarray(got.qvalue), np.asarray(want.qvalue))
        np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
    np.testing.assert_array_equal(
        np.asarray(jq.fake_quant(X, dtype=dtype, block_size=[2, 32])),
        np.asarray(jq.dequantize(want)))


# ----------------------------------------------------------------------------- precision

@pytest.mark.parametrize("call", [
    lambda p: jq.qdot_general(X, QW, DIMS, p, act_quant=jq.ActQuant()),  # was ignored
    lambda p: jq.qdot_general(X, QW, DIMS, p),
    lambda p: jq.qeinsum("ab,bc->ac", X, QW, precision=p, act_quant=jq.ActQuant()),
    lambda p: jq.qat_dot_general(X, W, DIMS, p),
])
def test_a_precision_dot_general_does_not_take_is_refused_on_every_path(call):
    """The int8 x int8 dot is exact and ignored ``precision``: a typo passed silently there
    and failed only once the same call ran on a float path."""
    with pytest.raises(ValueError, match="precision must be None, a jax.lax.Precision.*got 'hihgest'"):
        call("hihgest")
    want = np.asarray(call("highest"))
    for p in (["highest", "highest"], ("highest", "highest"), jax.lax.Precision.HIGHEST):
        np.testing.assert_array_equal(np.asarray(call(p)), want)  # a list pair was unhashable


def test_pack_axis_error_does_not_offer_none():
    """``pack(axis=None)`` said "axis must be an int or None, got None"."""
    q = jq.quantize(W, dtype=jnp.int4, axis=1)
    with pytest.raises(TypeError, match=r"^axis must be an int, got None\.$"):
        jq.pack(q, axis=None)
    with pytest.raises(TypeError, match=r"^axis must be an int or None, got 'x'\.$"):
        jq.quantize(W, axis="x")
    # also where a one-element scale makes axis irrelevant: a wrong type is still a mistake
    for fn in (lambda: jq.quantize(W, jnp.float32(0.5), axis="x"),
               lambda: jq.fake_quant(W, jnp.float32(0.5), axis=1.0),
               lambda: jq.QTensor(jnp.ones(W.shape, jnp.int8), jnp.float32(0.5), axis="x")):
        with pytest.raises(TypeError, match=r"^axis must be an int or None, got "):
            fn()


@pytest.mark.parametrize("name", ["float6_e2m3fn", "float6_e3m2fn"])
def test_a_numpy_float6_input_is_a_type_error_naming_it(name):
    """NumPy holds float6 arrays, XLA aborts on them: refused by name (a tree keeps them,
    as it keeps integer codes: `test_default_rules_keep_scale_format_and_float6_leaves`)."""
    x = np.ones((2, 4), np.float32).astype(getattr(ml_dtypes, name))
    for fn in (jq.quantize, jq.fake_quant):
        with pytest.raises(TypeError, match=f"x must be an array XLA can hold, got dtype {name}"):
            fn(x)


@pytest.mark.parametrize("name", ["float6_e2m3fn", "float6_e3m2fn"])
def test_a_numpy_float6_scale_is_a_type_error_naming_it(name):
    """A float6 scale passed the float check and XLA failed with an internal error."""
    s6 = np.asarray(0.5, getattr(ml_dtypes, name))
    x, codes = jnp.array([1.0, -2.0, 3.0]), jnp.array([2, -4], jnp.int8)
    message = f"^scale must be an array XLA can hold, got dtype {name}"
    for make in (lambda: jq.quantize(x, s6), lambda: jq.fake_quant(x, s6),
                 lambda: jq.QTensor(codes, s6)):
        with pytest.raises(TypeError, match=message):
            make()


def test_a_python_int_zero_point_is_the_code_dtype():
    """``quantize(x, s, 3)`` was refused with the hint "pass dtype=jnp.int32"."""
    x, s = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8), jnp.float32(0.01)
    for dtype in (jnp.int8, jnp.uint8, jnp.int4):
        want = jq.quantize(x, s, jnp.asarray(3, dtype), dtype=dtype)
        got = jax.jit(lambda x, dtype=dtype: jq.quantize(x, s, 3, dtype=dtype))(x)
        assert got.zero_point.dtype == dtype
        np.testing.assert_array_equal(got.qvalue, want.qvalue)
        np.testing.assert_array_equal(jq.fake_quant(x, s, 3, dtype=dtype),
                                      jq.fake_quant(x, s, jnp.asarray(3, dtype), dtype=dtype))
    assert jq.quantize(x, s, 0, dtype=jnp.float8_e4m3fn).zero_point.dtype == jnp.float8_e4m3fn
    with pytest.raises(ValueError, match=r"zero_point must lie within the int8 codes "
                                         r"\[-128, 127\], got 200"):
        jq.quantize(x, s, 200)
    with pytest.raises(ValueError, match="zero_point must be all zeros for the float format"):
        jq.quantize(x, s, 3, dtype=jnp.float8_e4m3fn)


def test_float8_e8m0fnu_is_no_value_dtype():
    """A code 0 dequantized to e8m0 (no zero, no sign) came back NaN, silently."""
    qt = jq.quantize(jnp.array([1.0, 2.0**-20, -3.0]))
    with pytest.raises(TypeError, match="^dtype must be a float dtype with zero and negative "
                                        "values, got float8_e8m0fnu"):
        jq.dequantize(qt, jnp.float8_e8m0fnu)
    with pytest.raises(TypeError, match="^dtype must be a float dtype with zero"):
        jq.QTensor(qt.qvalue, qt.scale, dtype=jnp.float8_e8m0fnu)
    x = jnp.array([1.0, 2.0**-20], jnp.float8_e8m0fnu)
    for fn in (jq.quantize, jq.fake_quant):
        with pytest.raises(TypeError, match="^x must be a float array with zero and negative "
                                            "values, got dtype float8_e8m0fnu"):
            fn(x)


def test_arguments_that_would_have_no_effect_are_refused():
    """Before: accepted and ignored (computed mode refused a bad scale_rounding already)."""
    x, s = jnp.ones((2, 4)), jnp.float32(0.25)
    for fn in (jq.quantize, jq.fake_quant):
        with pytest.raises(ValueError, match=r"scale_rounding apply to computed scales; an "
                                             r"explicit scale is stored as given .*"
                                             r"scale_rounding='ceil'"):
            fn(x, s, scale_rounding="ceil")
    with pytest.raises(ValueError, match=r"lsq_grad_scale=True scales the gradients of an "
                                         r"explicit \(learned\) scale"):
        jq.fake_quant(x, lsq_grad_scale=True)
    assert jq.fake_quant(x, s, lsq_grad_scale=True).shape == x.shape


def test_load_safetensors_allow_plain_must_be_a_bool(tmp_path):
    jq.save_safetensors(tmp_path / "w", {"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"^allow_plain must be a bool \(True or False\), "
                                        r"got 'no'\.$"):
        jq.load_safetensors(tmp_path / "w", allow_plain="no")


def test_promote_dtype_is_flax_promote_dtype_for_arrays():
    linen = pytest.importorskip("flax.linen")
    cases = [((jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int8)), {}),
             ((jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.int8)), {}),
             ((jnp.ones(2, jnp.int32),), dict(inexact=False)),
             ((jnp.ones(2, jnp.float16), np.ones(2, np.float32)), {}),
             ((jnp.ones(2), None), dict(dtype=jnp.bfloat16)),
             # weakly typed scalars give way (they made bfloat16 operands float32)
             ((1.0, jnp.ones(2, jnp.bfloat16)), {}), ((jnp.asarray(1.0), jnp.ones(2, jnp.bfloat16)), {}),
             ((jnp.ones(2, jnp.bfloat16), 2), {}), ((jnp.ones(2, jnp.int8), 1), {})]
    for args, kw in cases:
        with jax.numpy_dtype_promotion("standard"):  # as jq.promote_dtype promotes
            want = linen.dtypes.promote_dtype(*args, **kw)
        got = jq.promote_dtype(*args, **kw)
        assert [None if a is None else a.dtype for a in got] == \
            [None if a is None else a.dtype for a in want], (args, kw)
    with pytest.raises(ValueError, match=r"dtype must be inexact .* got int32"):
        jq.promote_dtype(jnp.ones(2), dtype=jnp.int32)
    with pytest.raises(ValueError, match="inexact"):  # Flax's own refusal
        linen.dtypes.promote_dtype(jnp.ones(2), dtype=jnp.int32)
    with pytest.raises(TypeError, match=r"^args\[0\] must be an array, got str"):
        jq.promote_dtype("x", jnp.ones(2))


def test_a_traced_python_int_zero_point_is_refused_not_wrapped():
    """A jit-traced 300 was cast to uint4 (12) silently."""
    x = jnp.ones(4)
    with pytest.raises(TypeError, match=r"a Python int traced by jit: pass it as jnp\.uint4 "):
        jax.jit(lambda z: jq.quantize(x, 0.1, z, dtype=jnp.uint4))(300)


@pytest.mark.parametrize("kw", [dict(dtype="mxfp4"), dict(scale_dtype=jnp.float8_e8m0fnu)])
def test_double_quant_with_e8m0_scales_says_where_they_come_from(kw):
    # before: "mxfp4" named a scale_dtype the user never passed (the scheme's own)
    with pytest.raises(ValueError, match=r"cannot be combined with scale_dtype=float8_e8m0fnu "
                                         r"\(given, or the format's own"):
        jq.quantize(jnp.ones((2, 64)), double_quant=True, **kw)
