"""Tensor parallel (Megatron, horizontal_parallel_size=2) against one process: step time, and the time
spent inside the f/g all_reduces (wrapped here around megatron._all_reduce in each rank).

    .venv/bin/python bench/tensor_parallel.py [--kind gpt2|bert|bench] [--hidden 256] [--layers 2] [--steps 20]

Each setting runs in fresh processes, 1 thread per process; the first 3 steps (build, warm-up) are
not timed. Prints the median step time and the share of the step inside the collectives."""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")


def _worker():
    sys.path.insert(0, TESTS)  # only in the ranks; never bench/ on the path (bench/models.py shadows)
    import tensor_parallel_worker as worker

    return worker


def _timed_all_reduce():
    from orttrainer.engine import megatron

    original, spent = megatron._all_reduce, [0.0]

    def timed(tensor):
        started = time.perf_counter()
        try:
            return original(tensor)
        finally:
            spent[0] += time.perf_counter() - started

    megatron._all_reduce = timed
    return spent


def _bench_gpt_trainer(worker, rank, world, args):
    """The bench GPT (bench/models.py: blocks qkv -> proj, fc -> out) on the worker's GPT-2 batches.
    bench/models.py is loaded from its file: tests/ is on the path here, and its models.py would shadow."""
    import importlib.util

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    spec = importlib.util.spec_from_file_location("bench_models", os.path.join(os.path.dirname(TESTS), "bench",
                                                                               "models.py"))
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    torch.manual_seed(0)
    model = models.GPT(models.GPTConfig(vocab=worker.VOCAB, hidden=args.hidden, layers=args.layers,
                                        heads=args.heads, max_positions=worker.SEQ))
    # Static shapes: the block reads its width from x.shape, which a dynamic batch axis leaves a run-time
    # value in the exported Reshapes (a TensorParallelError names the block); static, it is a constant.
    b, s = worker.BATCH, worker.SEQ
    desc = {"inputs": [("input_ids", [b, s]), ("labels", [b, s])],
            "outputs": [("loss", [], True), ("logits", [b, s, worker.VOCAB])]}
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "distributed": {
        "world_rank": rank, "world_size": world, "local_rank": rank, "horizontal_parallel_size": world}})
    return ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3), loss_fn=models.gpt_loss, options=options)


def _rank(rank, world, port, args, out):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    worker = _worker()
    spent = _timed_all_reduce()
    if args.kind == "bench":
        trainer = _bench_gpt_trainer(worker, rank, world, args)
    else:
        trainer = worker.trainer(args.kind, "adam", rank, world, world, hidden=args.hidden, layers=args.layers,
                                 heads=args.heads)
    seconds, collective = [], []
    for step in range(args.steps + 3):
        before, started = spent[0], time.perf_counter()
        trainer.train_step(*worker.batch("gpt2" if args.kind == "bench" else args.kind, step))
        if step >= 3:
            seconds.append(time.perf_counter() - started)
            collective.append(spent[0] - before)
    torch.save({"seconds": seconds, "collective": collective}, os.path.join(out, f"rank{rank}.pt"))


def run(world, args):
    import torch.multiprocessing as mp

    sys.path.insert(0, TESTS)
    from distributed_worker import free_port
    sys.path.remove(TESTS)
    out = tempfile.mkdtemp()
    port = free_port()
    context = mp.get_context("spawn")
    processes = [context.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(600)
        if p.is_alive():
            p.kill()
            raise TimeoutError("bench rank still running after 600 s")
    return torch.load(os.path.join(out, "rank0.pt"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="gpt2", choices=["gpt2", "bert", "bench"],
                        help="bench: the bench GPT of bench/models.py")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    one, two = run(1, args), run(2, args)
    t1, t2 = statistics.median(one["seconds"]), statistics.median(two["seconds"])
    share = sum(two["collective"]) / sum(two["seconds"])
    print(f"{args.kind} hidden={args.hidden} layers={args.layers}: 1 process {t1 * 1e3:.1f} ms/step, "
          f"2 ranks tensor parallel {t2 * 1e3:.1f} ms/step ({t1 / t2:.2f}x); inside f/g/norm all_reduces "
          f"{share:.0%} of the 2-rank step ({statistics.median(two['collective']) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
