"""Paired A/B of one graph rewrite: the engine as shipped against the engine without that rewrite.

    cd bench && ../.venv/bin/python ab_rewrite.py large_bias_gradient_as_matmul --model bert --rounds 30

Two trainers (copies of the same model) step through the same batches, interleaved, the order
alternating every round. Prints each one's median step and the median over rounds of
(without − with): positive means the rewrite saves time. With only two trainers in the process this
resolves a few milliseconds better than bench/ablation.py; the machine's noise floor is still ~±5 ms.
REWRITE is a function that `orttrainer.engine.graph.training_graph` calls (see bench/ablation.py for how it is
switched off).
"""

import argparse
import statistics
import time

from ablation import build, keep_as_exported  # bench/ablation.py
from models import BertSize, BertWorkload, GPTWorkload  # bench/models.py


def interleaved_step_times(trainers, batches, rounds):
    """{name: [seconds of each measured train_step]}: the trainers step in turn through the batches,
    the order alternating every round, after two warm-up rounds."""
    times = {name: [] for name in trainers}
    for round_ in range(rounds + 2):
        order = list(trainers.items())
        for name, trainer in order if round_ % 2 else reversed(order):
            start = time.perf_counter()
            trainer.train_step(*batches[round_ % len(batches)])
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    return times


def print_paired(title, times, base, other):
    """Medians of both trainers and the paired difference other - base (with its quartiles)."""
    print(title)
    for name, values in times.items():
        print(f"  {name:9s} median {statistics.median(values) * 1e3:7.1f} ms   min {min(values) * 1e3:7.1f} ms")
    paired = [b - a for a, b in zip(times[base], times[other])]
    low, _, high = statistics.quantiles(paired, n=4)
    print(f"  paired median ({other} - {base}): {statistics.median(paired) * 1e3:+.1f} ms"
          f"   quartiles {low * 1e3:+.1f} / {high * 1e3:+.1f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rewrite", help="e.g. fuse_cross_entropy_gradient, small_embedding_as_matmul")
    parser.add_argument("--model", choices=["gpt", "bert"], default="gpt")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    workload = GPTWorkload() if args.model == "gpt" else BertWorkload(batch=8, seq=128, size=BertSize())
    model = workload.make_model()
    batches = workload.batches(4)
    trainers = {"with": build(workload, model, batches[0], {}),
                "without": build(workload, model, batches[0], {args.rewrite: keep_as_exported})}
    times = interleaved_step_times(trainers, batches, args.rounds)
    print_paired(f"{args.model}: {args.rewrite}, {args.rounds} interleaved rounds", times, "with", "without")

if __name__ == "__main__":
    main()
