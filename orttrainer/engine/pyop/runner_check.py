"""Whether this process may run PythonOps through engine/pyop/python_op's ctypes runners.

The runners are C++ function pointers handed to onnxruntime's internals; their calling convention
and the kernels that call them are those of onnxruntime-training 1.19.2 on x86-64 Linux. A different
build would crash or corrupt memory rather than raise, so before anything uses them (the GELU
gradient rewrite, a custom torch.autograd.Function) this module checks, once per process:

  1. the platform (x86-64 Linux) and `onnxruntime.__version__ == 1.19.2`;
  2. that the registration functions exist in onnxruntime's bindings;
  3. a self-test: a PythonOp and its PythonOpGrad in a two-node graph, run once, whose forward and
     backward results must be exactly what the test Function computes in torch.

`problem()` is "" when all pass, else why not (cached). Callers fall back: the GELU gradient keeps
onnxruntime's GeluGrad kernel (one warning), a custom Function gets a clear error (`require`).
"""

import platform
import sys

import numpy as np
import torch

from orttrainer.engine.pyop import python_op
from orttrainer.placement.process_state import PROCESS, keep_module_names

SUPPORTED_VERSION = "1.19.2"
_BINDINGS = ("register_forward_runner", "register_backward_runner", "register_torch_autograd_function",
             "register_shape_inference_function", "register_miscellaneous_const_input",
             "unregister_python_functions")

# PROCESS.runner_problem: None (not checked yet), "" (the runners work here), else why they may not be used.
keep_module_names(__name__, _problem="runner_problem")


class _SelfTest(torch.autograd.Function):
    """y = 2x + 1; its backward returns dy * x (not the true gradient: proves the backward ran)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2 + 1

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return dy * x


def problem():
    """"" when PythonOps may run through our runners in this process, else the reason (checked once)."""
    if PROCESS.runner_problem is None:
        try:
            PROCESS.runner_problem = _check()
        except Exception as exc:  # noqa: BLE001 -- any failure of the check means: do not use the hook
            PROCESS.runner_problem = f"the PythonOp self-test failed: {type(exc).__name__}: {exc}"
    return PROCESS.runner_problem


def require(what):
    """Raise python_op.UnsupportedFunctionError naming why `what` cannot run here, if it cannot."""
    reason = problem()
    if reason:
        raise python_op.UnsupportedFunctionError(
            f"{what} needs onnxruntime's PythonOp hook, which is disabled in this process: {reason}. "
            f"Install onnxruntime-training=={SUPPORTED_VERSION} on x86-64 Linux, or replace the "
            "torch.autograd.Function by ordinary torch operations")


def _check():
    import onnxruntime
    from onnxruntime.capi import _pybind_state as C

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the runners need x86-64 Linux; this is {sys.platform}/{platform.machine()}"
    version = getattr(onnxruntime, "__version__", "unknown")
    if version != SUPPORTED_VERSION:
        return f"onnxruntime is {version}; the runners are written for {SUPPORTED_VERSION}"
    missing = [name for name in _BINDINGS if not hasattr(C, name)]
    if missing:
        return f"onnxruntime's bindings lack {', '.join(missing)}"
    return _self_test()


def _self_test():
    import onnxruntime as ort
    from onnx import TensorProto, helper

    python_op._install_runners()
    name = python_op._register_function(_SelfTest)
    forward = helper.make_node(
        python_op.PYTHON_OP, ["x"], ["ctx", "y"], domain=python_op.MS_DOMAIN, func_name=name,
        input_convention="d", input_tensor_types=[TensorProto.FLOAT], input_tensor_ranks=[1],
        input_requires_grads=[1], output_tensor_types=[TensorProto.FLOAT], output_tensor_ranks=[1],
        training_mode=1, safe_run_mode=0)
    backward = helper.make_node(
        python_op.PYTHON_OP_GRAD, ["ctx", "dy"], ["dx"], domain=python_op.MS_DOMAIN, func_name=name,
        input_tensor_types=[TensorProto.FLOAT], input_tensor_ranks=[1], output_convention="d",
        output_tensor_types=[TensorProto.FLOAT], output_tensor_ranks=[1], output_tensor_requires_grads=[1],
        safe_run_mode=0)
    values = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("x", "dy", "y", "dx")]
    graph = helper.make_graph([forward, backward], "pythonop_self_test", values[:2], values[2:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14),
                                                    helper.make_opsetid(python_op.MS_DOMAIN, 1)])
    model.ir_version = 8
    from orttrainer.placement import device as placement

    # The trainer's allocator setting: this is often the process's first session, and the first
    # session's arena flag builds the one CPU provider of the process (docs/ort-notes.md).
    options = placement.default_session_options()
    options.log_severity_level = 4  # a failure is reported by the caller's one warning
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.array([-1.5, 0.0, 0.25, 3.0], np.float32)
    dy = np.array([2.0, -1.0, 4.0, 0.5], np.float32)
    known = set(PROCESS.live_contexts)
    try:
        with python_op.function_errors():
            y, dx = session.run(["y", "dx"], {"x": x, "dy": dy})
    finally:
        for key in set(PROCESS.live_contexts) - known:  # this session's nodes never run again
            del PROCESS.live_contexts[key]
    del session
    expected_y, expected_dx = x * 2 + 1, dy * x
    if not (np.array_equal(y, expected_y) and np.array_equal(dx, expected_dx)):
        return (f"the PythonOp self-test gave wrong results (forward {y.tolist()}, expected {expected_y.tolist()}; "
                f"backward {dx.tolist()}, expected {expected_dx.tolist()})")
    return ""
