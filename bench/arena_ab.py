"""Paired A/B of onnxruntime's CPU allocators: the trainer's default session options (arena off, each
session's own allocators) against `--other`:

    plain  the opt-in process-wide plain allocator (`placement.use_plain_cpu_allocator`: no BFC arena
           even with PythonOps in the graph, docs/ort-notes.md)
    arena  the CPU arena on (onnxruntime's default). Not valid in one process: onnxruntime-training
           gives every session the CPU provider of the process's first session (docs/ort-notes.md),
           so both trainers get the same allocator; use provider_arena_ab.py (fresh processes)

    cd bench && ../.venv/bin/python arena_ab.py --model bert --other plain --rounds 12

Two trainers (copies of one model) step through the same batches, interleaved, the order alternating
every round (ab_rewrite.interleaved_step_times). Prints each one's median step and the paired median of
(other - default): positive means the default is faster. Both run in one process, so memory is not
compared here (bench/real_size.py does that, one fresh process per setting)."""

import argparse
import copy


from ab_rewrite import interleaved_step_times, print_paired  # bench/ab_rewrite.py
from models import BertSize, BertWorkload, GPTWorkload  # bench/models.py
from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.placement import device as placement


def build(workload, model, batch, other):
    options = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
    if other:
        session_options = placement.default_session_options()
        if other == "plain":
            placement.use_plain_cpu_allocator(session_options)
        else:
            session_options.enable_cpu_mem_arena = True
        options["session_options"] = session_options
    module, model_desc, loss_fn = workload.ort_trainer_args(copy.deepcopy(model))
    trainer = ORTTrainer(module, model_desc, optim.AdamConfig(lr=1e-4), loss_fn=loss_fn,
                         options=ORTTrainerOptions(options))
    trainer.train_step(*batch)
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "bert"], default="gpt")
    parser.add_argument("--other", choices=["plain", "arena"], default="plain")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    workload = GPTWorkload() if args.model == "gpt" else BertWorkload(batch=8, seq=128, size=BertSize())
    model = workload.make_model()
    batches = workload.batches(4)
    trainers = {"default": build(workload, model, batches[0], None),
                args.other: build(workload, model, batches[0], args.other)}
    times = interleaved_step_times(trainers, batches, args.rounds)
    print_paired(f"{args.model}: CPU allocators, default vs {args.other}, {args.rounds} interleaved rounds",
                 times, "default", args.other)

if __name__ == "__main__":
    main()
