"""Live-tensor peak of the trainer's optimised training graph: which tensors are alive together.

    python bench/liveness.py --model bert [--ort-outputs loss|all] [--quick] [--top 12]

Trains one step, saves the session's graph as onnxruntime optimises it, runs that graph once with
every node output fetched to learn each tensor's size, then walks the nodes in the saved order:
a tensor is allocated by its producer and freed after its last consumer; graph outputs (the
described model outputs) are never freed, as in onnxruntime's allocation planner. View ops
(Reshape, Squeeze, Unsqueeze, Flatten, Identity) share their input's buffer. The states the trainer
binds from its own buffers (weights, moments) are not counted. Prints the peak and what is alive
there: a lower bound on what the arena must hold, no fragmentation.
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort

import train_bench as tb  # bench/train_bench.py

VIEWS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "bert"], default="bert")
    parser.add_argument("--ort-outputs", choices=["loss", "all"], default="loss")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    from orttrainer.engine import training_graph as tg

    ort.set_default_logger_severity(3)
    argv = ["--model", args.model, "--ort-outputs", args.ort_outputs] + (["--quick"] if args.quick else [])
    workload = tb.make_workload(args.model, tb.parse_args(argv))
    batches = workload.batches(2)
    system = tb.ORTSystem(workload, workload.make_model())
    system.first_step(batches[0])
    trainer = system.trainer
    runtime = trainer._training_session

    path = os.path.join(tempfile.mkdtemp(prefix="liveness-"), "optimised.onnx")
    options = ort.SessionOptions()
    options.enable_mem_pattern = False
    options.optimized_model_filepath = path
    ort.InferenceSession(runtime.graph.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    model = onnx.load(path)
    graph = model.graph
    kept = [o.name for o in graph.output]
    external = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    del graph.output[:]
    for node in graph.node:
        for name in node.output:
            if name:
                graph.output.add().name = name
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), plain, providers=["CPUExecutionProvider"])
    batch = dict(zip([d.name for d in trainer.model_desc.inputs], batches[1]))
    feeds = {}
    for i in session.get_inputs():
        if i.name in runtime._pairs:
            feeds[i.name] = runtime.current(i.name).numpy().copy()
        elif i.name in runtime._scalars:
            feeds[i.name] = runtime._scalars[i.name].numpy().copy()
        elif i.name == tg.TRAINING_MODE:
            feeds[i.name] = np.array(True)
        else:
            feeds[i.name] = batch[i.name].numpy()
    run_options = ort.RunOptions()
    run_options.training_mode = True
    values = session.run(None, feeds, run_options)
    # None: an output its kernel leaves unset (the GELU PythonOpGrad's unused one) holds no memory
    size = {o.name: v.nbytes for o, v in zip(session.get_outputs(), values) if v is not None}
    shape = {o.name: v.shape for o, v in zip(session.get_outputs(), values) if v is not None}

    source = {}  # view -> the tensor whose buffer it shares

    def owner(name):
        while name in source:
            name = source[name]
        return name

    last_use = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name:
                last_use[owner(name)] = index
        if node.op_type in VIEWS and node.input[0] not in external:
            source[node.output[0]] = owner(node.input[0])
    pinned = {owner(name) for name in kept}
    live, peak, at, alive = {}, 0, None, {}
    for index, node in enumerate(graph.node):
        for name in node.output:
            if name and name not in source and name in size:
                live[name] = size[name]
        total = sum(live.values())
        if total > peak:
            peak, at, alive = total, f"{node.op_type} {node.name}", dict(live)
        for name in list(live):
            if name not in pinned and last_use.get(name, -1) <= index:
                del live[name]
    print(f"{args.model} (outputs {args.ort_outputs}): peak of live tensors {peak / 2**20:.0f} MB, at node {at}")
    for name, nbytes in sorted(alive.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {nbytes / 2**20:8.1f} MB  {name} {list(shape[name])}")


if __name__ == "__main__":
    sys.exit(main())
