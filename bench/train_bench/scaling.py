"""--scaling of train_bench.py: orttrainer on the GPT model at several batch/seq sizes, and the
least-squares fits of step time against tokens and model FLOPs."""

import gc
import statistics

import numpy as np

from . import models as bm
from .measure import CpuMonitor, QuietGate, summarize, timed_call
from .report import log
from .systems import count_flops, make_system, make_workload


def run_scaling(args):
    """orttrainer on the GPT model at several batch/seq sizes, all trainers built first and then stepped
    interleaved round by round (like the main benchmark) so that drift hits every size alike."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    ref = make_workload("gpt", args)
    b0, s0 = ref.batch, ref.seq
    configs = list(dict.fromkeys([(b0 // 2, s0), (b0, s0), (b0 * 2, s0), (b0, s0 // 2), (b0, s0 * 2)]))
    if args.quick:  # smoke: two batch sizes still build, step and fit a sweep; more points only cost trainers
        configs = [(b0, s0), (b0 * 2, s0)]
    log(
        f"\n=== scaling (orttrainer, gpt): batch {b0 // 2}/{b0}/{b0 * 2} at seq {s0}; "
        f"seq {s0 // 2}/{s0}/{s0 * 2} "
        f"at batch {b0}, interleaved"
    )
    points = []
    for batch, seq in configs:
        cfg = ref.cfg
        if seq > cfg.max_positions:
            cfg = bm.GPTConfig(**{**cfg.__dict__, "max_positions": seq})
        workload = bm.GPTWorkload(batch=batch, seq=seq, cfg=cfg)
        batches = workload.batches(1 + args.warmup + args.scaling_steps)
        system = make_system("orttrainer", workload, workload.make_model())
        system.first_step(batches[0])
        points.append(
            {
                "batch": batch,
                "seq": seq,
                "flops": count_flops(workload)[0],
                "batches": batches,
                "system": system,
                "times": [],
                "others": [],
            }
        )
    gc.collect()
    monitor = None
    gate = QuietGate(args.quiet_threshold, args.wait_quiet, args.wait_budget)
    for i in range(args.warmup + args.scaling_steps):
        if i >= args.warmup:
            gate.wait()
        if i == args.warmup:
            monitor = CpuMonitor()
        for k in range(len(points)):
            point = points[(i + k) % len(points)]
            _, seconds, busy = timed_call(point["system"].step, point["batches"][1 + i])
            point["times"].append(seconds)
            point["others"].append(busy)
    others = monitor.others_cores() if monitor else None
    rows = []
    quiet_everywhere = True
    for point in points:
        times = point["times"][args.warmup :]
        quiet = [t for t, o in zip(times, point["others"][args.warmup :]) if o < args.quiet_threshold]
        quiet_everywhere &= len(quiet) >= 3
        stats = summarize(times)
        flops, tokens = point["flops"], point["batch"] * point["seq"]
        row = {
            "batch": point["batch"],
            "seq": point["seq"],
            "tokens": tokens,
            **stats,
            "model_flops": flops,
            "quiet_n": len(quiet),
            "quiet_median_s": statistics.median(quiet) if quiet else None,
            "step_times_s": point["times"],
            "other_cores_per_step": point["others"],
        }
        rows.append(row)
    basis = "quiet_median_s" if quiet_everywhere else "median_s"
    for row in rows:
        med, flops, tokens = row[basis], row["model_flops"], row["tokens"]
        row.update(
            basis=basis,
            step_s=med,
            tokens_per_s=tokens / med,
            ms_per_gflop=med * 1e3 / (flops / 1e9),
            achieved_gflops=flops / med / 1e9,
        )
        log(
            f"batch {row['batch']:3d} seq {row['seq']:4d}: {med * 1e3:8.1f} ms ({basis})  "
            f"{row['tokens_per_s']:8.0f} tok/s  {row['ms_per_gflop']:.2f} ms/GFLOP"
        )
    del points
    gc.collect()
    by_batch = [r for r in rows if r["seq"] == s0]
    by_seq = [r for r in rows if r["batch"] == b0]
    fit_flops = None
    if len(rows) >= 2:
        slope, intercept = np.polyfit([r["model_flops"] / 1e9 for r in rows], [r["step_s"] for r in rows], 1)
        fit_flops = {"fixed_s": float(intercept), "s_per_gflop": float(slope)}
    return {
        "rows": rows,
        "basis": basis,
        "other_processes_cores": others,
        "waited_for_quiet_s": gate.waited_s,
        "fit_batch_sweep": linear_fit(by_batch),
        "fit_seq_sweep": linear_fit(by_seq),
        "fit_all_vs_model_flops": fit_flops,
    }


def linear_fit(rows):
    """step_s = fixed_s + per_token_s * tokens (least squares) over a sweep."""
    if len(rows) < 2:
        return None
    rows = sorted(rows, key=lambda r: r["tokens"])
    x = np.array([r["tokens"] for r in rows], dtype=float)
    y = np.array([r["step_s"] for r in rows])
    slope, intercept = np.polyfit(x, y, 1)
    return {
        "fixed_s": float(intercept),
        "per_token_us": float(slope * 1e6),
        "fixed_share_at_middle": float(intercept / y[len(y) // 2]),  # the middle size of the sweep
    }
