"""Measurement helpers of the benchmark: resident memory (VmRSS/VmHWM), step timing with the other
processes' CPU use, the quiet-machine gate, thread checks, and the engine and host description."""

import hashlib
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from . import host
from .systems import BASELINES, baselines_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


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
    """What makes a run's figures unusable: an MFU above the measured matmul roof (its own precision's),
    ratios between an orttrainer system and its baselines that ran on different numbers of threads."""
    errors = []
    for sname, s in out.items():
        for label, mfu in (("all steps", s["mfu"]), ("quiet steps", (s.get("quiet") or {}).get("mfu"))):
            if mfu is not None and mfu > 1.0:
                errors.append(f"{sname}: MFU {mfu * 100:.0f}% ({label}) is above the measured matmul roof")
    for ort_name in (n for n in BASELINES if n in out):
        for other in (r for r in baselines_of(ort_name) if r in out):
            why = thread_mismatch(out, ort_name, other)
            if why:
                errors.append(f"no ratio {ort_name} vs {other}: {why}")
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
        "command": "python " + " ".join([_script(sys.argv[0])] + sys.argv[1:]),
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


def _script(argv0):
    """How this process was started, as a user would type it: `-m bench.train_bench[.x]` or a path."""
    path = os.path.relpath(argv0, ROOT)
    if path.startswith(os.path.join("bench", "train_bench") + os.sep):
        name = path[:-3].replace(os.sep, ".")
        return "-m " + (name[: -len(".__main__")] if name.endswith(".__main__") else name)
    return path
