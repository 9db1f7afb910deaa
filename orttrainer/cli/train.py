"""`orttrainer train RECIPE.yaml`: train what a recipe describes (see docs/recipes.md).

    orttrainer train recipes/bert-pretrain-tiny.yaml
    orttrainer train RECIPE.yaml --set run.max_steps=50 --set data.batch_size=8
    orttrainer train RECIPE.yaml --resume auto      # continue from the newest complete checkpoint

Expected problems (bad recipe, missing data or checkpoint) print one line per problem on stderr and
exit with status 2; Ctrl-C saves a checkpoint and exits with status 130.
"""

import sys


def register(subparsers):
    parser = subparsers.add_parser("train", help="train from a recipe (YAML)",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", metavar="RECIPE.yaml")
    add_set_argument(parser)
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="'auto': continue from the newest complete checkpoint in the output folder "
                             "(start fresh if there is none); PATH: a checkpoint-N folder, checkpoint file "
                             "or run folder")
    parser.add_argument("--output-dir", metavar="DIR", help="overrides run.output_dir")
    parser.set_defaults(func=run)


def add_set_argument(parser):
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override one recipe key (the value is read as YAML); repeatable")


def error(command, lines):
    for line in lines:
        print(f"orttrainer {command}: error: {line}", file=sys.stderr)
    return 2


def run(args):
    from orttrainer.run.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides, args.output_dir)
    except RecipeError as exc:
        return error("train", str(exc).splitlines())

    from orttrainer.run.checkpointing import resume_command
    from orttrainer.run.loop import TrainingError, train

    command = resume_command(args.recipe, args.overrides, args.output_dir)
    try:
        return train(recipe, resume=args.resume, resume_command=command)
    except RecipeError as exc:
        return error("train", str(exc).splitlines())
    except TrainingError as exc:
        print(f"orttrainer train: {exc}", file=sys.stderr)
        return 1
