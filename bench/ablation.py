"""Ablation of the engine's graph rewrites on a benchmark model: each variant switches one off.

    python bench/ablation.py [--model gpt|bert] [--steps 12]

Variants train copies of the same model on the same batch, interleaved step by step (drift cancels);
prints the median step time of each and the median over rounds of (variant − shipped) in the same
round, which resolves differences of ~1% that the medians alone do not on this shared machine.
The numbers behind docs/performance.md's optimisation log.
"""

import argparse
import contextlib
import copy
import statistics
import time
from unittest import mock

import torch

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine.graph import training_graph  # the rewrites are patched where it looks them up

from models import BertSize, BertWorkload, GPTWorkload  # bench/models.py


def keep_as_exported(model, *unused):
    """Stands in for a rewrite: the graph stays as the exporter (or the gradient builder) wrote it."""
    return []


VARIANTS = {
    "engine as shipped": {},
    "without LayerNorm fusion": {"fuse_layer_norm": keep_as_exported},
    "without loss decomposition (fused SCE kernel)": {"decompose_softmax_cross_entropy": keep_as_exported},
    "without fused loss gradient (autodiff of exp-sum)": {"fuse_cross_entropy_gradient": keep_as_exported},
    "without tall LM head as Gemm (transposed table)": {"tall_weight_product_as_gemm": keep_as_exported},
    "without small-table embeddings as one-hot MatMul": {"small_embedding_as_matmul": keep_as_exported},
    "without contrib Gelu": {"contrib_ops": False},
    "without GELU gradient by torch (GeluGrad kernel)": {"gelu_gradient_in_torch": keep_as_exported},
}


def build(workload, model, batch, patches):
    # No export cache: it would serve the shipped graph to a variant (the patches are not in its key).
    options = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
    if patches.get("contrib_ops") is False:
        options["_internal_use"] = {"enable_onnx_contrib_ops": False}
    rewrites = {k: v for k, v in patches.items() if k != "contrib_ops"}
    with mock.patch.multiple(training_graph, **rewrites) if rewrites else contextlib.nullcontext():
        module, model_desc, loss_fn = workload.ort_trainer_args(copy.deepcopy(model))
        trainer = ORTTrainer(module, model_desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn,
                             options=ORTTrainerOptions(options))
        trainer.train_step(*batch)  # export + session happen here, under the patch
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "bert"], default="gpt")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    workload = GPTWorkload() if args.model == "gpt" else BertWorkload(batch=8, seq=128, size=BertSize())
    model = workload.make_model()
    batch = workload.batches(1)[0]
    trainers = {name: build(workload, model, batch, patches) for name, patches in VARIANTS.items()}
    times = {name: [] for name in trainers}
    for _ in range(2):  # warm-up
        for trainer in trainers.values():
            trainer.train_step(*batch)
    names = list(trainers)
    for round_ in range(args.steps):
        # Rotate the order every round, so no variant always runs right after the same neighbour.
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            trainers[name].train_step(*batch)
            times[name].append(time.perf_counter() - start)
    shipped = times[names[0]]
    print(f"{args.model} (bench/models.py) batch 8 x seq 128, Adam; {args.steps} interleaved rounds")
    print(f"  {'variant':52s} {'median step':>11s}   {'paired: variant - shipped (median over rounds)':s}")
    for name, values in times.items():
        paired = statistics.median(v - s for v, s in zip(values, shipped))
        print(f"  {name:52s} {statistics.median(values):9.3f} s   {paired * 1e3:+8.1f} ms")

if __name__ == "__main__":
    main()
