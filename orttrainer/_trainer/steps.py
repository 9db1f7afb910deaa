"""StepAccounting: a trainer's step counters, learning rate, loss scaler and mixed-precision counters.

It owns the TrainStepInfo that ORTTrainer exposes as `_train_step_info` (docs/legacy-api.md §1.4), says
what one train_step feeds the session (update or accumulate, learning rate, gradient and loss scale)
and counts the step once the session has run it. Their state_dict entries are written and loaded
here: checked first, applied only after every other part of a load has been checked.
"""

import contextlib
import signal
import threading
import time

import torch

from orttrainer import _utils
from orttrainer.state import load_checks as _load_checks
from orttrainer.amp import DynamicLossScaler
from orttrainer.train_step_info import MixedPrecisionCounters, TrainStepInfo

# A second Ctrl-C this long after the first one, inside a step, aborts it at once (interrupt.py's rule).
CTRL_C_REPEAT_SECONDS = 1.0
LOSS_SCALER_KEY = "loss_scaler"
MIXED_PRECISION_COUNTERS_KEY = "mixed_precision_counters"


class StepAccounting:
    """Args: the trainer's optim_config, options, model_desc, compute dtype and world size."""

    def __init__(self, optim_config, options, model_desc, compute_dtype, world_size):
        self.optim_config, self.options, self.model_desc = optim_config, options, model_desc
        self.world_size = world_size
        self.info = TrainStepInfo(optim_config)
        mixed = options.mixed_precision
        # The user's scaler object is used (as in the original), but a default one is never written
        # into the user's options.
        self.loss_scaler = (mixed.loss_scaler or DynamicLossScaler()) if mixed.enabled else None
        if compute_dtype == torch.bfloat16 and mixed.loss_scaler is None:
            # bfloat16 has float32's exponent range: gradients do not underflow, no scaling is needed.
            self.loss_scaler = DynamicLossScaler(automatic_update=False, loss_scale=1.0)
        self.counters = MixedPrecisionCounters() if self.loss_scaler is not None else None

    @property
    def accumulation_steps(self):
        return self.options.batch.gradient_accumulation_steps

    @property
    def micro_step(self):
        """Micro-steps done inside the current accumulation window (0 at a window boundary)."""
        return self.info.step % self.accumulation_steps

    # ------------------------------------------------------------------ one train_step
    def next_step(self):
        """What the next train_step feeds the session: {update, lr, gradient_scale, loss_scale}.
        Changes nothing: a step that fails to run is not counted."""
        is_update = (self.info.step + 1) % self.accumulation_steps == 0
        scheduler = self.options.lr_scheduler
        lr = float(self.optim_config.lr) if scheduler is None else float(scheduler._step(self.info)[0])
        loss_scale = float(self.loss_scaler.loss_scale) if self.loss_scaler else 1.0
        # Gradients are summed over micro-steps and ranks: the scale makes them the global batch's mean.
        scale = 1.0 / (self.accumulation_steps * self.world_size * loss_scale)
        return {"update": is_update, "lr": lr, "gradient_scale": scale, "loss_scale": loss_scale}

    def run_counted(self, run, step, fetches):
        """`run()` -> (outputs, all_finite), then `count`, as one: the session updates the weights in
        place, so a KeyboardInterrupt between the two would leave an applied step uncounted."""
        with _ctrl_c_deferred():
            outputs, all_finite = run()
            self.count(step, outputs, fetches, all_finite)
        return outputs

    def count(self, step, outputs, fetches, all_finite):
        """Count a step the session ran (`step`: next_step's dict; `outputs` for `fetches`, [] = all)."""
        info, is_update = self.info, step["update"]
        info.step += 1
        if self.counters is not None:
            self._count_non_finite(outputs, fetches, is_update, all_finite)
        if not is_update:
            return
        if self.loss_scaler is not None:
            info.all_finite = all_finite
            self.loss_scaler.update(info)
            if bool(all_finite.item()):
                info.optimization_step += 1
        else:
            info.optimization_step += 1

    def _count_non_finite(self, outputs, fetches, is_update, all_finite):
        names = list(fetches or [o.name for o in self.model_desc.outputs])
        loss = next((o.name for o in self.model_desc.outputs if o.is_loss), None)
        if loss in names and not bool(torch.isfinite(outputs[names.index(loss)]).all()):
            self.counters.nan_steps += 1
        if is_update and all_finite is not None and not bool(all_finite.item()):
            self.counters.skipped_steps += 1

    # ------------------------------------------------------------------ state_dict
    def check_window_boundary(self, group):
        """Several ranks inside an accumulation window: each holds only its own unreduced part of the
        window's gradients, which no state_dict can carry; a resume from it would silently train a
        different run, so refuse (a warning in N ranks' logs is easy to miss)."""
        micro = self.micro_step
        if group.active and micro:
            raise RuntimeError(
                f"state_dict()/save_checkpoint() on rank {group.rank} of {group.world_size} "
                f"{micro} micro-steps into an accumulation window of {self.accumulation_steps}: the ranks' "
                "unreduced gradients cannot be saved, so a resume would train a different run. Call it "
                "after the window's last train_step (train_step_info.step a multiple of "
                "gradient_accumulation_steps); state_dict(pytorch_format=True) gives the current weights.")

    def state_dict(self):
        """The state_dict entries of the counters (+ loss scaler and its counters under mixed precision)."""
        state = {_utils.TRAIN_STEP_INFO_KEY: {_utils.OPTIMIZATION_STEP_KEY: self.info.optimization_step,
                                              _utils.STEP_KEY: self.info.step}}
        if self.loss_scaler is not None:
            state[LOSS_SCALER_KEY] = self.loss_scaler.state_dict()
            state[MIXED_PRECISION_COUNTERS_KEY] = self.counters.state_dict()
        return state

    def checked_load(self, state_dict):
        """Check this part of a state_dict; returns the function that applies it (which cannot fail)."""
        info = state_dict.get(_utils.TRAIN_STEP_INFO_KEY)
        steps = _load_checks.check_step_info(info) if info is not None else None
        scaler_state = _load_checks.plain_dict(state_dict.get(LOSS_SCALER_KEY))
        if scaler_state is not None and self.loss_scaler is not None:
            _load_checks.checked_load(self.loss_scaler, scaler_state, LOSS_SCALER_KEY)
        counters = _load_checks.plain_dict(state_dict.get(MIXED_PRECISION_COUNTERS_KEY))
        if counters is not None and self.counters is not None:
            _load_checks.checked_load(self.counters, counters, MIXED_PRECISION_COUNTERS_KEY)

        def apply():
            if steps is not None:
                self.info.optimization_step, self.info.step = steps
            if scaler_state is not None and self.loss_scaler is not None:
                self.loss_scaler.load_state_dict(scaler_state)
            if counters is not None and self.counters is not None:
                self.counters.load_state_dict(counters)
        return apply


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Ctrl-C (the default SIGINT handler, KeyboardInterrupt) inside the block is raised when the block is
    done; a second one more than CTRL_C_REPEAT_SECONDS later aborts at once (a step that never ends).
    Another handler (the recipe loop's, the user's) is left to decide, as is any thread but the main one."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    first = []

    def handler(signum, frame):
        if first and time.monotonic() - first[0] > CTRL_C_REPEAT_SECONDS:
            raise KeyboardInterrupt
        first.append(first[0] if first else time.monotonic())

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if first:
        raise KeyboardInterrupt
