"""The `orttrainer` command line: one console script, one module per sub-command.

Each sub-command module exposes `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed namespace; its return value is the exit code).
"""

import argparse
import importlib
import sys

# name -> module under orttrainer.cli; modules are imported lazily so `orttrainer ckpt`
# does not pay for importing the recipe machinery and vice versa.
_SUBCOMMANDS = {
    "train": "train",
    "config": "config",
    "data": "data",
    "ckpt": "ckpt",
    "plot": "plot",
}


def _version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("orttrainer")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "(not installed)"


def build_parser():
    parser = argparse.ArgumentParser(prog="orttrainer", description="Training on ONNX Runtime.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in _SUBCOMMANDS.values():
        try:
            module = importlib.import_module(f"orttrainer.cli.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"orttrainer.cli.{module_name}":
                continue  # sub-command not built yet
            raise
        module.register(sub)
    return parser


def main(argv=None):
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # `train --nproc` re-runs the same command under torchrun
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
