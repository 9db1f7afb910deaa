"""Does bf16 mixed precision still learn? The bundled recipes trained twice, fp32 and bf16, side by side.

    .venv/bin/python bench/studies/bf16_learning/bf16_learning.py [--out DIR] [--json OUT]

1. BERT-tiny pretraining (recipes/bert-pretrain-tiny.yaml, 200 steps): fp32, then mixed precision
   with compute_dtype bfloat16. Compared: the train loss logged at step 200.
2. The bundled fine-tune (recipes/bert-finetune-classification-tiny.yaml, from the fp32 pretraining
   run): fp32, then bf16, each with the seeds of --seeds. Compared: the mean over the seeds of the dev
   accuracy at the end (results.json's eval_accuracy). The dev set has 160 passages, so one seed's
   accuracy moves by ~0.03 (one standard error) between seeds: one run each could not tell 0.02.

What the trainer must reach (docs/performance.md, "Matmul kernels and bf16"): the step-200 loss within
1% of fp32's and the dev accuracy within 0.02. Needs a CPU with bf16 units (amx_bf16 / avx512_bf16):
elsewhere compute_dtype bfloat16 is refused. Each run is a fresh `orttrainer train` process; the runs
share one data cache. About 7 minutes on 2 cores.
"""

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.train_bench.host import host_facts  # noqa: E402

CLI = [sys.executable, "-m", "orttrainer", "train"]
PRECISIONS = {
    "fp32": ["trainer.mixed_precision.enabled=false", "trainer.mixed_precision.compute_dtype=float32"],
    "bf16": ["trainer.mixed_precision.enabled=true", "trainer.mixed_precision.compute_dtype=bfloat16"],
}


def train(recipe, out, sets):
    args = [*CLI, str(ROOT / "recipes" / recipe), "--set", f"run.output_dir={out}", "--set",
            "run.overwrite_output_dir=true", "--set", f"data.cache_dir={out.parent / 'data'}"]
    for item in sets:
        args += ["--set", item]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                 f"{done.stderr[-3000:]}")
    return time.perf_counter() - started


def loss_at(out, step):
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train" and record.get("step") == step:
            return record["loss"]
    raise SystemExit(f"{out}/metrics.jsonl has no train line for step {step}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bf16_learning")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--seeds", default="42,7,1234", help="fine-tune seeds (run.seed), comma-separated")
    args = parser.parse_args()
    facts = host_facts()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {"host": facts, "date": now, "commit": commit.stdout.strip(), "pretrain": {}, "finetune": {}}
    for name, sets in PRECISIONS.items():
        out = args.out / f"pretrain-{name}"
        seconds = train("bert-pretrain-tiny.yaml", out, sets)
        result["pretrain"][name] = {"loss_at_200": loss_at(out, 200), "seconds": seconds}
        loss = result["pretrain"][name]["loss_at_200"]
        print(f"pretrain {name}: loss at step 200 {loss:.4f} ({seconds:.0f} s)")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    for name, sets in PRECISIONS.items():
        per_seed = {}
        for seed in seeds:
            out = args.out / f"finetune-{name}-{seed}"
            seconds = train("bert-finetune-classification-tiny.yaml", out,
                            [*sets, f"model.from={args.out / 'pretrain-fp32'}", f"run.seed={seed}"])
            per_seed[seed] = json.loads((out / "results.json").read_text())["eval_accuracy"]
            print(f"finetune {name} seed {seed}: dev accuracy {per_seed[seed]:.4f} ({seconds:.0f} s)")
        mean = sum(per_seed.values()) / len(per_seed)
        result["finetune"][name] = {"dev_accuracy": mean, "per_seed": per_seed}
        print(f"finetune {name}: mean dev accuracy {mean:.4f}")
    fp32, bf16 = result["pretrain"]["fp32"]["loss_at_200"], result["pretrain"]["bf16"]["loss_at_200"]
    result["pretrain_loss_relative_difference"] = abs(bf16 - fp32) / fp32
    result["finetune_accuracy_difference"] = abs(result["finetune"]["bf16"]["dev_accuracy"]
                                                 - result["finetune"]["fp32"]["dev_accuracy"])
    print(f"step-200 loss: bf16 {bf16:.4f} vs fp32 {fp32:.4f} "
          f"({100 * result['pretrain_loss_relative_difference']:.2f}%, target < 1%); mean dev accuracy "
          f"difference {result['finetune_accuracy_difference']:.4f} (target <= 0.02)")
    name = f"bf16_learning-{facts['host_kind']}-{datetime.date.today()}.json"
    path = args.json or ROOT / "bench" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
