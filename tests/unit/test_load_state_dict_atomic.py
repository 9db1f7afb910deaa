"""load_state_dict is all-or-nothing: every value (names, shapes, dtypes, frozen values, counters,
loss scaler state) is checked before anything changes, so a rejected call leaves the trainer usable
and unchanged (the key/shape cases are REJECTED in test_trainer_checkpoint.py)."""

import copy
import re

import numpy as np
from onnx import numpy_helper
import pytest
from test_trainer_checkpoint import assert_same_state, batch, make_trainer, snapshot, train

FROZEN = {"utils": {"frozen_weights": ["fc1.bias"]}}


def _rejected(trainer, state, error, message):
    before = snapshot(trainer)
    expected_loss = float(trainer.eval_step(*batch("mlp", 2))[0])
    with pytest.raises(error, match=re.escape(message)):
        trainer.load_state_dict(state)
    assert_same_state(snapshot(trainer), before)
    assert float(trainer.train_step(*batch("mlp", 2))[0]) == expected_loss  # still trains, from the same state


@pytest.mark.parametrize("value, error, message", [
    (np.zeros(16, np.int32), TypeError, "State 'fc1.bias' has dtype int32 in the state_dict but float32"),
    (np.zeros(15, np.float32), ValueError, "State 'fc1.bias' has shape [15] in the state_dict but [16]"),
    (np.array(["x"] * 16), TypeError, "State 'fc1.bias' has dtype <U1"),
])
def test_rejected_frozen_value_changes_nothing(value, error, message):
    trainer = make_trainer(optimizer="adam", extra=FROZEN)
    train(trainer, "mlp", 0, 2)
    state = copy.deepcopy(trainer.state_dict())
    state["model"]["full_precision"]["fc2.weight"] = state["model"]["full_precision"]["fc2.weight"] + 1
    state["model"]["full_precision"]["fc1.bias"] = value
    _rejected(trainer, state, error, message)


def test_float64_values_load_as_the_states_dtype_frozen_ones_included():
    source = make_trainer(optimizer="adam", seed=3, extra=FROZEN)
    train(source, "mlp", 0, 2)
    state = copy.deepcopy(source.state_dict())
    for name, value in state["model"]["full_precision"].items():
        state["model"]["full_precision"][name] = value.astype(np.float64)
    trainer = make_trainer(optimizer="adam", extra=FROZEN)
    trainer.eval_step(*batch("mlp", 0))
    trainer.load_state_dict(state)
    assert_same_state(snapshot(trainer), snapshot(source))
    assert {i.name: i.data_type for i in trainer._onnx_model.graph.initializer}["fc1.bias"] == 1  # FLOAT
    assert train(trainer, "mlp", 2, 4) == train(source, "mlp", 2, 4)


@pytest.mark.parametrize("scaler_state, message", [
    ({"loss_scale": 2.0, "stable_steps_count": "x"}, "state_dict[loss_scaler] cannot be loaded: ValueError"),
    ({"loss_scale": 2.0}, "state_dict[loss_scaler] cannot be loaded: KeyError"),
])
def test_rejected_loss_scaler_state_changes_nothing(scaler_state, message):
    trainer = make_trainer(optimizer="adam", extra={"mixed_precision": {"enabled": True}})
    train(trainer, "mlp", 0, 2)
    scale = trainer.loss_scaler.loss_scale
    state = copy.deepcopy(trainer.state_dict())
    state["model"]["full_precision"]["fc1.weight"] = state["model"]["full_precision"]["fc1.weight"] + 1
    state["loss_scaler"] = scaler_state
    _rejected(trainer, state, ValueError, message)
    assert trainer.loss_scaler.loss_scale == scale


def test_failed_session_rebuild_for_frozen_values_restores_the_old_session(monkeypatch):
    # The rebuild really fails inside the engine: the first model it gets has a DOUBLE fc1.bias
    # feeding a float Add (what a frozen value of the wrong dtype used to do).
    trainer = make_trainer(optimizer="adam", extra=FROZEN)
    train(trainer, "mlp", 0, 2)
    state = copy.deepcopy(trainer.state_dict())
    state["model"]["full_precision"]["fc1.bias"] = state["model"]["full_precision"]["fc1.bias"] + 1
    given, calls = trainer._graphs.given, []

    def first_build_fails(forward):
        calls.append(forward)
        if len(calls) == 1:
            broken = copy.deepcopy(forward)
            for init in broken.graph.initializer:
                if init.name == "fc1.bias":
                    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
            return given(broken)
        return given(forward)

    monkeypatch.setattr(trainer._graphs, "given", first_build_fails)
    before = snapshot(trainer)
    expected_loss = float(trainer.eval_step(*batch("mlp", 2))[0])
    with pytest.raises(RuntimeError, match="bound to different types"):  # onnxruntime's own error
        trainer.load_state_dict(state)
    assert len(calls) == 2  # the failed build, then the old constants again
    assert_same_state(snapshot(trainer), before)
    assert float(trainer.train_step(*batch("mlp", 2))[0]) == expected_loss
