"""`run.profile_steps: [from, to]`: onnxruntime's per-node profile of those steps, and its top ops.

onnxruntime profiles a session from its creation until `end_profiling()`; there is no switch per run.
So rank 0's sessions are created with profiling on (SessionOptions of our own, with the trainer's
defaults), the wall-clock interval of every train_step call of the window is recorded, and after the
window's last step the sessions' profiles are ended and only the events inside those intervals are
kept. Event times are microseconds after `get_profiling_start_time_ns()`, which onnxruntime 1.19.2
takes from the system clock (time.time_ns, not time.monotonic_ns as its docstring says).

Written into output_dir/profile/: `steps-F-T.json` (the window's events, Chrome trace format: open in
https://ui.perfetto.dev or chrome://tracing) and `top-ops-F-T.json` (time per op type). The check that
the window is right: the kept events hold exactly one `model_run` per session run of the window.
"""

import json
import os
import time
import warnings
from collections import defaultdict
from pathlib import Path

from orttrainer.run.run_folder import write_durably

PROFILE_FOLDER = "profile"
TOP_PRINTED = 10


class StepProfiler:
    def __init__(self, out, first, last, say):
        self.folder = Path(out) / PROFILE_FOLDER
        self.first, self.last, self.say = first, last, say
        self.intervals = []  # (start ns, end ns, step) of each train_step call in the window
        self.finished = False
        self._started = None
        self.options = None
        self.seconds = 0.0  # spent ending the profile: kept out of the throughput, like evaluation

    def session_options(self):
        """SessionOptions with profiling on, else the trainer's own defaults (it uses them as given)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("ort_*.json"):
            stale.unlink()  # raw profiles of an earlier, interrupted run
        from orttrainer.placement import device as placement

        options = placement.default_session_options()
        options.enable_profiling = True
        options.profile_file_prefix = str(self.folder / "ort")
        self.options = options
        return options

    def before_call(self, step):
        """`step`: this run's number (1-based) of the step the call works on."""
        self._started = time.time_ns() if not self.finished and self.first <= step <= self.last else None

    def after_call(self, step):
        if self._started is not None:
            self.intervals.append((self._started, time.time_ns(), step))
            self._started = None

    def maybe_finish(self, step, trainer, run_ends=False):
        """After the window's last step (`step`: this run's number), or when the run ends inside it:
        end the profile and print its top ops."""
        if self.finished or not (run_ends or step >= self.last):
            return
        started = time.perf_counter()
        self.finish(trainer)
        self.seconds += time.perf_counter() - started

    def finish(self, trainer, runs_per_update=1):
        """End every session's profile; keep and summarise the window's events (returns the summary)."""
        self.finished = True
        self.options.enable_profiling = False  # sessions built from now on do not profile
        raw = []
        builds = trainer._graphs._sessions.values() if trainer._graphs is not None else ()
        for build in list(builds):
            session = build.runtime.session
            start_ns = session.get_profiling_start_time_ns()
            path = session.end_profiling()
            if path and os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    raw += [(start_ns, event) for event in json.load(f)]
                os.unlink(path)
        if not self.intervals:
            return None
        origin = self.intervals[0][0]
        kept = []
        for start_ns, event in raw:
            begin = start_ns + event.get("ts", 0) * 1000
            end = begin + event.get("dur", 0) * 1000
            if any(lo <= begin and end <= hi for lo, hi, _ in self.intervals):
                kept.append({**event, "ts": (begin - origin) / 1000})
        first, last = self.intervals[0][2], self.intervals[-1][2]
        calls = len(self.intervals)
        runs = sum(1 for e in kept if e.get("name") == "model_run")
        summary = self._top_ops(kept, first, last, calls, runs)
        if runs < calls:
            warnings.warn(f"run.profile_steps: {runs} session runs were profiled in the {calls} train_step "
                          f"calls of steps {first}-{last} (onnxruntime records a limited number of events per "
                          "session); the top ops cover only those: profile an earlier window", stacklevel=2)
        name = f"steps-{first}-{last}"
        write_durably(self.folder / f"{name}.json", json.dumps(kept))
        write_durably(self.folder / f"top-ops-{first}-{last}.json", json.dumps(summary, indent=2) + "\n")
        self._print(summary)
        return summary

    def _top_ops(self, events, first, last, calls, runs):
        window_us = sum(hi - lo for lo, hi, _ in self.intervals) / 1000
        total, count = defaultdict(float), defaultdict(int)
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                op = e.get("args", {}).get("op_name", "?")
                total[op] += e.get("dur", 0)
                count[op] += 1
        ops = [{"op_type": op, "total_ms": us / 1000, "calls": count[op], "percent": 100 * us / window_us}
               for op, us in sorted(total.items(), key=lambda kv: -kv[1])]
        return {"steps": [first, last], "train_step_calls": calls, "session_runs": runs,
                "window_ms": window_us / 1000, "kernel_ms": sum(total.values()) / 1000,
                "profile": f"steps-{first}-{last}.json", "ops": ops}

    def _print(self, summary):
        first, last = summary["steps"]
        self.say(f"profile of steps {first}-{last} ({summary['train_step_calls']} train_step calls, "
                 f"{summary['window_ms']:.1f} ms; kernels {summary['kernel_ms']:.1f} ms): "
                 "top ops by total time")
        for op in summary["ops"][:TOP_PRINTED]:
            self.say(f"  {op['op_type']:<28} {op['total_ms']:>10.2f} ms {op['percent']:>6.1f}%  "
                     f"({op['calls']} calls)")
        self.say(f"  profile: {self.folder / summary['profile']}")
