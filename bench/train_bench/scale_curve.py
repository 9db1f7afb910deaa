"""The scale curve: peak memory and step time against parameters and sequence length, orttrainer vs eager.

    cd bench && ../.venv/bin/python scale_curve.py [--jobs 2] [--stop-at 03:05] [--steps 1]
    cd bench && ../.venv/bin/python scale_curve.py --quick      # tiny sizes, 1 step (tests/integration/test_bench_smoke.py)

Every point is one `real_size.py` run (its own fresh child process per system, peaks = VmHWM above the
RSS after imports, model and batches; see that file), GPT-2 shapes, Adam, fp32, batch 4:

- parameters, at seq 256: ~10 M (2 layers, hidden 192), ~30 M (6 layers, hidden 384), 124 M (GPT-2
  small) and 354 M (GPT-2 medium: 24 layers, hidden 1024);
- sequence length, at GPT-2 small: 128, 256, 512, 1024.

A point runs only if its estimated peak (`estimate_mb`, deliberately high) fits in the machine's
memory less `--reserve-gib` (what other work on the machine needs); otherwise it is skipped with the
reason printed and kept in the JSON. Up to `--jobs` run at once while their estimates together fit
that and what was available at the start. Cheapest first, so every axis gets its small points; any
not finished by `--stop-at` (UTC, HH:MM) are stopped and recorded as such. Memory is valid on a loaded machine, step
times are not: the load average is recorded per point. Writes bench/results/scale_curve-<host kind>-<date>.json
(`--out`) and the plot docs/images/scale-curve.png (`--png`).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import signal
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
REAL_SIZE = ["-m", "bench.train_bench.real_size"]
VOCAB = 50257
SYSTEMS = ("ort", "eager")

# (label, layers, hidden, seq, batch); hidden 768 x 12 layers = GPT-2 small (real_size.py's default)
FULL_PARAMS = [("10M", 2, 192, 256), ("30M", 6, 384, 256), ("124M", 12, 768, 256), ("350M", 24, 1024, 256)]
FULL_SEQS = [128, 256, 512, 1024]
QUICK_PARAMS = [("L1", 1, 64, 16), ("L2", 2, 64, 16)]
QUICK_SEQS = [16, 32]


def gpt2_params(layers, hidden, vocab, positions):
    """GPT2LMHeadModel's parameter count (tied head): embeddings, 12 h^2 + 13 h per block, final norm."""
    return vocab * hidden + positions * hidden + layers * (12 * hidden * hidden + 13 * hidden) + 2 * hidden


def estimate_mb(layers, hidden, seq, batch, vocab):
    """A deliberately high estimate of a run's whole-process peak (MB): 1 GB of imports, 24 bytes per
    parameter (weights, gradients, Adam's two moments, start-up copies), fp32 activations kept for
    backward (~68 bytes per token per hidden unit per layer, plus 10 * heads * seq for the attention
    scores) and the logits three times (values, softmax, gradient). At GPT-2 small x 256 it says
    ~5.6 GB where real_size.py measured 4.4 GB (eager) whole-process."""
    params = gpt2_params(layers, hidden, vocab, max(256, seq))
    heads = max(1, hidden // 64)
    activations = layers * batch * seq * hidden * (68 + 10 * heads * seq / hidden)
    logits = 3 * 4 * batch * seq * vocab
    return 1024 + (24 * params + activations + logits) / 2**20


def plan(quick):
    """The points: one per distinct shape, each tagged with the axes it belongs to."""
    params_axis = QUICK_PARAMS if quick else FULL_PARAMS
    base = params_axis[0] if quick else params_axis[2]  # the seq axis runs at this model
    vocab = 512 if quick else VOCAB
    points = {}
    for label, layers, hidden, seq in params_axis:
        points[(layers, hidden, seq)] = {"label": label, "axes": ["params"]}
    for seq in QUICK_SEQS if quick else FULL_SEQS:
        key = (base[1], base[2], seq)
        points.setdefault(key, {"label": f"{base[0]} seq {seq}", "axes": []})["axes"].append("seq")
    out = []
    for (layers, hidden, seq), p in points.items():
        batch = 2 if quick else 4
        out.append({**p, "layers": layers, "hidden": hidden, "heads": max(1, hidden // 64), "seq": seq,
                    "batch": batch, "vocab": vocab, "params": gpt2_params(layers, hidden, vocab, max(256, seq)),
                    "estimate_mb": round(estimate_mb(layers, hidden, seq, batch, vocab))})
    return out


def meminfo_mb(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return None


def load():
    return [round(x, 2) for x in os.getloadavg()]


class Job:
    """One (point, system): `real_size.py --systems <system>` in its own process, JSON to a temp file."""

    def __init__(self, point, system, args, tmp):
        self.point, self.system = point, system
        self.path = os.path.join(tmp, f"L{point['layers']}-H{point['hidden']}-S{point['seq']}-{system}.json")
        cmd = [sys.executable, *REAL_SIZE, "--model", "gpt2", "--systems", system, "--steps", str(args.steps),
               "--layers", str(point["layers"]), "--hidden", str(point["hidden"]), "--batch", str(point["batch"]),
               "--seq", str(point["seq"]), "--out", self.path,
               "--timeout", str(max(1, int(min(args.stop_ts - time.time(), 4 * 3600))))]
        if point["vocab"] != VOCAB:
            cmd += ["--vocab", str(point["vocab"])]
        self.record = {"system": system, "load_at_start": load(), "started": utc_now()}
        # its own process group: stopping it must also stop the real_size.py child it started
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, cwd=ROOT)

    def finish(self, stopped=False):
        if stopped:
            os.killpg(self.proc.pid, signal.SIGKILL)
        out, err = self.proc.communicate(timeout=60)
        self.record.update({"load_at_end": load(), "ended": utc_now()})
        if stopped:
            self.record.update(status="stopped", reason="still running at --stop-at")
        elif self.proc.returncode or not os.path.exists(self.path):
            self.record.update(status="failed", reason=f"rc {self.proc.returncode}: {(err or out)[-600:]}")
        else:
            r = json.load(open(self.path))["results"][0]
            steps = sorted(r["step_s"])
            self.record.update(status="ok", params_measured=r["params"], **{
                k: r[k] for k in ("peak_mb", "startup_peak_mb", "steady_peak_mb", "baseline_mb", "first_step_s",
                                  "step_s", "losses", "torch_threads")},
                step_median_s=steps[len(steps) // 2] if steps else None)
        return self.record


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def run(points, args):
    """Run every (point, system), at most `args.jobs` at once, within the memory budget and the stop time."""
    budget = meminfo_mb("MemTotal") - args.reserve_gib * 1024
    room = min(budget, meminfo_mb("MemAvailable") or 0)  # for the points running at once
    queue = []
    for p in sorted(points, key=lambda p: p["estimate_mb"]):  # small first: every axis gets its cheap points
        p["runs"] = []
        if p["estimate_mb"] > budget:
            reason = (f"estimated peak {p['estimate_mb'] / 1024:.1f} GiB > {budget / 1024:.1f} GiB "
                      f"(machine less --reserve-gib {args.reserve_gib})")
            print(f"skip {p['label']}: {reason}", flush=True)
            p["runs"] = [{"system": s, "status": "skipped", "reason": reason} for s in SYSTEMS]
            continue
        queue += [(p, s) for s in args.systems]
    running = []
    with tempfile.TemporaryDirectory() as tmp:
        while queue or running:
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                report(job.point, job.finish())
            if time.time() >= args.stop_ts:
                for job in running:
                    report(job.point, job.finish(stopped=True))
                running = []
                for p, s in queue:
                    p["runs"].append({"system": s, "status": "not run", "reason": "not started by --stop-at"})
                    print(f"not run {p['label']} {s}: --stop-at reached", flush=True)
                break
            if queue and len(running) < args.jobs:
                p, s = queue[0]
                held = sum(j.point["estimate_mb"] for j in running)
                if not running or held + p["estimate_mb"] <= room:
                    queue.pop(0)
                    print(f"start {p['label']} {s} (estimate {p['estimate_mb']} MB, load {load()})", flush=True)
                    running.append(Job(p, s, args, tmp))
                    continue
            time.sleep(0.5)
    return points


def report(point, record):
    point["runs"].append(record)
    if record["status"] == "ok":
        print(f"done {point['label']:14s} {record['system']:5s} peak {record['peak_mb']:7.0f} MB  first step "
              f"{record['first_step_s']:7.1f} s  step {record['step_median_s'] or float('nan'):7.1f} s  "
              f"load {record['load_at_end']}", flush=True)
    else:
        print(f"{record['status']} {point['label']} {record['system']}: {record['reason']}", flush=True)


def curve(points, axis, system, key):
    """(x, y) of the ok runs of `system` on `axis`, sorted by x."""
    xs = []
    for p in points:
        if axis in p["axes"]:
            for r in p["runs"]:
                if r["system"] == system and r["status"] == "ok" and r.get(key) is not None:
                    xs.append((p["params"] / 1e6 if axis == "params" else p["seq"], r[key]))
    return sorted(xs)


def plot(points, path, loads, quick=False):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    at, seq = ("1 layer x 64", 16) if quick else ("GPT-2 small", 256)
    panels = [("params", "peak_mb", "peak memory (MB above baseline)", f"parameters (M), seq {seq}"),
              ("seq", "peak_mb", "peak memory (MB above baseline)", f"sequence length ({at})"),
              ("params", "step_median_s", "step time (s), loaded machine", f"parameters (M), seq {seq}"),
              ("seq", "step_median_s", "step time (s), loaded machine", f"sequence length ({at})")]
    for ax, (axis, key, ylabel, xlabel) in zip(axes.flat, panels):
        for system, style in zip(SYSTEMS, ("o-", "s--")):
            xy = curve(points, axis, system, key)
            if xy:
                ax.plot(*zip(*xy), style, label="orttrainer" if system == "ort" else "eager")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xscale("log")
        ticks = sorted({x for system in SYSTEMS for x, _ in curve(points, axis, system, key)})
        ax.set_xticks(ticks, [f"{x:.4g}" for x in ticks])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPT-2 shapes, batch {points[0]['batch']}, Adam, fp32, CPU. Step times: shared machine, load average "
                 f"{min(loads):.0f}-{max(loads):.0f}: not speed figures", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)


def table(points):
    """The points as a markdown table (docs/performance.md): MB above the baseline, seconds."""
    rows = ["| point | params | seq | eager peak | orttrainer peak | ort / eager | ort start-up peak | "
            "eager step | ort first step | ort step |", "|---" * 10 + "|"]
    for p in sorted(points, key=lambda p: (p["params"], p["seq"])):
        runs = {r["system"]: r for r in p["runs"]}
        ort, eager = runs.get("ort", {}), runs.get("eager", {})

        def num(r, key, fmt):
            return format(r[key], fmt) if r.get("status") == "ok" else r.get("status", "-")
        ratio = f"{ort['peak_mb'] / eager['peak_mb']:.2f}×" if ort.get("status") == eager.get("status") == "ok" else "-"
        rows.append(f"| {p['label']} | {p['params'] / 1e6:.1f} M | {p['seq']} | {num(eager, 'peak_mb', '.0f')} | "
                    f"{num(ort, 'peak_mb', '.0f')} | {ratio} | {num(ort, 'startup_peak_mb', '.0f')} | "
                    f"{num(eager, 'step_median_s', '.1f')} | {num(ort, 'first_step_s', '.0f')} | "
                    f"{num(ort, 'step_median_s', '.1f')} |")
    return "\n".join(rows)


def all_loads(report):
    """Every 1-minute load average the run recorded."""
    return [report["load_start"][0], report["load_end"][0]] + [
        r[k][0] for p in report["points"] for r in p["runs"] for k in ("load_at_start", "load_at_end") if k in r]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (vocab 512, batch 2, seq 16/32), 1 step")
    parser.add_argument("--steps", type=int, default=1, help="steps after the first")
    parser.add_argument("--systems", default="ort,eager")
    parser.add_argument("--jobs", type=int, default=1, help="points run at once (memory is per process)")
    parser.add_argument("--reserve-gib", type=float, default=4.0, help="memory left to other work on the machine")
    parser.add_argument("--stop-at", help="UTC HH:MM: stop what still runs then, record it as not run")
    parser.add_argument("--out", help="JSON (default bench/results/scale_curve-<host kind>-<date>.json)")
    parser.add_argument("--png", default=os.path.join(ROOT, "docs", "images", "scale-curve.png"))
    parser.add_argument("--replot", metavar="JSON", help="only redraw the PNG from a run's JSON, print its table")
    args = parser.parse_args()
    if args.replot:
        report = json.load(open(args.replot))
        print(table(report["points"]))
        return plot(report["points"], args.png, all_loads(report), report["quick"])
    args.systems = args.systems.split(",")
    now = datetime.datetime.now(datetime.timezone.utc)
    args.stop_ts = float("inf")
    if args.stop_at:
        h, m = map(int, args.stop_at.split(":"))
        stop = now.replace(hour=h, minute=m, second=0, microsecond=0)
        args.stop_ts = (stop + datetime.timedelta(days=1 if stop < now else 0)).timestamp()
    from .host import host_facts, host_line, result_path
    facts = host_facts()
    print("host:", host_line(facts), flush=True)
    load_start = load()
    points = run(plan(args.quick), args)
    path = args.out or result_path("scale_curve", facts)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        report = {"command": " ".join(sys.argv), "started": f"{now:%Y-%m-%d %H:%M:%S}", "ended": utc_now(),
                  "quick": args.quick, "steps": args.steps, "host": facts, "host_line": host_line(facts),
                  "load_start": load_start, "load_end": load(), "mem_total_mb": meminfo_mb("MemTotal"),
                  "reserve_gib": args.reserve_gib, "jobs": args.jobs, "points": points}
        json.dump(report, f, indent=1)
    plot(points, args.png, all_loads(report), args.quick)
    print(table(points))
    print("wrote", path, "and", args.png)


if __name__ == "__main__":
    main()
