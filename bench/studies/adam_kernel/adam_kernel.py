"""Adam on the kernel library against onnxruntime's AdamOptimizer: step time and peak memory.

    .venv/bin/python bench/studies/adam_kernel/adam_kernel.py [--layers 6 --hidden 768 --heads 12]
        [--batch 4 --seq 256] [--steps 8] [--rounds 2] [--json OUT]

The benchmark's GPT (bench/train_bench/models.py; default d768 L6, b4 x s256) trained by ORTTrainer
with Adam, fp32 and mixed precision (`mixed_precision.enabled=True`, compute_dtype auto: bf16 on a CPU
with bf16 units, fp32 elsewhere), once with ORTTRAINER_ADAM=onnxruntime (AdamOptimizer: one thread,
and under mixed precision second copies of every weight and moment) and once with the default (the
library's Adam: the session's threads, in place). Each run is a fresh process; the four runs go in
turn, `--rounds` times, so drift hits all alike. Reported per run: the median step after the first
two, and the process's peak RSS above its baseline (the model built). Nothing else should run.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.train_bench.host import host_facts  # noqa: E402

KERNELS = ("onnxruntime", "orttrainer")
PRECISIONS = ("fp32", "mixed")


def child(args):
    import torch

    from bench.train_bench import models as bm
    from bench.train_bench.measure import rss_now_kb
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    torch.set_num_threads(2)
    cfg = bm.GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads, max_positions=args.seq)
    workload = bm.GPTWorkload(batch=args.batch, seq=args.seq, cfg=cfg)
    model = workload.make_model()
    batches = workload.batches(args.steps)
    baseline = rss_now_kb()
    opts = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
    if args.precision == "mixed":
        opts["mixed_precision"] = {"enabled": True}
    module, desc, loss_fn = workload.ort_trainer_args(model)
    trainer = ORTTrainer(module, desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn,
                         options=ORTTrainerOptions(opts))
    times, losses = [], []
    for batch in batches:
        started = time.perf_counter()
        loss = trainer.train_step(*batch)
        losses.append(float(loss.item()))
        times.append(time.perf_counter() - started)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    nodes = [n.op_type for n in trainer.training_model.graph.node]
    print(json.dumps({"step_s": times, "losses": losses, "peak_above_baseline_mb": (peak - baseline) / 1024,
                      "compute_dtype": str(trainer.compute_dtype), "adam_nodes": nodes.count("Adam"),
                      "adam_optimizer_nodes": nodes.count("AdamOptimizer")}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--precision", choices=PRECISIONS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    host = host_facts()
    runs = {f"{k}-{p}": [] for p in PRECISIONS for k in KERNELS}
    for _ in range(args.rounds):
        for precision in PRECISIONS:
            for kernel in KERNELS:
                sizes = ("layers", "hidden", "heads", "batch", "seq", "steps")
                command = [sys.executable, __file__, "--child", "--precision", precision]
                command += [f"--{k}={getattr(args, k)}" for k in sizes]
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                      env={**os.environ, "ORTTRAINER_ADAM": kernel})
                if done.returncode != 0:
                    sys.exit(f"{kernel} {precision} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs[f"{kernel}-{precision}"].append(result)
                median = statistics.median(result["step_s"][2:]) * 1e3
                print(f"{kernel:12s} {precision:6s} median step {median:8.1f} ms"
                      f"  peak +{result['peak_above_baseline_mb']:7.0f} MB  ({result['compute_dtype']}, "
                      f"Adam nodes {result['adam_nodes']}, AdamOptimizer {result['adam_optimizer_nodes']})",
                      flush=True)
    summary = {}
    for name, results in runs.items():
        steps = [t for r in results for t in r["step_s"][2:]]
        summary[name] = {"median_step_ms": statistics.median(steps) * 1e3,
                         "peak_above_baseline_mb": max(r["peak_above_baseline_mb"] for r in results)}
    for precision in PRECISIONS:
        before, after = summary[f"onnxruntime-{precision}"], summary[f"orttrainer-{precision}"]
        speed = before["median_step_ms"] / after["median_step_ms"]
        memory = after["peak_above_baseline_mb"] - before["peak_above_baseline_mb"]
        print(f"{precision}: the library's Adam runs the step {speed:.2f}x as fast, peak {memory:+.0f} MB")
    date = datetime.date.today().isoformat()
    out = Path(args.json or ROOT / "bench" / "results" / f"adam_kernel-{host['host_kind']}-{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"command": " ".join(sys.argv), "host": host,
                                        "time": datetime.datetime.utcnow().isoformat(timespec="seconds")},
                               "args": vars(args), "summary": summary, "runs": runs}, indent=1))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
