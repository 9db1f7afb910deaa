"""Where orttrainer's resident memory goes, phase by phase, on a benchmark model (the numbers behind
docs/performance.md's "Memory" section and the memory rows of its optimisation log).

    python bench/memory_probe.py --model gpt [--arena default|off|same-as-requested] [--malloc-trim] [--steps 6]
                                 [--ort-outputs loss|all] [--mmap-every-allocation]

With `--arena off --mmap-every-allocation` every freed buffer goes back to the system at once, so
the steady high-water mark is the live peak itself; the default run's excess over it is the arena's
slack (the step is ~2x slower that way: every buffer is page-faulted afresh).

Prints resident memory above the process's RSS before training (imports, model, batches) after
export, after session creation, after the first step, and after the steady steps, each with the
high-water mark (VmHWM) so far; the steady peak is measured after resetting the mark.
"""

import argparse
import ctypes
import gc
import time

import onnxruntime as ort

import measure  # bench/measure.py: RSS helpers, the graph factory's trace hook
import train_bench as tb  # bench/train_bench.py: workloads, RSS helpers, the orttrainer system


def arena_session_options(mode):
    """SessionOptions for the CPU arena variant (None: the trainer's defaults)."""
    if mode == "default":
        return None
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_mem_pattern = False
    if mode == "off":
        options.enable_cpu_mem_arena = False
    else:  # one shared arena that grows by what is requested instead of powers of two
        config = ort.OrtArenaCfg({"arena_extend_strategy": 1, "max_dead_bytes_per_chunk": 1 << 20})
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, config)
        options.add_session_config_entry("session.use_env_allocators", "1")
    return options


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "bert"], default="gpt")
    parser.add_argument("--arena", choices=["default", "off", "same-as-requested"], default="default")
    parser.add_argument("--malloc-trim", action="store_true", help="return freed heap to the OS after start-up")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mmap-every-allocation", action="store_true",
                        help="glibc: serve allocations >= 256 KiB by mmap and return freed memory at once")
    parser.add_argument("--ort-outputs", choices=["loss", "all"], default="loss",
                        help="what model_desc describes (see bench/train_bench.py)")
    args = parser.parse_args()
    ort.set_default_logger_severity(3)
    if args.mmap_every_allocation:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD (a fixed one also stops glibc raising it)
        libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
    workload = tb.make_workload(args.model, tb.parse_args(["--model", args.model, "--ort-outputs", args.ort_outputs]))
    model = workload.make_model()
    batches = workload.batches(args.steps + 1)
    gc.collect()
    baseline = tb.rss_now_kb() / 1024

    def report(what):
        print(f"{what:28s} resident {tb.rss_now_kb() / 1024 - baseline:6.0f} MB   "
              f"high-water {tb._status_kb('VmHWM') / 1024 - baseline:6.0f} MB")

    system = tb.ORTSystem(workload, model, session_options=arena_session_options(args.arena))
    measure.trace_graph_factory("build_training_graph", before=lambda: report("after export"))
    measure.trace_graph_factory("make_runtime", after=lambda _: report("after session creation"))
    system.first_step(batches[0])
    if args.malloc_trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    report("after the first step")
    tb.reset_peak_rss()
    times = []
    for batch in batches[1:]:
        started = time.perf_counter()
        system.step(batch)
        times.append(time.perf_counter() - started)
    report(f"after {args.steps} steady steps")
    print(f"baseline RSS {baseline:.0f} MB; median step {sorted(times)[len(times) // 2] * 1e3:.0f} ms "
          f"(model {args.model}, outputs {args.ort_outputs}, arena {args.arena}, "
          f"malloc_trim {'on' if args.malloc_trim else 'off'}, mmap every allocation "
          f"{'on' if args.mmap_every_allocation else 'off'})")


if __name__ == "__main__":
    main()
