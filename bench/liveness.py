"""Where the training step's live tensors peak: a walk over the graph onnxruntime runs, at real size.

    python bench/liveness.py --model bert|gpt2 [--layers N] [--hidden H] [--vocab V] [--batch B] [--seq S]
                             [--top 12] [--points 20]

Builds the trainer as bench/real_size.py does (same model, batches and options), trains one step,
saves the training graph as onnxruntime optimizes it (its session options, `optimized_model_filepath`),
runs that graph once more with every node output fetched to learn each tensor's size, then walks the
nodes in the saved order: a tensor is allocated by its producer and freed after its last reader; view
ops, and outputs a `tensor_reuse_map` declares written into an input, share that input's buffer; the
state outputs (`*.updated`) are not counted (the trainer binds them to the state's own buffers). Prints
the live total along the walk, the peak and what is alive there: a lower bound for what an allocator must hold at that moment, without fragmentation. Compare it
with real_size.py's steady peak, which also holds the Adam moments, start-up leftovers and the
allocators' slack. Needs memory for every tensor of one step at once (~6 GB at BERT-base).
"""

import argparse
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

def trained_one_step(model_name, layers, hidden=0, vocab=0, batch=0, seq=0):
    import onnxruntime as ort
    import real_size
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    ort.set_default_logger_severity(3)
    model, cfg = real_size.make_model(model_name, layers, hidden, vocab, max(256, seq))
    batches = real_size.make_batches(model_name, cfg, 2, batch, seq)
    module, desc = real_size.loss_module(model, batches)
    options = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
    trainer = ORTTrainer(module, desc, optim.AdamConfig(lr=1e-4), options=ORTTrainerOptions(options))
    trainer.train_step(*batches[0].values())
    return trainer._training_session.runtime, batches[1]


def optimized_graph(runtime):
    import onnx
    import onnxruntime as ort
    from orttrainer.placement.device import default_session_options

    path = os.path.join(tempfile.mkdtemp(prefix="liveness-"), "optimized.onnx")
    options = default_session_options()
    options.optimized_model_filepath = path
    ort.InferenceSession(runtime.graph.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(path)


def tensor_sizes(model, runtime, batch):
    """{tensor: bytes} of every node output, from one run of `model` with everything fetched."""
    import onnxruntime as ort
    from orttrainer.engine.graph import training_graph as tg
    from orttrainer.placement.device import default_session_options

    graph = model.graph
    del graph.output[:]
    for node in graph.node:
        for name in node.output:
            if name:
                graph.output.add().name = name
    options = default_session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {}
    for i in session.get_inputs():
        if i.name in runtime._pairs:
            feeds[i.name] = runtime.current(i.name).detach().numpy().copy()
        elif i.name in runtime._scalars:
            feeds[i.name] = runtime._scalars[i.name].numpy().copy()
        elif i.name == tg.TRAINING_MODE:
            feeds[i.name] = np.array(True)
        else:
            feeds[i.name] = batch[i.name].numpy()
    run_options = ort.RunOptions()
    run_options.training_mode = True
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, feeds, run_options)
    return {n: v.nbytes for n, v in zip(names, values) if v is not None}, \
        {n: v.shape for n, v in zip(names, values) if v is not None}


def walk(graph, kept, size):
    """(live bytes after each node, peak, index of the peak node, {tensor: bytes} alive there)."""
    from orttrainer.engine.graph.builder import VIEW_OPS

    external = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    source = {}  # view -> the tensor whose buffer it shares

    def owner(name):
        while name in source:
            name = source[name]
        return name

    last_read = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name:
                last_read[owner(name)] = index
        if node.op_type in VIEW_OPS and node.input[0] not in external:
            source[node.output[0]] = owner(node.input[0])
        reuse = next((list(a.ints) for a in node.attribute if a.name == "tensor_reuse_map"), [])
        for out, into in zip(node.output, reuse):  # a PythonOpGrad output written into an input's buffer
            if into >= 0 and out:
                source[out] = owner(node.input[into])
    pinned = {owner(name) for name in kept}
    live, curve, peak, at, alive = {}, [], 0, None, {}
    for index, node in enumerate(graph.node):
        for name in node.output:
            if name and name not in source and name in size and not name.endswith(".updated"):
                live[name] = size[name]
        total = sum(live.values())
        curve.append(total)
        if total > peak:
            peak, at, alive = total, index, dict(live)
        for name in list(live):
            if name not in pinned and last_read.get(name, -1) <= index:
                del live[name]
    return curve, peak, at, alive


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt2", "bert"], default="bert")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=0, help="0: the real size (smaller for smoke runs)")
    parser.add_argument("--vocab", type=int, default=0, help="0: the real size")
    parser.add_argument("--batch", type=int, default=0, help="0: the real size's (real_size.py)")
    parser.add_argument("--seq", type=int, default=0, help="0: the real size's (real_size.py)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--points", type=int, default=20, help="how many points of the walk to print")
    args = parser.parse_args()

    runtime, batch = trained_one_step(args.model, args.layers, args.hidden, args.vocab, args.batch, args.seq)
    model = optimized_graph(runtime)
    kept = [o.name for o in model.graph.output]
    size, shape = tensor_sizes(model, runtime, batch)
    graph = model.graph
    curve, peak, at, alive = walk(graph, kept, size)
    mb = 2.0 ** 20
    print(f"{args.model}, {args.layers} layers: {len(graph.node)} nodes; live peak {peak / mb:.0f} MB "
          f"after node {at} ({graph.node[at].op_type} {graph.node[at].name})")
    for index in range(0, len(curve), max(1, len(curve) // args.points)):
        print(f"  node {index:5d} {graph.node[index].op_type:24s} live {curve[index] / mb:7.0f} MB")
    print(f"  node {len(curve) - 1:5d} {graph.node[-1].op_type:24s} live {curve[-1] / mb:7.0f} MB")
    print(f"alive at the peak: {len(alive)} tensors; the largest:")
    for name, nbytes in sorted(alive.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {nbytes / mb:8.1f} MB  {name} {list(shape[name])}")


if __name__ == "__main__":
    sys.exit(main())
