"""Real-size memory and start-up: GPT-2 small and BERT-base (transformers), orttrainer against eager.

    python -m bench.train_bench.real_size --model gpt2|bert [--systems ort,eager[,compile,ort-mixed,eager-bf16,compile-bf16]]
        [--steps 3] [--layers N]

One fresh process per system (this script re-runs itself with --child). Each child builds the model
(fp32, dropout off, eager attention), its batches, imports what its system needs, and takes its
baseline = RSS then. It reports, above that baseline:

- `startup_peak`: VmHWM after the first step (export, gradient graph, session, first step);
- `steady_peak`: VmHWM over the later steps, after resetting the mark (/proc/self/clear_refs);
- `peak`: the whole-process VmHWM at the end (no reset: what a user's machine must have);
- `first_step_s` (construction + first step, export cache off) and the later steps' times.

GPT-2 small: GPT2LMHeadModel(GPT2Config()), 124 M parameters, batch 4 x seq 256, Adam, no clipping.
BERT-base: BertForPreTraining(BertConfig()), batch 8 x seq 128, MLM (15% of tokens) + NSP, Adam.
Timings from a loaded machine are not comparable; memory is. Writes bench/results/real_size-<host kind>-<date>.json.
The diagnosis options of earlier investigations (session knobs, allocator shims, copied weights) are
at commit ce81696; docs/notes/ has what they found.
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


def child(args):
    from .measure import reset_peak_rss as reset_peak  # bench/train_bench/measure.py
    import torch
    model, cfg = make_model(args.model, args.layers, args.hidden, args.vocab, max(256, args.seq))
    batches = make_batches(args.model, cfg, args.steps + 1, args.batch, args.seq)
    gc.collect()
    base = status_kb("VmRSS")
    phases = {}

    def mark(what):
        phases[what] = {"rss_mb": (status_kb("VmRSS") - base) / 1024, "hwm_mb": (status_kb("VmHWM") - base) / 1024,
                        **malloc_mb()}

    mark("baseline")
    started = time.perf_counter()
    bf16 = args.system.endswith("-bf16")
    if args.system in ("ort", "ort-mixed"):
        import onnxruntime as ort
        from orttrainer import ORTTrainer, ORTTrainerOptions, optim
        ort.set_default_logger_severity(3)
        module, desc = loss_module(model, batches)
        opts = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
        if args.system == "ort-mixed":
            opts["mixed_precision"] = {"enabled": True}  # compute_dtype 'auto': bf16 on a CPU with bf16 units
        trainer = ORTTrainer(module, desc, optim.AdamConfig(lr=1e-4), options=ORTTrainerOptions(opts))

        def step(batch):
            return trainer.train_step(*batch.values()).item()
    else:
        target = model if args.system in ("eager", "eager-bf16") else torch.compile(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(batch):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the forward; backward outside
                loss = target(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    losses = [step(batches[0])]
    first = time.perf_counter() - started
    mark("after_first_step")
    startup_peak = (status_kb("VmHWM") - base) / 1024
    resettable = reset_peak()
    times = []
    for batch in batches[1:]:
        t = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - t)
    steady = (status_kb("VmHWM") - base) / 1024 if resettable else None
    mark("end")
    result = {"system": args.system, "baseline_mb": base / 1024, "first_step_s": first, "step_s": times,
              "startup_peak_mb": startup_peak, "steady_peak_mb": steady,
              "peak_mb": max(startup_peak, steady or 0), "losses": losses, "phases": phases,
              "params": sum(p.numel() for p in model.parameters()),
              "tokens_per_step": batches[0]["input_ids"].numel(),
              "torch_threads": torch.get_num_threads(),
              "startup_seconds": dict(trainer.startup_seconds) if args.system.startswith("ort") else None,
              "compute_dtype": str(trainer.compute_dtype) if args.system.startswith("ort") else
              ("torch.bfloat16" if bf16 else "torch.float32"),
              "matmul_kernels": trainer.matmul_kernels if args.system.startswith("ort") else None}
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt2", "bert"], default="gpt2")
    parser.add_argument("--systems", default="ort,eager")
    parser.add_argument("--steps", type=int, default=3, help="steps after the first")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count (0: the real size)")
    for flag in ("hidden", "vocab", "batch", "seq"):  # smoke runs (tests/integration/test_bench_smoke.py)
        parser.add_argument(f"--{flag}", type=int, default=0, help=f"override the {flag} size (0: the real one)")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--env", action="append", default=[],
                        help="KEY=VALUE for the children's environment, e.g. MALLOC_ARENA_MAX=2")
    parser.add_argument("--child", action="store_true")
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
              f"{' '.join(f'{x:.4f}' for x in r['losses'])}",
              flush=True)
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
