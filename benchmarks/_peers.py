"""Peers timed beside jaxquant: one-node ONNX Runtime sessions and PyTorch calls.

Both are imported lazily, so a missing package only disables its own rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
"""Intra-op threads for ONNX Runtime and PyTorch: the cores this process may use, as many as
XLA:CPU's thread pool gets (2 on the development machine)."""


def ort_call(op: str, x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray,
             axis: int | None = None) -> Callable[[], object]:
    """A one-node ONNX Runtime session running ``op`` (QuantizeLinear or DequantizeLinear)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    out_type = TensorProto.INT8 if op == "QuantizeLinear" else TensorProto.FLOAT
    attrs = {} if axis is None else {"axis": axis}
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "scale", "zero_point"], ["y"], **attrs)],
        op,
        [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)],
        [helper.make_tensor_value_info("y", out_type, x.shape)],
        [numpy_helper.from_array(np.asarray(scale, np.float32), "scale"),
         numpy_helper.from_array(np.asarray(zero_point, np.int8), "zero_point")],
    )
    # IR version 10, the first with opset 21: onnx writes its own newest by default, which
    # an older ONNX Runtime refuses (ONNX Runtime 1.30 with onnx 1.23.1 did).
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return lambda: session.run(None, {"x": x})


def torch_call(fn_name: str, make_args: Callable[[object], tuple]) -> Callable[[], object]:
    """``torch.<fn_name>(*make_args(torch))`` with ``THREADS`` intra-op threads."""
    import torch

    torch.set_num_threads(THREADS)
    fn = getattr(torch, fn_name)
    args = make_args(torch)
    return lambda: fn(*args)
