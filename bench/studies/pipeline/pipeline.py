"""Pipeline parallel on this machine: a 2-stage step against one process (docs/distributed.md,
"Pipeline parallel").

    python bench/studies/pipeline/pipeline.py [--steps 6] [--warmup 2] [--batch 8] [--seq 64] [--micro 4] [--layers 4]

Both settings train the same GPT (bench/train_bench/train_bench/models.py, small config) on the same batches with Adam, each
process with one onnxruntime/torch thread: 1 process on the whole batch, then 2 ranks x 1 thread as
2 pipeline stages (1F1B, `--micro` micro-batches, automatic cut). Printed: the median step time of
each; per stage, the share of its step time spent blocked on its neighbour (the bubble, plus the
transfer time) and in forward-only runs (the cost of recomputing at the stage boundary); and the
1F1B bubble share in theory, (P - 1) / (M + P - 1).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, ROOT)

from bench.train_bench.models import GPTConfig, GPTWorkload  # noqa: E402
from bench.train_bench.host import free_port  # noqa: E402


def workload(args):
    cfg = GPTConfig(vocab=2048, hidden=128, layers=args.layers, heads=4, max_positions=args.seq,
                    attention="masked")
    return GPTWorkload(batch=args.batch, seq=args.seq, cfg=cfg)


def run(rank, world, port, args, out):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    import onnxruntime as ort

    torch.set_num_threads(1)
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = session_options.inter_op_num_threads = 1
    options = {"device": {"id": "cpu"}, "session_options": session_options}
    if world > 1:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)})
        options["distributed"] = {"world_rank": rank, "world_size": world, "local_rank": rank,
                                  "pipeline_parallel": {"pipeline_parallel_size": world,
                                                        "num_pipeline_micro_batches": args.micro}}
    w = workload(args)
    model = w.make_model()
    trainer = ORTTrainer(model, w.model_desc(), optim.AdamConfig(lr=1e-3), loss_fn=w.loss_fn,
                         options=ORTTrainerOptions(options))
    times, before = [], {}
    for step, (x, y) in enumerate(w.batches(args.warmup + args.steps)):
        if step == args.warmup:
            before = trainer.step_seconds
        started = time.perf_counter()
        trainer.train_step(x, y)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    result = {"median_s": statistics.median(times)}
    s = {k: v - before.get(k, 0.0) for k, v in trainer.step_seconds.items()}
    if "wait" in s:  # pipeline parallel
        result["wait_share"] = s["wait"] / s["step"]
        result["forward_share"] = s["forward"] / s["step"]
    out.put((rank, result))


def launch(world, args):
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=run, args=(r, world, port, args, queue)) for r in range(world)]
    for p in processes:
        p.start()
    results = dict(queue.get(timeout=600) for _ in processes)
    for p in processes:
        p.join(60)
    return [results[r] for r in range(world)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    (one,) = launch(1, args)
    stages = launch(2, args)
    tokens = args.batch * args.seq
    print(f"GPT hidden 128, {args.layers} layers, batch {args.batch} x seq {args.seq}, Adam, 1 thread per process")
    print(f"1 process:          {one['median_s'] * 1e3:8.1f} ms/step  {tokens / one['median_s']:8.0f} tokens/s")
    two = max(r["median_s"] for r in stages)
    print(f"2 stages, M={args.micro}:    {two * 1e3:8.1f} ms/step  {tokens / two:8.0f} tokens/s")
    for rank, r in enumerate(stages):
        print(f"  stage {rank}: waited on its neighbour {r['wait_share']:.0%} of its step; forward-only runs "
              f"(recomputed in the backward slot) {r['forward_share']:.0%}")
    print(f"  1F1B bubble in theory: (P-1)/(M+P-1) = {1 / (args.micro + 1):.0%}")


if __name__ == "__main__":
    main()
