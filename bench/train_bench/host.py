"""What the benchmark ran on, and with how many threads each system really ran.

A ratio between two systems only means something when both used the same cores: an onnxruntime pool
of four threads against torch's two on a four-CPU VM "wins" by using twice the hardware. So every
benchmark records, per system,

  * the host: CPU model and the flags that decide the kernels (AVX2/AVX-512/AMX/F16C/FMA), the CPUs
    the OS reports, this process's affinity, the cgroup's CPU quota;
  * the threads configured (torch's intra-/inter-op counts, the environment variables that set them)
    and the threads that actually ran: every OS thread of the process whose CPU time grew by at least
    `ACTIVE_SHARE` of the wall time while that system stepped (`ThreadActivity`);
  * the matmul roof for that many threads: the best sgemm rate of torch (`torch.matmul`) and of
    onnxruntime's MLAS (a one-node `MatMul` session), so that an MFU above 100% shows up as what it is:
    a measurement fault, never a result.
"""

import os
import re
import socket
import time

import torch

from orttrainer.run.report import measures as watch  # the matmul rates the run summary takes its roof from

ACTIVE_SHARE = 0.10  # a thread "ran" if it was on a CPU for >= 10% of the system's stepping time
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ORT_INTRA_OP_THREADS")


def host_facts():
    """The machine as this process sees it (one dict, JSON-able)."""
    cpuinfo = _read("/proc/cpuinfo") or ""
    model = re.search(r"model name\s*:\s*(.*)", cpuinfo)
    flags = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.M)
    flag_set = set(flags.group(1).split()) if flags else set()
    vendor = re.search(r"vendor_id\s*:\s*(\S+)", cpuinfo)
    affinity = sorted(os.sched_getaffinity(0))
    return {
        "cpu": model.group(1).strip() if model else None,
        "vendor": vendor.group(1) if vendor else None,
        "host_kind": host_kind(vendor.group(1) if vendor else None, flag_set),
        "kernel_flags": [f for f in KERNEL_FLAGS if f in flag_set],
        "cpus_visible": os.cpu_count(),
        "affinity": affinity,
        "usable_cpus": len(affinity),
        "cgroup_cpu_quota": cgroup_cpu_quota(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "thread_env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
    }


def host_kind(vendor, flags):
    """The kind of host a result JSON is named after (docs/performance.md, "Threads, cores and the matmul
    roof"): the vendor and the widest matmul units, which choose the kernels and move every ratio."""
    maker = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, (vendor or "unknown").lower())
    if "amx_bf16" in flags:
        return f"{maker}-amx"
    return f"{maker}-avx512" if "avx512f" in flags else f"{maker}-avx2"


def result_path(benchmark, facts=None, folder=None):
    """bench/results/<benchmark>-<host kind>-<UTC date>.json, with -b, -c, ... when that name is taken."""
    import datetime
    import string

    folder = folder or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    kind = (facts or host_facts())["host_kind"]
    stem = f"{benchmark}-{kind}-{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}"
    for suffix in [""] + [f"-{c}" for c in string.ascii_lowercase[1:]]:
        path = os.path.join(folder, stem + suffix + ".json")
        if not os.path.exists(path):
            return path
    return path


def free_port():
    """A TCP port on 127.0.0.1 that is free now: the rendezvous of a study's ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cgroup_cpu_quota():
    """CPUs the cgroup may use (quota / period), or None when unlimited or unknown."""
    v2 = _read("/sys/fs/cgroup/cpu.max")
    if v2:
        quota, period = v2.split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota and period and int(quota) > 0:
        return int(quota) / int(period)
    return None


def host_line(facts):
    """One line to print beside a quoted figure."""
    quota = facts.get("cgroup_cpu_quota")
    return (
        f"{facts.get('cpu')}, {facts.get('usable_cpus')} usable of {facts.get('cpus_visible')} CPUs"
        f"{f', cgroup quota {quota:g} CPUs' if quota else ''}, flags {'/'.join(facts.get('kernel_flags') or [])}"
    )


class ThreadActivity:
    """CPU time per OS thread of this process, accumulated over the intervals one system stepped.

    `with activity.measuring():` around each step; `running()` then counts the threads that were on a
    CPU for at least ACTIVE_SHARE of the measured wall time (the stepping thread itself included).
    """

    def __init__(self):
        self.cpu_s = {}  # thread id -> CPU seconds inside the measured intervals
        self.wall_s = 0.0

    def measuring(self):
        return _Interval(self)

    def running(self):
        if self.wall_s <= 0:
            return None
        return sum(1 for s in self.cpu_s.values() if s >= ACTIVE_SHARE * self.wall_s)

    def summary(self):
        busy = sorted(self.cpu_s.values(), reverse=True)
        return {
            "threads_running": self.running(),
            "cpu_s_of_busiest_threads": [round(s, 3) for s in busy[:8]],
            "wall_s": round(self.wall_s, 3),
        }


class _Interval:
    def __init__(self, activity):
        self.activity = activity

    def __enter__(self):
        self.start, self.t0 = thread_cpu_seconds(), time.perf_counter()

    def __exit__(self, *exc):
        end = thread_cpu_seconds()
        self.activity.wall_s += time.perf_counter() - self.t0
        for tid, s in end.items():
            self.activity.cpu_s[tid] = self.activity.cpu_s.get(tid, 0.0) + s - self.start.get(tid, 0.0)


def thread_cpu_seconds():
    """{thread id: user+system CPU seconds} for every thread of this process."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        stat = _read(f"/proc/self/task/{tid}/stat")
        if stat:
            fields = stat.rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / hz
    return out


def sgemm_torch(n, reps):
    """Best torch.matmul rate (GFLOP/s) on n x n fp32, on torch's configured threads."""
    return watch.torch_matmul_gflops(n, reps)


def sgemm_mlas(n, reps, threads=0):
    """Best onnxruntime MatMul rate (GFLOP/s) on n x n fp32 (MLAS), with `threads` intra-op threads
    (0: onnxruntime's default, as the trainer's sessions use unless told otherwise)."""
    return watch.onnxruntime_matmul_gflops(n, reps, threads)


def matmul_roof(n, reps):
    """The measured matmul roof: torch's and MLAS's best sgemm rates and the larger of the two."""
    rates = {"torch_gflops": sgemm_torch(n, reps), "mlas_gflops": sgemm_mlas(n, reps), "n": n}
    rates["roof_gflops"] = max(rates["torch_gflops"], rates["mlas_gflops"])
    return rates


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None
