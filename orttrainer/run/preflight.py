"""The checks of a recipe against this machine that need no data built: what `orttrainer config
validate` runs after the schema, so that a recipe it passes is not then refused by `train` for a
missing file, a damaged checkpoint or an unwritable folder. A run too large for this machine's memory
is a note, not a problem: validating a cluster's recipe on a laptop is what `validate` is for
(`train` refuses it here).

What needs the data built (vocabulary of a tokenizer trained on the corpus, number of examples
against data.batch_size) is left to `train`.
"""

import os

from orttrainer.run.recipe.spec import RecipeError, check_paths


def preflight(recipe):
    """RecipeError with one line per problem found; else the notes (lines) worth showing. Nothing is written."""
    problems = []
    for check in (check_paths, _weight_sources, _data_files, _tokenizer):
        try:
            check(recipe)
        except RecipeError as exc:
            problems += exc.lines
    if problems:
        raise RecipeError(problems)
    return [line for line in (_memory(recipe),) if line]


def _weight_sources(recipe):
    from orttrainer.run import hf_models as models

    if recipe.model.from_:
        models.weight_source(recipe.model.from_, "model.from")
    if recipe.run.init_from:
        source = models.weight_source(recipe.run.init_from, "run.init_from")
        if source.kind != "checkpoint":
            raise RecipeError(f"run.init_from: {recipe.run.init_from} is a Hugging Face folder; run.init_from "
                              "continues an orttrainer run (optimizer state, step count): use model.from")


def _data_files(recipe):
    data = recipe.data
    problems = []
    if data.path:
        if not os.path.exists(data.path):
            problems.append(f"data.path: {data.path} does not exist")
    else:
        corpus = [data.corpus] if isinstance(data.corpus, str) else list(data.corpus)
        if corpus != ["stdlib"] or os.path.exists("stdlib"):
            from orttrainer.run.data.common import DataError
            from orttrainer.run.data.sources import expand_corpus

            for entry in corpus:  # files, folders of .txt, globs, saved datasets
                try:
                    expand_corpus(entry, what="")
                except DataError as exc:
                    problems.append(f"data.corpus: {exc}")
    if problems:
        raise RecipeError(problems)


def _tokenizer(recipe):
    """A given tokenizer must load, and fit in the model's vocabulary when the recipe sets one."""
    given = recipe.data.tokenizer
    if not given:
        return
    from orttrainer.run.data.common import DataError
    from orttrainer.run.data.tokenizer import load_tokenizer

    try:
        size = load_tokenizer(given).get_vocab_size()
    except DataError as exc:
        raise RecipeError(f"data.tokenizer: {exc}") from None
    vocab = recipe.model.config.get("vocab_size")
    if isinstance(vocab, int) and vocab < size:
        raise RecipeError(f"model.config.vocab_size: got {vocab}; the tokenizer has {size} tokens, so it must "
                          "be at least that")


def _memory(recipe):
    from orttrainer.run import memory_estimate as memory

    world = recipe.trainer["distributed"]["world_size"]
    found = memory.shortfall(recipe, memory.processes_on_this_machine(world))
    return found and f"{found}: `orttrainer train` refuses to start it here; {memory.ADVICE}"
