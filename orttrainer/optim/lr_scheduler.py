"""Learning-rate schedulers (docs/legacy-api.md §1.6), after HuggingFace's warm-up schedules.

The trainer calls `_step(train_step_info)` before each update; the learning rate is
`lr0 * factor(s)` with `lr0 = train_step_info.optimizer_config.lr` and
`s = train_step_info.optimization_step` (0-based). A warm-up of `W = warmup * total_steps` steps
raises the factor linearly from 0 to 1, then each scheduler decays it its own way.
"""

import math


class _LRScheduler:
    r"""Base class of learning-rate schedulers: subclasses implement `get_lr`.

    Only one learning rate (the default one) is supported, so `get_lr` returns a one-element list.
    """

    def __init__(self):
        self._last_lr = []

    def __repr__(self):
        public = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({public})"

    def _step(self, train_step_info):
        r"""Computes, remembers and returns the learning rate for the coming update."""
        new_lr = self.get_lr(train_step_info)
        self._last_lr = new_lr
        return new_lr

    def get_lr(self, train_step_info):
        r"""Returns `[lr]` for `train_step_info` (a :py:class:`.TrainStepInfo`)."""
        raise NotImplementedError

    def get_last_lr(self):
        r"""The last learning rate computed by :py:meth:`_step` (`[]` before the first step)."""
        return self._last_lr

    def state_dict(self):
        r"""The scheduler's mutable state, for checkpoints."""
        return {"last_lr": [float(lr) for lr in self._last_lr]}

    def load_state_dict(self, state_dict):
        r"""Restores what :py:meth:`state_dict` returned (lists or arrays, e.g. read back from HDF5)."""
        self._last_lr = [float(lr) for lr in state_dict["last_lr"]]


class _WarmupLRScheduler(_LRScheduler):
    """Shared argument checks and the linear warm-up of the four built-in schedulers."""

    def __init__(self, total_steps, warmup=0.002):
        super().__init__()
        assert (
            isinstance(total_steps, int) and not isinstance(total_steps, bool) and total_steps > 0
        ), f"total_steps must be a strict positive number, got {total_steps!r}"
        assert (
            isinstance(warmup, float) and 0 <= warmup < 1
        ), f"warmup must be a float in [0, 1), got {warmup!r}"
        self.total_steps = total_steps
        self.warmup = warmup
        self._num_warmup_steps = warmup * total_steps

    def _warmup_factor(self, step):
        return float(step) / float(max(1, self._num_warmup_steps))

    def _factor(self, step, lr0):
        raise NotImplementedError

    def get_lr(self, train_step_info):
        lr0 = train_step_info.optimizer_config.lr
        step = train_step_info.optimization_step
        if step < self._num_warmup_steps:
            return [lr0 * self._warmup_factor(step)]
        return [lr0 * self._factor(step, lr0)]


class ConstantWarmupLRScheduler(_WarmupLRScheduler):
    r"""Linear warm-up, then the initial learning rate.

    Args:
        total_steps (int): number of optimization steps of the run.
        warmup (float, default is 0.002): fraction of `total_steps` spent warming up, in [0, 1).
    """

    def _factor(self, step, lr0):
        return 1.0


class CosineWarmupLRScheduler(_WarmupLRScheduler):
    r"""Linear warm-up, then a cosine decay: `max(0, 0.5 * (1 + cos(pi * cycles * 2 * progress)))`.

    Args:
        total_steps (int): number of optimization steps of the run.
        cycles (float, default is 0.5): number of cosine waves after warm-up (0.5: from 1 down to 0).
        warmup (float, default is 0.002): fraction of `total_steps` spent warming up, in [0, 1).
    """

    def __init__(self, total_steps, cycles=0.5, warmup=0.002):
        super().__init__(total_steps, warmup)
        assert isinstance(cycles, float) and cycles > 0, f"cycles must be a positive float, got {cycles!r}"
        self.cycles = cycles

    def _factor(self, step, lr0):
        progress = float(step - self._num_warmup_steps) / float(
            max(1, self.total_steps - self._num_warmup_steps)
        )
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.cycles * 2.0 * progress)))


class LinearWarmupLRScheduler(_WarmupLRScheduler):
    r"""Linear warm-up, then a linear decay to 0 at `total_steps`.

    Args:
        total_steps (int): number of optimization steps of the run.
        warmup (float, default is 0.002): fraction of `total_steps` spent warming up, in [0, 1).
    """

    def _factor(self, step, lr0):
        return max(
            0.0, float(self.total_steps - step) / float(max(1, self.total_steps - self._num_warmup_steps))
        )


class PolyWarmupLRScheduler(_WarmupLRScheduler):
    r"""Linear warm-up, then a polynomial decay from the initial learning rate to `lr_end`.

    After warm-up: `lr = (lr0 - lr_end) * (1 - (s - W) / (T - W)) ** power + lr_end`, and `lr_end`
    once `s > total_steps`.

    Args:
        total_steps (int): number of optimization steps of the run.
        lr_end (float, default is 1e-7): final learning rate; must be below the optimizer's lr.
        power (float, default is 1.0): polynomial power.
        warmup (float, default is 0.002): fraction of `total_steps` spent warming up, in [0, 1).

    Raises:
        ValueError: from `get_lr`, when `lr_end` is not smaller than the optimizer's lr.
    """

    def __init__(self, total_steps, lr_end=1e-7, power=1.0, warmup=0.002):
        super().__init__(total_steps, warmup)
        assert isinstance(lr_end, float) and lr_end >= 0, f"lr_end must be a positive float, got {lr_end!r}"
        assert isinstance(power, float) and power >= 0, f"power must be a positive float, got {power!r}"
        self.lr_end = lr_end
        self.power = power

    def get_lr(self, train_step_info):
        lr0 = train_step_info.optimizer_config.lr
        if not lr0 > self.lr_end:
            raise ValueError(
                f"PolyWarmupLRScheduler: lr_end ({self.lr_end}) must be smaller than the initial lr ({lr0})"
            )
        return super().get_lr(train_step_info)

    def _factor(self, step, lr0):
        if step > self.total_steps:
            return self.lr_end / lr0
        decay_steps = self.total_steps - self._num_warmup_steps
        pct_remaining = 1 - (step - self._num_warmup_steps) / decay_steps
        return ((lr0 - self.lr_end) * pct_remaining**self.power + self.lr_end) / lr0
