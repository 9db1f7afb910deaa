"""Where orttrainer's FIRST session run spends its extra time, against later runs of the same process.

    cd bench && ../.venv/bin/python first_run.py [--model gpt2|bert] [--layers N] [--steps 3] [--top 15]
                                                 [--ort-knob ...] [--json OUT]
    (--hidden/--vocab/--batch/--seq shrink it for smoke runs)

Builds real_size.py's model (GPT-2 small by default), trains `--steps` steps with onnxruntime's
per-node profile on (the trainer's default session options + `enable_profiling`) and records, per
session run: wall, CPU user/sys and minor/major faults (getrusage of the process, all threads), and
per train_step the same, so the Python side outside the session run is the difference. The profile's
kernel times are then compared node by node between run 1 and run 2 (the nodes and op types whose
first run is slowest). The machine may be loaded: compare runs of this one process, CPU seconds and
fault counts, not wall times across processes.
"""

import argparse
import collections
import json
import os
import resource
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository (orttrainer)

import real_size  # noqa: E402  (bench/real_size.py: the models and batches)


def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": time.perf_counter(), "user": r.ru_utime, "sys": r.ru_stime, "minflt": r.ru_minflt,
            "majflt": r.ru_majflt}


def delta(a, b):
    return {k: round(b[k] - a[k], 3) for k in a}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt2", "bert"], default="gpt2")
    parser.add_argument("--layers", type=int, default=0)
    for flag in ("hidden", "vocab", "batch", "seq"):  # smoke runs (0: the real size)
        parser.add_argument(f"--{flag}", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--ort-knob", action="append", default=[])
    parser.add_argument("--no-profile", action="store_true", help="rusage only (no per-node profile)")
    parser.add_argument("--export-cache", default="", help="an export cache folder (default: cache off)")
    parser.add_argument("--json")
    args = parser.parse_args()

    import onnxruntime as ort
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim
    from orttrainer.placement import device as placement
    from orttrainer.engine.runtime import session as engine_session

    ort.set_default_logger_severity(3)
    model, cfg = real_size.make_model(args.model, args.layers, args.hidden, args.vocab, max(256, args.seq))
    batches = real_size.make_batches(args.model, cfg, args.steps, args.batch, args.seq)
    module, desc = real_size.loss_module(model, batches)
    so = real_size.session_options(args.ort_knob) or placement.default_session_options()
    tmp = tempfile.mkdtemp(prefix="first-run-")
    if not args.no_profile:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "ort")
    runs, sessions = [], []
    plain_run = engine_session.Runtime.run

    def run(self, *a, **k):
        sessions.append(self.session)
        before = usage()
        try:
            return plain_run(self, *a, **k)
        finally:
            runs.append(delta(before, usage()))
    engine_session.Runtime.run = run

    opts = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": bool(args.export_cache),
                                                      "export_cache_dir": args.export_cache}, "session_options": so}
    trainer = ORTTrainer(module, desc, optim.AdamConfig(lr=1e-4), options=ORTTrainerOptions(opts))
    steps, losses = [], []
    for batch in batches:
        before = usage()
        losses.append(trainer.train_step(*batch.values()).item())
        steps.append(delta(before, usage()))
    startup = dict(trainer.startup_seconds)
    result = {"model": args.model, "layers": args.layers, "knobs": args.ort_knob, "losses": losses,
              "export_cache": args.export_cache,
              "startup_seconds": startup, "steps": steps, "runs": runs,
              "load_average": os.getloadavg()}
    print(f"losses {losses}\nstart-up phases (s): {startup}")
    print("per train_step (wall s, CPU user/sys s, minor/major faults) and its session run:")
    for i, (s, r) in enumerate(zip(steps, runs)):
        print(f"  step {i + 1}: train_step {s}\n          run        {r}")
    if not args.no_profile:
        result.update(compare_profile(sessions[-1].end_profiling(), len(runs), args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def compare_profile(path, n_runs, top):
    """Per-node kernel time of each session run; the nodes and op types whose run 1 exceeds run 2 most."""
    with open(path) as f:
        events = json.load(f)
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "Session" and e.get("name") == "model_run")[-n_runs:]
    per_run = [collections.defaultdict(float) for _ in windows]
    ops = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        for i, (a, b) in enumerate(windows):
            if a <= e["ts"] <= b:
                node = e["name"][: -len("_kernel_time")]
                per_run[i][node] += e["dur"] / 1e6
                ops[node] = e.get("args", {}).get("op_name", "?")
    totals = [sum(r.values()) for r in per_run]
    model_run = [(b - a) / 1e6 for a, b in windows]
    print(f"profile: model_run per run (s) {[round(x, 2) for x in model_run]}, "
          f"kernel sum {[round(x, 2) for x in totals]}")
    if len(per_run) < 2:
        return {"model_run_s": model_run, "kernel_sum_s": totals}
    first, second = per_run[0], per_run[1]
    diff = sorted(((first[n] - second.get(n, 0.0), n) for n in first), reverse=True)
    by_op = collections.defaultdict(lambda: [0.0, 0.0])
    for n in first:
        by_op[ops[n]][0] += first[n]
        by_op[ops[n]][1] += second.get(n, 0.0)
    op_diff = sorted(by_op.items(), key=lambda kv: -(kv[1][0] - kv[1][1]))
    print(f"nodes, run 1 - run 2 (s), top {top}:")
    for d, n in diff[:top]:
        print(f"  {d:+8.3f}  {first[n]:8.3f} {second.get(n, 0):8.3f}  {ops[n]:24s} {n}")
    print("op types, run 1 / run 2 (s):")
    for op, (a, b) in op_diff[:top]:
        print(f"  {a - b:+8.3f}  {a:8.3f} {b:8.3f}  {op}")
    return {"model_run_s": model_run, "kernel_sum_s": totals,
            "nodes_run1_minus_run2": [{"node": n, "op": ops[n], "run1_s": first[n], "run2_s": second.get(n, 0.0)}
                                      for d, n in diff[:50]],
            "ops": [{"op": op, "run1_s": a, "run2_s": b} for op, (a, b) in op_diff[:30]]}


if __name__ == "__main__":
    main()
