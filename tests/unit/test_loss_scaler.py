"""Loss scalers (§1.7, final version) and their checkpointable state."""

import numpy as np
import pytest

from orttrainer import TrainStepInfo, amp, optim
from orttrainer.amp import loss_scaler


def step_info(all_finite=True):
    return TrainStepInfo(optim.SGDConfig(), all_finite=all_finite)


def run(scaler, finite_flags):
    """Loss scale and stable-step counter after each update."""
    out = []
    for flag in finite_flags:
        returned = scaler.update(step_info(flag))
        assert returned == scaler.loss_scale
        out.append((scaler.loss_scale, scaler._stable_steps_count))
    return out


def test_exports():
    assert amp.DynamicLossScaler is loss_scaler.DynamicLossScaler
    assert amp.LossScaler is loss_scaler.LossScaler


def test_defaults():
    scaler = amp.DynamicLossScaler()
    assert scaler.automatic_update is True
    assert scaler.loss_scale == float(1 << 16) and isinstance(scaler.loss_scale, float)
    assert scaler.up_scale_window == 2000
    assert (scaler.min_loss_scale, scaler.max_loss_scale) == (1.0, float(1 << 24))
    assert scaler._stable_steps_count == 0
    assert scaler.input_name is None


def test_custom_values():
    scaler = amp.DynamicLossScaler(
        automatic_update=False, loss_scale=3, up_scale_window=7, min_loss_scale=5, max_loss_scale=10
    )
    assert scaler.automatic_update is False
    assert (scaler.loss_scale, scaler.up_scale_window, scaler.min_loss_scale, scaler.max_loss_scale) == (
        3.0,
        7,
        5.0,
        10.0,
    )


def test_small_window_sequence():
    scaler = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=3, min_loss_scale=2.0, max_loss_scale=32.0)
    flags = [True, True, True, True, True, True, True, True, True, False, True, False, False, False, True]
    assert run(scaler, flags) == [
        (8.0, 1),
        (8.0, 2),
        (16.0, 0),  # window of 3 finite steps doubles the scale
        (16.0, 1),
        (16.0, 2),
        (32.0, 0),
        (32.0, 1),
        (32.0, 2),
        (32.0, 0),  # clamped at max_loss_scale, counter still resets
        (16.0, 0),  # overflow halves and resets the counter
        (16.0, 1),
        (8.0, 0),
        (4.0, 0),
        (2.0, 0),  # halves down to min_loss_scale
        (2.0, 1),
    ]
    assert run(scaler, [False, False]) == [(2.0, 0), (2.0, 0)]  # clamped at min_loss_scale


def test_default_scaler_long_run():
    """Legacy scenario: 9 windows of 2000 finite steps, then overflows down to the minimum."""
    scaler = amp.DynamicLossScaler()
    finite, overflow = step_info(True), step_info(False)
    scale = float(1 << 16)
    for cycle in range(1, 10):
        for i in range(1, 2000):
            scaler.update(finite)
            assert scaler._stable_steps_count == i and scaler.loss_scale == scale
        scaler.update(finite)
        if cycle <= 8:
            scale *= 2
        assert scaler._stable_steps_count == 0 and scaler.loss_scale == scale
    assert scale == float(1 << 24)
    for count in range(1, 2050):
        scaler.update(finite)
        assert scaler._stable_steps_count == count % 2000 and scaler.loss_scale == scale
    for _ in range(24):
        scaler.update(overflow)
        scale /= 2
        assert scaler._stable_steps_count == 0 and scaler.loss_scale == scale
    assert scale == 1.0
    for _ in range(4):
        assert scaler.update(overflow) == 1.0


def test_all_finite_may_be_a_tensor():
    torch = pytest.importorskip("torch")
    scaler = amp.DynamicLossScaler(loss_scale=4.0, up_scale_window=1)
    info = step_info()
    info.all_finite = torch.tensor([False])
    assert scaler.update(info) == 2.0
    info.all_finite = torch.tensor([True])
    assert scaler.update(info) == 4.0


def test_automatic_update_off_keeps_the_scale():
    scaler = amp.DynamicLossScaler(automatic_update=False, loss_scale=4.0, up_scale_window=1)
    assert run(scaler, [False, True, True]) == [(4.0, 0)] * 3


def test_reset():
    scaler = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=5)
    run(scaler, [False, True, True])
    assert (scaler.loss_scale, scaler._stable_steps_count) == (4.0, 2)
    scaler.reset()
    assert (scaler.loss_scale, scaler._stable_steps_count) == (8.0, 0)


def test_state_dict_round_trip():
    scaler = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=5)
    run(scaler, [False, True, True])
    state = scaler.state_dict()
    assert state == {"loss_scale": 4.0, "stable_steps_count": 2}
    assert isinstance(state["loss_scale"], float) and isinstance(state["stable_steps_count"], int)

    restored = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=5)
    restored.load_state_dict(
        {"loss_scale": np.float64(4.0), "stable_steps_count": np.int64(2)}
    )  # as from HDF5
    assert restored.state_dict() == state
    assert run(restored, [True, True, True]) == run(scaler, [True, True, True])
    restored.reset()
    assert restored.loss_scale == 8.0  # the initial scale is not part of the state


def test_base_class():
    scaler = amp.LossScaler(loss_scale=2)
    assert scaler.loss_scale == 2.0 and isinstance(scaler.loss_scale, float)
    with pytest.raises(NotImplementedError):
        scaler.update(step_info())
    scaler.loss_scale = 16
    assert scaler.loss_scale == 16.0 and isinstance(scaler.loss_scale, float)
    scaler.reset()
    assert scaler.loss_scale == 2.0
    assert scaler.state_dict() == {"loss_scale": 2.0}


@pytest.mark.parametrize("value", [0, -1.0, "1", None, True])
def test_loss_scale_must_be_positive_number(value):
    with pytest.raises(AssertionError, match="'loss_scale' must be a positive number"):
        amp.LossScaler(value)
    scaler = amp.DynamicLossScaler()
    with pytest.raises(AssertionError, match="'loss_scale' must be a positive number"):
        scaler.loss_scale = value


def test_input_name():
    scaler = amp.DynamicLossScaler()
    scaler.input_name = "loss_scale"
    assert scaler.input_name == "loss_scale"
    with pytest.raises(AssertionError, match="'input_name' must be a string"):
        scaler.input_name = 1
    with pytest.raises(AssertionError, match="'input_name' cannot be empty"):
        scaler.input_name = ""


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"automatic_update": 1}, "'automatic_update' must be a bool"),
        ({"up_scale_window": 0}, "'up_scale_window' must be a positive int"),
        ({"up_scale_window": 2.0}, "'up_scale_window' must be a positive int"),
        ({"min_loss_scale": 0.0}, "'min_loss_scale' must be a positive number"),
        ({"max_loss_scale": -1.0}, "'max_loss_scale' must be a positive number"),
        ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, "'min_loss_scale' \\(4.0\\) must not exceed"),
    ],
)
def test_dynamic_invalid_arguments(kwargs, message):
    with pytest.raises(AssertionError, match=message):
        amp.DynamicLossScaler(**kwargs)


def test_repr():
    assert repr(amp.DynamicLossScaler(loss_scale=4.0, up_scale_window=3)) == (
        "DynamicLossScaler(loss_scale=4.0, automatic_update=True, up_scale_window=3, "
        "min_loss_scale=1.0, max_loss_scale=16777216.0, hysteresis=1, at_min_loss_scale='skip')"
    )


# --- beyond the original: hysteresis and the action at the minimum scale -----------------------


def scales(scaler, finite_flags):
    return [scale for scale, _ in run(scaler, finite_flags)]


def test_hysteresis_halves_at_the_nth_overflow_since_the_scale_changed():
    scaler = amp.DynamicLossScaler(loss_scale=64.0, up_scale_window=3, hysteresis=3)
    # Finite steps between overflows do not reset the count; the third overflow halves.
    assert scales(scaler, [False, True, False, True]) == [64.0, 64.0, 64.0, 64.0]
    assert scales(scaler, [False]) == [32.0]
    # After a change the count starts again: two more overflows are tolerated.
    assert scales(scaler, [False, False, False]) == [32.0, 32.0, 16.0]
    # Doubling resets it too: 3 finite steps double, then overflows count from zero.
    assert scales(scaler, [True, True, True, False, False, False]) == [16.0, 16.0, 32.0, 32.0, 32.0, 16.0]
    assert scaler.state_dict() == {"loss_scale": 16.0, "stable_steps_count": 0, "overflow_count": 0}
    scales(scaler, [False])
    restored = amp.DynamicLossScaler(loss_scale=64.0, up_scale_window=3, hysteresis=3)
    restored.load_state_dict(scaler.state_dict())
    assert scales(restored, [False, False]) == scales(scaler, [False, False]) == [16.0, 8.0]


def test_hysteresis_one_is_the_legacy_rule():
    legacy, explicit = amp.DynamicLossScaler(loss_scale=8.0), amp.DynamicLossScaler(loss_scale=8.0, hysteresis=1)
    pattern = [False, True, False, False, True, True]
    assert scales(legacy, pattern) == scales(explicit, pattern) == [4.0, 4.0, 2.0, 1.0, 1.0, 1.0]


def test_at_min_loss_scale_actions():
    skip = amp.DynamicLossScaler(loss_scale=4.0, min_loss_scale=2.0)
    assert skip.at_min_loss_scale == "skip"
    assert scales(skip, [False, False, False]) == [2.0, 2.0, 2.0]  # legacy: stays at the minimum, silently

    warn = amp.DynamicLossScaler(loss_scale=4.0, min_loss_scale=2.0, at_min_loss_scale="warn")
    assert scales(warn, [False]) == [2.0]  # reaching the minimum is not yet an overflow at it
    with pytest.warns(RuntimeWarning, match="already at min_loss_scale \\(2\\)"):
        assert scales(warn, [False]) == [2.0]

    strict = amp.DynamicLossScaler(loss_scale=4.0, min_loss_scale=2.0, at_min_loss_scale="raise", hysteresis=2)
    assert scales(strict, [False, False, False]) == [4.0, 2.0, 2.0]
    with pytest.raises(RuntimeError, match="Loss scaling failed: .*already at min_loss_scale"):
        scales(strict, [False])
    with pytest.raises(AssertionError, match="'at_min_loss_scale' must be one of"):
        amp.DynamicLossScaler(at_min_loss_scale="stop")
    with pytest.raises(AssertionError, match="'hysteresis' must be a positive int"):
        amp.DynamicLossScaler(hysteresis=0)
