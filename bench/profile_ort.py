"""Where orttrainer's training step spends its time: onnxruntime's per-node profile + Python-side overhead.

    python bench/profile_ort.py [--model gpt|bert] [--steps N] [--warmup N] [--quick] [--py-spy] [--json OUT]

Builds the benchmark workload (bench/models.py, same sizes as bench/train_bench.py), trains it with
orttrainer with `SessionOptions.enable_profiling=True` (passed through ORTTrainerOptions.session_options;
otherwise default SessionOptions), and after start-up + warm-up times `--steps` steps with four clocks:

    train_step wall  ⊇  Runtime.run wall  ⊇  InferenceSession.run_with_iobinding wall
                     ⊇  profile model_run
                                                                                         ⊇  Σ kernel times

(the two inner wrappers are instance attributes set by this script: nothing under orttrainer/ changes).
The differences are: frontend Python (input checks, feeds), runtime Python (binding, dlpack outputs),
pybind/IOBinding, and the executor's own overhead outside kernels. The onnxruntime profile (JSON) of the
measured runs only is aggregated by op type (top 15) and by node (top 10), and by phase (forward /
loss / backward / optimizer, from node names).

--py-spy re-runs the script under `py-spy record` (if installed) and summarises the Python samples taken
inside train_step by leaf function.

Output: tables on stdout, JSON (default bench/results/profile_<model>.json).
"""

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import onnxruntime as ort  # noqa: E402

import train_bench as tb  # noqa: E402  (bench/train_bench.py)
from orttrainer.placement import device as placement  # noqa: E402


def timed(fn, sink):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - started)

    return wrapper


def phase_of(name, op, forward_names):
    if op in (
        "AdamOptimizer",
        "SGDOptimizer",
        "LambOptimizer",
        "InPlaceAccumulatorV2",
        "ZeroGradient",
    ) or name.startswith("train_"):
        return "optimizer"
    if (
        "_Grad" in name
        or op.endswith("Grad")
        or "Grad_" in op
        or op in ("BroadcastGradientArgs", "GatherGrad")
    ):
        return "backward"
    if name.startswith("sce_"):
        return "loss"
    parts = name.split("/")
    for k in range(len(parts), 0, -1):  # fused nodes keep the original name plus a suffix
        if "/".join(parts[:k]) in forward_names:
            return "forward"
    return "other (fused/renamed)"


def profile(args):
    ort.set_default_logger_severity(3)
    workload = tb.make_workload(args.model, args)
    batches = workload.batches(1 + args.warmup + args.steps)
    tmp = tempfile.mkdtemp(prefix="ort-profile-")
    # The engine's own defaults plus profiling: plain SessionOptions() would profile a different session
    # (memory pattern on, the provider's power-of-two arena), ~1.5x slower per step on this host.
    so = placement.default_session_options()
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tmp, "ort_profile")
    system = tb.make_system("orttrainer", workload, workload.make_model(), session_options=so)
    trainer = system.trainer
    system.first_step(batches[0])
    runtime = trainer._training_session.runtime  # the Runtime itself: its methods are patched below
    session = runtime.session
    run_times, iob_times = [], []
    runtime.run = timed(runtime.run, run_times)
    session.run_with_iobinding = timed(session.run_with_iobinding, iob_times)
    for batch in batches[1 : 1 + args.warmup]:
        system.step(batch)
    skip_runs = len(iob_times)  # session runs so far that are not measured (count since wrapping)
    runs_before_wrap = None  # runs of start-up (eval checks, first step): found from the profile below
    # A second trainer with the engine's default session options and no profiling, stepped interleaved
    # with the profiled one: the profiler's own per-node cost is the difference.
    plain = tb.make_system("orttrainer", workload, workload.make_model())
    plain.first_step(batches[0])
    for batch in batches[1 : 1 + args.warmup]:
        plain.step(batch)
    step_times, plain_times, others = [], [], []
    gate = tb.QuietGate(args.quiet_threshold, args.wait_quiet, args.wait_budget)
    for batch in batches[1 + args.warmup :]:
        gate.wait()
        _, seconds, busy = tb.timed_call(_measured_step, trainer, batch)
        step_times.append(seconds)
        others.append(busy)
        started = time.perf_counter()
        plain.trainer.train_step(*batch)
        plain_times.append(time.perf_counter() - started)
    del plain
    assert len(iob_times) - skip_runs == args.steps, "expected one session run per train_step"
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)

    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    n_measured = args.steps
    runs_before_wrap = len(runs) - n_measured - skip_runs
    # Only steps during which other processes left the machine alone (if there are at least 3 of them).
    use = [i for i in range(n_measured) if others[i] < args.quiet_threshold]
    basis = "quiet steps" if len(use) >= 3 else "all steps (fewer than 3 quiet ones)"
    if len(use) < 3:
        use = list(range(n_measured))
    pick = lambda values: [values[i] for i in use]  # noqa: E731
    measured_runs = pick(runs[-n_measured:])
    step_times, plain_all = pick(step_times), plain_times
    windows = [(r["ts"], r["ts"] + r["dur"]) for r in measured_runs]
    forward_names = {n.name for n in trainer._forward_model.graph.node}

    by_op = collections.defaultdict(lambda: [0, 0])
    by_node = collections.defaultdict(lambda: {"us": 0, "count": 0})
    by_phase = collections.defaultdict(int)
    kernel_per_run = [0] * len(windows)
    w = 0
    for e in sorted(
        (e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")),
        key=lambda e: e["ts"],
    ):
        while w < len(windows) and e["ts"] > windows[w][1]:
            w += 1
        if w >= len(windows):
            break
        if e["ts"] < windows[w][0]:
            continue
        node = e["name"][: -len("_kernel_time")]
        op = e.get("args", {}).get("op_name", "?")
        dur = e["dur"]
        kernel_per_run[w] += dur
        by_op[op][0] += dur
        by_op[op][1] += 1
        entry = by_node[node]
        entry["us"] += dur
        entry["count"] += 1
        entry["op"] = op
        entry.setdefault("input_shapes", _shapes(e.get("args", {}).get("input_type_shape")))
        entry.setdefault("output_shapes", _shapes(e.get("args", {}).get("output_type_shape")))
        by_phase[phase_of(node, op, forward_names)] += dur

    steps = len(windows)
    kernel_total = sum(kernel_per_run)
    ms = lambda us: us / 1e3 / steps  # noqa: E731  per-step milliseconds
    ops = sorted(by_op.items(), key=lambda kv: -kv[1][0])
    nodes = sorted(by_node.items(), key=lambda kv: -kv[1]["us"])
    measured_run_s = pick(run_times[-n_measured:])
    measured_iob_s = pick(iob_times[-n_measured:])
    med = statistics.median
    clocks = {
        "unprofiled_train_step_ms": med(pick(plain_all)) * 1e3,
        "train_step_ms": med(step_times) * 1e3,
        "runtime_run_ms": med(measured_run_s) * 1e3,
        "run_with_iobinding_ms": med(measured_iob_s) * 1e3,
        "profile_model_run_ms": med(r["dur"] for r in measured_runs) / 1e3,
        "kernel_sum_ms": med(kernel_per_run) / 1e3,
    }
    clocks["frontend_python_ms"] = med(a - b for a, b in zip(step_times, measured_run_s)) * 1e3
    clocks["runtime_python_ms"] = med(a - b for a, b in zip(measured_run_s, measured_iob_s)) * 1e3
    clocks["pybind_iobinding_ms"] = (
        med(a - r["dur"] / 1e6 for a, r in zip(measured_iob_s, measured_runs)) * 1e3
    )
    clocks["executor_outside_kernels_ms"] = (
        med((r["dur"] - k) for r, k in zip(measured_runs, kernel_per_run)) / 1e3
    )
    opts = session.get_session_options()
    result = {
        "meta": {
            **tb.environment(),
            "workload": workload.describe(),
            "steps": steps,
            "measured_steps": n_measured,
            "basis": basis,
            "other_cores_per_step": others,
            "waited_for_quiet_s": gate.waited_s,
            "warmup": args.warmup,
            "startup_runs_in_profile": runs_before_wrap,
            "session_options": {
                "graph_optimization_level": str(opts.graph_optimization_level),
                "execution_mode": str(opts.execution_mode),
                "intra_op_num_threads": opts.intra_op_num_threads,
                "inter_op_num_threads": opts.inter_op_num_threads,
                "enable_mem_pattern": opts.enable_mem_pattern,
                "enable_cpu_mem_arena": opts.enable_cpu_mem_arena,
            },
            "graph_nodes": len(runtime.graph.model.graph.node),
            "kernels_per_step": sum(c for _, c in by_op.values()) // max(steps, 1),
            "model_flops_per_step": tb.count_flops(workload)[0],
        },
        "clocks": clocks,
        "step_times_s": step_times,
        "unprofiled_step_times_s": plain_all,
        "by_phase_ms": {k: ms(v) for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
        "op_types": [
            {"op": op, "ms_per_step": ms(us), "share": us / kernel_total, "calls_per_step": n / steps}
            for op, (us, n) in ops
        ],
        "nodes": [
            {
                "node": name,
                "op": e["op"],
                "ms_per_step": ms(e["us"]),
                "share": e["us"] / kernel_total,
                "input_shapes": e["input_shapes"],
                "output_shapes": e["output_shapes"],
            }
            for name, e in nodes  # all of them: the report prints the top ones
        ],
    }
    return result


def _measured_step(trainer, batch):
    """One profiled train_step (a named frame, so py-spy samples of the measured steps can be picked out)."""
    started = time.perf_counter()
    trainer.train_step(*batch)
    return time.perf_counter() - started


def _shapes(value):
    if not value:
        return None
    out = []
    for item in value:
        for _, shape in item.items():
            out.append(shape)
    return out


def report(result, top_ops, top_nodes):
    c = result["clocks"]
    m = result["meta"]
    lines = [
        f"# orttrainer step profile: {m['workload']['model']} "
        f"(medians over {m['steps']} {m.get('basis', 'steps')} "
        f"of {m.get('measured_steps', m['steps'])} measured, "
        f"after {m['warmup']} warm-up; "
        f"{m['graph_nodes']} graph nodes, {m['kernels_per_step']} kernels run per step; session "
        f"{m['session_options']['graph_optimization_level']}, intra_op_num_threads="
        f"{m['session_options']['intra_op_num_threads']})",
        "",
        "## Clocks per step (median, ms)",
        "",
        "| clock | ms | |",
        "|---|---|---|",
        f"| train_step wall, no profiling (interleaved, engine-default session options) | "
        f"{c['unprofiled_train_step_ms']:.1f} | |",
        f"| train_step wall (profiled) | {c['train_step_ms']:.1f} | |",
        f"| Runtime.run wall | {c['runtime_run_ms']:.1f} | "
        f"frontend Python outside it: {c['frontend_python_ms']:.2f} |",
        f"| run_with_iobinding wall | {c['run_with_iobinding_ms']:.1f} | runtime Python outside it: "
        f"{c['runtime_python_ms']:.2f} |",
        f"| profile model_run | {c['profile_model_run_ms']:.1f} | pybind/IOBinding outside it: "
        f"{c['pybind_iobinding_ms']:.2f} |",
        f"| sum of kernel times | {c['kernel_sum_ms']:.1f} | executor outside kernels: "
        f"{c['executor_outside_kernels_ms']:.2f} |",
        "",
        "## Kernel time by phase (ms/step)",
        "",
        "| phase | ms/step |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in result["by_phase_ms"].items()]
    lines += [
        "",
        f"## Top {top_ops} op types by kernel time",
        "",
        "| op type | ms/step | share | calls/step |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {o['op']} | {o['ms_per_step']:.2f} | {o['share'] * 100:.1f}% | {o['calls_per_step']:.0f} |"
        for o in result["op_types"][:top_ops]
    ]
    lines += [
        "",
        f"## Top {top_nodes} nodes by kernel time",
        "",
        "| node | op | ms/step | share | input shapes |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{n['node']}` | {n['op']} | {n['ms_per_step']:.2f} | {n['share'] * 100:.1f}% "
        f"| {n['input_shapes']} |"
        for n in result["nodes"][:top_nodes]
    ]
    if "py_spy" in result:
        p = result["py_spy"]
        lines += [
            "",
            f"## py-spy: {p['samples_in_train_step']} samples inside the measured train_steps "
            f"({p['rate']} Hz; {(p['share_in_onnxruntime_run'] or 0) * 100:.1f}% inside "
            "InferenceSession.run_with_iobinding), by leaf frame",
            "",
            "| leaf frame | share |",
            "|---|---|",
        ]
        lines += [f"| `{f}` | {s * 100:.1f}% |" for f, s in p["top_leaf_frames"]]
    return "\n".join(lines)


def py_spy_summary(raw_path, rate):
    """Collapsed stacks ('f1;f2;...;leaf count') -> leaf-frame shares among samples of the measured steps."""
    leaves, total = collections.Counter(), 0
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if "_measured_step" not in stack:
                continue
            leaves[stack.split(";")[-1]] += int(count)
            total += int(count)
    native = sum(n for f, n in leaves.items() if f.startswith("run_with_iobinding "))
    return {
        "rate": rate,
        "samples_in_train_step": total,
        "share_in_onnxruntime_run": native / total if total else None,
        "top_leaf_frames": [(f, n / total) for f, n in leaves.most_common(12)] if total else [],
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["gpt", "bert"], default="gpt")
    p.add_argument("--steps", type=int, default=None, help="profiled steps (default 10, quick 3)")
    p.add_argument(
        "--warmup", type=int, default=None, help="steps after the first, before profiling (default 3)"
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--attention", choices=["sdpa", "masked"], default="sdpa")
    p.add_argument("--bert-vocab", type=int, default=30522)
    p.add_argument("--ort-outputs", choices=["loss", "all"], default="loss", help="see train_bench.py")
    p.add_argument("--top-ops", type=int, default=15)
    p.add_argument("--top-nodes", type=int, default=10)
    p.add_argument("--quiet-threshold", type=float, default=0.1)
    p.add_argument("--wait-quiet", type=float, default=None, help="see train_bench.py (default 20; quick 0)")
    p.add_argument("--wait-budget", type=float, default=300)
    p.add_argument("--py-spy", action="store_true", help="also sample the Python side with py-spy")
    p.add_argument("--py-spy-rate", type=int, default=250)
    p.add_argument("--json", default=None)
    p.add_argument("--_raw", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.wait_quiet = args.wait_quiet if args.wait_quiet is not None else (0.0 if args.quick else 20.0)
    return args


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    path = args.json or os.path.join(HERE, "results", f"profile_{args.model}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.py_spy:
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if not os.path.exists(spy):
            sys.exit("py-spy is not installed (pip install py-spy)")
        raw = tempfile.mktemp(suffix=".txt", prefix="pyspy-")
        inner = [a for a in argv if a != "--py-spy"] + ["--_raw", raw, "--json", path]
        cmd = [
            spy,
            "record",
            "--format",
            "raw",
            "--rate",
            str(args.py_spy_rate),
            "-o",
            raw,
            "--",
            sys.executable,
            os.path.abspath(__file__),
            *inner,
        ]
        started = time.time()
        rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
        # py-spy 0.4 can exit 1 with "No child process" after a complete recording (a waitpid race at the
        # target's exit): judge by the outputs, not by the exit code.
        fresh = os.path.exists(path) and os.path.getmtime(path) >= started
        if not (os.path.exists(raw) and os.path.getsize(raw) > 0 and fresh):
            sys.exit(f"py-spy run failed (exit {rc})")
        with open(path) as f:
            result = json.load(f)
        result["py_spy"] = py_spy_summary(raw, args.py_spy_rate)
        os.remove(raw)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(report(result, args.top_ops, args.top_nodes))
        print(f"\nJSON: {os.path.relpath(path, os.getcwd())}")
        return 0
    result = profile(args)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if not args._raw:
        print(report(result, args.top_ops, args.top_nodes))
        print(f"\nJSON: {os.path.relpath(path, os.getcwd())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
