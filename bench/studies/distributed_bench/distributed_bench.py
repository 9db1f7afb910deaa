"""Data parallel and ZeRO-1 on this machine: where a distributed step's time goes, what each rank
keeps, and what 2 ranks buy over one process (the numbers in docs/performance.md, "Distributed").

    python bench/studies/distributed_bench/distributed_bench.py --model gpt [--steps 8] [--warmup 2] [--batch 8]

Every setting runs in fresh processes on the same global batch (`--batch` sequences, split evenly
over the ranks) and the same initial model:

    1 process x 1 thread     the plain single-process trainer, one onnxruntime/torch thread
    1 process x 2 threads    the same with both cores (what `orttrainer train` uses alone)
    2 ranks x 1 thread DP    data parallel over gloo (one all_reduce of the gradients per step)
    2 ranks x 1 thread ZeRO  ZeRO-1 (reduce_scatter, update of the rank's half, all_gather)

Printed per setting: median step time and tokens/s of the global batch; for the ranks, the share of
the step spent in communication (collectives, measured by the runtime around each one), the micro
and apply runs, the optimizer-state bytes each rank holds, and each rank's peak RSS after warm-up.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, ROOT)

from bench.train_bench import cli as tb  # noqa: E402  (workloads and RSS helpers)
from bench.train_bench.host import free_port  # noqa: E402


def _session_options(threads):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_mem_pattern = False  # as the trainer's default
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return options


def _optimizer_bytes(trainer):
    """The bytes of this rank's Adam moments (its segment under ZeRO-1), from its state_dict."""
    return sum(np.asarray(value).nbytes for per_weight in trainer.state_dict()["optimizer"].values()
               if isinstance(per_weight, dict) for key, value in per_weight.items() if key.startswith("Moment_"))


def _worker(rank, world, port, threads, zero, args, out):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(threads)
    workload = tb.make_workload(args.model, args, batch=args.batch // world, seq=args.seq)
    model, desc, loss_fn = workload.ort_trainer_args(workload.make_model(seed=0))
    options = ORTTrainerOptions({
        "device": {"id": "cpu"}, "session_options": _session_options(threads),
        "distributed": {"world_rank": rank, "world_size": world, "local_rank": rank,
                        "deepspeed_zero_optimization": {"stage": zero}}})
    trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn, options=options)
    # Rank r takes the r-th part of every global batch.
    global_batches = tb.make_workload(args.model, args, batch=args.batch, seq=args.seq).batches(args.warmup + args.steps)
    per = args.batch // world
    batches = [[t[rank * per:(rank + 1) * per] for t in b] for b in global_batches]
    for batch in batches[:args.warmup]:
        trainer.train_step(*batch)
    phases_before = trainer.step_seconds
    resettable = tb.reset_peak_rss()
    times = []
    for batch in batches[args.warmup:]:
        started = time.perf_counter()
        trainer.train_step(*batch)
        times.append(time.perf_counter() - started)
    phases = {k: v - phases_before.get(k, 0.0) for k, v in trainer.step_seconds.items()}
    result = {"rank": rank, "median_s": statistics.median(times), "total_s": sum(times), "phases_s": phases,
              "optimizer_state_bytes": _optimizer_bytes(trainer),
              "peak_rss_mb": tb._status_kb("VmHWM") / 1024 if resettable else None}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_setting(world, threads, zero, args, out_dir):
    out = os.path.join(out_dir, f"w{world}-t{threads}-z{zero}")
    os.makedirs(out, exist_ok=True)
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_worker, args=(r, world, port, threads, zero, args, out))
                 for r in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(args.timeout)
        if p.is_alive():
            p.kill()
            raise TimeoutError(f"setting world={world} threads={threads} zero={zero} did not finish")
        if p.exitcode != 0:
            raise RuntimeError(f"setting world={world} threads={threads} zero={zero}: a process exited {p.exitcode}")
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["gpt", "bert"], default="gpt")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over the ranks")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                      "distributed"),
                        help="where the per-rank JSON and <model>.json go (default bench/results/distributed, "
                             "git-ignored)")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 2, 1
    args.ort_outputs, args.attention, args.bert_vocab = "loss", "sdpa", 30522  # train_bench's defaults
    os.makedirs(args.out, exist_ok=True)
    settings = [("1 process x 1 thread", 1, 1, 0), ("1 process x 2 threads", 1, 2, 0),
                ("2 ranks x 1 thread, DP", 2, 1, 0), ("2 ranks x 1 thread, ZeRO-1", 2, 1, 1)]
    tokens = args.batch * tb.make_workload(args.model, args, seq=args.seq).seq
    rows = []
    for label, world, threads, zero in settings:
        ranks = run_setting(world, threads, zero, args, args.out)
        step = max(r["median_s"] for r in ranks)
        row = {"setting": label, "step_ms": 1e3 * step, "tokens_per_s": tokens / step,
               "optimizer_state_mb": [r["optimizer_state_bytes"] / 2**20 for r in ranks],
               "peak_rss_mb": [r["peak_rss_mb"] for r in ranks]}
        if world > 1:
            total = statistics.mean(r["total_s"] for r in ranks)
            for phase in ("micro", "communication", "apply"):
                row[f"{phase}_share"] = statistics.mean(r["phases_s"][phase] for r in ranks) / total
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"{args.model}, global batch {args.batch}, {tokens} tokens/step, Adam, {args.steps} timed steps")
    print(f"{'setting':<28}{'step ms':>9}{'tokens/s':>10}{'comm':>7}{'micro':>7}{'apply':>7}"
          f"{'optim MB/rank':>15}{'peak RSS MB/rank':>20}")
    for row in rows:
        shares = "".join(f"{100 * row[k]:>6.0f}%" if k in row else f"{'-':>7}"
                         for k in ("communication_share", "micro_share", "apply_share"))
        optim = "/".join(f"{v:.1f}" for v in row["optimizer_state_mb"])
        rss = "/".join(f"{v:.0f}" if v else "?" for v in row["peak_rss_mb"])
        print(f"{row['setting']:<28}{row['step_ms']:>9.0f}{row['tokens_per_s']:>10,.0f}{shares}{optim:>15}{rss:>20}")
    with open(os.path.join(args.out, f"{args.model}.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "environment": tb.environment()}, f, indent=1)


if __name__ == "__main__":
    main()
