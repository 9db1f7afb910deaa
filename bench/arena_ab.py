"""Paired A/B of onnxruntime's CPU arena: the trainer's default session options against the same with
`enable_cpu_mem_arena = False` (docs/performance.md, optimisation log, issue 20).

    cd bench && ../.venv/bin/python arena_ab.py --model gpt --rounds 30

Two trainers (copies of one model) step through the same batches, interleaved, the order alternating
every round (ab_rewrite.interleaved_step_times). Prints each one's median step and the paired median of
(arena off - arena on): positive means the arena saves time. Both run in one process, so memory is
not compared here (bench/real_size.py does that, one fresh process per setting).
"""

import argparse
import copy

import onnxruntime as ort

from ab_rewrite import interleaved_step_times, print_paired  # bench/ab_rewrite.py
from models import BertSize, BertWorkload, GPTWorkload  # bench/models.py
from orttrainer import ORTTrainer, ORTTrainerOptions, optim


def build(workload, model, batch, arena):
    options = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
    if not arena:
        session_options = ort.SessionOptions()
        session_options.log_severity_level = 3
        session_options.enable_mem_pattern = False  # as the trainer's defaults
        session_options.enable_cpu_mem_arena = False
        options["session_options"] = session_options
    module, model_desc, loss_fn = workload.ort_trainer_args(copy.deepcopy(model))
    trainer = ORTTrainer(module, model_desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn,
                         options=ORTTrainerOptions(options))
    trainer.train_step(*batch)
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "bert"], default="gpt")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    workload = GPTWorkload() if args.model == "gpt" else BertWorkload(batch=8, seq=128, size=BertSize())
    model = workload.make_model()
    batches = workload.batches(4)
    trainers = {"arena on": build(workload, model, batches[0], True),
                "arena off": build(workload, model, batches[0], False)}
    times = interleaved_step_times(trainers, batches, args.rounds)
    print_paired(f"{args.model}: CPU arena, {args.rounds} interleaved rounds", times, "arena on", "arena off")

if __name__ == "__main__":
    main()
