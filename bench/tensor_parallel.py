"""Tensor parallel (Megatron, horizontal_parallel_size=2) against one process: step time, and the time
spent inside the f/g all_reduces (wrapped here around megatron._all_reduce in each rank).

    .venv/bin/python bench/tensor_parallel.py [--kind gpt2|bert|bench] [--hidden 256] [--layers 2] [--steps 20]
        [--collectives pythonop|cut|both] [--rounds 2]

Each setting runs in fresh processes, 1 thread per process; the first 3 steps (build, warm-up) are
not timed. Prints the median step time and the share of the step inside the collectives.
--collectives cut: the step cut at the collective points (bench/tp_cut.py) instead of the engine's
PythonOp f/g; both: first checks that the two compute the same losses and weights (rtol 1e-6), then
times them interleaved (pythonop, cut, pythonop, cut, ...: the machine may be shared), with the
load average before each run."""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")


def _worker():
    sys.path.insert(0, TESTS)  # only in the ranks; never bench/ on the path (bench/models.py shadows)
    import tensor_parallel_worker as worker

    return worker


def _timed_all_reduce():
    from orttrainer.engine.parallel import megatron

    original, spent = megatron._all_reduce, [0.0]

    def timed(tensor):
        started = time.perf_counter()
        try:
            return original(tensor)
        finally:
            spent[0] += time.perf_counter() - started

    megatron._all_reduce = timed
    return spent


def _bench_gpt_trainer(worker, rank, world, args):
    """The bench GPT (bench/models.py: blocks qkv -> proj, fc -> out) on the worker's GPT-2 batches.
    bench/models.py is loaded from its file: tests/ is on the path here, and its models.py would shadow."""
    import importlib.util

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    spec = importlib.util.spec_from_file_location("bench_models", os.path.join(os.path.dirname(TESTS), "bench",
                                                                               "models.py"))
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    torch.manual_seed(0)
    model = models.GPT(models.GPTConfig(vocab=worker.VOCAB, hidden=args.hidden, layers=args.layers,
                                        heads=args.heads, max_positions=worker.SEQ))
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", worker.VOCAB])]}
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "distributed": {
        "world_rank": rank, "world_size": world, "local_rank": rank, "horizontal_parallel_size": world}})
    return ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3), loss_fn=models.gpt_loss, options=options)


def _install_cut():
    """bench/tp_cut.py loaded from its file (bench/ is never put on the path: bench/models.py shadows)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tp_cut", os.path.join(os.path.dirname(TESTS), "bench",
                                                                         "tp_cut.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
    return module


def _rank(rank, world, port, args, out, collectives):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    # onnxruntime's intra-op pool: 1 thread per session (intra_op_threads_per_rank shares the cores
    # among LOCAL_WORLD_SIZE ranks); its default, a thread per core, would oversubscribe 2 ranks
    os.environ["LOCAL_WORLD_SIZE"] = str(len(os.sched_getaffinity(0)))
    worker = _worker()
    spent = _timed_all_reduce()
    cut = _install_cut() if collectives == "cut" else None
    if args.kind == "bench":
        trainer = _bench_gpt_trainer(worker, rank, world, args)
    else:
        trainer = worker.trainer(args.kind, "adam", rank, world, world, hidden=args.hidden, layers=args.layers,
                                 heads=args.heads)
    seconds, collective, losses = [], [], []
    for step in range(args.steps + 3):
        before, started = spent[0], time.perf_counter()
        loss = trainer.train_step(*worker.batch("gpt2" if args.kind == "bench" else args.kind, step))
        if step >= 3:
            seconds.append(time.perf_counter() - started)
            collective.append(spent[0] - before)
        losses.append(float(loss[0] if isinstance(loss, (list, tuple)) else loss))
    runtime = trainer._training_session.runtime
    weights = {n: runtime.current(n).clone() for n in runtime.graph.weights}
    segments = cut.segments_of(runtime) if cut else None
    torch.save({"seconds": seconds, "collective": collective, "losses": losses, "weights": weights,
                "segments": segments}, os.path.join(out, f"rank{rank}.pt"))


def run(world, args, collectives="pythonop"):
    import torch.multiprocessing as mp

    sys.path.insert(0, TESTS)
    from distributed_worker import free_port
    sys.path.remove(TESTS)
    out = tempfile.mkdtemp()
    port = free_port()
    context = mp.get_context("spawn")
    processes = [context.Process(target=_rank, args=(r, world, port, args, out, collectives))
                 for r in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(600)
        if p.is_alive():
            p.kill()
            raise TimeoutError("bench rank still running after 600 s")
    return torch.load(os.path.join(out, "rank0.pt"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="gpt2", choices=["gpt2", "bert", "bench"],
                        help="bench: the bench GPT of bench/models.py")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--collectives", default="pythonop", choices=["pythonop", "cut", "both"],
                        help="f/g as PythonOps in the session (the engine), the step cut at them, or both")
    parser.add_argument("--rounds", type=int, default=2, help="with both: pythonop/cut pairs timed")
    args = parser.parse_args()
    if args.collectives == "both":
        return compare(args)
    one, two = run(1, args), run(2, args, args.collectives)
    t1, t2 = statistics.median(one["seconds"]), statistics.median(two["seconds"])
    share = sum(two["collective"]) / sum(two["seconds"])
    print(f"{args.kind} hidden={args.hidden} layers={args.layers}: 1 process {t1 * 1e3:.1f} ms/step, "
          f"2 ranks tensor parallel {t2 * 1e3:.1f} ms/step ({t1 / t2:.2f}x); inside f/g/norm all_reduces "
          f"{share:.0%} of the 2-rank step ({statistics.median(two['collective']) * 1e3:.1f} ms)")
    # Same batches, dropout off: 2 ranks must train like one process (rtol 1e-5 in the tests).
    worst = max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"]))
    print(f"losses 2 ranks vs 1 process over {len(one['losses'])} steps: max relative difference {worst:.1e}"
          + ("" if worst <= 1e-5 else "  ** NOT EQUAL **"))


def _load():
    return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def _weight_mismatches(a, b):
    """(weights not allclose, a note on GPT-2's key biases): the key third of c_attn.bias has an exactly
    zero gradient (softmax ignores a shift of all scores), so its update is Adam's m/sqrt(v) of rounding
    noise -- any change of summation order moves it by ~lr per step. Those are reported, not checked."""
    bad, key, worst = [], [], 0.0
    for name in a:
        x, y = a[name].clone(), b[name].clone()
        if name.endswith("attn.c_attn.bias"):
            third = x.shape[0] // 3
            key.append(float((x[third:2 * third] - y[third:2 * third]).abs().max()))
            x[third:2 * third] = y[third:2 * third] = 0
        worst = max(worst, float((x - y).abs().max()))
        if not torch.allclose(y, x, rtol=1e-6, atol=1e-6):
            bad.append(f"{name} (max |diff| {float((x - y).abs().max()):.1e})")
    note = f" (max |diff| {worst:.1e}" + (f"; key biases, not checked: {max(key):.1e})" if key else ")")
    return bad, note


def compare(args):
    """Same results, then interleaved timings of the PythonOp f/g against the cut step (2 ranks)."""
    print(f"{args.kind} hidden={args.hidden} heads={args.heads} layers={args.layers}, {args.steps} timed "
          "steps "
          "after 3, 1 thread per rank")
    print(f"1 process ({_load()}) ...", flush=True)
    one = statistics.median(run(1, args)["seconds"])
    print(f"  1 process: {one * 1e3:.1f} ms/step")
    times = {"pythonop": [], "cut": []}
    for round_ in range(args.rounds):
        results = {}
        for mode in ("pythonop", "cut"):
            load = _load()
            results[mode] = run(2, args, mode)
            times[mode].append(statistics.median(results[mode]["seconds"]))
            print(f"  round {round_ + 1} {mode:8s} 2 ranks: {times[mode][-1] * 1e3:.1f} ms/step "
                  f"(inside all_reduces {statistics.median(results[mode]['collective']) * 1e3:.1f} ms; "
                  f"{load} before)", flush=True)
        if round_ == 0:
            a, b = results["pythonop"], results["cut"]
            n = len(a["losses"])
            loss_diff = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
            bad, key_bias = _weight_mismatches(a["weights"], b["weights"])
            # the gate is the losses: weights are reported (Adam's m/sqrt(v) turns rounding-level gradient
            # differences on near-zero gradients into ~lr-sized steps; the segments fuse kernels differently)
            ok = loss_diff <= 1e-6
            matched = "all" if not bad else f"not {len(bad)} of {len(a['weights'])}"
            print(f"  check: cut ({b['segments']} [(segments, collectives)]) == pythonop over {n} steps: "
                  f"losses max rel diff {loss_diff:.1e} (rtol 1e-6); weights after them allclose(rtol 1e-6, "
                  f"atol 1e-6): {matched}{key_bias}: "
                  f"{'OK' if ok else 'FAILED'}",
                  flush=True)
            if not ok:
                raise SystemExit("the cut step does not compute what the PythonOp step does")
    pythonop, cut = statistics.median(times["pythonop"]), statistics.median(times["cut"])
    print(f"median over rounds: pythonop {pythonop * 1e3:.1f} ms/step, cut {cut * 1e3:.1f} ms/step "
          f"(cut/pythonop {cut / pythonop:.3f}); 1 process {one * 1e3:.1f} ms/step; {_load()} after")


if __name__ == "__main__":
    main()
