"""Peak memory and step time of the graph_transformer recompute options (docs/performance.md, "Recompute").

    python bench/studies/recompute_memory/recompute_memory.py [--batch 4] [--seq 512] [--layers 4] [--steps 4] [--attn-dropout 0.1]
    python bench/studies/recompute_memory/recompute_memory.py --timing [--rounds 10]    # paired step times, one process

Each setting runs in a fresh subprocess: build the GPT of bench/train_bench/train_bench/models.py (masked attention with dropout
on the attention probabilities, so that attn_dropout_recompute has something to act on) and its batches,
take the process's RSS as the baseline, then create the ORTTrainer and train. Reported per setting,
above that baseline: the peak RSS of the steady steps (after the first step, the heap the export freed
is handed back with malloc_trim and VmHWM is reset: what stays is the session, its arena and the
states, and the steps' own peak) -- the memory a training step needs; the peak over the whole run,
which on this workload is the TorchScript export's (the same in every setting); and the median
steady step time (a noisy figure on a shared machine: use --timing). The losses
of every setting are compared with the baseline's (they must be identical: recompute only changes
when values are computed).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, ROOT)  # bench.train_bench

SETTINGS = {
    "none": {},
    "attn_dropout_recompute": {"attn_dropout_recompute": True},
    "gelu_recompute": {"gelu_recompute": True},
    "transformer_layer_recompute": {"transformer_layer_recompute": True},
    "transformer_layer_recompute, number_recompute_layers=1": {"transformer_layer_recompute": True,
                                                               "number_recompute_layers": 1},
    "all three": {"attn_dropout_recompute": True, "gelu_recompute": True, "transformer_layer_recompute": True},
}


def gpt_workload(args):
    from bench.train_bench import models as bm

    cfg = bm.GPTConfig(layers=args.layers, max_positions=args.seq, attention="masked", attn_dropout=args.attn_dropout)
    return bm.GPTWorkload(batch=args.batch, seq=args.seq, cfg=cfg)


def make_trainer(workload, model, setting):
    from bench.train_bench import cli as tb
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    model, desc, loss_fn = workload.ort_trainer_args(model)
    options = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False}, "graph_transformer": SETTINGS[setting]}
    return ORTTrainer(model, desc, optim.AdamConfig(lr=tb.LR), loss_fn=loss_fn, options=ORTTrainerOptions(options))


def timing(args):
    """Every setting's trainer in one process, stepping through the same batches in interleaved rounds
    (the order rotating every round): per setting the median step and the median over rounds of its
    step / none's step of the same round. Background load hits all settings alike."""
    import copy

    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    workload = gpt_workload(args)
    model = workload.make_model()
    batches = workload.batches(4)
    trainers = {name: make_trainer(workload, copy.deepcopy(model), name) for name in args.settings}
    for trainer in trainers.values():
        trainer.train_step(*batches[0])  # export + session + first step
    times = {name: [] for name in trainers}
    names = list(trainers)
    for round_ in range(args.rounds + 1):  # one warm-up round
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            trainers[name].train_step(*batches[round_ % len(batches)])
            if round_:
                times[name].append(time.perf_counter() - started)
    print(f"GPT {args.layers} layers, batch {args.batch}, seq {args.seq}: {args.rounds} interleaved rounds")
    print("| setting | median step | paired ratio to none |")
    print("|---|---|---|")
    for name, values in times.items():
        ratio = statistics.median(a / b for a, b in zip(values, times["none"])) if "none" in times else float("nan")
        print(f"| {name} | {statistics.median(values) * 1e3:.0f} ms | {ratio:.2f}x |")


def child(args):
    import ctypes
    import gc

    import onnxruntime as ort
    import torch

    from bench.train_bench import cli as tb

    ort.set_default_logger_severity(3)
    torch.manual_seed(0)
    workload = gpt_workload(args)
    model = workload.make_model()
    batches = workload.batches(args.steps + 1)
    gc.collect()
    baseline = tb.rss_now_kb()
    trainer = make_trainer(workload, model, args._child)
    torch.manual_seed(1)  # dropout masks: the same draws in every setting
    losses = [trainer.train_step(*batches[0]).item()]
    peak_all = tb._status_kb("VmHWM") - baseline
    if not args.whole:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back the heap the export freed: it is not the step's
        tb.reset_peak_rss()
    times = []
    for batch in batches[1:]:
        started = time.perf_counter()
        losses.append(trainer.train_step(*batch).item())
        times.append(time.perf_counter() - started)
    steady = tb._status_kb("VmHWM") - baseline
    print(json.dumps({"peak_mb": max(peak_all, steady) / 1024, "steady_peak_mb": steady / 1024,
                      "step_ms": statistics.median(times) * 1e3, "losses": losses}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="steady steps after the first")
    p.add_argument("--attn-dropout", type=float, default=0.1)
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--timing", action="store_true", help="paired step times instead of memory")
    p.add_argument("--whole", action="store_true",
                   help="no malloc_trim, no reset of VmHWM: the 'steady' column is the whole process's peak "
                        "(start-up included), what a user's machine must have; every setting runs with a cold "
                        "export cache, then again with the cache that run left (a second table)")
    p.add_argument("--rounds", type=int, default=10, help="--timing: interleaved rounds")
    p.add_argument("--_child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        return child(args)
    if args.timing:
        return timing(args)
    results, warm = {}, {}
    for name in args.settings:
        command = [sys.executable, __file__, "--_child", name, "--batch", str(args.batch), "--seq", str(args.seq),
                   "--layers", str(args.layers), "--steps", str(args.steps), "--attn-dropout", str(args.attn_dropout)]
        command += ["--whole"] if args.whole else []
        with tempfile.TemporaryDirectory() as cache:  # a cold export cache for every setting: the user's first run
            env = dict(os.environ, ORTTRAINER_CACHE_DIR=cache)
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            if args.whole:  # the same run again: graphs from the cache, verified (the user's second run)
                again = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
                warm[name] = json.loads(again.strip().splitlines()[-1])
        results[name] = json.loads(out.strip().splitlines()[-1])
        print(f"  {name}: {results[name]['peak_mb']:.0f} MB" +
              (f", warm cache {warm[name]['peak_mb']:.0f} MB" if name in warm else ""), file=sys.stderr)
    base = results.get("none")
    print(f"GPT {args.layers} layers, hidden 256, batch {args.batch}, seq {args.seq}, attention dropout "
          f"{args.attn_dropout}, Adam; peak RSS above the pre-trainer baseline, median of {args.steps} steps")
    what = "whole-process peak" if args.whole else "steady-step peak"
    print(f"| setting | {what} | vs none | whole-run peak | step | vs none | losses = none's |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        cut = f"{(r['steady_peak_mb'] / base['steady_peak_mb'] - 1) * 100:+.0f}%" if base else "—"
        slower = f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "—"
        same = ("yes" if r["losses"] == base["losses"] else "NO") if base else "—"
        print(f"| {name} | {r['steady_peak_mb']:.0f} MB | {cut} | {r['peak_mb']:.0f} MB | "
              f"{r['step_ms']:.0f} ms | {slower} | {same} |")

    if warm:
        print("\nThe same runs again with the export cache each left (graphs loaded and verified, no export):")
        print("| setting | whole-process peak, warm cache | vs none | losses = cold run's |")
        print("|---|---|---|---|")
        for name, r in warm.items():
            cut = f"{(r['peak_mb'] / warm['none']['peak_mb'] - 1) * 100:+.0f}%" if "none" in warm else "—"
            same = "yes" if r["losses"] == results[name]["losses"] else "NO"
            print(f"| {name} | {r['peak_mb']:.0f} MB | {cut} | {same} |")

if __name__ == "__main__":
    main()
