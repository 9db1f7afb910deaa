"""Why a run stops early (a bad recipe is recipe.RecipeError): one line each, printed by the CLI."""


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, a file that cannot be written); exit status 1."""


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written (e.g. a full disk); older checkpoints are untouched."""
