"""Loss scalers for mixed-precision training (docs/legacy-api.md §1.7, final version).

The trainer multiplies the loss by `loss_scale` (fed to the graph as an input) so that small fp16
gradients do not underflow, and calls `update(train_step_info)` after each optimizer step with
`train_step_info.all_finite` telling whether the scaled gradients overflowed.
"""

import warnings

AT_MIN_LOSS_SCALE = ("skip", "warn", "raise")


def _is_positive_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


class LossScaler:
    r"""Base class of loss-scaling strategies; subclasses implement :py:meth:`update`.

    Args:
        loss_scale (float): initial (and :py:meth:`reset`) loss scale, a positive number.
    """

    def __init__(self, loss_scale):
        assert _is_positive_number(loss_scale), f"'loss_scale' must be a positive number, got {loss_scale!r}"
        self._input_name = None
        self._loss_scale = float(loss_scale)
        self._initial_loss_scale = float(loss_scale)

    @property
    def input_name(self):
        """Name of the graph input the loss scale is fed to (set by the trainer)."""
        return self._input_name

    @input_name.setter
    def input_name(self, input_name):
        assert isinstance(input_name, str), "'input_name' must be a string"
        assert input_name, "'input_name' cannot be empty"
        self._input_name = input_name

    @property
    def loss_scale(self):
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, loss_scale):
        assert _is_positive_number(loss_scale), f"'loss_scale' must be a positive number, got {loss_scale!r}"
        self._loss_scale = float(loss_scale)

    def __repr__(self):
        public = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}(loss_scale={self._loss_scale!r}{', ' if public else ''}{public})"

    def reset(self):
        r"""Restores the initial loss scale."""
        self.loss_scale = self._initial_loss_scale

    def update(self, train_step_info):
        r"""Updates the loss scale after a step (`train_step_info.all_finite`) and returns it."""
        raise NotImplementedError

    def state_dict(self):
        r"""The scaler's mutable state, so a resumed run continues with the same scale."""
        return {"loss_scale": self._loss_scale}

    def load_state_dict(self, state_dict):
        r"""Restores what :py:meth:`state_dict` returned (numpy scalars, e.g. from HDF5, are accepted)."""
        self.loss_scale = float(state_dict["loss_scale"])


class DynamicLossScaler(LossScaler):
    r"""Doubles the scale after `up_scale_window` finite steps in a row, halves it on overflow.

    Args:
        automatic_update (bool, default is True): when False, :py:meth:`update` leaves the scale
            unchanged (static loss scaling).
        loss_scale (float, default is 2**16): initial loss scale.
        up_scale_window (int, default is 2000): finite steps in a row before the scale doubles.
        min_loss_scale (float, default is 1.0): the scale never goes below this.
        max_loss_scale (float, default is 2**24): the scale never goes above this.
        hysteresis (int, default is 1): overflows tolerated before the scale halves. The scale halves
            at the `hysteresis`-th overflow since it last changed (finite steps in between do not
            reset the count; halving or doubling does). 1 halves on every overflow (legacy).
        at_min_loss_scale (str, default is 'skip'): what a halving does when the scale is already at
            `min_loss_scale`: 'skip' keeps the minimum and training skips the step (legacy);
            'warn' does the same with a warning; 'raise' raises RuntimeError (after the trainer has
            discarded the step), since a scale that cannot go lower will not cure the overflow.
    """

    def __init__(
        self,
        automatic_update=True,
        loss_scale=float(1 << 16),
        up_scale_window=2000,
        min_loss_scale=1.0,
        max_loss_scale=float(1 << 24),
        hysteresis=1,
        at_min_loss_scale="skip",
    ):
        super().__init__(loss_scale)
        assert isinstance(automatic_update, bool), "'automatic_update' must be a bool"
        assert (
            isinstance(up_scale_window, int) and not isinstance(up_scale_window, bool) and up_scale_window > 0
        ), f"'up_scale_window' must be a positive int, got {up_scale_window!r}"
        assert _is_positive_number(
            min_loss_scale
        ), f"'min_loss_scale' must be a positive number, got {min_loss_scale!r}"
        assert _is_positive_number(
            max_loss_scale
        ), f"'max_loss_scale' must be a positive number, got {max_loss_scale!r}"
        assert (
            min_loss_scale <= max_loss_scale
        ), f"'min_loss_scale' ({min_loss_scale}) must not exceed 'max_loss_scale' ({max_loss_scale})"
        assert isinstance(hysteresis, int) and not isinstance(hysteresis, bool) and hysteresis > 0, (
            f"'hysteresis' must be a positive int (overflows tolerated before halving), got {hysteresis!r}"
        )
        assert at_min_loss_scale in AT_MIN_LOSS_SCALE, (
            f"'at_min_loss_scale' must be one of {AT_MIN_LOSS_SCALE}, got {at_min_loss_scale!r}"
        )
        self.automatic_update = automatic_update
        self.up_scale_window = up_scale_window
        self.min_loss_scale = float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self.hysteresis = hysteresis
        self.at_min_loss_scale = at_min_loss_scale
        self._stable_steps_count = 0
        self._overflow_count = 0  # overflows since the scale last changed (hysteresis)

    def reset(self):
        super().reset()
        self._stable_steps_count = 0
        self._overflow_count = 0

    def update(self, train_step_info):
        if not self.automatic_update:
            return self.loss_scale
        if train_step_info.all_finite:
            self._stable_steps_count += 1
            if self._stable_steps_count >= self.up_scale_window:
                self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2)
                self._stable_steps_count = 0
                self._overflow_count = 0
            return self.loss_scale
        self._stable_steps_count = 0
        self._overflow_count += 1
        if self._overflow_count < self.hysteresis:
            return self.loss_scale
        self._overflow_count = 0
        if self.loss_scale <= self.min_loss_scale:
            self._overflow_at_minimum()
        self.loss_scale = max(self.min_loss_scale, self.loss_scale / 2)
        return self.loss_scale

    def _overflow_at_minimum(self):
        if self.at_min_loss_scale == "skip":
            return
        message = (f"the gradients overflowed with the loss scale already at min_loss_scale "
                   f"({self.min_loss_scale:g}); the step was skipped. Lowering the scale cannot cure this: "
                   "look for NaN/inf in the data or the loss, or a learning rate that makes training diverge "
                   "(or lower DynamicLossScaler's min_loss_scale).")
        if self.at_min_loss_scale == "raise":
            raise RuntimeError("Loss scaling failed: " + message)
        warnings.warn("DynamicLossScaler: " + message, RuntimeWarning, stacklevel=3)

    def state_dict(self):
        state = {**super().state_dict(), "stable_steps_count": self._stable_steps_count}
        if self.hysteresis > 1:  # the legacy layout otherwise
            state["overflow_count"] = self._overflow_count
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._stable_steps_count = int(state_dict["stable_steps_count"])
        self._overflow_count = int(state_dict.get("overflow_count", 0))
