"""The Adam update: onnxruntime's AdamOptimizer kernel (one thread per weight) against the same rule
composed from standard element-wise ops (which onnxruntime runs on its intra-op thread pool).

    python bench/adam_kernels.py [--model gpt|bert] [--rounds 30] [--threshold N ...]   # the update alone
    python bench/adam_kernels.py --step [--model gpt|bert] [--rounds 20]               # whole training steps

The first form builds one graph holding the update of every weight of the benchmark model (the
composed rule for weights of at least N elements, the kernel for the rest), binds every state in
place as the engine does, and times the runs interleaved; it also prints the largest difference of
one update from the kernel's. `--step` trains two copies of the model, one with the engine's Adam
and one with the composed rule for every weight, interleaved, and prints the paired median of
(composed − kernel) per step. Tried for issue 14 and not kept (docs/performance.md, optimisation log).
"""

import argparse
import copy
import statistics
import time
from unittest import mock

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine import optimizer_graph
from orttrainer.engine.graph_builder import MS_DOMAIN, GraphBuilder
from orttrainer.engine.optimizer_graph import Target, updated_name

from models import BertSize, BertWorkload, GPTWorkload  # bench/models.py

HYPER_PARAMETERS = dict(alpha=0.9, beta=0.999, epsilon=1e-8, max_norm_clip=1.0, do_bias_correction=1,
                        weight_decay_mode=0, **{"lambda": 0.0})


def build_adam_composed(b: GraphBuilder, lr, target: Target, grad, hp):
    """The AdamOptimizer kernel's rule written with standard ops, which onnxruntime runs on its
    intra-op thread pool (the kernel runs on one thread). Same operations in the same order:

    m1 = a·m1 + (1−a)·g;  m2 = b·m2 + ((1−b)·g)·g;  c1, c2 = 1 − a^t, 1 − b^t (in double, as the kernel)
    denom = √(m2 / c2) + ε';  u = (m1 / c1) / denom + λ·w  [mode 1: − (m1/c1)·lr·λ / denom, ε' = ε/√c2]
    w ← w − lr·u
    """
    w = target.weight
    alpha, beta, lam = np.float32(hp["alpha"]), np.float32(hp["beta"]), np.float32(hp["lambda"])
    count = f"Update_Count_{w}"
    b.op("Add", [count, b.const(1, np.int64)], outputs=[updated_name(count)])
    m1_new = b.op("Add", [b.op("Mul", [f"Moment_1_{w}", b.const(alpha)]),
                          b.op("Mul", [grad, b.const(np.float32(1) - alpha)])], outputs=[updated_name(f"Moment_1_{w}")])
    m2_new = b.op("Add", [b.op("Mul", [f"Moment_2_{w}", b.const(beta)]),
                          b.op("Mul", [b.op("Mul", [grad, b.const(np.float32(1) - beta)]), grad])],
                  outputs=[updated_name(f"Moment_2_{w}")])
    if hp["do_bias_correction"]:
        c1, c2 = (_bias_correction(b, count, coefficient) for coefficient in (alpha, beta))
        m1_new = b.op("Div", [m1_new, c1])
        m2_new = b.op("Div", [m2_new, c2])
    stability = b.const(np.float32(hp["epsilon"]))
    if int(hp["weight_decay_mode"]) == 1 and hp["do_bias_correction"]:
        stability = b.op("Div", [stability, b.op("Sqrt", [c2])])
    denom = b.op("Add", [b.op("Sqrt", [m2_new]), stability])
    update = b.op("Div", [m1_new, denom])
    if lam != 0:
        update = b.op("Add", [update, b.op("Mul", [target.param, b.const(lam)])])
        if int(hp["weight_decay_mode"]) == 1:
            decay_term = b.op("Div", [b.op("Mul", [b.op("Mul", [m1_new, lr]), b.const(lam)]), denom])
            update = b.op("Sub", [update, decay_term])
    b.op("Sub", [target.param, b.op("Mul", [update, lr])], outputs=[updated_name(target.param)])


def _bias_correction(b: GraphBuilder, count, coefficient):
    """1 − coefficient^count as float, computed in double like the kernel; 1 for count ≤ 0."""
    power = b.op("Pow", [b.const(np.float64(coefficient), np.float64), b.op("Cast", [count], to=TensorProto.DOUBLE)])
    correction = b.op("Cast", [b.op("Sub", [b.const(1.0, np.float64), power])], to=TensorProto.FLOAT)
    return b.op("Where", [b.op("Greater", [count, b.const(0, np.int64)]), correction, b.const(1.0)])


def workload(name):
    return GPTWorkload() if name == "gpt" else BertWorkload(batch=8, seq=128, size=BertSize())


def update_session(shapes, threshold):
    """One graph updating every weight; composed for weights of >= threshold elements (None: none)."""
    graph = helper.make_graph([], "adam", [], [])
    b = GraphBuilder(graph)
    b.add_input("lr", TensorProto.FLOAT, [1])
    for w, shape in shapes.items():
        for name in (w, f"{w}_grad", f"Moment_1_{w}", f"Moment_2_{w}"):
            b.add_input(name, TensorProto.FLOAT, list(shape))
        b.add_input(f"Update_Count_{w}", TensorProto.INT64, [1])
        composed = threshold is not None and int(np.prod(shape)) >= threshold
        (build_adam_composed if composed else optimizer_graph.build_adam)(
            b, "lr", Target.whole(w), f"{w}_grad", HYPER_PARAMETERS)
        for name in (w, f"Moment_1_{w}", f"Moment_2_{w}"):
            b.add_output(updated_name(name), TensorProto.FLOAT, list(shape))
        b.add_output(updated_name(f"Update_Count_{w}"), TensorProto.INT64, [1])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def bound_state(session, shapes, seed=0):
    """An IOBinding with every state bound in place (outputs written into the input buffers)."""
    rng = np.random.default_rng(seed)
    values, binding = {}, session.io_binding()
    for w, shape in shapes.items():
        for name in (w, f"{w}_grad", f"Moment_1_{w}", f"Moment_2_{w}"):
            data = rng.standard_normal(shape).astype(np.float32) * 0.01
            if name.startswith("Moment_2"):
                data = np.abs(data)
            values[name] = ort.OrtValue.ortvalue_from_numpy(data)
            binding.bind_ortvalue_input(name, values[name])
        for name in (w, f"Moment_1_{w}", f"Moment_2_{w}"):
            binding.bind_ortvalue_output(updated_name(name), values[name])
        count = f"Update_Count_{w}"
        values[count] = ort.OrtValue.ortvalue_from_numpy(np.array([3], np.int64))
        values[updated_name(count)] = ort.OrtValue.ortvalue_from_numpy(np.zeros([1], np.int64))
        binding.bind_ortvalue_input(count, values[count])
        binding.bind_ortvalue_output(updated_name(count), values[updated_name(count)])
    values["lr"] = ort.OrtValue.ortvalue_from_numpy(np.array([1e-3], np.float32))
    binding.bind_ortvalue_input("lr", values["lr"])
    return binding, values


def update_alone(args):
    model = workload(args.model).make_model()
    shapes = {name.replace(".", "_"): tuple(p.shape) for name, p in model.named_parameters()}
    print(f"{args.model}: {len(shapes)} weights, {sum(int(np.prod(s)) for s in shapes.values())} parameters")
    variants = {"kernel": None, **{f"composed >= {t}": t for t in args.threshold}}
    runs = {}
    for label, threshold in variants.items():
        session = update_session(shapes, threshold)
        runs[label] = (session, *bound_state(session, shapes))
    reference = runs["kernel"][2]
    for label, (session, binding, values) in runs.items():  # one update each from the same state
        session.run_with_iobinding(binding)
        worst = max(float(np.max(np.abs(values[w].numpy() - reference[w].numpy()))) for w in shapes)
        print(f"  {label:18s} max |w - kernel's w| after one update: {worst:.2e}")
    times = {label: [] for label in runs}
    for round_ in range(args.rounds + 2):
        order = list(runs.items())
        for label, (session, binding, _) in order if round_ % 2 else reversed(order):
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            if round_ >= 2:
                times[label].append(time.perf_counter() - start)
    for label, values in times.items():
        paired = statistics.median(b - a for a, b in zip(times["kernel"], values))
        print(f"  {label:18s} median {statistics.median(values) * 1e3:7.2f} ms  min {min(values) * 1e3:7.2f} ms"
              f"  paired (this - kernel) {paired * 1e3:+7.2f} ms")


def whole_steps(args):
    bench = workload(args.model)
    model = bench.make_model()
    batches = bench.batches(4)
    trainers = {}
    for label, builders in (("kernel", {}), ("composed", {"AdamOptimizer": build_adam_composed})):
        with mock.patch.dict(optimizer_graph._BUILDERS, builders):
            module, model_desc, loss_fn = bench.ort_trainer_args(copy.deepcopy(model))
            trainers[label] = ORTTrainer(module, model_desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn,
                                         options=ORTTrainerOptions({"device": {"id": "cpu"},
                                                                    "utils": {"grad_norm_clip": False}}))
            trainers[label].train_step(*batches[0])  # the graph is built here, under the patch
    times = {label: [] for label in trainers}
    losses = {label: [] for label in trainers}
    for round_ in range(args.rounds + 2):  # two warm-up rounds
        order = list(trainers.items())
        for label, trainer in order if round_ % 2 else reversed(order):
            start = time.perf_counter()
            loss = trainer.train_step(*batches[round_ % len(batches)])
            if round_ >= 2:
                times[label].append(time.perf_counter() - start)
            losses[label].append(float(loss if not isinstance(loss, (list, tuple)) else loss[0]))
    print(f"{args.model}: whole steps, {args.rounds} interleaved rounds;"
          f" max |loss difference| {max(abs(a - b) for a, b in zip(*losses.values())):.2e}")
    for label, values in times.items():
        print(f"  {label:9s} median {statistics.median(values) * 1e3:7.1f} ms   min {min(values) * 1e3:7.1f} ms")
    paired = [b - a for a, b in zip(times["kernel"], times["composed"])]
    quartiles = statistics.quantiles(paired, n=4)
    print(f"  paired (composed - kernel): median {statistics.median(paired) * 1e3:+.1f} ms,"
          f" quartiles {quartiles[0] * 1e3:+.1f} / {quartiles[2] * 1e3:+.1f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "bert"], default="gpt")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threshold", type=int, nargs="*", default=[0, 65536],
                        help="compose the update of weights with at least this many elements (one variant each)")
    parser.add_argument("--step", action="store_true", help="whole training steps instead of the update alone")
    args = parser.parse_args()
    whole_steps(args) if args.step else update_alone(args)


if __name__ == "__main__":
    main()
