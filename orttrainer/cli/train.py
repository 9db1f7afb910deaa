"""`orttrainer train RECIPE.yaml`: train what a recipe describes (see docs/recipes.md).

    orttrainer train recipes/bert-pretrain-tiny.yaml
    orttrainer train RECIPE.yaml --set run.max_steps=50 --set data.batch_size=8
    orttrainer train RECIPE.yaml --resume auto      # continue from the newest complete checkpoint
    orttrainer train RECIPE.yaml --nproc 2          # data parallel on 2 processes (starts torchrun)

Expected problems (bad recipe, missing data or checkpoint, a folder another run uses) print one line
per problem on stderr and exit with status 2; training that cannot go on (a non-finite loss, a
checkpoint that cannot be written) exits with status 1 and says how to resume. Ctrl-C saves a
checkpoint and exits with status 130, SIGTERM (a scheduler's preemption) with status 143.
"""

EXAMPLES = """examples:
  orttrainer train recipes/bert-pretrain-tiny.yaml
  orttrainer train recipes/gpt2-pretrain-tiny.yaml --set run.max_steps=50 --set data.batch_size=4
  orttrainer train recipes/bert-pretrain-tiny.yaml --resume auto        # after Ctrl-C, SIGTERM or a crash
  orttrainer train recipes/bert-pretrain-tiny.yaml --resume runs/bert-pretrain-tiny/checkpoint-100
  orttrainer train recipes/bert-pretrain-tiny.yaml --output-dir runs/try2 --nproc 2
  orttrainer train recipes/bert-pretrain-tiny.yaml --nproc 2 --max-restarts 3   # a failed rank: restart, resume

exit status: 0 done, 1 training failed, 2 bad recipe or command line, 130 Ctrl-C, 143 SIGTERM
(130 and 143: a checkpoint was saved; continue with --resume auto). Keys: docs/recipes.md
"""

import argparse
import os
import signal
import sys


def register(subparsers):
    parser = subparsers.add_parser("train", help="train from a recipe (YAML)",
                                   description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", metavar="RECIPE.yaml")
    add_set_argument(parser)
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="'auto': continue from the newest complete checkpoint in the output folder "
                             "(start fresh if there is none); PATH: a checkpoint-N folder, checkpoint file "
                             "or run folder")
    parser.add_argument("--output-dir", metavar="DIR", help="overrides run.output_dir")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="train on N processes of this machine (data parallel, or ZeRO-1 with "
                             "trainer.distributed.deepspeed_zero_optimization.stage=1): starts "
                             "`torchrun --standalone --nproc_per_node=N -m orttrainer train ...`; for several "
                             "machines run torchrun yourself (docs/distributed.md)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="with --nproc: torchrun restarts the ranks up to K times when one of them fails "
                             "(crash, SIGKILL); each restart resumes from the newest complete checkpoint")
    parser.set_defaults(func=run)


def add_set_argument(parser):
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override one recipe key (the value is read as YAML); repeatable")


def error(command, lines):
    for line in lines:
        print(f"orttrainer {command}: error: {line}", file=sys.stderr)
    return 2


def _torchrun(args, argv):
    """Run this command under torchrun's agent, one process per rank; returns the job's exit status.

    The agent runs in this process (torch.distributed.run's own entry point), so a Ctrl-C or SIGTERM,
    which it forwards to every rank (they save and exit), ends the command with the ranks' status
    instead of the agent's traceback.
    """
    if "WORLD_SIZE" in os.environ:
        print("orttrainer train: error: --nproc inside a torchrun job; drop --nproc (torchrun already "
              "started the processes)", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from orttrainer.run.ranks import LAUNCHER_PID_ENV

    rest = []
    skip = False
    for arg in argv:  # the same command without --nproc
        if skip:
            skip = False
        elif arg in ("--nproc", "--max-restarts"):
            skip = True
        elif not arg.startswith(("--nproc=", "--max-restarts=")):
            rest.append(arg)
    launch = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={args.nproc}",
                                           f"--max-restarts={args.max_restarts}", "-m", "orttrainer", *rest])
    # The ranks inherit it and die with this process (orttrainer.run.ranks.die_with_launcher).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        torchrun(launch)
    except SignalException as exc:  # the ranks have saved (or were stopped after torchrun's grace period)
        return _stopped_by(int(exc.sigval), "this command")
    except ChildFailedError as exc:
        codes = sorted({failure.exitcode for failure in exc.failures.values()})
        first = next(iter(exc.failures.values()))
        # A rank still closing when another exited gets torchrun's own stop signal (-15, later -9).
        own = [code for code in codes if code not in (-signal.SIGTERM, -signal.SIGKILL)] or codes
        first = next((f for f in exc.failures.values() if f.exitcode in own), first)
        for signum in (signal.SIGTERM, signal.SIGINT):
            if own == [128 + signum]:  # every rank stopped on the signal one of them received
                return _stopped_by(signum, "a rank")
        print(f"orttrainer train: a rank exited with status {', '.join(map(str, codes))} "
              f"(rank {first.local_rank}; its error is printed above)", file=sys.stderr)
        return own[0] if own and own[0] > 0 else 1
    return 0


def _stopped_by(signum, who):
    name = signal.Signals(signum).name
    print(f"orttrainer train: stopped by {name} (sent to {who}); exit status {128 + signum}", file=sys.stderr)
    return 128 + signum


def run(args):
    from orttrainer.run.recipe.spec import RecipeError, load_recipe

    if args.nproc < 1:
        return error("train", [f"--nproc: got {args.nproc}; expected 1 or more processes"])
    if args.max_restarts < 0 or (args.max_restarts and args.nproc == 1):
        return error("train", [f"--max-restarts: got {args.max_restarts}; expected 0 or more, with --nproc N "
                               "(under torchrun yourself use torchrun's --max-restarts)"])
    if "WORLD_SIZE" in os.environ:
        from orttrainer.run.ranks import die_with_launcher

        die_with_launcher()

    try:
        recipe = load_recipe(args.recipe, args.overrides, args.output_dir)
        from orttrainer.run import memory_estimate as memory

        memory.check(recipe, memory.processes_on_this_machine(args.nproc))  # before building anything
    except RecipeError as exc:
        return error("train", str(exc).splitlines())
    if args.nproc > 1:
        return _torchrun(args, args.argv)

    from orttrainer.run.checkpointer import resume_command
    from orttrainer.run.errors import TrainingError
    from orttrainer.run.loop import train

    command = resume_command(args.recipe, args.overrides, args.output_dir,
                             nproc=int(os.environ.get("WORLD_SIZE", "1")))
    try:
        return train(recipe, resume=args.resume, resume_command=command)
    except RecipeError as exc:
        return error("train", str(exc).splitlines())
    except TrainingError as exc:
        print(f"orttrainer train: {exc}", file=sys.stderr)
        return 1
