"""Optimization barriers against XLA:GPU rewrites: present in programs lowered for GPUs and
TPUs, absent (fusion untouched) on CPU, and never a change of value or dtype where it matters.

The failures they prevent were seen on an NVIDIA H100 (jaxlib 0.11.2): a jitted MXFP4/NVFP4
fake quantization came back unrounded, int8 x int8 dots of freshly quantized activations
returned doubled products, and weight-only dots of unpacked int4 codes wrong sums. CI has no
GPU, so these tests check the programs JAX lowers for one (``lowering_platforms``).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxpr_utils import lowered_text

import jaxquant as jq
from jaxquant._barriers import (
    contraction_first_dot,
    float_conv_sums,
    gemm_operand,
    int_conv,
    int_dot_general,
    keep_rounding,
)
from jaxquant._dot import ActQuant, qdot_general

DN = (((1,), (0,)), ((), ()))


def _barrier_types(text):
    """The element types of every optimization barrier's results, in order."""
    return re.findall(r"stablehlo\.optimization_barrier [^\n]*: tensor<[0-9x]*([a-zA-Z0-9]+)>",
                      text)


@pytest.mark.parametrize("name,types", [("mxfp4", ["f4E2M1FN"]),
                                        ("nvfp4", ["f4E2M1FN", "f8E4M3FN"]),
                                        ("float8_e4m3fn", ["f8E4M3FN"])])
def test_narrow_float_codes_sit_behind_a_barrier_off_cpu(name, types):
    x = jnp.linspace(-5.0, 5.0, 256).reshape(4, 64)
    fq = lambda x: jq.fake_quant(x, dtype=name)  # noqa: E731
    for platform in ("cuda", "rocm", "tpu"):
        assert sorted(_barrier_types(lowered_text(fq, x, platform=platform))) == sorted(types)
    assert _barrier_types(lowered_text(fq, x, platform="cpu")) == []


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_integer_fake_quant_has_no_barrier(name):
    x = jnp.linspace(-5.0, 5.0, 256).reshape(4, 64)
    assert _barrier_types(lowered_text(lambda x: jq.fake_quant(x, dtype=name), x,
                                       platform="cuda")) == []


@pytest.mark.parametrize("dtype,types", [(jnp.bfloat16, ["bf16"]), (jnp.float16, ["f16"])])
def test_narrow_float_fake_quant_values_sit_behind_a_barrier_off_cpu(dtype, types):
    """A QAT layer promotes its bfloat16 fake-quantized kernel to float32: XLA:GPU folded the
    rounding to bfloat16 away (the QAT model then differed from the quantized one by ~1e-3)."""
    x = jnp.linspace(-5.0, 5.0, 256, dtype=dtype).reshape(4, 64)
    fq = lambda x: jq.fake_quant(x, dtype="int8").astype(jnp.float32)  # noqa: E731
    assert _barrier_types(lowered_text(fq, x, platform="cuda")) == types
    assert _barrier_types(lowered_text(fq, x, platform="cpu")) == []
    np.testing.assert_array_equal(np.asarray(jax.jit(fq)(x)),
                                  np.asarray(jq.fake_quant(x, dtype="int8"), np.float32))


def test_int8_dot_operands_sit_behind_barriers_off_cpu():
    x = jax.random.normal(jax.random.key(0), (16, 8))
    w = jq.quantize(jax.random.normal(jax.random.key(1), (8, 16)), axis=1)
    f = lambda x, w: qdot_general(x, w, DN, act_quant=ActQuant())  # noqa: E731
    assert _barrier_types(lowered_text(f, x, w, platform="cuda")) == ["i8", "i8"]
    assert _barrier_types(lowered_text(f, x, w, platform="cpu")) == []


@pytest.mark.parametrize("dtype,widened", [("int4", "i8"), ("uint4", "ui8"), ("int2", "i8")])
def test_unpacked_sub_byte_weights_are_widened_behind_a_barrier_off_cpu(dtype, widened):
    x = jax.random.normal(jax.random.key(0), (5, 70))
    w = jq.quantize(jax.random.normal(jax.random.key(1), (33, 70)), dtype=dtype, axis=0,
                    symmetric=not dtype.startswith("u"))
    f = lambda x, w: qdot_general(x, w, (((1,), (1,)), ((), ())))  # noqa: E731
    # the codes, and the zero points of an asymmetric format (int4 read inside a GEMM fusion
    # gave wrong products, zero points too)
    behind = [widened] * (1 if w.zero_point is None else 2)
    assert _barrier_types(lowered_text(f, x, w, platform="cuda")) == behind
    assert _barrier_types(lowered_text(f, x, w, platform="cpu")) == []
    ref = np.asarray(x, np.float64) @ np.asarray(jq.dequantize(w), np.float64).T
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x, w)), ref, rtol=1e-5, atol=1e-5)


def test_int8_and_packed_weights_keep_their_fusion():
    x = jax.random.normal(jax.random.key(0), (5, 64))
    w = jax.random.normal(jax.random.key(1), (64, 32))
    f = lambda x, w: qdot_general(x, w, DN)  # noqa: E731
    for q in (jq.quantize(w, axis=1), jq.quantize(w, dtype="int4", axis=1, packed=True)):
        assert _barrier_types(lowered_text(f, x, q, platform="cuda")) == []


def test_gemm_operand_values_and_dtypes():
    for dtype, wide in [(jnp.int4, jnp.int8), (jnp.uint4, jnp.uint8), (jnp.int2, jnp.int8),
                        (jnp.uint2, jnp.uint8), (jnp.int8, jnp.int8), (jnp.uint8, jnp.uint8)]:
        info = jnp.iinfo(dtype)
        codes = jnp.arange(info.min, info.max + 1).astype(dtype)
        out = jax.jit(gemm_operand)(codes)
        assert out.dtype == wide
        np.testing.assert_array_equal(np.asarray(out, np.int32), np.asarray(codes, np.int32))


def test_keep_rounding_is_the_identity():
    t = jnp.linspace(-6.0, 6.0, 97)
    for dtype in (jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float8_e5m2):
        c = t.astype(dtype)
        out = jax.jit(keep_rounding)(c)
        assert out.dtype == c.dtype
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.asarray(c).view(np.uint8))



def _integer_contractions(text):
    """The contracted length of every dot_general and the input features per group of every
    convolution on 8-bit integer operands in StableHLO ``text``."""
    shape = lambda t: [int(d) for d in t.split("x")[:-1]]  # noqa: E731
    found = []
    for m in re.finditer(r"stablehlo\.dot_general [^\n]*contracting_dims = \[([\d, ]*)\] x "
                         r"\[[\d, ]*\][^\n]*: \(tensor<([\dx]+xu?i8)>", text):
        found.append(("dot", math.prod(shape(m[2])[int(d)] for d in m[1].split(","))))
    for m in re.finditer(r"stablehlo\.convolution[^\n]*\]x\[([^\]]*)\][^\n]*: \(tensor<[\dx]+xi8>, "
                         r"tensor<([\dx]+xi8)>", text):
        found.append(("conv", shape(m[2])[[d.strip() for d in m[1].split(",")].index("i")]))
    return found


def test_int8_contractions_are_padded_to_a_multiple_of_four():
    """XLA:GPU's int8 dots over 2..15 (and more) elements not divisible by 4 doubled the sums;
    the padding is in every backend's program (so CI runs the padded program)."""
    nnx = pytest.importorskip("flax.nnx")
    from jaxquant.flax import ActSpec, QuantConfig, nnx_quantize

    x, w = jnp.linspace(-2.0, 2.0, 4 * 6).reshape(4, 6), jnp.linspace(-1.0, 1.0, 6 * 6)
    w = w.reshape(6, 6)
    conv = nnx.Conv(6, 6, (3,), feature_group_count=3, rngs=nnx.Rngs(0))
    nnx_quantize(conv, QuantConfig(act=ActSpec()))
    programs = {  # name: (function, arguments, the contractions padded from 6 and 2)
        "w8a8": (lambda x, w: qdot_general(x, jq.quantize(w, axis=1), DN, act_quant=ActQuant()),
                 (x, w), {("dot", 8)}),
        "QAT int8 dot, int8 backward": (jax.grad(lambda x, w: jnp.sum(jnp.sin(
            jq.qat_dot_general(x, w, DN, backward="int8"))), argnums=(0, 1)), (x, w),
            {("dot", 8)}),
        "grouped int8 convolution": (lambda x: conv(x), (jnp.ones((2, 9, 6)),), {("conv", 4)}),
    }
    for name, (fn, args, padded) in programs.items():
        for platform in ("cpu", "cuda"):
            text = lowered_text(fn, *args, platform=platform)
            found = set(_integer_contractions(text))
            if platform == "cuda" and "convolution" in name:  # cuDNN: no int32 convolution
                assert not found and re.search(r"stablehlo\.convolution[^\n]*tensor<[\dx]+xf32>",
                                               text), (name, platform, found)
                continue
            assert found == padded, (name, platform, found)


@pytest.mark.parametrize("dims,shapes", [((((1,), (0,)), ((), ())), ((5, 6), (6, 7))),
                                         ((((2,), (1,)), ((0,), (0,))), ((3, 4, 6), (3, 6, 5))),
                                         ((((1, 2), (0, 1)), ((), ())), ((2, 3, 3), (3, 3, 4))),
                                         # both contracted on their last axis (SwitchBack's
                                         # backward): rhs transposed to contraction first
                                         ((((1,), (1,)), ((), ())), ((5, 9), (70, 9))),
                                         ((((2,), (2,)), ((0,), (0,))), ((3, 4, 6), (3, 5, 6))),
                                         # rhs: contracting, free, batch axes
                                         ((((1,), (0,)), ((0,), (2,))), ((3, 6), (6, 5, 3)))])
def test_the_padded_int8_dot_gives_the_same_sums(dims, shapes):
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.integers(-128, 128, s), jnp.int8) for s in shapes)
    want = lax.dot_general(np.asarray(a, np.int64), np.asarray(b, np.int64), dims)
    for dot in (int_dot_general, contraction_first_dot):  # the latter: the branch off CPU
        got = jax.jit(dot, static_argnums=2)(a, b, dims)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_switchback_backward_takes_the_codes_contraction_first():
    """XLA:GPU's Triton GEMMs doubled SwitchBack's int8 product (the weight's codes contracted
    on their last axis) in a program with the forward dot; off CPU each int8 dot's rhs is now
    laid out contraction first (the same sums: `test_the_padded_int8_dot_gives_the_same_sums`
    runs that branch, `contraction_first_dot`, here)."""
    x, w, g = jnp.ones((5, 70)), jnp.linspace(-1.0, 1.0, 70 * 9).reshape(70, 9), jnp.ones((5, 9))

    def joint(g, x, w):
        y, vjp = jax.vjp(lambda x, w: jq.qat_dot_general(x, w, DN, act=ActQuant(),
                                                         backward="int8"), x, w)
        return y, *vjp(g)

    for platform in ("cpu", "cuda"):
        text = lowered_text(joint, g, x, w, platform=platform)
        rhs_dims = re.findall(r"stablehlo\.dot_general [^\n]*contracting_dims = \[[\d, ]*\] x "
                              r"\[([\d, ]*)\][^\n]*: \(tensor<[\dx]+xi8>, tensor<[\dx]+xi8>", text)
        # the forward dot and SwitchBack's (twice on the CPU: the branches of a lax.cond),
        # whose weight codes the CPU reads in place (a transpose cost 1.8x there)
        want = {"cuda": ["0", "0"], "cpu": ["0", "1", "1"]}[platform]
        assert sorted(rhs_dims) == want, (platform, rhs_dims)


@pytest.mark.parametrize("groups,layout", [(1, ("NWC", "WIO", "NWC")), (3, ("NWC", "WIO", "NWC")),
                                           (3, ("NCW", "OIW", "NCW"))])
def test_the_padded_int8_convolution_gives_the_same_sums(groups, layout):
    rng = np.random.default_rng(1)
    lhs_shape = (2, 9, 6) if layout[0] == "NWC" else (2, 6, 9)
    rhs_shape = (3, 6 // groups, 6) if layout[1] == "WIO" else (6, 6 // groups, 3)
    x, w = (jnp.asarray(rng.integers(-128, 128, s), jnp.int8) for s in (lhs_shape, rhs_shape))
    dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, layout)

    def conv(a, b, **kw):
        return lax.conv_general_dilated(a, b, (2,), "SAME", dimension_numbers=dn,
                                        feature_group_count=groups, **kw)

    want = conv(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                precision=lax.Precision.HIGHEST)  # sums below 2**24: exact in float32
    got = jax.jit(lambda x, w: int_conv(conv, x, w, dn, groups))(x, w)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want, np.int64))


@pytest.mark.parametrize("groups,in_features,width", [
    (1, 6, 3),  # 18 products per output: one float32 convolution
    (2, 1002, 3),  # 1,503 products per output (an odd sum): split into 4-bit halves
])
@pytest.mark.parametrize("dtypes", [(jnp.int8, jnp.int8), (jnp.uint8, jnp.int8)],
                         ids=["int8", "uint8-input"])
def test_float_conv_sums_are_the_exact_integer_sums(groups, in_features, width, dtypes):
    """The GPU route of `int_conv` (cuDNN has no int32 convolution), run here on the CPU: the
    extreme codes make products as large as they get, so an inexact float32 sum shows."""
    rng = np.random.default_rng(groups)
    info = np.iinfo(dtypes[0])
    lhs_shape, rhs_shape = (2, 7, in_features), (width, in_features // groups, 4)
    x = rng.integers(info.min, info.max + 1, lhs_shape)
    w = rng.integers(-128, 128, rhs_shape)
    # one batch row and one output feature of large odd codes: their sums pass 2**24 and are
    # odd, which a float32 sum cannot hold
    odd = lambda lo, shape: lo + 2 * rng.integers(0, 14, shape)  # noqa: E731
    x[0] = odd(229, x[0].shape) if info.min == 0 else -odd(101, x[0].shape)
    w[..., 0] = -odd(101, w[..., 0].shape)
    dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, ("NWC", "WIO", "NWC"))

    def conv(a, b, **kw):
        return lax.conv_general_dilated(a, b, (1,), "SAME", dimension_numbers=dn,
                                        feature_group_count=groups, **kw)

    terms = width * in_features // groups
    got = jax.jit(lambda a, b: float_conv_sums(conv, a, b, terms))(
        jnp.asarray(x, dtypes[0]), jnp.asarray(w, dtypes[1]))
    with jax.enable_x64():  # the int64 convolution on the CPU: the exact sums
        cpu = jax.devices("cpu")[0]
        want = conv(*(jax.device_put(jnp.asarray(v, jnp.int64), cpu) for v in (x, w)))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
