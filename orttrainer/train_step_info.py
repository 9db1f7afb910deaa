"""TrainStepInfo: the trainer's step counters, handed to LR schedulers and loss scalers (§1.4)."""

from orttrainer.optim.config import _OptimizerConfig


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class TrainStepInfo:
    r"""Runtime information of the current training step.

    :py:meth:`ORTTrainer.train_step` keeps one instance up to date and passes it to
    :py:meth:`._LRScheduler.get_lr` and :py:meth:`.LossScaler.update`.

    Args:
        optimizer_config (optim._OptimizerConfig): the trainer's optimizer config (schedulers read `lr`).
        all_finite (bool, default is True): whether the last mixed-precision step had finite gradients
            (after a real step the trainer stores a one-element bool tensor here).
        fetches (list of str, default is []): output names train_step/eval_step return; [] means all.
        optimization_step (int, default is 0): optimizer updates done so far (drives LR schedulers).
        step (int, default is 0): train_step calls so far (drives gradient accumulation).
    """

    def __init__(
        self, optimizer_config, all_finite=True, fetches=[], optimization_step=0, step=0
    ):  # noqa: B006
        assert isinstance(
            optimizer_config, _OptimizerConfig
        ), "optimizer_config must be a optim._OptimizerConfig"
        assert isinstance(all_finite, bool), "all_finite must be a bool"
        assert isinstance(fetches, list) and all(
            isinstance(item, str) for item in fetches
        ), "fetches must be a list of str"
        assert _is_count(optimization_step), "optimization_step must be a positive int"
        assert _is_count(step), "step must be a positive int"

        self.optimizer_config = optimizer_config
        self.all_finite = all_finite
        self.fetches = list(fetches)
        self.optimization_step = optimization_step
        self.step = step


class MixedPrecisionCounters:
    r"""Mixed-precision health counters, kept by the trainer beside its TrainStepInfo
    (`ORTTrainer.mixed_precision_counters`), saved in state_dict / checkpoints and logged by recipes.

    Attributes:
        skipped_steps (int): optimizer steps discarded because the gradients were not finite
            (the weights and optimizer state were left unchanged, the loss scale adapted).
        nan_steps (int): train_step calls whose loss came out NaN or infinite: the forward pass itself
            was not finite, which loss scaling (it acts on the backward) cannot cure.
    """

    KEYS = ("skipped_steps", "nan_steps")

    def __init__(self, skipped_steps=0, nan_steps=0):
        self.skipped_steps = skipped_steps
        self.nan_steps = nan_steps

    def state_dict(self):
        return {key: int(getattr(self, key)) for key in self.KEYS}

    def load_state_dict(self, state):
        for key in self.KEYS:
            setattr(self, key, int(state.get(key, 0)))

    def __repr__(self):
        return f"MixedPrecisionCounters(skipped_steps={self.skipped_steps}, nan_steps={self.nan_steps})"
