"""GPT-2 small (real_size.py's model and batches) with the export cache: one cold process fills it, then
one warm process reads it; each reports its first step (start-up split) and VmHWM above the RSS after
imports, model and batches. Losses must be equal.

    .venv/bin/python bench/studies/warm_start/warm_start.py [--layers N]
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)  # bench.train_bench

from bench.train_bench.real_size import loss_module, make_batches, make_model, status_kb  # noqa: E402


def child(cache_dir, run, layers):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    model, cfg = make_model("gpt2", layers)
    batches = make_batches("gpt2", cfg, 2)
    module, desc = loss_module(model, batches)
    gc.collect()
    base = status_kb("VmRSS")
    options = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache_dir": cache_dir}}
    trainer = ORTTrainer(module, desc, optim.AdamConfig(lr=1e-4), options=ORTTrainerOptions(options))
    started = time.perf_counter()
    losses = [trainer.train_step(*batches[0].values()).item()]
    first = time.perf_counter() - started
    first_peak = (status_kb("VmHWM") - base) / 1024
    losses.append(trainer.train_step(*batches[1].values()).item())
    source = "export cache" if trainer.startup_seconds.get("export_cache_load") else "export"
    print(json.dumps({"run": run, "source": source, "first_step_s": first,
                      "startup_seconds": trainer.startup_seconds, "first_step_peak_mb": first_peak,
                      "peak_mb": (status_kb("VmHWM") - base) / 1024, "losses": losses}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=0, help="override the layer count (0: the real size)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.layers)
    with tempfile.TemporaryDirectory() as cache_dir:
        for run in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--child", cache_dir, run],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            split = ", ".join(f"{k} {v:.2f}" for k, v in r["startup_seconds"].items() if v)
            print(f"{run:5s} ({r['source']}): first step {r['first_step_s']:.1f} s ({split}); peak after the first "
                  f"step {r['first_step_peak_mb']:.0f} MB, after the second {r['peak_mb']:.0f} MB; losses "
                  + " ".join(f"{x:.4f}" for x in r["losses"]))


if __name__ == "__main__":
    main()
