"""The README's main job (tiny BERT pretraining) under one CPU-allocator setting, in this process.

    .venv/bin/python bench/main_job_allocators.py default|plain|arena [--steps 60]

default  the trainer's default session options (arena off, each session's own allocators)
plain    the default plus the opt-in process-wide plain allocator (placement.use_plain_cpu_allocator)
arena    the default with the CPU arena on (onnxruntime's own default)

Run each setting in a fresh process (the plain allocator is registered process-wide), from the
repository root, after the main job has built runs/data/; compare the `throughput` lines, and the
user/sys times of `/usr/bin/time -f "%U %S"` (the plain allocator's cost shows as kernel time).
Writes runs/allocators-<setting>/ (replaced on every run).
"""

import argparse
import sys

from orttrainer.cli import main
from orttrainer.placement import device as placement


def patched_defaults(setting):
    make_defaults = placement.default_session_options

    def defaults():
        options = make_defaults()
        if setting == "plain":
            placement.use_plain_cpu_allocator(options)
        elif setting == "arena":
            options.enable_cpu_mem_arena = True
        return options

    return defaults


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("setting", choices=["default", "plain", "arena"])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    placement.default_session_options = patched_defaults(args.setting)
    sys.exit(main(["train", "recipes/bert-pretrain-tiny.yaml", "--set", f"run.max_steps={args.steps}",
                   "--set", f"run.output_dir=runs/allocators-{args.setting}", "--set", "run.overwrite_output_dir=true",
                   "--set", "run.report_to=[]"]))
