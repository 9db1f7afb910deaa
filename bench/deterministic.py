"""What debug.deterministic_compute costs, and why its embedding gradient is deterministic.

    cd bench && ../.venv/bin/python deterministic.py --model bert --rounds 20

1. The kernel: onnxruntime's CPU GatherGrad against the ScatterElements(reduction='add') that replaces
   it under the option, on 4096 ids into a [30522, 768] table (BERT-large's embedding gradient; the
   ids repeat, as tokens do): the median time of each and whether repeated runs are bitwise equal.
2. The step: two trainers (copies of one benchmark model, export cache off) with the option off and
   on, stepped interleaved on the same batches; prints each median step and the median over rounds
   of (on - off).
"""

import argparse
import copy
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

V, N, D = 30522, 4096, 768


def kernel_model(kind):
    shape_input = [helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
                   helper.make_tensor_value_info("ids", TensorProto.INT64, [N]),
                   helper.make_tensor_value_info("grad", TensorProto.FLOAT, [N, D])]
    if kind == "GatherGrad":
        nodes = [helper.make_node("GatherGrad", ["shape", "ids", "grad"], ["out"], domain="com.microsoft", axis=0)]
    else:
        zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
        nodes = [helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=zero),
                 helper.make_node("Unsqueeze", ["ids", "one"], ["column"]),
                 helper.make_node("Expand", ["column", "grad_shape"], ["index"]),
                 helper.make_node("ScatterElements", ["zeros", "index", "grad"], ["out"], axis=0, reduction="add")]
    constants = [helper.make_tensor("one", TensorProto.INT64, [1], [1]),
                 helper.make_tensor("grad_shape", TensorProto.INT64, [2], [N, D])]
    graph = helper.make_graph(nodes, kind, shape_input, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [V, D])],
                              constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def kernels(repeats=10):
    rng = np.random.default_rng(0)
    feed = {"shape": np.array([V, D], np.int64), "ids": rng.integers(0, 2000, N).astype(np.int64),
            "grad": rng.standard_normal((N, D)).astype(np.float32)}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for kind in ("GatherGrad", "ScatterElements"):
        session = ort.InferenceSession(kernel_model(kind).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        outputs, times = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            outputs.append(session.run(None, feed)[0])
            times.append(time.perf_counter() - started)
        same = all(np.array_equal(o, outputs[0]) for o in outputs)
        print(f"{kind:16s} {1e3 * statistics.median(times):7.1f} ms   {repeats} runs bitwise equal: {same}")


def steps(model_name, rounds):
    from ab_rewrite import interleaved_step_times  # bench/ab_rewrite.py
    from models import BertSize, BertWorkload, GPTWorkload  # bench/models.py
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    workload = GPTWorkload() if model_name == "gpt" else BertWorkload(batch=8, seq=128, size=BertSize())
    model = workload.make_model()
    batches = workload.batches(4)
    trainers = {}
    for name, on in (("off", False), ("on", True)):
        module, model_desc, loss_fn = workload.ort_trainer_args(copy.deepcopy(model))
        trainers[name] = ORTTrainer(module, model_desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn,
                                    options=ORTTrainerOptions({"device": {"id": "cpu"},
                                                               "utils": {"export_cache": False},
                                                               "debug": {"deterministic_compute": on}}))
    times = interleaved_step_times(trainers, batches, rounds)
    difference = statistics.median(a - b for a, b in zip(times["on"], times["off"]))
    print(f"{model_name}: median step off {1e3 * statistics.median(times['off']):.1f} ms, on "
          f"{1e3 * statistics.median(times['on']):.1f} ms; median (on - off) {1e3 * difference:+.1f} ms "
          f"over {rounds} interleaved rounds")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "bert"], default="bert")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    kernels()
    steps(args.model, args.rounds)


if __name__ == "__main__":
    main()
