"""`orttrainer config validate|print RECIPE.yaml`: check a recipe, or show it fully resolved.

    orttrainer config validate recipes/bert-pretrain-tiny.yaml   # also the files and folders it names
    orttrainer config print recipes/bert-pretrain-tiny.yaml --set run.max_steps=10

`print` writes the recipe as `orttrainer train` would run it: every default filled in (options,
optimizer and scheduler arguments, output folder). Problems: one line each on stderr, exit status 2.
"""

import sys

from orttrainer.cli.train import add_set_argument, error


def register(subparsers):
    parser = subparsers.add_parser("config", help="validate or print a recipe",
                                   description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="config_command", metavar="ACTION")
    commands.required = True
    for name, func, text in (("validate", _validate, "check a recipe; exit status 2 if it is invalid"),
                             ("print", _print, "print the fully resolved recipe (defaults filled in)")):
        p = commands.add_parser(name, help=text, description=text)
        p.add_argument("recipe", metavar="RECIPE.yaml")
        add_set_argument(p)
        p.add_argument("--output-dir", metavar="DIR", help="overrides run.output_dir")
        if name == "validate":
            p.add_argument("--schema-only", action="store_true",
                           help="check the recipe alone, not the files and folders it names (e.g. before "
                                "the run whose checkpoint it starts from exists)")
        p.set_defaults(func=func)


def _load(args):
    from orttrainer.run.recipe.spec import load_recipe

    return load_recipe(args.recipe, args.overrides, args.output_dir)


def _validate(args):
    from orttrainer.run.preflight import preflight
    from orttrainer.run.recipe.spec import RecipeError

    try:
        recipe = _load(args)
        # The files, folders and checkpoints it names, as train checks them; notes such as a run too
        # large for this machine (train refuses it here) are shown, not errors.
        notes = [] if args.schema_only else preflight(recipe)
    except RecipeError as exc:
        return error("config", str(exc).splitlines())
    t = recipe.trainer
    scheduler = t["lr_scheduler"]["name"] if t["lr_scheduler"] else "constant lr"
    print(f"{args.recipe}: valid ({recipe.kind}, {t['optimizer']['name']} + {scheduler}, "
          f"{recipe.run.max_steps} steps of {recipe.data.batch_size} x "
          f"{t['batch']['gradient_accumulation_steps']} sequences of {recipe.data.seq_length}, "
          f"output {recipe.run.output_dir})")
    for note in notes:
        print(f"{args.recipe}: note: {note}")
    return 0


def _print(args):
    from orttrainer.run.recipe.spec import RecipeError

    try:
        recipe = _load(args)
    except RecipeError as exc:
        return error("config", str(exc).splitlines())
    sys.stdout.write(f"# {args.recipe}, fully resolved\n")
    sys.stdout.write(recipe.to_yaml())
    return 0
