"""Fresh-process A/B of the CPU provider's arena for a graph with PythonOps (tiny BERT, F.gelu).

    cd bench && ../.venv/bin/python provider_arena_ab.py --rounds 3 --steps 20 --settings arena,env

onnxruntime-training's bindings make one CPU provider per process, with the arena setting of the first
session (docs/ort-notes.md), so the two settings cannot share a process: each run is a fresh process,
the settings alternate. `env` = the trainer's defaults since round 7 (one process-wide arena that
grows by what is asked, every session); `off` = the defaults before (each session's own allocator)
with the provider built arena-off, i.e. arena truly off; `arena` = the same options after an arena-on
session made first, i.e. what every PythonOp graph (BERT) got before round 7; `shrink` = `env` with the
run option `memory.enable_memory_arena_shrinkage` (free arena regions returned after every run). Prints per run the median step (wall), user and sys CPU seconds of the
steps; times on a shared machine are only comparable paired, round by round, with the load line."""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(setting, steps):
    import onnxruntime as ort
    from onnx import helper as h

    from models import BertSize, BertWorkload  # bench/models.py
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    options = {"device": {"id": "cpu"}, "utils": {"export_cache": False}}
    if setting in ("off", "arena"):  # the defaults before round 7: each session's own allocator
        so = ort.SessionOptions()
        so.log_severity_level, so.enable_mem_pattern, so.enable_cpu_mem_arena = 3, False, False
        options["session_options"] = so
    if setting == "arena":
        graph = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "first", [h.make_tensor_value_info("x", 1, [2])],
                             [h.make_tensor_value_info("y", 1, [2])])
        first = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
        ort.InferenceSession(first.SerializeToString(), ort.SessionOptions(), providers=["CPUExecutionProvider"])
    if setting == "shrink":  # the defaults + the arena's free regions given back after every run
        from orttrainer.engine.runtime import session as runtime_module

        init = runtime_module.Runtime.__init__

        def shrinking_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            for opts in self._run_options.values():
                opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

        runtime_module.Runtime.__init__ = shrinking_init
    workload = BertWorkload(batch=8, seq=128, size=BertSize())
    module, desc, loss_fn = workload.ort_trainer_args(workload.make_model())
    trainer = ORTTrainer(module, desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn,
                         options=ORTTrainerOptions(options))
    batches = workload.batches(4)
    trainer.train_step(*batches[0])
    start = resource.getrusage(resource.RUSAGE_SELF)
    times, losses = [], []
    for i in range(steps):
        t = time.perf_counter()
        losses.append(float(trainer.train_step(*batches[i % 4])))
        times.append(time.perf_counter() - t)
    end = resource.getrusage(resource.RUSAGE_SELF)
    print("RESULT " + json.dumps({"setting": setting, "median_s": statistics.median(times),
                                  "user_s": end.ru_utime - start.ru_utime, "sys_s": end.ru_stime - start.ru_stime,
                                  "maxrss_mb": end.ru_maxrss / 1024, "last_loss": losses[-1].hex()}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--settings", default="off,arena,env", help="off, arena, env, shrink (comma-separated)")
    parser.add_argument("--out", help="write the runs as JSON here")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.steps)
    results, order = [], args.settings.split(",")
    for r in range(args.rounds):
        for setting in (order if r % 2 == 0 else order[::-1]):
            out = subprocess.run([sys.executable, __file__, "--child", setting, "--steps", str(args.steps)],
                                 capture_output=True, text=True, timeout=900, cwd=HERE)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                sys.exit(out.stderr[-3000:])
            results.append(dict(json.loads(line[0][7:]), round=r, load=os.getloadavg()))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "runs": results}, f, indent=1)
    for setting in order:
        rows = [x for x in results if x["setting"] == setting]
        print(setting, "median step", statistics.median(x["median_s"] for x in rows),
              "sys", statistics.median(x["sys_s"] for x in rows), "user", statistics.median(x["user_s"] for x in rows))


if __name__ == "__main__":
    main()
