"""GELU backward on one [8, 128, 1024] tensor (a benchmark MLP activation): onnxruntime's GeluGrad
kernel against the same gradient composed from Erf/Exp/Mul/Add kernels, torch's gelu_backward, and
the engine's form (engine/torch_gelu_gradient.py: torch's gelu_backward on one thread, called by a
PythonOp/PythonOpGrad pair inside the session).

    python bench/gelu_grad_kernels.py [--reps 15]

Prints the best and median time of each and the largest difference to the GeluGrad kernel.
"""

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from orttrainer.engine.graph_rewrites import _replace_nodes
from orttrainer.engine.torch_gelu_gradient import gelu_gradient_in_torch

SHAPE = [8, 128, 1024]


def compose_gelu_gradient(model: onnx.ModelProto):
    """com.microsoft GeluGrad(dy, x) -> dy · (Φ(x) + x·φ(x)) written with standard elementwise ops.

    Tried as an engine rewrite and not kept (docs/performance.md, optimisation log): 2.5 ms against the
    kernel's 5.6 ms in isolation, but no gain in the training step.
    """
    def compose(b, node):
        if node.op_type != "GeluGrad" or node.domain != "com.microsoft":
            return False
        dy, x = node.input
        t = b.op("Mul", [x, b.const(1.0 / np.sqrt(2.0))])                     # x / √2
        cdf = b.op("Add", [b.op("Mul", [b.op("Erf", [t]), b.const(0.5)]), b.const(0.5)])  # Φ(x)
        pdf = b.op("Mul", [b.op("Exp", [b.op("Neg", [b.op("Mul", [t, t])])]),
                           b.const(1.0 / np.sqrt(2.0 * np.pi))])                # φ(x)
        slope = b.op("Add", [cdf, b.op("Mul", [x, pdf])])
        b.op("Mul", [dy, slope], outputs=[node.output[0]])
        return True

    _replace_nodes(model.graph, "gelu_grad_", compose)

def grad_session(compose, torch_op=False):
    node = helper.make_node("GeluGrad", ["dy", "x"], ["dx"], domain="com.microsoft")
    graph = helper.make_graph(
        [node], "gelu_grad",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in ("dy", "x")],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, SHAPE)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    if compose:
        compose_gelu_gradient(model)
    if torch_op:
        assert gelu_gradient_in_torch(model) == 1
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    feeds = {"dy": rng.standard_normal(SHAPE, dtype=np.float32), "x": rng.standard_normal(SHAPE, dtype=np.float32)}
    kernel, composed, torch_op = grad_session(False), grad_session(True), grad_session(False, torch_op=True)
    reference = kernel.run(None, feeds)[0]
    dy, x = torch.from_numpy(feeds["dy"]), torch.from_numpy(feeds["x"])
    candidates = {
        "onnxruntime GeluGrad kernel": lambda: kernel.run(None, feeds)[0],
        "composed (Erf/Exp/Mul/Add)": lambda: composed.run(None, feeds)[0],
        "torch gelu_backward": lambda: torch.ops.aten.gelu_backward(dy, x).numpy(),
        "torch, 1 thread, in the session (engine)": lambda: torch_op.run(["dx"], feeds)[0],
    }
    print(f"GELU backward, {SHAPE} float32, {torch.get_num_threads()} threads, best / median of {args.reps}")
    for name, fn in candidates.items():
        best, median = timed(fn, args.reps)
        diff = float(np.abs(fn() - reference).max())
        print(f"  {name:38s} {best * 1e3:6.2f} / {median * 1e3:6.2f} ms   max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
