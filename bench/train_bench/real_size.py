"""Real-size memory and start-up: GPT-2 small and BERT-base (transformers), orttrainer against eager.

    python bench/train_bench/real_size.py --model gpt2|bert [--systems ort,eager[,compile]] [--steps 3] [--layers N]
                              [--copy-weights] [--ort-knob KEY=VALUE] [--diagnose]

One fresh process per system (this script re-runs itself with --child). Each child builds the model
(fp32, dropout off, eager attention), its batches, imports what its system needs, and takes its
baseline = RSS then. It reports, above that baseline:

- `startup_peak`: VmHWM after the first step (export, gradient graph, session, first step);
- `steady_peak`: VmHWM over the later steps, after resetting the mark (/proc/self/clear_refs);
- `peak`: the whole-process VmHWM at the end (no reset: what a user's machine must have);
- `first_step_s` (construction + first step, export cache off) and the later steps' times.

GPT-2 small: GPT2LMHeadModel(GPT2Config()), 124 M parameters, batch 4 x seq 256, Adam, no clipping.
BERT-base: BertForPreTraining(BertConfig()), batch 8 x seq 128, MLM (15% of tokens) + NSP, Adam.
Timings from a loaded machine are not comparable; memory is. Writes bench/results/real_size-<model>.json.
`--ort-knob` (repeatable) sets onnxruntime SessionOptions for experiments, e.g. `mem_pattern=1`,
`arena=1` (the trainer's default is off; other knobs keep it off), `shrink=1` (arena shrinkage after every
step), `shrink_runs=N` (after the first N steps only), `env_arena=0` (the defaults before round 7: no process-wide arena), `first_arena=1` (an arena-on
session first, which builds the process's one CPU provider with an arena: what BERT got before round 7), `extend=same`, `prepack=0`, `opt=0|1|2|99`, `dump=PATH` (the optimized graph), `env_alloc=1` (the
opt-in process-wide plain allocator, `placement.use_plain_cpu_allocator`, instead of the sessions' own),
`trim_built=1` (`malloc_trim(0)` once a build's start-up objects are dropped, before the first run).
Diagnostics by environment: REAL_SIZE_RSS_TRACE=path (VmRSS every 5 ms, with the phase marks),
REAL_SIZE_ALLOC_PEAK=prefix with alloc_peak.c (an LD_PRELOAD shim in bench/ at commit ce81696) preloaded (live blocks >= 1 MB at each interval's peak),
REAL_SIZE_ALLOC_DUMP=prefix with alloc_trace.c (the same, live blocks >= 16 MB at each mark).
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def status_kb(key):
    # bench/train_bench/measure.py imports torch (~3 s): only the children need it, not the parent that starts them
    from .measure import _status_kb

    return _status_kb(key)


def make_model(name, layers, hidden=0, vocab=0, positions=256):
    """The real-size model; `layers`/`hidden`/`vocab` (0: the real size) shrink it for smoke runs.
    GPT-2's position table has `positions` rows (longer sequences need more: bench/train_bench/scale_curve.py)."""
    import torch
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        extra = {"n_layer": layers} if layers else {}
        extra.update({"n_embd": hidden, "n_head": max(1, hidden // 64)} if hidden else {})
        extra.update({"vocab_size": vocab} if vocab else {})
        cfg = GPT2Config(n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         attn_implementation="eager", **extra)
        return GPT2LMHeadModel(cfg), cfg
    from transformers import BertConfig, BertForPreTraining
    extra = {"num_hidden_layers": layers} if layers else {}
    extra.update({"hidden_size": hidden, "num_attention_heads": max(1, hidden // 64),
                  "intermediate_size": 4 * hidden} if hidden else {})
    extra.update({"vocab_size": vocab} if vocab else {})
    cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager", **extra)
    return BertForPreTraining(cfg), cfg


def make_batches(name, cfg, n, batch=0, seq=0):
    """`n` batches; `batch`/`seq` 0: the real size's (GPT-2 4 x 256, BERT 8 x 128)."""
    import torch
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        if name == "gpt2":
            x = torch.randint(0, cfg.vocab_size, (batch or 4, seq or 256), generator=g)
            batches.append({"input_ids": x, "labels": x})
        else:
            b, t = batch or 8, seq or 128
            x = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
            masked = torch.rand(b, t, generator=g) < 0.15
            labels = torch.where(masked, x, torch.full_like(x, -100))
            batches.append({"input_ids": x, "token_type_ids": (torch.arange(t) >= t // 2).long().expand(b, t).contiguous(),
                            "attention_mask": torch.ones(b, t, dtype=torch.long), "labels": labels,
                            "next_sentence_label": torch.randint(0, 2, (b,), generator=g)})
    return batches


def loss_module(model, batches):
    """(module, model_desc) for orttrainer: `model` called with a batch's keys by name, returning its
    `.loss`, the one described output."""
    import torch

    names = list(batches[0])

    class Loss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *xs):
            return self.m(**dict(zip(names, xs))).loss

    return Loss(model), {"inputs": [(n, list(b.shape)) for n, b in batches[0].items()],
                         "outputs": [("loss", [], True)]}


def session_options(knobs):
    """SessionOptions for `--ort-knob`s (None: the trainer's defaults)."""
    if not knobs:
        return None
    import onnxruntime as ort
    from orttrainer.placement import device as placement
    from orttrainer.placement.device import default_session_options
    arena_cfg = {k: int(v) for k, v in (kn.split("=") for kn in knobs)
                 if k in ("max_dead_bytes_per_chunk", "initial_chunk_size_bytes", "arena_extend_strategy")}
    if arena_cfg:  # the process-wide arena with these OrtArenaCfg fields (registered before the trainer's)
        arena_cfg.setdefault("arena_extend_strategy", 1)
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(arena_cfg))
        placement._ENV_CPU_ALLOCATOR = "arena"
    if "extend=same" in knobs:  # registers its own arena allocator: the trainer's plain one must not exist
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_mem_pattern = False
    elif "env_arena=0" in knobs:  # the defaults before round 7: each session's own allocator
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_mem_pattern = False
        options.enable_cpu_mem_arena = False
    else:
        options = default_session_options()  # a knob changes only what it names (arena off, env allocator)
    if "first_arena=1" in knobs:  # an arena-on session first: builds the process's one CPU provider
        from onnx import helper as h
        graph = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "first", [h.make_tensor_value_info("x", 1, [2])],
                             [h.make_tensor_value_info("y", 1, [2])])
        first = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
        ort.InferenceSession(first.SerializeToString(), ort.SessionOptions(), providers=["CPUExecutionProvider"])
    for knob in knobs:
        key, value = knob.split("=")
        if key == "mem_pattern":
            options.enable_mem_pattern = value == "1"
        elif key == "arena":
            options.enable_cpu_mem_arena = value == "1"
        elif key == "prepack":  # MLAS keeps a packed copy of constant MatMul/Gemm weights
            options.add_session_config_entry("session.disable_prepacking", "0" if value == "1" else "1")
        elif key == "opt":  # graph optimisation level: 0 none, 1 basic, 2 extended, 99 all
            options.graph_optimization_level = {"0": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                                "1": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                                "2": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                                "99": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[value]
        elif key == "dump":  # the optimized graph as onnxruntime runs it (initializers included)
            options.optimized_model_filepath = value
        elif key == "mem_reuse":
            options.add_session_config_entry("session.disable_mem_reuse", "0" if value == "1" else "1")
        elif key == "order":
            options.execution_order = {"default": ort.ExecutionOrder.DEFAULT,
                                       "priority": ort.ExecutionOrder.PRIORITY_BASED,
                                       "memory": ort.ExecutionOrder.MEMORY_EFFICIENT}[value]
        elif key == "env_alloc" and value == "1":  # the opt-in plain allocator (no arena with PythonOps)
            placement.use_plain_cpu_allocator(options)
        elif key == "extend" and value == "same":
            config = ort.OrtArenaCfg({"arena_extend_strategy": 1})
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, config)
            options.add_session_config_entry("session.use_env_allocators", "1")
        elif key not in ("max_dead_bytes_per_chunk", "initial_chunk_size_bytes", "arena_extend_strategy", "shrink", "shrink_runs", "mmap_threshold", "trim", "torch_gelu", "trim_built", "env_arena", "first_arena"):
            raise SystemExit(f"unknown --ort-knob {knob!r}")
    return options


class _MallInfo2(__import__("ctypes").Structure):
    _fields_ = [(name, __import__("ctypes").c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_mb():
    """glibc's view, all arenas summed: `heap` = bytes its arenas hold (brk + per-thread heaps), `used` =
    of those in use, `free` = held but free (what fragmentation keeps), `mmapped` = big blocks by mmap."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return {"heap_mb": m.arena / 2**20, "used_mb": m.uordblks / 2**20, "free_mb": m.fordblks / 2**20,
            "mmapped_mb": m.hblkhd / 2**20}


def holders(trainer):
    """Drop, one by one, what the trainer keeps from start-up and print what each frees (glibc in use):
    finds which object holds heap memory. Destroys the trainer's ability to rebuild; diagnosis only."""
    graphs = trainer._graphs

    def drop(what, action):
        before, rss = malloc_mb(), status_kb("VmRSS")
        action()
        gc.collect()
        after = malloc_mb()
        print(f"DIAG dropping {what}: glibc in use -{before['used_mb'] - after['used_mb']:.0f} MB, mmapped "
              f"-{before['mmapped_mb'] - after['mmapped_mb']:.0f} MB, resident "
              f"-{(rss - status_kb('VmRSS')) / 1024:.0f} MB", flush=True)

    drop("lifecycle reference export", lambda: setattr(graphs, "_reference", None))
    drop("trainer._sample", lambda: setattr(trainer, "_sample", None))
    drop("forward models", lambda: [setattr(b, "forward", None) for b in graphs._sessions.values()] and None
         or setattr(trainer, "_forward_model", None))
    drop("training ModelProtos", lambda: [setattr(b.runtime.graph, "model", None) for b in graphs._sessions.values()])
    drop("the wrapper", lambda: setattr(trainer, "_wrapper", None))
    drop("IOBindings", lambda: [b.runtime._bindings.clear() for b in graphs._sessions.values()])
    drop("the sessions", lambda: [setattr(b.runtime, "session", None) for b in graphs._sessions.values()])


def diagnose(base):
    """Where the resident memory after the first step lies: glibc heap vs other anonymous mappings,
    before and after malloc_trim (freed heap that glibc kept)."""
    import ctypes
    sizes = {}
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                current = parts[5] if len(parts) > 5 else "[anon]"
            elif parts[0] == "Rss:":
                sizes[current] = sizes.get(current, 0) + int(parts[1])
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:4]
    print("DIAG rss by mapping (MB):", [(k, v // 1024) for k, v in top], flush=True)
    before = status_kb("VmRSS")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(f"DIAG malloc_trim returned {(before - status_kb('VmRSS')) / 1024:.0f} MB; rss above base now "
          f"{(status_kb('VmRSS') - base) / 1024:.0f} MB", flush=True)


def child(args):
    from .measure import reset_peak_rss as reset_peak, trace_graph_factory  # bench/train_bench/measure.py
    import torch
    for knob in args.ort_knob:
        if knob.startswith("mmap_threshold="):  # glibc: allocations at least this big by mmap, freed at once
            import ctypes
            ctypes.CDLL("libc.so.6").mallopt(-3, int(knob.split("=")[1]))  # M_MMAP_THRESHOLD
    model, cfg = make_model(args.model, args.layers, args.hidden, args.vocab, max(256, args.seq))
    batches = make_batches(args.model, cfg, args.steps + 1, args.batch, args.seq)
    if args.system == "ort":
        import onnxruntime as ort
        from orttrainer import ORTTrainer, ORTTrainerOptions, optim
        ort.set_default_logger_severity(3)
        if "torch_gelu=0" in args.ort_knob:  # GeluGrad kernels instead of torch's gelu_backward in PythonOps
            from orttrainer.engine.graph import torch_gelu_gradient
            torch_gelu_gradient._RUNNERS_WORK = False
    gc.collect()
    base = status_kb("VmRSS")
    phases = {}

    trim = "trim=1" in args.ort_knob  # malloc_trim(0) after each start-up phase (what export etc. freed)

    def mark(what):
        if trim and what.startswith("after_") and what != "after_first_step":
            import ctypes
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        if os.environ.get("REAL_SIZE_ALLOC_DUMP"):  # alloc_trace.c preloaded: its live large blocks
            import ctypes
            ctypes.CDLL(None).shim_dump(f"{os.environ['REAL_SIZE_ALLOC_DUMP']}-{what}.txt".encode())
        if os.environ.get("REAL_SIZE_ALLOC_PEAK"):  # alloc_peak.c preloaded: live >= 1 MB at the peak since
            import ctypes                               # the last mark, then a new interval starts
            shim = ctypes.CDLL(None)
            shim.shim_peak_dump(f"{os.environ['REAL_SIZE_ALLOC_PEAK']}-{what}.txt".encode())
            shim.shim_arm()
        phases[what] = {"rss_mb": (status_kb("VmRSS") - base) / 1024, "hwm_mb": (status_kb("VmHWM") - base) / 1024,
                        **malloc_mb()}

    if os.environ.get("REAL_SIZE_RSS_TRACE"):  # VmRSS every 5 ms (and the alloc_peak shim's live bytes)
        import threading
        trace = open(os.environ["REAL_SIZE_RSS_TRACE"], "w")
        import ctypes
        live = getattr(ctypes.CDLL(None), "shim_live", None)
        if live:
            live.restype = ctypes.c_long

        def sample():
            while True:
                trace.write(f"{time.perf_counter():.3f} {(status_kb('VmRSS') - base) / 1024:.0f} "
                            f"{(live() >> 20) if live else -1}\n")
                time.sleep(0.005)
        threading.Thread(target=sample, daemon=True).start()
        marked = mark

        def mark(what):
            trace.write(f"{time.perf_counter():.3f} MARK {what}\n")
            trace.flush()
            marked(what)
    mark("baseline")
    started = time.perf_counter()
    if args.system == "ort":
        module, desc = loss_module(model, batches)
        opts = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
        so = session_options([k for k in args.ort_knob])
        if so is not None:
            opts["session_options"] = so
        trainer = ORTTrainer(module, desc, optim.AdamConfig(lr=1e-4), options=ORTTrainerOptions(opts))
        trainer._share_module_parameters = not args.copy_weights

        shrink_runs = [int(k.split("=")[1]) for k in args.ort_knob if k.startswith("shrink_runs=")]
        runtimes = []

        def shrink_and_mark(runtime):
            if "shrink=1" in args.ort_knob or shrink_runs:  # give the arena's free chunks back after a run
                for options in runtime._run_options.values():
                    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            runtimes.append(runtime)
            mark("after_session")

        trace_graph_factory("export", before=lambda: mark("before_export"),
                            after=lambda _: mark("after_export_raw"))
        trace_graph_factory("build_training_graph", before=lambda: mark("after_export"),
                            after=lambda _: mark("after_training_graph"))
        trace_graph_factory("make_runtime", after=shrink_and_mark)

        import ctypes
        from orttrainer.engine.runtime import lifecycle as _lifecycle
        serve = _lifecycle.GraphLifecycle.serve

        def serve_and_mark(self, inputs):  # a mark once a build's start-up objects are dropped (before its run)
            built = len(self.builds)
            found = serve(self, inputs)
            if len(self.builds) > built:
                mark("after_build")
                if "trim_built=1" in args.ort_knob:  # malloc_trim(0) there
                    ctypes.CDLL("libc.so.6").malloc_trim(0)
                    mark("after_build_trim")
            return found
        _lifecycle.GraphLifecycle.serve = serve_and_mark

        steps_done = [0]

        def step(batch):
            loss = trainer.train_step(*batch.values()).item()
            steps_done[0] += 1
            if shrink_runs and steps_done[0] == shrink_runs[0]:  # only the first N runs shrink ("" = off)
                for runtime in runtimes:
                    for options in runtime._run_options.values():
                        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "")
            return loss
    else:
        target = model if args.system == "eager" else torch.compile(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(batch):
            loss = target(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    losses = [step(batches[0])]
    first = time.perf_counter() - started
    mark("after_first_step")
    if args.diagnose:
        diagnose(base)
        if args.system == "ort":
            holders(trainer)
    startup_peak = (status_kb("VmHWM") - base) / 1024
    resettable = reset_peak()
    times = []
    for batch in batches[1:]:
        t = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - t)
        if os.environ.get("REAL_SIZE_ALLOC_PEAK"):
            mark(f"after_step_{len(losses)}")
    steady = (status_kb("VmHWM") - base) / 1024 if resettable else None
    mark("end")
    result = {"system": args.system, "baseline_mb": base / 1024, "first_step_s": first, "step_s": times,
              "startup_peak_mb": startup_peak, "steady_peak_mb": steady,
              "peak_mb": max(startup_peak, steady or 0), "losses": losses, "phases": phases,
              "params": sum(p.numel() for p in model.parameters()), "knobs": list(args.ort_knob),
              "tokens_per_step": batches[0]["input_ids"].numel(),
              "copy_weights": bool(args.copy_weights),
              "torch_threads": torch.get_num_threads(),
              "startup_seconds": dict(trainer.startup_seconds) if args.system == "ort" else None}
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt2", "bert"], default="gpt2")
    parser.add_argument("--systems", default="ort,eager")
    parser.add_argument("--steps", type=int, default=3, help="steps after the first")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count (0: the real size)")
    for flag in ("hidden", "vocab", "batch", "seq"):  # smoke runs (tests/integration/test_bench_smoke.py)
        parser.add_argument(f"--{flag}", type=int, default=0, help=f"override the {flag} size (0: the real one)")
    parser.add_argument("--ort-knob", action="append", default=[])
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--copy-weights", action="store_true",
                        help="orttrainer keeps its own copy of the weights (the behaviour before the module's "
                             "parameters were shared)")
    parser.add_argument("--env", action="append", default=[],
                        help="KEY=VALUE for the children's environment, e.g. MALLOC_ARENA_MAX=2")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--diagnose", action="store_true", help="after the first step: smaps and malloc_trim")
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="JSON path (default bench/results/real_size-<host kind>-<date>.json)")
    args = parser.parse_args()
    if args.child:
        return child(args)
    results = []
    for system in args.systems.split(","):
        cmd = [sys.executable, "-m", "bench.train_bench.real_size", "--child", "--system", system, "--model", args.model,
               "--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
               "--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq)]
        if args.diagnose:
            cmd.append("--diagnose")
        if args.copy_weights:
            cmd.append("--copy-weights")
        for knob in args.ort_knob:
            cmd += ["--ort-knob", knob]
        env = dict(os.environ, **dict(e.split("=", 1) for e in args.env))
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{system} child failed (rc {out.returncode})")
        r = json.loads(lines[0][7:])
        results.append(r)
        steps = sorted(r["step_s"])
        median = steps[len(steps) // 2] if steps else float("nan")
        r["tokens_per_s"] = r["tokens_per_step"] / median if steps else None
        print(f"{args.model:5s} {system:8s} peak {r['peak_mb']:6.0f} MB  start-up peak {r['startup_peak_mb']:6.0f} MB  "
              f"steady peak {r['steady_peak_mb'] or float('nan'):6.0f} MB  first step {r['first_step_s']:6.1f} s  "
              f"median step {median:6.2f} s ({r['tokens_per_s'] or float('nan'):5.0f} tokens/s)  losses "
              f"{' '.join(f'{x:.4f}' for x in r['losses'])}  {' '.join(args.ort_knob) if system == 'ort' else ''}",
              flush=True)
        for line in out.stdout.splitlines():
            if line.startswith("DIAG"):
                print("   ", line)
        for phase, v in r["phases"].items():
            print(f"    {phase:22s} rss {v['rss_mb']:6.0f} MB  hwm {v['hwm_mb']:6.0f} MB  malloc heap "
                  f"{v['heap_mb']:6.0f} (used {v['used_mb']:6.0f}, free {v['free_mb']:6.0f})  mmapped "
                  f"{v['mmapped_mb']:6.0f} MB")
    from .host import host_facts, host_line, result_path  # CPU model and flags, affinity, quota, threads
    facts = host_facts()
    host = {"cpus": os.cpu_count(), "load": os.getloadavg(), "uname": " ".join(os.uname()), "facts": facts,
            "line": host_line(facts)}
    print(f"# host: {host['line']}; load average {' '.join(f'{x:.1f}' for x in host['load'])}")
    path = args.out or result_path("real_size", facts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"model": args.model, "layers": args.layers, "steps": args.steps, "host": host,
                   "sizes": {k: getattr(args, k) for k in ("hidden", "vocab", "batch", "seq")},
                   "command": " ".join(sys.argv), "env": args.env, "results": results}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
