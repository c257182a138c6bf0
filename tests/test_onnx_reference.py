"""jaxquant against ONNX's own reference implementation, bit for bit.

Three kinds of check, all against code nobody on this project wrote:

1. Randomized cases (every format x granularity x with/without zero point,
   saturate on/off for floats) run through `onnx.reference.ReferenceEvaluator`
   on a single QuantizeLinear / DequantizeLinear node, compared bit for bit
   (codes as bit patterns, so NaN / inf / negative-zero patterns count).
2. The ONNX backend node conformance cases for QuantizeLinear and
   DequantizeLinear (`onnx/backend/test/case/node/{quantize,dequantize}linear.py`),
   captured by replacing their `expect` and replayed through jaxquant.
3. Exactness at scale: tens of millions of values against the NumPy formula
   that the ONNX reference evaluates (float32 `x / scale`, which NumPy rounds
   correctly), plus a demonstration that the naive `round(x * (1 / scale))`
   formulation does NOT reproduce it on the same data.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
import onnx.backend.test.case.node.dequantizelinear as onnx_dq_cases
import onnx.backend.test.case.node.quantizelinear as onnx_q_cases
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import jaxquant as jq

# ---------------------------------------------------------------------------
# ONNX reference helpers
# ---------------------------------------------------------------------------

# Opset 23 is the newest QuantizeLinear/DequantizeLinear we pin to; INT2/UINT2
# entered the type constraints of these ops in opset 25, so those use 25.
OPSET = 23
OPSET_FOR = {"int2": 25, "uint2": 25}

INT_FORMATS = ["int2", "uint2", "int4", "uint4", "int8", "uint8", "int16", "uint16"]
FLOAT8_FORMATS = ["float8_e4m3fn", "float8_e5m2"]
FLOAT_FORMATS = [*FLOAT8_FORMATS, "float4_e2m1fn"]
ALL_FORMATS = INT_FORMATS + FLOAT_FORMATS


def np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def onnx_run(op: str, inputs: dict[str, np.ndarray], opset: int = OPSET, **attrs) -> np.ndarray:
    """Runs one ONNX node through the reference evaluator and returns its output."""
    inputs = {k: np.asarray(v) for k, v in inputs.items()}
    node = helper.make_node(op, list(inputs), ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in inputs.items()
        ],
        [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, inputs)[0]


def bits(a, nbits: int | None = None) -> np.ndarray:
    """The bit patterns of ``a`` as unsigned integers (masked to ``nbits`` for sub-byte codes)."""
    a = np.asarray(a)
    u = a.view(np.dtype(f"u{a.dtype.itemsize}"))
    if nbits is not None and nbits < 8 * a.dtype.itemsize:
        u = u & np.array((1 << nbits) - 1, u.dtype)
    return u


def assert_same_bits(actual, expected, what: str, nbits: int | None = None) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = bits(actual, nbits), bits(expected, nbits)
    bad = np.flatnonzero(a != e)
    if bad.size:
        i = bad[:8]
        raise AssertionError(
            f"{what}: {bad.size} of {a.size} differ; at flat indices {i.tolist()}: "
            f"jaxquant bits {a.ravel()[i].tolist()} ({actual.ravel()[i].tolist()}) vs "
            f"ONNX bits {e.ravel()[i].tolist()} ({expected.ravel()[i].tolist()})"
        )


# ---------------------------------------------------------------------------
# 1. Randomized cases against the ONNX reference evaluator
# ---------------------------------------------------------------------------

GRANULARITIES = ["per_tensor", "per_axis_pos", "per_axis_neg", "blocked"]

# Every format in every granularity, with and without a zero point: the zero point
# alternates between granularities (and between formats), so that each format meets
# both, each granularity meets both, and no format x granularity x zero point product
# compiles twice the same kernel for the same question.
CASES = [
    (fmt, gran, (i + j) % 2 == 1, True)
    for i, fmt in enumerate(ALL_FORMATS) for j, gran in enumerate(GRANULARITIES)
] + [
    # saturate=False: float8 overflow becomes NaN (e4m3fn) / inf (e5m2). ONNX
    # ignores `saturate` for FLOAT4E2M1 (no NaN/inf to produce), so float4
    # must saturate either way. The zero point is the other choice than with
    # saturate=True, so every float format x granularity sees both.
    (fmt, gran, (ALL_FORMATS.index(fmt) + j) % 2 == 0, False)
    for fmt in FLOAT_FORMATS for j, gran in enumerate(GRANULARITIES)
]


def case_id(case) -> str:
    fmt, gran, zp, sat = case
    return f"{fmt}-{gran}-{'zp' if zp else 'nozp'}-{'sat' if sat else 'nosat'}"


def expand_np(v: np.ndarray, shape, axis, block_size) -> np.ndarray:
    """A scale-shaped array broadcast to ``shape`` (independent of both implementations)."""
    if v.size == 1:
        return np.broadcast_to(v.reshape(()), shape)
    if not block_size:
        dims = [1] * len(shape)
        dims[axis] = v.size
        return np.broadcast_to(v.reshape(dims), shape)
    full = np.repeat(v, block_size, axis=axis)
    return np.take(full, np.arange(shape[axis]), axis=axis)


def few_bit_scales(rng, shape) -> np.ndarray:
    """Scales ``m * 2**e`` with odd ``m < 64``: mostly not powers of two, yet
    ``(k + 0.5) * scale`` is exact in float32 for every ``|k| < 2**17``."""
    m = 2 * rng.integers(0, 32, size=shape) + 1
    e = rng.integers(-10, 4, size=shape)
    return (m * np.exp2(e)).astype(np.float32)


def finite_grid(fmt: jq.Format) -> np.ndarray:
    """The non-negative finite values of a float format, ascending (from all bit patterns)."""
    vals = np.arange(1 << fmt.bits, dtype=np.uint8).view(fmt.dtype).astype(np.float64)
    return np.unique(vals[np.isfinite(vals) & (vals >= 0)])


def make_shape(rng):
    rank = int(rng.integers(1, 5))
    dims = [int(d) for d in rng.integers(2, 7, size=rank)]
    axis = int(rng.integers(0, rank))
    other = math.prod(dims) // dims[axis]
    dims[axis] = max(int(rng.integers(5, 18)), -(-96 // other))  # >= ~96 elements in all
    return tuple(dims), axis


def int_values(rng, S: np.ndarray, Z: np.ndarray, fmt: jq.Format) -> np.ndarray:
    """float32 inputs whose quotients by ``S`` hit ties, near-ties, the clip edges, far out, +-0."""
    n = S.size
    S, Z = S.ravel().astype(np.float64), Z.ravel().astype(np.float64)
    lo, hi = fmt.qmin - Z - 3, fmt.qmax - Z + 3  # quotients around (and past) both clip edges
    k = np.floor(rng.uniform(lo, hi + 1)).astype(np.float64)
    tie = (k + 0.5) * S
    assert np.all(tie.astype(np.float32) == tie), "test bug: a tie is not exact in float32"
    tie32 = tie.astype(np.float32)
    sign = rng.choice([-1.0, 1.0], size=n)
    candidates = [
        tie32,  # exact ties k + 0.5: round half to even decides
        np.nextafter(tie32, np.float32(np.inf)),  # one ulp either side of a tie
        np.nextafter(tie32, np.float32(-np.inf)),
        (k * S).astype(np.float32),  # exact integers
        # Far outside the code range, but |x / scale| < 2**31: the ONNX reference
        # casts np.rint(x / scale) to int32 *before* clipping, so larger quotients
        # would overflow there (undefined result plus a RuntimeWarning).
        (sign * rng.uniform(1e6, 1e9, size=n) * S).astype(np.float32),
        np.zeros(n, np.float32),
        np.full(n, -0.0, np.float32),
        (rng.uniform(lo - 10, hi + 10) * S).astype(np.float32),  # arbitrary quotients
    ]
    p = np.array([0.25, 0.1, 0.1, 0.12, 0.08, 0.05, 0.05, 0.25])
    cat = rng.choice(len(candidates), size=n, p=p)
    cat[: len(candidates)] = np.arange(len(candidates))  # every kind at least once
    cat = rng.permutation(cat)
    return np.choose(cat, candidates).astype(np.float32)


def float_values(rng, S: np.ndarray, fmt: jq.Format, with_nan: bool) -> np.ndarray:
    """float32 inputs whose quotients by ``S`` hit every code, ties between codes
    (including the one past the largest finite value), near-ties, subnormals,
    overflow, +-inf, +-NaN and +-0."""
    n = S.size
    S = S.ravel().astype(np.float64)
    grid = finite_grid(fmt)
    step = grid[-1] - grid[-2]
    mids = np.concatenate([(grid[1:] + grid[:-1]) / 2, [grid[-1] + step / 2]])
    sign = rng.choice([-1.0, 1.0], size=n)
    exact = sign * grid[rng.integers(0, grid.size, size=n)] * S
    tie = sign * mids[rng.integers(0, mids.size, size=n)] * S
    assert np.all(tie.astype(np.float32) == tie), "test bug: a tie is not exact in float32"
    tie32 = tie.astype(np.float32)
    tiny = grid[1]  # smallest positive (subnormal) value
    nan = np.where(sign > 0, np.float32(np.nan), -np.float32(np.nan)).astype(np.float32)
    candidates = [
        exact.astype(np.float32),
        tie32,
        np.nextafter(tie32, np.float32(np.inf)),
        np.nextafter(tie32, np.float32(-np.inf)),
        (sign * rng.uniform(1e6, 1e9, size=n) * S).astype(np.float32),
        np.zeros(n, np.float32),
        np.full(n, -0.0, np.float32),
        (sign * np.inf).astype(np.float32),
        (rng.uniform(-4 * tiny, 4 * tiny, size=n) * S).astype(np.float32),  # subnormal range
        (rng.normal(size=n) * grid[-1] / 4 * S).astype(np.float32),
    ]
    p = [0.15, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.04, 0.1, 0.16]
    if with_nan:
        candidates.append(nan)
        p = [*p[:-1], p[-1] - 0.04, 0.04]
    cat = rng.choice(len(candidates), size=n, p=np.array(p))
    cat[: len(candidates)] = np.arange(len(candidates))
    cat = rng.permutation(cat)
    return np.choose(cat, candidates).astype(np.float32)


def make_case(case):
    """Deterministic inputs for one parameter combination."""
    fmt_name, gran, with_zp, saturate = case
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    fmt = jq.get_format(np_dtype(fmt_name))
    shape, axis = make_shape(rng)
    rank = len(shape)
    block_size = None
    if gran == "per_tensor":
        scale_shape = () if rng.random() < 0.5 else (1,)
        # ONNX ignores axis for a one-element scale; so must jaxquant.
        j_axis = None if rng.random() < 0.5 else axis
        o_axis = j_axis
    elif gran == "per_axis_pos":
        scale_shape, j_axis = (shape[axis],), axis
        o_axis = j_axis
    elif gran == "per_axis_neg":
        scale_shape, j_axis = (shape[axis],), axis - rank
        o_axis = j_axis
    else:
        n = shape[axis]
        bs_choices = [b for b in range(2, n) if n % b]  # partial last block
        block_size = int(rng.choice(bs_choices))
        scale_shape = tuple(-(-n // block_size) if i == axis else d for i, d in enumerate(shape))
        j_axis = axis - rank if rng.random() < 0.5 else axis
        o_axis = j_axis
    scale = few_bit_scales(rng, scale_shape)
    if with_zp:
        if fmt.is_integer:
            zp = rng.integers(int(fmt.qmin), int(fmt.qmax) + 1, size=scale_shape).astype(fmt.dtype)
        else:
            zp = np.zeros(scale_shape, np.float32).astype(fmt.dtype)
    else:
        zp = None
    S = expand_np(scale, shape, axis, block_size)
    if fmt.is_integer:
        # No NaN/inf for integer codes: the ONNX reference casts rint(NaN) to int32
        # (undefined value plus a RuntimeWarning); the contract leaves it open.
        Z = np.zeros(shape) if zp is None else expand_np(zp.astype(np.float64), shape, axis, block_size)
        x = int_values(rng, S, Z, fmt)
    else:
        # float4_e2m1fn has no NaN; ONNX leaves NaN -> FLOAT4E2M1 unspecified
        # (ml_dtypes happens to map +NaN to -0 and -NaN to +0), so no NaN there.
        x = float_values(rng, S, fmt, with_nan=fmt.bits == 8)
    x = x.reshape(shape)
    return dict(fmt=fmt, x=x, scale=scale, zp=zp, j_axis=j_axis, o_axis=o_axis,
                block_size=block_size, saturate=saturate)


def onnx_quantize(c) -> np.ndarray:
    inputs = {"x": c["x"], "scale": c["scale"]}
    attrs = {"saturate": int(c["saturate"])}
    if c["zp"] is not None:
        inputs["zp"] = c["zp"]
    else:
        attrs["output_dtype"] = helper.np_dtype_to_tensor_dtype(c["fmt"].dtype)
    if c["o_axis"] is not None:
        attrs["axis"] = c["o_axis"]
    if c["block_size"]:
        attrs["block_size"] = c["block_size"]
    return onnx_run("QuantizeLinear", inputs, OPSET_FOR.get(c["fmt"].name, OPSET), **attrs)


def onnx_dequantize(codes, scale, zp, c, output_dtype=None) -> np.ndarray:
    inputs = {"x": codes, "scale": scale}
    if zp is not None:
        inputs["zp"] = zp
    attrs = {}
    if c["o_axis"] is not None:
        attrs["axis"] = c["o_axis"]
    if c["block_size"]:
        attrs["block_size"] = c["block_size"]
    if output_dtype is not None:
        attrs["output_dtype"] = helper.np_dtype_to_tensor_dtype(np.dtype(output_dtype))
    return onnx_run("DequantizeLinear", inputs, OPSET_FOR.get(c["fmt"].name, OPSET), **attrs)


def jq_quantize(c) -> jq.QTensor:
    return jq.quantize(c["x"], c["scale"], c["zp"], dtype=c["fmt"].dtype, axis=c["j_axis"],
                       block_size=c["block_size"], saturate=c["saturate"])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_quantize_matches_onnx_reference(case):
    c = make_case(case)
    expected = onnx_quantize(c)
    qt = jq_quantize(c)
    assert qt.shape == c["x"].shape
    assert_same_bits(qt.qvalue, expected, f"QuantizeLinear codes ({case_id(case)})",
                     nbits=c["fmt"].bits)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dequantize_matches_onnx_reference(case):
    """``jq.dequantize(qt)`` against DequantizeLinear on the same codes, in float32
    and (through a float16 / bfloat16 scale, as ONNX derives the output type from
    the scale) in a 16-bit float."""
    c = make_case(case)
    qt = jq_quantize(c)
    codes = np.asarray(qt.qvalue)
    failures = []
    try:
        assert_same_bits(jq.dequantize(qt), onnx_dequantize(codes, c["scale"], c["zp"], c),
                         f"DequantizeLinear float32 ({case_id(case)})")
    except AssertionError as e:
        failures.append(str(e))
    half = [np.float16, ml_dtypes.bfloat16][zlib.crc32(case_id(case).encode()) % 2]
    scale16 = c["scale"].astype(half)
    qt16 = jq.QTensor(qt.qvalue, jnp.asarray(scale16), qt.zero_point, axis=c["j_axis"],
                      block_size=c["block_size"], dtype=half)
    with np.errstate(over="ignore"):  # large codes * scale overflow float16 to inf: expected
        expected16 = onnx_dequantize(codes, scale16, c["zp"], c)
    try:
        assert_same_bits(jq.dequantize(qt16), expected16,
                         f"DequantizeLinear {np.dtype(half).name} ({case_id(case)})")
    except AssertionError as e:
        failures.append(str(e))
    assert not failures, "\n".join(failures)


def test_randomized_inputs_cover_the_hard_cases():
    """Guards the generator itself: ties land exactly on k + 0.5 and the
    quotients straddle both clip edges, so the comparisons above can fail."""
    for case in CASES:
        fmt_name, _, with_zp, _ = case
        c = make_case(case)
        fmt = c["fmt"]
        S = expand_np(c["scale"], c["x"].shape, c["j_axis"] if c["j_axis"] is not None else 0,
                      c["block_size"])
        q = c["x"] / S  # float32, correctly rounded
        assert np.any(np.signbit(c["x"]) & (c["x"] == 0)), case_id(case)
        if fmt.is_integer:
            frac = q - np.floor(q)
            assert np.count_nonzero(frac == 0.5) >= 3, case_id(case)
            assert np.any(np.abs(q) >= 1e6), case_id(case)
            assert np.all(np.abs(q) < 2.0**31), case_id(case)
            Z = 0 if c["zp"] is None else expand_np(c["zp"].astype(np.float64), q.shape,
                                                     c["j_axis"] if c["j_axis"] is not None else 0,
                                                     c["block_size"])
            r = np.rint(q) + Z
            assert np.any(r > fmt.qmax), case_id(case)
            assert np.any(r < fmt.qmin), case_id(case)
        else:
            assert np.any(np.isinf(c["x"])), case_id(case)
            assert np.any(np.abs(q[np.isfinite(q)]) > fmt.max_finite), case_id(case)


# ---------------------------------------------------------------------------
# 2. ONNX backend conformance cases
# ---------------------------------------------------------------------------


def _capture_conformance_cases():
    """(name, node, inputs, outputs) of every QuantizeLinear/DequantizeLinear case.

    Importing the modules already ran each ``export*`` once through the real
    ``expect`` (which only records in memory); here each one is run again with
    ``expect`` replaced by a recorder.
    """
    captured = []

    def record(node, inputs, outputs, name, **kwargs):
        captured.append((name, node, list(inputs), list(outputs)))

    for module, cls in ((onnx_q_cases, onnx_q_cases.QuantizeLinear),
                        (onnx_dq_cases, onnx_dq_cases.DequantizeLinear)):
        original = module.expect
        module.expect = record
        try:
            for attr in sorted(vars(cls)):
                if attr.startswith("export"):
                    np.random.seed(0)  # noqa: NPY002  (as onnx's own exporter does)
                    getattr(cls, attr)()
        finally:
            module.expect = original
    return captured


CONFORMANCE = _capture_conformance_cases()

# Cases that jaxquant's contract (API.md) does not cover, by name, with the
# reason. A captured case that jaxquant cannot run and that is not listed here
# fails `test_conformance_cases_are_all_accounted_for`, so nothing is dropped
# silently when onnx adds cases. (onnx 1.23's 27 cases are all in the contract.)
OUT_OF_CONTRACT_BY_NAME: dict[str, str] = {}

# Reasons for whole classes of cases, used to explain (and must match) the
# automatic classification below.
OUT_OF_CONTRACT_REASONS = {
    "format": "code type is not a jaxquant format (FNUZ float8, FLOAT6E2M3/E3M2, 8-bit E8M0 "
              "and other types outside API.md's list)",
    "precision": "the `precision` attribute (opset 25 division precision) is not part of "
                 "jaxquant's contract: the quotient is always the float32 one",
    "quotient_dtype": "x / scale is not computed in float32 by ONNX (e.g. float16 x and "
                      "float16 scale divide in float16); jaxquant's contract fixes float32",
}


def _arr(v) -> np.ndarray:
    return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _is_jq_format(dt: np.dtype) -> bool:
    return np.dtype(dt).name in jq.FORMATS


def _classify(node, inputs) -> str | None:
    """None when jaxquant's contract covers the case, else a key of OUT_OF_CONTRACT_REASONS."""
    attrs = _attrs(node)
    arrs = [_arr(v) for v in inputs]
    if node.op_type == "QuantizeLinear":
        if attrs.get("precision"):
            return "precision"
        if len(arrs) > 2:
            out = arrs[2].dtype
        elif "output_dtype" in attrs:
            out = np.dtype(helper.tensor_dtype_to_np_dtype(attrs["output_dtype"]))
        else:
            out = np.dtype(np.uint8)
        if not _is_jq_format(out):
            return "format"
        if np.result_type(arrs[0].dtype, arrs[1].dtype) != np.float32:
            return "quotient_dtype"
        return None
    assert node.op_type == "DequantizeLinear", node.op_type
    if not _is_jq_format(arrs[0].dtype):
        return "format"
    return None


def _run_conformance_case(node, inputs) -> np.ndarray:
    attrs = _attrs(node)
    arrs = [_arr(v) for v in inputs]
    axis = attrs.get("axis", 1)  # ONNX's default; irrelevant for one-element scales
    block_size = attrs.get("block_size", 0) or None
    if node.op_type == "QuantizeLinear":
        x, scale = arrs[0], arrs[1]
        zp = arrs[2] if len(arrs) > 2 else None
        if zp is not None:
            dtype = zp.dtype
        elif "output_dtype" in attrs:
            dtype = helper.tensor_dtype_to_np_dtype(attrs["output_dtype"])
        else:
            dtype = np.uint8
        qt = jq.quantize(x, scale, zp, dtype=dtype, axis=axis, block_size=block_size,
                         saturate=bool(attrs.get("saturate", 1)))
        return np.asarray(qt.qvalue)
    codes, scale = arrs[0], arrs[1]
    zp = arrs[2] if len(arrs) > 2 else None
    out = (helper.tensor_dtype_to_np_dtype(attrs["output_dtype"]) if attrs.get("output_dtype")
           else scale.dtype)
    qt = jq.QTensor(jnp.asarray(codes), jnp.asarray(scale),
                    None if zp is None else jnp.asarray(zp),
                    axis=axis, block_size=block_size, dtype=out)
    return np.asarray(jq.dequantize(qt))


RUNNABLE = [case for case in CONFORMANCE if _classify(case[1], case[2]) is None]


def test_conformance_cases_are_all_accounted_for():
    names = [name for name, *_ in CONFORMANCE]
    assert len(names) == len(set(names))
    skipped = {name: _classify(node, inputs) for name, node, inputs, _ in CONFORMANCE
               if _classify(node, inputs) is not None}
    unexplained = sorted(set(skipped) - set(OUT_OF_CONTRACT_BY_NAME))
    assert not unexplained, (
        f"conformance cases outside the contract but not listed in OUT_OF_CONTRACT_BY_NAME: "
        f"{ {n: OUT_OF_CONTRACT_REASONS[skipped[n]] for n in unexplained} }"
    )
    stale = sorted(n for n in OUT_OF_CONTRACT_BY_NAME if n in names and n not in skipped)
    assert not stale, f"listed as out of contract, yet jaxquant's contract covers them: {stale}"
    ops = [node.op_type for _, node, _, _ in RUNNABLE]
    assert ops.count("QuantizeLinear") >= 12, ops
    assert ops.count("DequantizeLinear") >= 12, ops
    assert len(RUNNABLE) >= 25


@pytest.mark.parametrize("case", RUNNABLE, ids=[name for name, *_ in RUNNABLE])
def test_onnx_conformance_case(case):
    name, node, inputs, outputs = case
    (expected,) = [_arr(o) for o in outputs]
    actual = _run_conformance_case(node, inputs)
    nbits = jq.get_format(expected.dtype).bits if _is_jq_format(expected.dtype) else None
    assert_same_bits(actual, expected, name, nbits=nbits)
    # The harness itself: the reference evaluator agrees with the recorded outputs.
    arrs = {f"i{i}": _arr(v) for i, v in enumerate(inputs)}
    node2 = helper.make_node(node.op_type, list(arrs), ["y"], **_attrs(node))
    graph = helper.make_graph(
        [node2], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in arrs.items()],
        [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    ref = ReferenceEvaluator(model).run(None, arrs)[0]
    assert_same_bits(ref, expected, f"{name} (ONNX reference vs its own recorded output)",
                     nbits=nbits)


# ---------------------------------------------------------------------------
# 3. Exactness at scale
# ---------------------------------------------------------------------------

N = 1 << 23  # 8M values per data set


def _big_datasets():
    """Three 8M-value float32 data sets: (name, x, scale, axis)."""
    rng = np.random.default_rng(20240607)
    out = []
    # (a) Gaussian, per-tensor, a scale that is not a power of two (nor few-bit).
    x = (rng.standard_normal(N, dtype=np.float32) * np.float32(0.9))
    out.append(("gaussian_per_tensor", x, np.float32(0.0173), None))
    # (b) Laplace, per-axis along the last axis, random float32 scales.
    rows, cols = 2048, N // 2048
    sc = rng.uniform(2e-3, 5e-2, size=cols).astype(np.float32)
    x = (rng.laplace(size=(rows, cols)) * sc * 40).astype(np.float32)
    out.append(("laplace_per_axis_last", x, sc, 1))
    # (c) Tie-heavy, per-axis along axis 0, few-bit scales (3/128, 5/64, ...):
    # exact ties k + 0.5 and their float32 neighbours, among uniform values.
    rows, cols = 4096, N // 4096
    sc = few_bit_scales(rng, rows)
    S = sc[:, None].astype(np.float64)
    k = rng.integers(-200, 200, size=(rows, cols)).astype(np.float64)
    tie = ((k + 0.5) * S).astype(np.float32)
    u = rng.random((rows, cols))
    x = np.where(u < 0.4, tie,
                 np.where(u < 0.55, np.nextafter(tie, np.float32(np.inf)),
                          np.where(u < 0.7, np.nextafter(tie, np.float32(-np.inf)),
                                   (rng.uniform(-300, 300, size=(rows, cols)) * S).astype(np.float32))))
    out.append(("ties_per_axis_first", x.astype(np.float32), sc, 0))
    return out


@pytest.fixture(scope="module")
def big_datasets():
    return _big_datasets()


def _zero_point(rng, dtype, scale):
    info = np.iinfo(dtype)
    shape = np.shape(scale)
    return rng.integers(info.min // 2, info.max // 2 + 1, size=shape).astype(dtype)


def _broadcast_shape(x, axis):
    return [1] * x.ndim if axis is None else [x.shape[i] if i == axis else 1 for i in range(x.ndim)]


def _numpy_codes(x, scale, zp, axis, dtype):
    """What the ONNX reference computes: float32 x / scale (correctly rounded by
    NumPy), rint (half to even), + zero point, clip."""
    info = np.iinfo(dtype)
    bshape = _broadcast_shape(x, axis)
    s = np.asarray(scale, np.float32).reshape(bshape)
    z = np.asarray(zp).astype(np.float32).reshape(bshape)
    q = np.rint(x / s) + z
    assert q.dtype == np.float32
    return np.clip(q, info.min, info.max).astype(dtype)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["int8", "uint8"])
def test_integer_codes_exact_at_scale(big_datasets, dtype):
    rng = np.random.default_rng(7 if dtype == np.int8 else 8)
    for name, x, scale, axis in big_datasets:
        zp = _zero_point(rng, dtype, scale)
        ref = _numpy_codes(x, scale, zp, axis, dtype)
        got = np.asarray(jq.quantize(x, scale, zp, dtype=dtype, axis=axis).qvalue)
        assert got.dtype == ref.dtype
        bad = np.flatnonzero(got != ref)
        assert bad.size == 0, (
            f"{name}: {bad.size} of {x.size} codes differ from the float32 formula, e.g. "
            f"x={x.ravel()[bad[:4]].tolist()} got {got.ravel()[bad[:4]].tolist()} "
            f"expected {ref.ravel()[bad[:4]].tolist()}"
        )


@pytest.mark.parametrize("dtype", [np.int8, np.uint8], ids=["int8", "uint8"])
def test_naive_reciprocal_formulation_is_not_exact(big_datasets, dtype):
    """``round(x * (1 / scale))`` (two roundings) moves codes across ties on the
    same data where jaxquant has none wrong: the exact division path matters."""
    info = np.iinfo(dtype)

    @jax.jit
    def naive(x, s, z):
        return jnp.clip(jnp.round(x * (1 / s)) + z, info.min, info.max).astype(dtype)

    rng = np.random.default_rng(7 if dtype == np.int8 else 8)
    naive_bad = jq_bad = 0
    for _, x, scale, axis in big_datasets:
        zp = _zero_point(rng, dtype, scale)
        ref = _numpy_codes(x, scale, zp, axis, dtype)
        bshape = _broadcast_shape(x, axis)
        s = jnp.asarray(np.asarray(scale, np.float32).reshape(bshape))
        z = jnp.asarray(np.asarray(zp).astype(np.float32).reshape(bshape))
        naive_bad += int(np.count_nonzero(np.asarray(naive(jnp.asarray(x), s, z)) != ref))
        got = np.asarray(jq.quantize(x, scale, zp, dtype=dtype, axis=axis).qvalue)
        jq_bad += int(np.count_nonzero(got != ref))
    assert jq_bad == 0
    # ~2e5 on this seeded data, nearly all on the exact ties of the third set.
    assert naive_bad >= 1000, naive_bad


@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("fmt_name", FLOAT8_FORMATS)
def test_float8_codes_exact_at_scale(fmt_name, saturate):
    """4M values, per-axis scales (half few-bit so that ties between codes are
    exact, half arbitrary), against ml_dtypes' cast of the NumPy float32 quotient
    (clipped to the largest finite value first when saturating), as ONNX does."""
    fmt = jq.get_format(np_dtype(fmt_name))
    rng = np.random.default_rng(zlib.crc32(f"{fmt_name}-{saturate}".encode()))
    rows, cols = 1024, 4096
    sc = np.where(np.arange(rows) % 2 == 0, few_bit_scales(rng, rows),
                  rng.uniform(1e-3, 1.0, size=rows).astype(np.float32)).astype(np.float32)
    S = sc[:, None].astype(np.float64)
    grid = finite_grid(fmt)
    step = grid[-1] - grid[-2]
    mids = np.concatenate([(grid[1:] + grid[:-1]) / 2, [grid[-1] + step / 2]])
    shape = (rows, cols)
    sign = rng.choice([-1.0, 1.0], size=shape)
    tie = (sign * mids[rng.integers(0, mids.size, size=shape)] * S).astype(np.float32)
    lo, hi = np.log2(grid[1] / 4), np.log2(grid[-1] * 4)
    candidates = [
        (sign * grid[rng.integers(0, grid.size, size=shape)] * S).astype(np.float32),
        tie,
        np.nextafter(tie, np.float32(np.inf)),
        np.nextafter(tie, np.float32(-np.inf)),
        (sign * np.exp2(rng.uniform(lo, hi, size=shape)) * S).astype(np.float32),
        np.where(sign > 0, np.float32(np.nan), -np.float32(np.nan)).astype(np.float32),
        (sign * np.inf).astype(np.float32),
        (sign * 0.0).astype(np.float32),
    ]
    cat = rng.choice(len(candidates), size=shape, p=[0.2, 0.25, 0.1, 0.1, 0.31, 0.01, 0.01, 0.02])
    x = np.choose(cat, candidates).astype(np.float32)
    q = x / sc[:, None]  # float32, correctly rounded
    if saturate:
        q = np.clip(q, -fmt.max_finite, fmt.max_finite)
    ref = q.astype(fmt.dtype)
    got = np.asarray(jq.quantize(x, sc, dtype=fmt.dtype, axis=0, saturate=saturate).qvalue)
    assert_same_bits(got, ref, f"{fmt_name} saturate={saturate}")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "float8_e4m3fn"])
def test_zero_and_negative_explicit_scales_are_used_as_onnx_uses_them(dtype):
    """Explicit scales are not checked for sign or zero: the codes are ONNX's (per channel: a
    zero, a negative and a positive scale side by side), and so are the dequantized values."""
    x = np.array([[1.5, -2.25, 0.0, 7.0], [-0.5, 3.0, 100.0, -100.0]], np.float32)
    scale = np.array([0.0, -0.5, 0.25, 2.0], np.float32)
    zp = np.zeros(4, np_dtype(dtype))
    want = onnx_run("QuantizeLinear", {"x": x[:, 1:], "scale": scale[1:], "zp": zp[1:]}, axis=1)
    got = jq.quantize(x, scale, zp, dtype=np_dtype(dtype), axis=1)
    assert_same_bits(got.qvalue[:, 1:], want, f"{dtype} codes")
    # x / 0: a nonzero value saturates (NaN for 0 / 0: the zero point's code, as documented)
    fmt = jq.get_format(dtype)
    column = np.asarray(got.qvalue[:, 0]).astype(np.float32)
    assert column[0] == fmt.qmax and column[1] == (fmt.qmin if fmt.is_integer else -fmt.qmax)
    back = onnx_run("DequantizeLinear", {"x": np.asarray(got.qvalue), "scale": scale, "zp": zp},
                    axis=1)
    assert_same_bits(jq.dequantize(got), back, f"{dtype} values")


@pytest.mark.parametrize("zp_values", [[-0.0], [0.0], [-0.0, 0.0, -0.0, 0.0]],
                         ids=["neg", "pos", "mixed-per-axis"])
def test_float4_zero_point_of_negative_zero_keeps_negative_zero_codes(zp_values):
    # ONNX computes x / s + zp: -0.0 + -0.0 stays -0.0 (code 8), -0.0 + 0.0 is +0.0
    # (code 0). Before, every float4 zero point turned -0.0 into +0.0.
    x = np.array([[-0.0, 0.0, -0.1, -2.0, 3.0]] * 4, np.float32)
    s = np.full(4 if len(zp_values) > 1 else (), 0.5, np.float32)
    zp = np.array(zp_values if len(zp_values) > 1 else zp_values[0], np_dtype("float4_e2m1fn"))
    axis = {"axis": 0} if len(zp_values) > 1 else {}
    want = onnx_run("QuantizeLinear", {"x": x, "s": s, "z": zp}, **axis)
    got = jq.quantize(jnp.asarray(x), jnp.asarray(s), jnp.asarray(zp), dtype="float4_e2m1fn",
                      **axis)
    assert_same_bits(got.qvalue, want, "codes", nbits=4)
    fq = np.asarray(jq.fake_quant(jnp.asarray(x), jnp.asarray(s), jnp.asarray(zp),
                                  dtype="float4_e2m1fn", **axis))
    deq = np.asarray(got.dequantize())
    assert_same_bits(fq, deq, "fake_quant vs dequantize(quantize)")  # -0.0 included
