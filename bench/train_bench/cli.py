"""Training benchmark: orttrainer vs PyTorch eager vs torch.compile (inductor), CPU, Adam; fp32, and
mixed precision on CPUs with bf16 matrix units.

    python bench/train_bench.py [--model gpt|bert|all] [--steps N] [--warmup N] [--quick] [--scaling]
                                [--mixed auto|on|off] [--json OUT]

What it does, per model (docs/performance.md explains every number):
  1. Builds the model once (seeded) and pre-generates the batches; every system trains a deepcopy of
     the same initial weights on the same batches with Adam(lr=1e-4, no decay, no clipping), fp32.
     On a host whose /proc/cpuinfo has amx_bf16 or avx512_bf16 (or with --mixed on) three mixed systems
     join: eager-bf16 and compile-bf16 (the same model, forward under torch.autocast("cpu",
     torch.bfloat16); fp32 master weights, gradients and Adam) and orttrainer-mixed
     (mixed_precision.enabled=True); each system records the dtype it really computed in.
  2. Counts the model FLOPs of one step with torch.utils.flop_counter.FlopCounterMode on an eager
     forward+backward (SDPA forced to its math kernel so the attention matmuls are counted). Each
     system's MFU uses the FLOPs it performs: the model's, less what orttrainer's masked-LM decoder on
     the labelled rows skips (systems.executed_flops).
  3. Measures the matmul roof: sgemm 2048x2048 fp32 through torch.matmul (torch's threads) and through
     onnxruntime's MatMul (MLAS, its default threads), best of several, before and after; MFU divides
     by the larger, and an MFU above 100% is reported as a measurement error (bench/train_bench/host.py). With the
     mixed systems also the bf16 roof (torch.matmul on bf16 2048x2048): the mixed systems' MFU divides
     by that one.
  4. Start-up: the first train step of each system, timed alone (orttrainer: export, gradient graph,
     session, first step; torch.compile: the first step, which compiles forward and backward).
  5. Runs the systems interleaved step by step (one round = one step of each system + one sgemm sample;
     the order rotates every round) so machine drift hits every system alike; reports the median step,
     and counts the OS threads each system really kept busy. Ratios between systems that ran on
     different numbers of threads are not printed (n/a, with the two counts). Pairs: orttrainer
     against eager and compile, orttrainer-mixed against eager-bf16 and compile-bf16.
  6. Peak resident memory: each system again in a fresh subprocess (same model, batches and steps):
     peak RSS over the whole child (ru_maxrss, start-up included) and the peak over steady-state steps
     only (VmHWM, reset through /proc/self/clear_refs after warm-up). The child also times its steps
     alone ("solo" median), a check that interleaving does not distort a system.
  7. --scaling: orttrainer step time for the GPT model at batch 4/8/16 (seq 128) and seq 64/128/256
     (batch 8), tokens/s and time per model-GFLOP, and a least-squares fit step = fixed + per_token x tokens.

Output: a table on stdout and a JSON file (default bench/results/<model>.json).
"""

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import torch

# The benchmark's parts (bench/train_bench/): workloads and systems, measurement, the --scaling sweep,
# the tables. The studies in bench/studies/ (and tests/integration/test_bench_smoke.py) reach them as
# bench.train_bench.cli.<name>, hence the names imported here but used only there (LR, ORTSystem, ...).
from . import host
from . import models as bm
from .measure import (
    CpuMonitor, QuietGate, _status_kb, engine_sha, engine_version, environment, measurement_errors,
    reset_peak_rss, rss_now_kb, summarize, thread_mismatch, timed_call,
)
from .report import _print_report, fmt_g, log, render, scaling_table, table
from .scaling import run_scaling
from .systems import (  # noqa: F401
    ALL_SYSTEMS, BASELINES, LR, SGEMM_N, SYSTEMS, ORTSystem, analytic_flops, baselines_of, count_flops,
    executed_flops, is_mixed, make_system, make_workload, sgemm_best, sgemm_once, systems_for_host,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


# =========================================================================== the benchmark of one model
def run_model(name, args):
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    if args.compile_cache == "fresh":
        # torch.compile's start-up depends on inductor's on-disk caches: compile into an empty one (a
        # user's first compile). The memory subprocesses inherit it, warm.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-cache-")
    workload = make_workload(name, args)
    names = args.systems
    log(f"\n=== {name}: {workload.describe()}; systems {', '.join(names)}")
    base = workload.make_model()
    n_rounds = args.warmup + args.steps
    batches = workload.batches(1 + n_rounds)
    result = {
        "model": name,
        "workload": workload.describe(),
        "tokens_per_step": workload.tokens,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "compile_backend": args.compile_backend,
        "system_names": list(names),
        "params": sum(p.numel() for p in base.parameters()),
        "loadavg_start": os.getloadavg(),
        **engine_version(),
    }

    flops, by_op, by_module = count_flops(workload)
    result["model_flops_per_step"] = flops
    result["model_flops_by_op"] = by_op
    result["analytic_flops_per_step"] = analytic_flops(workload)
    log(f"model FLOPs/step {flops / 1e9:.2f} G (analytic {fmt_g(result['analytic_flops_per_step'])})")

    sgemm_before = sgemm_best(args.sgemm_n, args.sgemm_reps)
    mlas_before = host.sgemm_mlas(args.sgemm_n, args.sgemm_reps)
    mixed = any(is_mixed(s) for s in names)
    bf16_before = sgemm_best(args.sgemm_n, args.sgemm_reps, torch.bfloat16) if mixed else None
    log(f"sgemm {args.sgemm_n}^3 best of {args.sgemm_reps}: torch {sgemm_before:.1f}, "
        f"onnxruntime MLAS {mlas_before:.1f} GFLOP/s"
        + (f"; torch bf16 matmul {bf16_before:.1f} GFLOP/s" if mixed else ""))

    # ---- start-up: the first step of each system, alone
    systems, losses, startup = {}, {s: [] for s in names}, {}
    gate = QuietGate(args.quiet_threshold, args.wait_quiet, args.wait_budget)
    for sname in names:
        gc.collect()
        gate.wait()
        monitor = CpuMonitor()
        system = make_system(sname, workload, copy.deepcopy(base), backend=args.compile_backend)
        losses[sname].append(system.first_step(batches[0]))
        systems[sname] = system
        startup[sname] = {**system.startup(), "other_processes_cores": monitor.others_cores()}
        log(
            f"start-up {sname}: "
            + ", ".join(f"{k}={v:.2f}" for k, v in startup[sname].items() if v is not None)
        )

    # ---- interleaved rounds: one step of every system (rotating order) + one sgemm sample
    times, others = {s: [] for s in names}, {s: [] for s in names}
    activity = {s: host.ThreadActivity() for s in names}
    sgemm_rounds, sgemm_others = [], []
    a, b = torch.randn(args.sgemm_n, args.sgemm_n), torch.randn(args.sgemm_n, args.sgemm_n)
    gc.collect()
    monitor = None
    for i in range(n_rounds):
        if i >= args.warmup:
            gate.wait()
        if i == args.warmup:
            monitor = CpuMonitor()
        batch = batches[1 + i]
        order = names[i % len(names) :] + names[: i % len(names)]
        for sname in order:
            with activity[sname].measuring():
                loss, seconds, busy = timed_call(systems[sname].step, batch)
            times[sname].append(seconds)
            others[sname].append(busy)
            losses[sname].append(loss)
        rate, _, busy = timed_call(sgemm_once, a, b)
        sgemm_rounds.append(rate)
        sgemm_others.append(busy)
        if args.verbose:
            log(
                f"round {i}: "
                + "  ".join(f"{s} {times[s][-1] * 1e3:.0f} ms ({others[s][-1]:.2f})" for s in names)
            )
    del a, b
    result["other_processes_cores"] = monitor.others_cores() if monitor else None  # includes the gate's waits
    result["quiet_threshold_cores"] = args.quiet_threshold
    result["waited_for_quiet_s"] = gate.waited_s
    sgemm_after = sgemm_best(args.sgemm_n, args.sgemm_reps)
    mlas_after = host.sgemm_mlas(args.sgemm_n, args.sgemm_reps)
    bf16_after = sgemm_best(args.sgemm_n, args.sgemm_reps, torch.bfloat16) if mixed else None
    torch_peak = max(sgemm_before, sgemm_after, *sgemm_rounds)
    # The roof is the faster library's rate: MFU against torch's sgemm alone passed 100% on a host
    # where MLAS was faster on the step's shapes.
    sgemm_peak = max(torch_peak, mlas_before, mlas_after)
    sgemm_round_median = statistics.median(sgemm_rounds[args.warmup :] or sgemm_rounds)
    result["sgemm"] = {
        "n": args.sgemm_n,
        "threads": torch.get_num_threads(),
        "best_before_gflops": sgemm_before,
        "best_after_gflops": sgemm_after,
        "round_samples_gflops": sgemm_rounds,
        "round_samples_other_cores": sgemm_others,
        "round_median_gflops": sgemm_round_median,
        "torch_peak_gflops": torch_peak,
        "mlas_best_gflops": max(mlas_before, mlas_after),
        "peak_gflops": sgemm_peak,
        # torch.matmul on bf16 operands: the roof of the mixed systems (None: no mixed system ran)
        "bf16_best_before_gflops": bf16_before,
        "bf16_best_after_gflops": bf16_after,
        "bf16_peak_gflops": max(bf16_before, bf16_after) if mixed else None,
    }
    roof = {s: result["sgemm"]["bf16_peak_gflops"] if is_mixed(s) else sgemm_peak for s in names}
    result["loadavg_end"] = os.getloadavg()
    flops_of = {s: executed_flops(s, systems[s], workload, flops, by_module, batches[1:]) for s in names}
    compute = {s: systems[s].compute_dtype() for s in names}
    del systems
    gc.collect()

    w = args.warmup
    quiet_rounds = [
        i for i in range(w, n_rounds) if all(others[s][i] < args.quiet_threshold for s in names)
    ]
    result["quiet_rounds"] = len(quiet_rounds)
    out = {}
    for sname in names:
        performed = flops_of[sname]
        measured = times[sname][w:]
        stats = summarize(measured)
        med = stats["median_s"]
        quiet = [t for t, o in zip(measured, others[sname][w:]) if o < args.quiet_threshold]
        qstats = summarize(quiet) if len(quiet) >= 3 else None
        if qstats:
            qmed = qstats["median_s"]
            qstats.update(
                n=len(quiet),
                tokens_per_s=workload.tokens / qmed,
                achieved_gflops=performed / qmed / 1e9,
                mfu=performed / qmed / 1e9 / roof[sname],
            )
        out[sname] = {
            **stats,
            "step_times_s": times[sname],
            "other_cores_per_step": others[sname],
            "tokens_per_s": workload.tokens / med,
            "achieved_gflops": performed / med / 1e9,
            "mfu": performed / med / 1e9 / roof[sname],
            "mfu_roof": "bf16" if is_mixed(sname) else "fp32",  # which measured roof mfu divides by
            "mfu_vs_round_median_sgemm": performed / med / 1e9 / sgemm_round_median,
            "compute_dtype": compute[sname],
            "flops_per_step": performed,  # what this system performs (systems.executed_flops)
            "quiet": qstats,
            "startup": startup[sname],
            "losses": losses[sname],
            "threads": activity[sname].summary(),
        }
    references = [s for s in names if not s.startswith("orttrainer")]  # the torch systems
    for sname in names:
        mine = out[sname]
        for ref in references:
            mine[f"speedup_vs_{ref}"] = out[ref]["median_s"] / mine["median_s"]
            # Paired: the median over rounds of (other system's step / this system's step) in the same round.
            ratios = [times[ref][i] / times[sname][i] for i in range(w, n_rounds)]
            mine[f"paired_speedup_vs_{ref}"] = statistics.median(ratios)
            quiet_ratios = [times[ref][i] / times[sname][i] for i in quiet_rounds]
            mine[f"quiet_paired_speedup_vs_{ref}"] = (
                statistics.median(quiet_ratios) if len(quiet_ratios) >= 3 else None
            )
            if mine["quiet"] and out[ref]["quiet"]:
                mine["quiet"][f"speedup_vs_{ref}"] = out[ref]["quiet"]["median_s"] / mine["quiet"]["median_s"]
        for ref in ("eager", "eager-bf16") if is_mixed(sname) else ("eager",):
            diff = np.abs(np.array(mine["losses"]) - np.array(out[ref]["losses"]))
            mine[f"max_loss_diff_vs_{ref}"] = float(diff.max())
    result["systems"] = out
    result["pairs"] = pairs(out)
    result["errors"] = measurement_errors(out)
    for error in result["errors"]:
        log(f"MEASUREMENT ERROR: {error}")
    for sname in names:
        q = out[sname]["quiet"]
        log(
            f"{sname}: median {out[sname]['median_s'] * 1e3:.0f} ms over {len(times[sname]) - w} steps; "
            + (
                f"quiet median {q['median_s'] * 1e3:.0f} ms over {q['n']} quiet steps"
                if q
                else "too few quiet steps"
            )
        )

    # ---- memory (and solo timing) in fresh subprocesses
    if not args.no_memory:
        # --quick: the children run side by side (peaks stay per process; a smoke run's times are not
        # measurements); otherwise one at a time, so that each one's steps are solo.
        started = {s: memory_child(name, s, args) for s in names} if args.quick else {}
        for sname in names:
            out[sname]["memory"] = child_result(started.get(sname) or memory_child(name, sname, args))
            m = out[sname]["memory"]
            if "error" in m:
                log(f"memory {sname}: FAILED {m['error'][-300:]}")
            else:
                changed = m.get("engine_sources_sha256") != result["engine_sources_sha256"]
                if sname.startswith("orttrainer") and changed:
                    log(
                        f"WARNING: the engine changed between the timed run and the {sname} memory subprocess"
                    )
                log(
                    f"memory {sname}: steady peak {m['steady_peak_rss_mb']:.0f} MB, overall peak "
                    f"{m['peak_rss_mb']:.0f} MB, solo median {m['solo_median_s'] * 1e3:.0f} ms"
                )
    if args.compile_cache == "fresh":
        import shutil

        shutil.rmtree(os.environ.pop("TORCHINDUCTOR_CACHE_DIR"), ignore_errors=True)
    return result


def pairs(out):
    """The ratios the report leads with: each orttrainer system against the torch systems of its own
    precision (fp32 with fp32, mixed with bf16), as the paired median over rounds (>1: orttrainer
    faster), with the dtype each side computed in."""
    rows = {}
    for ort_name in BASELINES:
        for ref in baselines_of(ort_name):
            if ort_name in out and ref in out:
                rows[f"{ort_name}/{ref}"] = {
                    "paired_speedup": out[ort_name][f"paired_speedup_vs_{ref}"],
                    "speedup": out[ort_name][f"speedup_vs_{ref}"],
                    "threads_differ": thread_mismatch(out, ort_name, ref),
                    "compute_dtypes": [out[n]["compute_dtype"]["dtype"] for n in (ort_name, ref)],
                }
    return rows


def memory_child(model_name, system_name, args):
    cmd = [
        sys.executable,
        "-m",
        "bench.train_bench",
        "--_child",
        system_name,
        "--model",
        model_name,
        "--steps",
        str(args.child_steps),
        "--warmup",
        str(max(1, args.warmup)),
        "--attention",
        args.attention,
        "--bert-vocab",
        str(args.bert_vocab),
        "--ort-outputs",
        args.ort_outputs,
        "--compile-backend",
        args.compile_backend,
        "--quiet-threshold",
        str(args.quiet_threshold),
        "--wait-quiet",
        str(args.wait_quiet),
        "--wait-budget",
        str(args.wait_budget),
    ]
    if args.quick:
        cmd.append("--quick")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ))


def child_result(proc):
    """Wait for a memory_child process; its JSON line, or an error naming its exit status."""
    stdout, stderr = proc.communicate()
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"child exited {proc.returncode}: {stderr[-2000:]}"}


def child_main(args):
    """One system alone: peak RSS and solo step times; prints one JSON line."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    workload = make_workload(args.model, args)
    model = workload.make_model()
    batches = workload.batches(1 + args.warmup + args.steps)
    sha = engine_sha()
    gc.collect()
    baseline_kb = rss_now_kb()  # interpreter + torch/ort/transformers + model + batches
    system = make_system(args._child, workload, model, backend=args.compile_backend)
    system.first_step(batches[0])
    for batch in batches[1 : 1 + args.warmup]:
        system.step(batch)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec, so a child's ru_maxrss starts at its
    # parent's peak (this script's main process) and would hide the child's own, smaller peak.
    startup_peak_kb = _status_kb("VmHWM")
    resettable = reset_peak_rss()
    before_steps_kb = rss_now_kb()
    times, others = [], []
    gate = QuietGate(args.quiet_threshold, args.wait_quiet, args.wait_budget / 4)
    for batch in batches[1 + args.warmup :]:
        gate.wait()
        _, seconds, busy = timed_call(system.step, batch)
        times.append(seconds)
        others.append(busy)
    quiet = [t for t, o in zip(times, others) if o < args.quiet_threshold]
    steady_kb = _status_kb("VmHWM") if resettable else None
    mb = 1 / 1024
    print(
        json.dumps(
            {
                "method": "fresh subprocess per system; VmHWM of the child after start-up + warm-up "
                "(peak_rss_mb), then "
                "VmHWM reset via /proc/self/clear_refs and read again after the steady-state steps "
                "(steady_peak_rss_mb)",
                "baseline_rss_mb": baseline_kb * mb,
                "rss_before_steps_mb": before_steps_kb * mb,
                "peak_rss_mb": max(startup_peak_kb, steady_kb or 0) * mb,
                "steady_peak_rss_mb": steady_kb * mb if steady_kb else None,
                "steady_peak_minus_baseline_mb": (steady_kb - baseline_kb) * mb if steady_kb else None,
                "solo_step_times_s": times,
                "solo_other_cores_per_step": others,
                "solo_median_s": statistics.median(times),
                "solo_quiet_median_s": statistics.median(quiet) if quiet else None,
                "engine_sources_sha256": sha,
            }
        )
    )


# =========================================================================== main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["gpt", "bert", "all"], default="all")
    p.add_argument("--steps", type=int, default=None, help="measured steps per system (default 20, quick 3)")
    p.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps after the first (default 3, quick 1)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models and step counts")
    p.add_argument("--scaling", action="store_true", help="also run the orttrainer GPT batch/seq sweep")
    p.add_argument(
        "--scaling-steps", type=int, default=None, help="measured steps per scaling point (default 10)"
    )
    p.add_argument("--json", default=None, help="output JSON (default bench/results/<model>.json)")
    p.add_argument("--attention", choices=["sdpa", "masked"], default="sdpa", help="GPT attention form")
    p.add_argument("--bert-vocab", type=int, default=30522)
    p.add_argument(
        "--ort-outputs",
        choices=["loss", "all"],
        default="loss",
        help="what orttrainer's model_desc describes: the loss only, like the step eager and compile run "
        "(default), or every model output as legacy scripts with a loss_fn do (the logits come back "
        "from every step)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the per-system memory subprocesses")
    p.add_argument("--child-steps", type=int, default=None, help="steady steps in each memory subprocess")
    p.add_argument("--sgemm-reps", type=int, default=None)
    p.add_argument(
        "--compile-cache",
        choices=["fresh", "default"],
        default="fresh",
        help="inductor cache for the main process: fresh (cold compile, default) or the user default",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (default inductor; --quick defaults to aot_eager: same plumbing, "
        "no C++ codegen, because a cold inductor compile alone takes 1-2 min on 2 cores)",
    )
    p.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.1,
        help="a step is 'quiet' when other processes used less than this many cores during it",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        help="before each measured round wait up to this many seconds for a quiet machine "
        "(default 20; 0 with --quick)",
    )
    p.add_argument(
        "--wait-budget",
        type=float,
        default=300,
        help="total seconds of such waiting per model (and per scaling sweep)",
    )
    p.add_argument(
        "--mixed",
        choices=["auto", "on", "off"],
        default="auto",
        help="the mixed-precision systems (eager-bf16, compile-bf16, orttrainer-mixed): auto = on a host "
        "whose CPU has amx_bf16 or avx512_bf16 (default)",
    )
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--render", metavar="JSON", help="print the tables of an existing JSON report and exit")
    p.add_argument("--_child", choices=ALL_SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    args.steps = args.steps if args.steps is not None else (3 if q else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 3)
    args.scaling_steps = args.scaling_steps if args.scaling_steps is not None else (2 if q else 10)
    args.child_steps = args.child_steps if args.child_steps is not None else (2 if q else 8)
    args.sgemm_reps = args.sgemm_reps if args.sgemm_reps is not None else (2 if q else 5)
    args.sgemm_n = SGEMM_N // 2 if q else SGEMM_N
    args.compile_backend = args.compile_backend or ("aot_eager" if q else "inductor")
    args.wait_quiet = args.wait_quiet if args.wait_quiet is not None else (0.0 if q else 20.0)
    args.systems, args.mixed_why = systems_for_host(args.mixed, host.host_facts()["kernel_flags"])
    return args


def main(argv=None):
    args = parse_args(argv)
    if args._child:
        child_main(args)
        return 0
    if args.render:
        render(args.render)
        return 0
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = {"meta": environment(), "results": {}}
    report["meta"]["attention"] = bm.ATTENTION_NOTE
    report["meta"]["quick"] = args.quick
    report["meta"]["compile_backend"] = args.compile_backend
    report["meta"]["mixed_systems"] = args.mixed_why
    report["meta"]["bf16_flags"] = [f for f in host.host_facts()["kernel_flags"]
                                    if f in ("amx_tile", "amx_bf16", "avx512_bf16")]
    report["meta"]["inductor_cache"] = (
        "fresh (empty) per model in the main process: compile time is a cold compile"
        if args.compile_cache == "fresh"
        else "the user's default (may be warm)"
    )
    names = ["gpt", "bert"] if args.model == "all" else [args.model]
    path = args.json or host.result_path("train_bench")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tables = []
    for name in names:
        report["results"][name] = run_model(name, args)
        tables.append(table(report["results"][name]))
        _write(path, report)
    if args.scaling:
        report["scaling"] = run_scaling(args)
        tables.append(scaling_table(report["scaling"]))
        _write(path, report)
    _print_report(report, tables, path)
    return 0


def _write(path, report):
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=float)
