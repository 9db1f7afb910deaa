"""Training benchmark: orttrainer vs PyTorch eager vs torch.compile (inductor), CPU, fp32, Adam.

    python bench/train_bench.py [--model gpt|bert|all] [--steps N] [--warmup N] [--quick] [--scaling]
                                [--json OUT]

What it does, per model (docs/performance.md explains every number):
  1. Builds the model once (seeded) and pre-generates the batches; every system trains a deepcopy of
     the same initial weights on the same batches with Adam(lr=1e-4, no decay, no clipping), fp32.
  2. Counts the model FLOPs of one step with torch.utils.flop_counter.FlopCounterMode on an eager
     forward+backward (SDPA forced to its math kernel so the attention matmuls are counted).
  3. Measures the matmul roof: sgemm 2048x2048 fp32 through torch.matmul (torch's threads) and through
     onnxruntime's MatMul (MLAS, its default threads), best of several, before and after; MFU divides
     by the larger, and an MFU above 100% is reported as a measurement error (bench/host.py).
  4. Start-up: the first train step of each system, timed alone (orttrainer: export, gradient graph,
     session, first step; torch.compile: the first step, which compiles forward and backward).
  5. Runs the systems interleaved step by step (one round = one step of each system + one sgemm sample;
     the order rotates every round) so machine drift hits every system alike; reports the median step,
     and counts the OS threads each system really kept busy. Ratios between systems that ran on
     different numbers of threads are not printed (n/a, with the two counts).
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
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import numpy as np
import torch

sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import host  # noqa: E402  (bench/host.py)
import models as bm  # noqa: E402  (bench/models.py)

SYSTEMS = ("orttrainer", "eager", "compile")
LR = 1e-4
SGEMM_N = 2048  # --quick: 1024


# =========================================================================== workloads
def make_workload(name, args, batch=None, seq=None):
    quick = args.quick
    if name == "gpt":
        cfg = bm.GPTConfig(attention=args.attention)
        if quick:
            cfg = bm.GPTConfig(
                vocab=512, hidden=64, layers=2, heads=2, max_positions=64, attention=args.attention
            )
        return bm.GPTWorkload(batch=batch or (4 if quick else 8), seq=seq or (32 if quick else 128), cfg=cfg,
                              ort_outputs=args.ort_outputs)
    if name == "bert":
        size = bm.BertSize(vocab=args.bert_vocab)
        if quick:
            size = bm.BertSize(vocab=1024, hidden=64, layers=2, heads=2, intermediate=128, max_positions=64)
        return bm.BertWorkload(
            batch=batch or (4 if quick else 8), seq=seq or (32 if quick else 128), size=size,
            ort_outputs=args.ort_outputs,
        )
    raise ValueError(name)


# =========================================================================== systems
class System:
    """One trainer under test: `first_step(batch)` (timed as start-up), then `step(batch)` -> loss."""

    name = ""

    def startup(self):
        return {}


class ORTSystem(System):
    name = "orttrainer"

    def __init__(self, workload, model, session_options=None):
        from orttrainer import ORTTrainer, ORTTrainerOptions, optim

        # Start-up is measured cold: bench/startup_cache.py measures what the export cache saves.
        opts = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
        if session_options is not None:
            opts["session_options"] = session_options
        model, model_desc, loss_fn = workload.ort_trainer_args(model)
        self.trainer = ORTTrainer(model, model_desc, optim.AdamConfig(lr=LR), loss_fn=loss_fn,
                                  options=ORTTrainerOptions(opts))
        self._first_wall = None

    def step(self, batch):
        outputs = self.trainer.train_step(*batch)  # the loss alone, or (loss, logits) with --ort-outputs all
        return (outputs[0] if isinstance(outputs, (list, tuple)) else outputs).item()

    def first_step(self, batch):
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = self.step(batch)
        self._first_wall = time.perf_counter() - started
        return loss

    def startup(self):
        s = dict(self.trainer.startup_seconds)
        parts = {
            "export_s": s.get("export"),
            "training_graph_s": s.get("training_graph"),
            "session_s": s.get("session"),
            "first_step_s": s.get("first_step"),
        }
        known = sum(v for v in parts.values() if v is not None)
        parts["other_s"] = self._first_wall - known  # sample run for output types, postprocess, checks
        parts["total_s"] = self._first_wall
        return parts


class TorchSystem(System):
    def __init__(self, workload, model, compiled, backend="inductor"):
        self.name = "compile" if compiled else "eager"
        self.model = model
        self.loss_module = workload.loss_module(model)
        if compiled:
            self.loss_module = torch.compile(self.loss_module, backend=backend)  # default mode
        self.optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        self._first_wall = None

    def step(self, batch):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_module(*batch)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def first_step(self, batch):
        started = time.perf_counter()
        loss = self.step(batch)
        self._first_wall = time.perf_counter() - started
        return loss

    def startup(self):
        if self.name == "compile":
            return {"compile_s": self._first_wall, "total_s": self._first_wall}
        return {"first_step_s": self._first_wall, "total_s": self._first_wall}


def make_system(name, workload, model, session_options=None, backend="inductor"):
    model.train()
    if name == "orttrainer":
        return ORTSystem(workload, model, session_options=session_options)
    return TorchSystem(workload, model, compiled=(name == "compile"), backend=backend)


# =========================================================================== measurements
def sgemm_once(a, b):
    started = time.perf_counter()
    torch.matmul(a, b)
    return 2 * a.shape[0] ** 3 / (time.perf_counter() - started) / 1e9


def sgemm_best(n, reps):
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)  # warm
    return max(sgemm_once(a, b) for _ in range(reps))


def count_flops(workload):
    """Model FLOPs of one training step (forward + backward), counted on eager PyTorch.

    FlopCounterMode counts matmul-class ops exactly (mm/addmm/bmm/baddbmm/conv, 2 FLOPs per MAC; the
    backward's two matmuls per forward matmul included). CPU flash attention is not in its registry,
    so SDPA is forced to the math kernel here: the attention matmuls are counted over the full
    seq x seq score matrix (the causal half is not discounted). Element-wise work (LayerNorm, GELU,
    softmax, Adam) is not counted: "model FLOPs" are matmul FLOPs.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = workload.make_model()
    loss_module = workload.loss_module(model)
    batch = workload.batches(1)[0]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_module(*batch).backward()
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    return int(counter.get_total_flops()), by_op


def analytic_flops(workload):
    """Cross-check of count_flops for the GPT model (documented formula, see docs/performance.md)."""
    if workload.name != "gpt":
        return None
    c, b, t = workload.cfg, workload.batch, workload.seq
    d, L, V = c.hidden, c.layers, c.vocab
    matmul_params = L * 12 * d * d + d * V  # qkv 3d², proj d², MLP 8d² per layer; tied head dV
    return 6 * matmul_params * b * t + 12 * L * b * t * t * d


def rss_now_kb():
    return _status_kb("VmRSS")


def _status_kb(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))


def reset_peak_rss():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def summarize(times):
    times = sorted(times)
    q = np.percentile(times, [10, 25, 75])
    return {
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "min_s": times[0],
        "p10_s": float(q[0]),
        "max_s": times[-1],
        "iqr_s": float(q[2] - q[1]),
    }


class CpuMonitor:
    """CPU time taken by everything but this process (other users' jobs, hypervisor steal), in cores.

    The benchmark shares a 2-core machine: this says how much of it was not ours while we measured.
    """

    def __init__(self):
        self._start = self._read()

    @staticmethod
    def _read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        own = int(fields[11]) + int(fields[12])  # utime + stime of all our threads
        return sum(v) - v[3] - v[4], own, time.monotonic()

    def others_cores(self):
        busy, own, now = self._read()
        hz = os.sysconf("SC_CLK_TCK")
        return max(0.0, ((busy - self._start[0]) - (own - self._start[1])) / hz / (now - self._start[2]))


class QuietGate:
    """Before a round, wait (within a budget) until other processes leave the machine alone.

    On a shared 2-core machine a step that overlaps another process's work runs 2-8x slower, and the
    slowdown depends on the threading runtime more than on the engine. Waiting for quiet moments
    collects more uncontended samples; a round still runs when the wait times out (and is then just
    not counted among the quiet ones).
    """

    def __init__(self, threshold, per_round_s, budget_s, probe_s=0.3):
        self.threshold, self.per_round_s, self.budget_s, self.probe_s = (
            threshold,
            per_round_s,
            budget_s,
            probe_s,
        )
        self.waited_s = 0.0

    def wait(self):
        deadline = time.monotonic() + min(self.per_round_s, max(0.0, self.budget_s - self.waited_s))
        started = time.monotonic()
        quiet = False
        while time.monotonic() < deadline:
            monitor = CpuMonitor()
            time.sleep(self.probe_s)
            if monitor.others_cores() < self.threshold:
                quiet = True
                break
        self.waited_s += time.monotonic() - started
        return quiet


def timed_call(fn, *args):
    """(fn(*args), wall seconds, cores other processes used meanwhile)."""
    monitor = CpuMonitor()
    started = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - started, monitor.others_cores()


def threads_running(system):
    return (system.get("threads") or {}).get("threads_running")


def thread_mismatch(out, a, b):
    """None when systems a and b kept the same number of threads busy, else why their ratio is void."""
    ta, tb = threads_running(out[a]), threads_running(out[b])
    if ta is None or tb is None or ta == tb:
        return None
    return f"threads differ: {a} {ta}, {b} {tb}"


def measurement_errors(out):
    """What makes a run's figures unusable: an MFU above the measured matmul roof, ratios between
    systems that ran on different numbers of threads."""
    errors = []
    for sname, s in out.items():
        for label, mfu in (("all steps", s["mfu"]), ("quiet steps", (s.get("quiet") or {}).get("mfu"))):
            if mfu is not None and mfu > 1.0:
                errors.append(f"{sname}: MFU {mfu * 100:.0f}% ({label}) is above the measured matmul roof")
    for other in SYSTEMS[1:]:
        why = thread_mismatch(out, SYSTEMS[0], other)
        if why:
            errors.append(f"no ratio {SYSTEMS[0]} vs {other}: {why}")
    return errors


def engine_sha():
    """Short hash of orttrainer/**/*.py: the engine changes while we measure; results say which one ran."""
    sources = hashlib.sha256()
    for dirpath, dirs, files in os.walk(os.path.join(ROOT, "orttrainer")):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    sources.update(f.encode() + fh.read())
    return sources.hexdigest()[:16]


def _git(*cmd):
    try:
        proc = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return proc.stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def engine_version():
    """{git commit, engine_dirty, engine_sources_sha256}: which engine a number was measured on."""
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        "engine_dirty": bool(_git("status", "--porcelain", "--", "orttrainer")),
        "engine_sources_sha256": engine_sha(),
    }


def environment():
    import onnxruntime as ort

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    return {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
        "transformers": tf_version,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ort_threads": "onnxruntime default (intra_op_num_threads=0: one per physical core)",
        "host": host.host_facts(),
        **engine_version(),
        "inductor_cache": None,  # filled in by main()
    }


# =========================================================================== the benchmark of one model
def run_model(name, args):
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    if args.compile_cache == "fresh":
        # torch.compile's start-up depends on inductor's on-disk caches: compile into an empty one (a
        # user's first compile). The memory subprocesses inherit it, warm.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-cache-")
    workload = make_workload(name, args)
    log(f"\n=== {name}: {workload.describe()}")
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
        "params": sum(p.numel() for p in base.parameters()),
        "loadavg_start": os.getloadavg(),
        **engine_version(),
    }

    flops, by_op = count_flops(workload)
    result["model_flops_per_step"] = flops
    result["model_flops_by_op"] = by_op
    result["analytic_flops_per_step"] = analytic_flops(workload)
    log(f"model FLOPs/step {flops / 1e9:.2f} G (analytic {fmt_g(result['analytic_flops_per_step'])})")

    sgemm_before = sgemm_best(args.sgemm_n, args.sgemm_reps)
    mlas_before = host.sgemm_mlas(args.sgemm_n, args.sgemm_reps)
    log(f"sgemm {args.sgemm_n}^3 best of {args.sgemm_reps}: torch {sgemm_before:.1f}, "
        f"onnxruntime MLAS {mlas_before:.1f} GFLOP/s")

    # ---- start-up: the first step of each system, alone
    systems, losses, startup = {}, {s: [] for s in SYSTEMS}, {}
    gate = QuietGate(args.quiet_threshold, args.wait_quiet, args.wait_budget)
    for sname in SYSTEMS:
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
    times, others = {s: [] for s in SYSTEMS}, {s: [] for s in SYSTEMS}
    activity = {s: host.ThreadActivity() for s in SYSTEMS}
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
        order = SYSTEMS[i % 3 :] + SYSTEMS[: i % 3]
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
                + "  ".join(f"{s} {times[s][-1] * 1e3:.0f} ms ({others[s][-1]:.2f})" for s in SYSTEMS)
            )
    del a, b
    result["other_processes_cores"] = monitor.others_cores() if monitor else None  # includes the gate's waits
    result["quiet_threshold_cores"] = args.quiet_threshold
    result["waited_for_quiet_s"] = gate.waited_s
    sgemm_after = sgemm_best(args.sgemm_n, args.sgemm_reps)
    mlas_after = host.sgemm_mlas(args.sgemm_n, args.sgemm_reps)
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
    }
    result["loadavg_end"] = os.getloadavg()
    del systems
    gc.collect()

    w = args.warmup
    quiet_rounds = [
        i for i in range(w, n_rounds) if all(others[s][i] < args.quiet_threshold for s in SYSTEMS)
    ]
    result["quiet_rounds"] = len(quiet_rounds)
    out = {}
    for sname in SYSTEMS:
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
                achieved_gflops=flops / qmed / 1e9,
                mfu=flops / qmed / 1e9 / sgemm_peak,
            )
        out[sname] = {
            **stats,
            "step_times_s": times[sname],
            "other_cores_per_step": others[sname],
            "tokens_per_s": workload.tokens / med,
            "achieved_gflops": flops / med / 1e9,
            "mfu": flops / med / 1e9 / sgemm_peak,
            "mfu_vs_round_median_sgemm": flops / med / 1e9 / sgemm_round_median,
            "quiet": qstats,
            "startup": startup[sname],
            "losses": losses[sname],
            "threads": activity[sname].summary(),
        }
    for sname in SYSTEMS:
        mine = out[sname]
        mine["speedup_vs_eager"] = out["eager"]["median_s"] / mine["median_s"]
        mine["speedup_vs_compile"] = out["compile"]["median_s"] / mine["median_s"]
        for ref in ("eager", "compile"):
            # Paired: the median over rounds of (other system's step / this system's step) in the same round.
            ratios = [times[ref][i] / times[sname][i] for i in range(w, n_rounds)]
            mine[f"paired_speedup_vs_{ref}"] = statistics.median(ratios)
            quiet_ratios = [times[ref][i] / times[sname][i] for i in quiet_rounds]
            mine[f"quiet_paired_speedup_vs_{ref}"] = (
                statistics.median(quiet_ratios) if len(quiet_ratios) >= 3 else None
            )
            if mine["quiet"] and out[ref]["quiet"]:
                mine["quiet"][f"speedup_vs_{ref}"] = out[ref]["quiet"]["median_s"] / mine["quiet"]["median_s"]
        diff = np.abs(np.array(mine["losses"]) - np.array(out["eager"]["losses"]))
        mine["max_loss_diff_vs_eager"] = float(diff.max())
    result["systems"] = out
    result["errors"] = measurement_errors(out)
    for error in result["errors"]:
        log(f"MEASUREMENT ERROR: {error}")
    for sname in SYSTEMS:
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
        for sname in SYSTEMS:
            out[sname]["memory"] = memory_child(name, sname, args)
            m = out[sname]["memory"]
            if "error" in m:
                log(f"memory {sname}: FAILED {m['error'][-300:]}")
            else:
                changed = m.get("engine_sources_sha256") != result["engine_sources_sha256"]
                if sname == "orttrainer" and changed:
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


def memory_child(model_name, system_name, args):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
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
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"child exited {proc.returncode}: {proc.stderr[-2000:]}"}


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


# =========================================================================== scaling
def run_scaling(args):
    """orttrainer on the GPT model at several batch/seq sizes, all trainers built first and then stepped
    interleaved round by round (like the main benchmark) so that drift hits every size alike."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    ref = make_workload("gpt", args)
    b0, s0 = ref.batch, ref.seq
    configs = list(dict.fromkeys([(b0 // 2, s0), (b0, s0), (b0 * 2, s0), (b0, s0 // 2), (b0, s0 * 2)]))
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


# =========================================================================== output
_T0 = time.perf_counter()


def log(msg):
    lead = msg[: len(msg) - len(msg.lstrip("\n"))]
    print(f"{lead}[{time.perf_counter() - _T0:6.1f}s] {msg.lstrip()}", file=sys.stderr, flush=True)


def fmt_g(x):
    return "n/a" if x is None else f"{x / 1e9:.2f} G"


def _others_during_steps(series):
    """Time-weighted mean of 'cores used by other processes' over measured steps: [(times, others)]."""
    total = sum(t for times, _ in series for t in times)
    busy = sum(t * o for times, others in series for t, o in zip(times, others))
    return busy / total if total else None


def table(result):
    out = result["systems"]
    w = result["warmup_steps"]
    others = _others_during_steps(
        [(out[s]["step_times_s"][w:], out[s]["other_cores_per_step"][w:]) for s in SYSTEMS]
    )
    thr = result.get("quiet_threshold_cores")
    lines = [
        f"\n## {result['model']}: {result['tokens_per_step']} tokens/step, "
        f"{result['model_flops_per_step'] / 1e9:.2f} GFLOP/step (model FLOPs); "
        f"matmul roof {result['sgemm']['peak_gflops']:.1f} GFLOP/s "
        f"(sgemm best: torch {_num(result['sgemm'].get('torch_peak_gflops'), '{:.1f}')}, "
        f"onnxruntime MLAS {_num(result['sgemm'].get('mlas_best_gflops'), '{:.1f}')}; "
        f"torch median in the rounds {result['sgemm']['round_median_gflops']:.1f}); "
        f"{result['measured_steps']} interleaved steps after {result['warmup_steps']} warm-up, "
        f"{result['quiet_rounds']} rounds fully quiet; other processes used {_num(others, '{:.2f}')} of "
        f"{os.cpu_count()} cores on average during the measured steps (load avg "
        f"{result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f})",
        "",
        f"Engine: orttrainer/ sha {result.get('engine_sources_sha256')}"
        + (
            f" (commit {result['git_commit'][:8]}{'+dirty' if result.get('engine_dirty') else ''})"
            if result.get("git_commit")
            else ""
        )
        + ". "
        f"Quiet = steps during which other processes used < {thr} cores; the run waited "
        f"{result.get('waited_for_quiet_s', 0):.0f} s in all for quiet moments before rounds.",
        "",
    ]
    header = (
        "| system | median step, all (ms) | median step, quiet (ms) [n] | tokens/s (quiet) "
        "| vs eager: all / quiet / paired-quiet | vs compile: all / quiet / paired-quiet "
        "| MFU: all / quiet | peak RSS steady (MB) | peak RSS incl. start-up (MB) | solo median (ms) "
        "| start-up (s) |"
    )
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    def ratios(sname, ref):
        s, q = out[sname], out[sname].get("quiet") or {}
        void = thread_mismatch(out, sname, ref)
        if void:
            return f"n/a ({void})"
        return " / ".join([
            f"{s[f'speedup_vs_{ref}']:.2f}x",
            _num(q.get(f"speedup_vs_{ref}"), "{:.2f}x"),
            _num(s.get(f"quiet_paired_speedup_vs_{ref}"), "{:.2f}x"),
        ])

    for sname in SYSTEMS:
        s = out[sname]
        q = s.get("quiet") or {}
        m = s.get("memory") or {}
        label = sname if sname != "compile" else f"torch.compile ({result['compile_backend']})"
        label += f" [{threads_running(s) if threads_running(s) is not None else 'n/a'} threads]"
        cells = [
            label,
            f"{s['median_s'] * 1e3:.1f}",
            f"{q['median_s'] * 1e3:.1f} [{q['n']}]" if q else "n/a",
            _num(q.get("tokens_per_s"), "{:.0f}"),
            ratios(sname, "eager"),
            ratios(sname, "compile"),
            f"{s['mfu'] * 100:.1f}% / " + _num(q.get("mfu"), "{:.1f}%", 100),
            _num(m.get("steady_peak_rss_mb"), "{:.0f}"),
            _num(m.get("peak_rss_mb"), "{:.0f}"),
            _num(m.get("solo_median_s"), "{:.1f}", 1e3),
            f"{s['startup']['total_s']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"**MEASUREMENT ERROR: {e}**" for e in result.get("errors", [])]
    st = out["orttrainer"]["startup"]
    parts = ", ".join(
        f"{k[:-2]} {v:.2f}" for k, v in st.items() if v is not None and k.endswith("_s") and k != "total_s"
    )
    busy = [out[s]["startup"].get("other_processes_cores") for s in SYSTEMS]
    lines += [
        "",
        f"Start-up (s): orttrainer {parts} = {st['total_s']:.2f}; "
        f"torch.compile compile (first step) {out['compile']['startup']['compile_s']:.2f}; "
        f"eager first step {out['eager']['startup']['first_step_s']:.2f}"
        + (
            " (other processes used " + " / ".join(_num(b, "{:.2f}") for b in busy) + " cores meanwhile)"
            if any(b is not None for b in busy)
            else ""
        ),
    ]
    lines.append(
        "Max |loss - eager loss| over all steps: "
        + ", ".join(f"{s} {out[s]['max_loss_diff_vs_eager']:.2e}" for s in SYSTEMS if s != "eager")
    )
    if all("baseline_rss_mb" in (out[s].get("memory") or {}) for s in SYSTEMS):
        lines.append(
            "RSS before training (imports + model + batches), per child: "
            + ", ".join(f"{s} {out[s]['memory']['baseline_rss_mb']:.0f} MB" for s in SYSTEMS)
        )
    return "\n".join(lines)


def _num(value, spec, scale=1.0):
    return "n/a" if value is None else spec.format(value * scale)


def scaling_table(scaling):
    basis = "quiet steps" if scaling.get("basis") == "quiet_median_s" else "all steps (too few quiet ones)"
    others = _others_during_steps([(r["step_times_s"], r["other_cores_per_step"]) for r in scaling["rows"]])
    lines = [
        f"\n## scaling: orttrainer, GPT (sizes interleaved step by step; other processes used "
        f"{_num(others, '{:.2f}')} cores on average during the steps; "
        f"step = median over {basis})",
        "",
        "| batch | seq | tokens | step (ms) | median, all steps (ms) | quiet steps | tokens/s | GFLOP/step "
        "| ms per GFLOP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in scaling["rows"]:
        lines.append(
            f"| {r['batch']} | {r['seq']} | {r['tokens']} | {r['step_s'] * 1e3:.1f} "
            f"| {r['median_s'] * 1e3:.1f} | {r['quiet_n']} | {r['tokens_per_s']:.0f} "
            f"| {r['model_flops'] / 1e9:.2f} | {r['ms_per_gflop']:.2f} |"
        )
    lines.append("")
    for key, what in (("fit_batch_sweep", "batch sweep"), ("fit_seq_sweep", "seq sweep")):
        fit = scaling.get(key)
        if fit:
            lines.append(
                f"Least-squares fit, {what}: step = {fit['fixed_s'] * 1e3:.1f} ms + "
                f"{fit['per_token_us']:.1f} us x tokens "
                f"(fixed part = {fit['fixed_share_at_middle'] * 100:.0f}% "
                f"of the middle point)"
            )
    fit = scaling.get("fit_all_vs_model_flops")
    if fit:
        lines.append(
            f"Least-squares fit, all points: step = {fit['fixed_s'] * 1e3:.1f} ms + "
            f"{fit['s_per_gflop'] * 1e3:.2f} ms x model GFLOP"
        )
    return "\n".join(lines)


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
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--render", metavar="JSON", help="print the tables of an existing JSON report and exit")
    p.add_argument("--_child", choices=SYSTEMS, help=argparse.SUPPRESS)
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
    return args


def render(path):
    """Print the tables of an existing JSON report."""
    with open(path) as f:
        report = json.load(f)
    _print_report(report, [table(r) for r in report["results"].values()]
                  + ([scaling_table(report["scaling"])] if "scaling" in report else []), path)


def _print_report(report, tables, path):
    meta = report["meta"]
    print(
        f"# {meta['command']}  ({meta['time']}, "
        + (host.host_line(meta["host"]) if meta.get("host") else f"{meta['cpu']}, {meta['cpus']} CPUs")
        + f", torch {meta['torch']}, "
        f"onnxruntime {meta['onnxruntime']}, "
        f"engine {meta['git_commit'][:8] if meta['git_commit'] else '?'}"
        f"{'+dirty' if meta['engine_dirty'] else ''} sha {meta['engine_sources_sha256']})"
    )
    print("\n".join(tables))
    print(f"\nJSON: {os.path.relpath(path, os.getcwd())}")


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
    report["meta"]["inductor_cache"] = (
        "fresh (empty) per model in the main process: compile time is a cold compile"
        if args.compile_cache == "fresh"
        else "the user's default (may be warm)"
    )
    names = ["gpt", "bert"] if args.model == "all" else [args.model]
    path = args.json or os.path.join(HERE, "results", f"{args.model}.json")
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


if __name__ == "__main__":
    sys.exit(main())
