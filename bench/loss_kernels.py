"""Micro-benchmark: onnxruntime CPU kernels for a language-model loss head, forward + backward.

    python bench/loss_kernels.py [--rows 1024] [--vocab 8192]

Compares the fused SoftmaxCrossEntropyLoss (+ its gradient), a LogSoftmax decomposition, the
shifted exp-sum form the engine uses, and torch's cross_entropy, on the same logits. Prints the best
of several runs in milliseconds. The numbers behind docs/ort-notes.md.
"""

import argparse
import time

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi._pybind_state import GradientGraphBuilder

ort.set_default_logger_severity(3)


def best_ms(fn, repeat=7):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def training_session(nodes, rows, vocab, initializers=()):
    graph = helper.make_graph(
        nodes, "loss",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, vocab]),
         helper.make_tensor_value_info("y", TensorProto.INT64, [rows])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.log_severity_level = 3
    builder = GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"x"}, "loss", options)
    builder.build()
    return ort.InferenceSession(builder.get_model(), providers=["CPUExecutionProvider"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    x = torch.randn(args.rows, args.vocab)
    y = torch.randint(0, args.vocab, (args.rows,))
    feed = {"x": x.numpy(), "y": y.numpy()}
    only_needed = ort.RunOptions()
    only_needed.only_execute_path_to_fetches = True  # a forward-only row must not run the backward
    one = numpy_helper.from_array(np.array([1], np.int64), "one")

    fused = training_session([helper.make_node("SoftmaxCrossEntropyLoss", ["x", "y"], ["loss", "log_prob"])],
                             args.rows, args.vocab)
    decomposed = training_session([
        helper.make_node("LogSoftmax", ["x"], ["log_prob"], axis=1),
        helper.make_node("Unsqueeze", ["y", "one"], ["y1"]),
        helper.make_node("GatherElements", ["log_prob", "y1"], ["picked"], axis=1),
        helper.make_node("ReduceMean", ["picked"], ["mean"], keepdims=0),
        helper.make_node("Neg", ["mean"], ["loss"]),
    ], args.rows, args.vocab, [one])
    # The engine's form: an integer row shift (no gradient through it), log-sum-exp from elementwise ops.
    shifted_sum = training_session([
        helper.make_node("ReduceMax", ["x"], ["row_max"], axes=[1], keepdims=1),
        helper.make_node("Cast", ["row_max"], ["row_max_int"], to=TensorProto.INT64),
        helper.make_node("Cast", ["row_max_int"], ["shift"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["x", "shift"], ["shifted"]),
        helper.make_node("Exp", ["shifted"], ["exp"]),
        helper.make_node("ReduceSum", ["exp", "one"], ["sum"], keepdims=1),
        helper.make_node("Log", ["sum"], ["log_sum"]),
        helper.make_node("Unsqueeze", ["y", "one"], ["y1"]),
        helper.make_node("GatherElements", ["shifted", "y1"], ["picked_shifted"], axis=1),
        helper.make_node("Sub", ["picked_shifted", "log_sum"], ["picked"]),
        helper.make_node("ReduceMean", ["picked"], ["mean"], keepdims=0),
        helper.make_node("Neg", ["mean"], ["loss"]),
    ], args.rows, args.vocab, [one])
    xr = x.clone().requires_grad_()

    def torch_step():
        xr.grad = None
        torch.nn.functional.cross_entropy(xr, y).backward()

    rows = [
        ("onnxruntime SoftmaxCrossEntropyLoss, forward", lambda: fused.run(["loss"], feed, only_needed)),
        ("onnxruntime SoftmaxCrossEntropyLoss, forward+backward", lambda: fused.run(["loss", "x_grad"], feed, only_needed)),
        ("onnxruntime LogSoftmax decomposition, forward", lambda: decomposed.run(["loss"], feed, only_needed)),
        ("onnxruntime LogSoftmax decomposition, forward+backward",
         lambda: decomposed.run(["loss", "x_grad"], feed, only_needed)),
        ("onnxruntime shifted exp-sum (the engine's), forward", lambda: shifted_sum.run(["loss"], feed, only_needed)),
        ("onnxruntime shifted exp-sum (the engine's), forward+backward",
         lambda: shifted_sum.run(["loss", "x_grad"], feed, only_needed)),
        ("torch cross_entropy, forward+backward", torch_step),
    ]
    print(f"logits [{args.rows}, {args.vocab}] float32, best of 7, ms")
    for name, fn in rows:
        print(f"  {name:58s} {best_ms(fn):8.1f}")
    loss_fused = fused.run(["loss"], feed, only_needed)[0]
    others = [decomposed.run(["loss"], feed, only_needed)[0], shifted_sum.run(["loss"], feed, only_needed)[0]]
    print(f"  same loss: {all(np.allclose(loss_fused, o, rtol=1e-6) for o in others)} ({loss_fused:.6f})")


if __name__ == "__main__":
    main()
