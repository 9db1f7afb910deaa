"""Start-up cold vs warm export cache: each run is a fresh process that builds a trainer and takes its
first train_step.

    cd bench && ../.venv/bin/python startup_cache.py --model bert --rounds 3

Round by round: a cold run (an empty cache folder) then a warm run (the folder the cold run filled).
Prints each run's wall time from the trainer's construction to the end of its first step and the
trainer's startup_seconds breakdown, then the medians. The cache folder is a temporary one.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(model_name, cache_dir):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim
    from models import BertSize, BertWorkload, GPTWorkload  # bench/models.py

    workload = GPTWorkload() if model_name == "gpt" else BertWorkload(batch=8, seq=128, size=BertSize())
    model = workload.make_model()
    batch = workload.batches(1)[0]
    started = time.perf_counter()
    module, model_desc, loss_fn = workload.ort_trainer_args(model)
    trainer = ORTTrainer(module, model_desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn,
                         options=ORTTrainerOptions({"device": {"id": "cpu"},
                                                    "utils": {"export_cache_dir": cache_dir}}))
    trainer.train_step(*batch)
    wall = time.perf_counter() - started
    print(json.dumps({"wall_s": wall, "source": trainer._build.source, **trainer.startup_seconds}))


def run(model_name, cache_dir):
    out = subprocess.run([sys.executable, __file__, "--child", model_name, cache_dir], cwd=HERE,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "bert"], default="bert")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    results = {"cold": [], "warm": []}
    for round_ in range(args.rounds):
        folder = tempfile.mkdtemp(prefix="export-cache-")
        try:
            for kind in ("cold", "warm"):
                result = run(args.model, folder)
                results[kind].append(result)
                parts = ", ".join(f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float) and k != "wall_s")
                print(f"round {round_ + 1} {kind:4s} ({result['source']}): {result['wall_s']:.2f} s to the end of "
                      f"the first step ({parts})")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    medians = {kind: statistics.median(r["wall_s"] for r in runs) for kind, runs in results.items()}
    print(f"{args.model}: median start-up cold {medians['cold']:.2f} s, warm {medians['warm']:.2f} s "
          f"({medians['cold'] - medians['warm']:.2f} s saved)")


if __name__ == "__main__":
    main()
