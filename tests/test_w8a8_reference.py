"""The int8 x int8 -> int32 dot (``act_quant=ActQuant()``) against references nobody on the
project wrote: ONNX ``DynamicQuantizeLinear`` / ``QuantizeLinear`` / ``MatMulInteger`` /
``QLinearMatMul`` (``onnx.reference`` and, where installed, ONNX Runtime) and PyTorch's
dynamic quantized ``Linear`` (fbgemm).

What must match, and how tightly:

* codes, zero points, scales and int32 accumulators: exactly;
* the float output ``acc * s_x * s_w``: ONNX Runtime's graph and fbgemm multiply
  ``acc * (s_x * s_w)`` (two float32 roundings after the exact int32 -> float32 cast,
  which is exact below ``2**24``), jaxquant ``(acc * s_x) * s_w``; each product is within
  half an ulp, so the two are within ``2**-22`` of each other relative to the result,
  element by element (a product has no cancellation);
* PyTorch's weight codes: torch rounds ``w * (1 / s)`` where ONNX and jaxquant round the
  correctly rounded ``w / s``, so codes may differ by one, only where ``w / s`` lies within
  a few ulps of a half-integer (the largest weight of a channel is exactly one:
  ``amax / (amax / 127.5)`` is ``127.5``);
* PyTorch's activations are asymmetric uint8 with ``reduce_range`` (codes 0..127),
  quantized as fbgemm does (``rint(x * (1 / s)) + zp``); given those codes as a uint8
  `QTensor`, jaxquant's dot equals torch's output to the bound above; jaxquant's own
  symmetric int8 activations differ from torch's by the two quantization errors only.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import jaxquant as jq

try:  # a second, compiled ONNX implementation where installed (the bench extras)
    import onnxruntime as ort
except ImportError:  # pragma: no cover
    ort = None


def _x86_without_vnni() -> bool:
    """Whether this is an x86 CPU without VNNI: ONNX Runtime's uint8 x int8 kernel there adds
    pairs of products in int16 (``vpmaddubsw``) and saturates, so its ``MatMulInteger`` is
    not exact (its own documentation recommends ``reduce_range`` for such CPUs)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


DN = (((1,), (0,)), ((), ()))
W8A8 = jq.ActQuant()
_X86_WITHOUT_VNNI = _x86_without_vnni()
REL = 2.0**-22  # (acc * sx) * sw against acc * (sx * sw): see the module docstring
_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int8): TensorProto.INT8,
          np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int32): TensorProto.INT32}


def _onnx(nodes, feeds: dict, outputs: dict) -> list:
    """Runs an opset-21 graph of ``(op, inputs, outputs, attrs)`` nodes through
    ``onnx.reference`` and ONNX Runtime (when installed, its graph run as written, except an
    integer matmul on x86 without VNNI, where it saturates); their outputs must agree bit for
    bit."""
    feeds = {k: np.asarray(v) for k, v in feeds.items()}
    graph = helper.make_graph(
        [helper.make_node(op, i, o, **a) for op, i, o, a in nodes], "g",
        [helper.make_tensor_value_info(k, _TYPES[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(k, _TYPES[np.dtype(t)], None) for k, t in outputs.items()])
    # IR 10: what ONNX Runtime reads (newer onnx releases write IR versions it refuses)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    ref = ReferenceEvaluator(model).run(None, feeds)
    integer_matmul = any(op in ("MatMulInteger", "QLinearMatMul") for op, *_ in nodes)
    if ort is not None and not (integer_matmul and _X86_WITHOUT_VNNI):  # unfused: its MatMulIntegerToFloat fusion rounds the scaling apart
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(model.SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
        for a, b in zip(ref, sess.run(None, feeds), strict=True):
            np.testing.assert_array_equal(a, b)
    return ref


def _int8_graph(x_name: str, zp_name: str) -> list:
    """MatMulInteger of ``x_name`` and ``w`` (zero points ``zp_name``, ``wz``), cast to
    float and multiplied by ``sx * sw``: ONNX Runtime's dynamic quantization of a MatMul."""
    return [("MatMulInteger", [x_name, "w", zp_name, "wz"], ["acc"], {}),
            ("Cast", ["acc"], ["accf"], dict(to=TensorProto.FLOAT)),
            ("Mul", ["sx", "sw"], ["s"], {}),
            ("Mul", ["accf", "s"], ["y"], {})]


def _act_codes(x, axes):
    """ActQuant's codes as its docstring writes them: ``absmax / 127`` per group (1 for
    zeros), ``clip(round_half_even(x / scale), -127, 127)`` with float32 (IEEE) division."""
    amax = np.max(np.abs(x), axis=axes, keepdims=True, initial=0.0)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return np.clip(np.rint(x / s), -127, 127), s


def _assert_close(y, ref, rel=REL):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert y.shape == ref.shape
    np.testing.assert_array_less(np.abs(y - ref), rel * np.abs(ref) + 1e-30)


# ----------------------------------------------------------------------------- ONNX


def test_uint8_activations_equal_dynamic_quantize_linear_and_matmul_integer():
    """jaxquant's asymmetric uint8 quantization is DynamicQuantizeLinear's (scale, zero point,
    codes); as the lhs QTensor of the int8 dot, its int32 sums are MatMulInteger's and its
    output ONNX Runtime's dynamic-quantized MatMul."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 6)).astype(np.float32)
    qw = jq.quantize(jnp.asarray(w), axis=1)  # int8, per output column
    wc, sw = np.asarray(qw.qvalue), np.asarray(qw.scale)
    base = rng.standard_normal((5, 40)).astype(np.float32)
    for x in (base * 3 + 0.7, np.abs(base), -np.abs(base) * 1e-3, np.full((1, 40), 2.5, np.float32)):
        xq, sx, zx = _onnx([("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], {})], {"x": x},
                           {"q": np.uint8, "s": np.float32, "z": np.uint8})
        qx = jq.quantize(jnp.asarray(x), dtype=jnp.uint8, symmetric=False)
        np.testing.assert_array_equal(np.asarray(qx.qvalue), xq)
        np.testing.assert_array_equal(np.asarray(qx.scale), sx)
        np.testing.assert_array_equal(np.asarray(qx.zero_point).reshape(()), zx)

        feeds = {"q": xq, "w": wc, "z": zx, "wz": np.zeros(6, np.int8), "sx": sx, "sw": sw}
        acc, y = _onnx(_int8_graph("q", "z"), feeds, {"acc": np.int32, "y": np.float32})
        ones = jq.QTensor(jnp.asarray(wc), jnp.ones(6, jnp.float32), axis=1)
        sums = jq.qdot_general(jq.QTensor(jnp.asarray(xq), jnp.float32(1), jnp.asarray(zx)),
                               ones, DN, act_quant=W8A8)  # unit scales: the int32 sums
        np.testing.assert_array_equal(np.asarray(sums), acc.astype(np.float32))
        _assert_close(jq.qdot_general(qx, qw, DN, act_quant=W8A8), y)


@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_int8_activations_equal_quantize_linear_and_matmul_integer(granularity):
    """Per token over a batch (3-D activation) or per tensor, against a uint8 weight with a
    zero point per column: QuantizeLinear gives the codes, MatMulInteger the int32 sums."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3, 48)) * rng.uniform(0.01, 50, (2, 3, 1))).astype(np.float32)
    x[0, 1] = 0.0  # an all-zero token
    x[1, 2] = -4.0  # a constant token
    w = rng.standard_normal((48, 7)).astype(np.float32) + 0.3
    qw = jq.quantize(jnp.asarray(w), dtype=jnp.uint8, axis=1, symmetric=False)
    wc, sw, wz = (np.asarray(a) for a in (qw.qvalue, qw.scale, qw.zero_point))

    x2 = x.reshape(6, 48)
    ref_codes, sx = _act_codes(x2, 1 if granularity == "token" else None)
    quant = ("QuantizeLinear", ["x", "s1", "z1"], ["q"], dict(axis=0))
    xq, acc, y = _onnx([quant, *_int8_graph("q", "z0")],
                       {"x": x2, "s1": np.broadcast_to(sx, (6, 1))[:, 0].copy(),
                        "z1": np.zeros(6, np.int8), "z0": np.zeros((), np.int8), "w": wc,
                        "wz": wz, "sx": sx, "sw": sw},
                       {"q": np.int8, "acc": np.int32, "y": np.float32})
    np.testing.assert_array_equal(xq, ref_codes)

    dims = (((2,), (0,)), ((), ()))
    act = jq.ActQuant(granularity=granularity)
    unit = jq.QTensor(jnp.asarray(wc), jnp.ones(7, jnp.float32), jnp.asarray(wz), axis=1)
    sums = np.asarray(jq.qdot_general(x, unit, dims, act_quant=act), np.float64).reshape(6, 7)
    # f32(acc) * sx is within half an ulp of acc * sx: dividing recovers acc (|acc| < 2**22)
    np.testing.assert_array_equal(np.rint(sums / sx), acc)
    _assert_close(np.asarray(jq.qdot_general(x, qw, dims, act_quant=act)).reshape(6, 7), y)


def test_qlinear_matmul_is_the_int8_dot_requantized():
    """QLinearMatMul (per-tensor int8 operands) and DequantizeLinear of its result are
    QuantizeLinear of jaxquant's float output (one code apart only next to a tie)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    qw = jq.quantize(jnp.asarray(rng.standard_normal((64, 16)).astype(np.float32)))
    y = np.asarray(jq.qdot_general(x, qw, DN, act_quant=jq.ActQuant(granularity="tensor")))
    xq, sx = _act_codes(x, None)
    sy, z = np.float32(np.abs(y).max() / 100), np.zeros((), np.int8)
    nodes = [("QLinearMatMul", ["a", "sa", "z", "b", "sb", "z", "sy", "z"], ["q"], {}),
             ("DequantizeLinear", ["q", "sy", "z"], ["yq"], {}),
             ("QuantizeLinear", ["yj", "sy", "z"], ["qj"], {})]
    q, yq, qj = _onnx(nodes, {"a": xq.astype(np.int8), "sa": sx.reshape(()), "z": z,
                              "b": np.asarray(qw.qvalue), "sb": np.asarray(qw.scale), "sy": sy,
                              "yj": y}, {"q": np.int8, "yq": np.float32, "qj": np.int8})
    exact = (xq.astype(np.int64) @ np.asarray(qw.qvalue).astype(np.int64)
             * (np.float64(sx.reshape(())) * np.float64(qw.scale) / np.float64(sy)))
    near_tie = np.abs(np.abs(exact - np.floor(exact)) - 0.5) < 1e-4
    assert np.abs(q.astype(int) - qj).max() <= 1
    np.testing.assert_array_equal(q[~near_tie], qj[~near_tie])
    np.testing.assert_array_less(np.abs(yq - y), sy * 0.5001)


def test_a_large_activation_scale_does_not_overflow_a_finite_product():
    """Activations near 1e36 against small weights: the product (about 1e34) is finite, and
    ONNX Runtime's graph (``acc * (sx * sw)``) gives it; ``acc * sx`` alone overflows and
    must not turn it into inf."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 256)) * 1e36).astype(np.float32)
    qw = jq.quantize(jnp.asarray(rng.standard_normal((256, 4)).astype(np.float32) * 1e-3),
                     axis=1)
    xq, sx = _act_codes(x, 1)
    (y,) = _onnx([("QuantizeLinear", ["x", "s1", "z1"], ["q"], dict(axis=0)),
                  *_int8_graph("q", "z0")],
                 {"x": x, "s1": sx[:, 0], "z1": np.zeros(3, np.int8), "z0": np.zeros((), np.int8),
                  "w": np.asarray(qw.qvalue), "wz": np.zeros(4, np.int8), "sx": sx,
                  "sw": np.asarray(qw.scale)}, {"y": np.float32})
    assert np.isfinite(y).all()
    for act in (W8A8, jq.ActQuant(granularity="tensor")):
        out = np.asarray(jq.qdot_general(x, qw, DN, act_quant=act))
        assert np.isfinite(out).all()
        if act == W8A8:
            _assert_close(out, y)


# ----------------------------------------------------------------------------- PyTorch


def _torch_dynamic_linear(per_channel: bool):
    torch = pytest.importorskip("torch")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if "fbgemm" not in torch.backends.quantized.supported_engines:  # x86 only
        pytest.skip("the activation rounding below is fbgemm's")

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 9)
    with torch.no_grad():
        lin.weight[2, 5] = 0.0  # a zero weight: code 0 in both
        lin.bias.zero_()  # the output is then acc * (sx * sw), rounded once
    spec = {torch.nn.Linear: per_channel_dynamic_qconfig} if per_channel else {torch.nn.Linear}
    return torch, lin, quantize_dynamic(torch.nn.Sequential(lin), spec, dtype=torch.qint8)[0]


# torch.ao.quantization is deprecated (DeprecationWarning, raised from typing_extensions) and
# PyTorch 2.13 warns on every quantized tensor it creates (UserWarning)
@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_matches_torch_dynamic_quantized_linear(per_channel):
    torch, lin, qlin = _torch_dynamic_linear(per_channel)
    qweight = qlin.weight()
    codes = qweight.int_repr().numpy()  # (out, in)
    assert codes[2, 5] == 0
    w = lin.weight.detach().numpy()
    if per_channel:
        sw = qweight.q_per_channel_scales().numpy().astype(np.float32)
        assert not qweight.q_per_channel_zero_points().numpy().any()
        mine = jq.quantize(jnp.asarray(w), jnp.asarray(sw), axis=0)
    else:
        sw = np.float32(qweight.q_scale())
        assert qweight.q_zero_point() == 0
        mine = jq.quantize(jnp.asarray(w), jnp.asarray(sw))
    # the weight codes: equal but for ties of w / s, which torch's w * (1 / s) misses
    t = w / (sw[:, None] if per_channel else sw)
    diff = np.asarray(mine.qvalue).astype(int) - codes
    assert np.abs(diff).max() <= 1
    assert (np.abs(np.abs(t[diff != 0]) % 1 - 0.5) < 1e-5).all()

    # torch's activation: uint8, reduce_range (0..127), per tensor, fbgemm's rounding
    x = (torch.randn(6, 64) * 2 + 0.3)
    scale, zp = torch._choose_qparams_per_tensor(x, True)
    sx = np.float32(scale)
    xc = np.clip(np.rint(x.numpy() * (np.float32(1) / sx)) + zp, 0, 127).astype(np.uint8)
    yt = qlin(x).detach().numpy()
    qx = jq.QTensor(jnp.asarray(xc), jnp.float32(sx), jnp.asarray(np.uint8(zp)))
    qw = jq.QTensor(jnp.asarray(codes.T), jnp.asarray(sw), axis=1 if per_channel else None)
    _assert_close(jq.qdot_general(qx, qw, DN, act_quant=W8A8), yt)

    # jaxquant's own symmetric int8 activations: both within their rounding errors of the
    # float product of torch's weights (torch's: one step sx at most, with the nudged zp)
    y = np.asarray(jq.qdot_general(jnp.asarray(x.numpy()), qw, DN, act_quant=W8A8), np.float64)
    wd = np.asarray(jq.dequantize(qw), np.float64)
    _, sj = _act_codes(x.numpy(), 1)
    bound = np.abs(wd).sum(axis=0) * (np.float64(sx) + sj / 2) + 1e-5
    np.testing.assert_array_less(np.abs(y - yt), bound)


# ----------------------------------------------------------------------------- shapes


def _per_axis(qt) -> np.ndarray:
    """A QTensor's scale as float64, broadcastable to its shape."""
    sw = np.asarray(qt.scale, np.float64)
    return sw.reshape([-1 if d == qt.axis % qt.ndim else 1 for d in range(qt.ndim)]) if sw.ndim \
        else sw


@pytest.mark.parametrize("sub,xshape,wshape,axis,act_first,x_axes", [
    ("bqhd,hkd->bhqk", (2, 3, 4, 8), (4, 5, 8), 1, True, (3,)),
    ("dbs,fd->sfb", (8, 2, 3), (6, 8), 0, True, (0,)),  # contracted first
    ("fd,bsd->fbs", (6, 8), (2, 1, 8), 0, False, (2,)),  # activation on the right, one row
    ("kd,bdk->bk", (3, 8), (2, 8, 3), None, False, (1,)),  # batch dim k, transposed
])
def test_qeinsum_batched_and_transposed_subscripts_equal_int64_sums(sub, xshape, wshape, axis,
                                                                    act_first, x_axes):
    """The int64 sums of codes written with NumPy times both scales (each output element
    has one activation and one weight scale: their einsum over the contraction, divided by
    its length, is their product)."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(xshape if act_first else wshape) * 7).astype(np.float32)
    x.reshape(-1)[::5] = 0.0
    w = rng.standard_normal(wshape if act_first else xshape).astype(np.float32)
    qw = jq.quantize(jnp.asarray(w), axis=axis)
    q, s = _act_codes(x, x_axes)
    wc, sw = np.asarray(qw.qvalue).astype(np.int64), _per_axis(qw)
    ins = [(q.astype(np.int64), np.broadcast_to(s, x.shape).astype(np.float64)),
           (wc, np.broadcast_to(sw, qw.shape))]
    (a, sa), (b, sb) = ins if act_first else ins[::-1]
    length = np.prod([x.shape[d] for d in x_axes])
    ref = np.einsum(sub, a, b) * (np.einsum(sub, sa, sb) / length)
    ops = (x, qw) if act_first else (qw, x)
    _assert_close(jq.qeinsum(sub, *ops, act_quant=W8A8), ref)


def test_nan_token_of_a_transposed_rhs_activation_stays_nan():
    """Per token on an activation on the right with its contraction not last: the NaN's
    token (b, s) gives NaN for every f, the others are finite; per tensor all is NaN."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 2, 3)).astype(np.float32)  # (d, b, s)
    x[4, 1, 2] = np.nan
    qw = jq.quantize(jnp.asarray(rng.standard_normal((6, 8)).astype(np.float32)), axis=0)
    y = np.array(jq.qeinsum("fd,dbs->fbs", qw, x, act_quant=W8A8))
    assert np.isnan(y[:, 1, 2]).all()
    y[:, 1, 2] = 0.0
    assert np.isfinite(y).all()
    y = np.asarray(jq.qeinsum("fd,dbs->fbs", qw, x, act_quant=jq.ActQuant(granularity="tensor")))
    assert np.isnan(y).all()


def test_zero_size_batches_of_several_batch_dims():
    qw = jq.quantize(jnp.ones((8, 3), jnp.float32), axis=1)
    for shape, act in (((0, 4, 8), W8A8), ((2, 0, 8), jq.ActQuant(granularity="tensor"))):
        y = jq.qeinsum("bsd,df->bsf", jnp.zeros(shape, jnp.bfloat16), qw, act_quant=act)
        assert y.shape == shape[:2] + (3,) and y.dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- errors


def test_bad_act_quant_settings_raise_clear_errors():
    x, qw = jnp.ones((2, 8), jnp.float32), jq.quantize(jnp.ones((8, 3), jnp.float32), axis=1)
    # the class instead of an instance: a common slip, named with its fix
    with pytest.raises(TypeError, match=re.escape("act_quant must be None or a jaxquant.ActQuant"
                                                  ", got the class ActQuant itself; pass an "
                                                  "instance, ActQuant()")):
        jq.qdot_general(x, qw, DN, act_quant=jq.ActQuant)
    with pytest.raises(TypeError, match="act_quant must be None or a jaxquant.ActQuant, got "
                                        "str 'int8'"):
        jq.qeinsum("bd,df->bf", x, qw, act_quant="int8")
    # checked even where both operands are arrays (a float layer of a quantized model)
    with pytest.raises(TypeError, match="act_quant must be None or a jaxquant.ActQuant"):
        jq.qdot_general(x, jnp.ones((8, 3), jnp.float32), DN, act_quant="int8")
    with pytest.raises(TypeError, match="act_quant must be None or a jaxquant.ActQuant"):
        jq.QDotGeneral(act_quant="int8")
    # an array granularity passed ``in (...)`` and then failed to hash inside jit
    with pytest.raises(ValueError, match=re.escape("granularity must be 'token' or 'tensor', "
                                                   "got array('token'")):
        jq.ActQuant(granularity=np.array("token"))
    with pytest.raises(ValueError, match="needs rhs codes of an integer format of at most 8 "
                                         "bits, got int16"):
        jq.qdot_general(x, jq.quantize(jnp.ones((8, 3), jnp.float32), dtype=jnp.int16), DN,
                        act_quant=W8A8)
