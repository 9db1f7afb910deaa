"""Embedding and bias gradients on the benchmark shapes: onnxruntime's kernels against the forms the
engine uses instead (the measurements behind small_embedding_as_matmul and large_bias_gradient_as_matmul).

    python bench/gradient_kernels.py [--reps 9]

- GatherGrad (embedding gradient, 1024 ids) against OneHot + Gemm, for a [2, 256] token-type table,
  [512, 256] positions (ids 0..127) and a [30522, 256] vocabulary;
- ReduceSum over the leading axes of [8, 128, C] (a bias gradient) against MatMul(ones[1, 1024], dy).

Prints the best time of each and the largest difference between the two forms.
"""

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

TOKENS, HIDDEN = 1024, 256


def session(nodes, inputs, initializers=()):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in inputs],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def best_ms(sess, feeds, reps):
    sess.run(None, feeds)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def compare(title, first, second, feeds, reps):
    (name_a, sess_a), (name_b, sess_b) = first, second
    diff = float(np.abs(sess_a.run(None, feeds)[0] - sess_b.run(None, feeds)[0]).max())
    print(f"  {title:34s} {name_a} {best_ms(sess_a, feeds, reps):7.2f} ms   "
          f"{name_b} {best_ms(sess_b, feeds, reps):7.2f} ms   max |diff| {diff:.1e}")


def embedding_gradients(reps, rng):
    print(f"embedding gradient, {TOKENS} ids, hidden {HIDDEN}:")
    dy = rng.standard_normal((8, 128, HIDDEN), dtype=np.float32)
    for rows, ids in ((2, rng.integers(0, 2, (8, 128))), (512, np.tile(np.arange(128), (8, 1))),
                      (30522, rng.integers(0, 30522, (8, 128)))):
        ids = ids.astype(np.int64)
        inputs = [("ids", TensorProto.INT64, [8, 128]), ("dy", TensorProto.FLOAT, [8, 128, HIDDEN])]
        gather_grad = session(
            [helper.make_node("GatherGrad", ["shape", "ids", "dy"], ["out"], domain="com.microsoft")], inputs,
            [helper.make_tensor("shape", TensorProto.INT64, [2], [rows, HIDDEN])])
        one_hot = session(
            [helper.make_node("OneHot", ["ids", "depth", "values"], ["hot"], axis=-1),
             helper.make_node("Reshape", ["hot", "hot_2d"], ["hot2"]),
             helper.make_node("Reshape", ["dy", "dy_2d"], ["dy2"]),
             helper.make_node("Gemm", ["hot2", "dy2"], ["out"], transA=1)], inputs,
            [helper.make_tensor("depth", TensorProto.INT64, [], [rows]),
             helper.make_tensor("values", TensorProto.FLOAT, [2], [0.0, 1.0]),
             helper.make_tensor("hot_2d", TensorProto.INT64, [2], [TOKENS, rows]),
             helper.make_tensor("dy_2d", TensorProto.INT64, [2], [TOKENS, HIDDEN])])
        compare(f"[{rows}, {HIDDEN}] table", ("GatherGrad", gather_grad), ("OneHot+Gemm", one_hot),
                {"ids": ids, "dy": dy}, reps)


def bias_gradients(reps, rng):
    print("bias gradient, sum of dy [8, 128, C] over the first two axes:")
    for columns in (30522, 1024, 256):
        dy = rng.standard_normal((8, 128, columns), dtype=np.float32)
        inputs = [("dy", TensorProto.FLOAT, [8, 128, columns])]
        reduce_sum = session([helper.make_node("ReduceSum", ["dy", "axes"], ["out"], keepdims=0)], inputs,
                             [helper.make_tensor("axes", TensorProto.INT64, [2], [0, 1])])
        ones_matmul = session(
            [helper.make_node("Reshape", ["dy", "rows_shape"], ["rows"]),
             helper.make_node("MatMul", ["ones", "rows"], ["summed"]),
             helper.make_node("Reshape", ["summed", "out_shape"], ["out"])], inputs,
            [helper.make_tensor("rows_shape", TensorProto.INT64, [2], [TOKENS, columns]),
             helper.make_tensor("ones", TensorProto.FLOAT, [1, TOKENS], [1.0] * TOKENS),
             helper.make_tensor("out_shape", TensorProto.INT64, [1], [columns])])
        compare(f"C = {columns}", ("ReduceSum", reduce_sum), ("ones-MatMul", ones_matmul), {"dy": dy}, reps)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    embedding_gradients(args.reps, rng)
    bias_gradients(args.reps, rng)


if __name__ == "__main__":
    main()
