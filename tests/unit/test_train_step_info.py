"""TrainStepInfo (§1.4): defaults and constructor assertions."""

import pytest

from orttrainer import TrainStepInfo, optim
from orttrainer.train_step_info import TrainStepInfo as DirectTrainStepInfo


def test_exported():
    assert TrainStepInfo is DirectTrainStepInfo


def test_defaults():
    config = optim.SGDConfig()
    info = TrainStepInfo(config)
    assert info.optimizer_config is config
    assert info.all_finite is True
    assert info.fetches == []
    assert (info.optimization_step, info.step) == (0, 0)


def test_values():
    config = optim.AdamConfig()
    info = TrainStepInfo(config, all_finite=False, fetches=["loss"], optimization_step=3, step=6)
    assert (info.all_finite, info.fetches, info.optimization_step, info.step) == (False, ["loss"], 3, 6)
    info.fetches = ["out"]  # the trainer and tests set these attributes directly
    info.all_finite = None
    assert info.fetches == ["out"]


def test_default_fetches_are_not_shared():
    first, second = TrainStepInfo(optim.SGDConfig()), TrainStepInfo(optim.SGDConfig())
    first.fetches.append("loss")
    assert second.fetches == []
    assert TrainStepInfo(optim.SGDConfig()).fetches == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"optimizer_config": None}, "optimizer_config must be a optim._OptimizerConfig"),
        ({"optimizer_config": "Hello"}, "optimizer_config must be a optim._OptimizerConfig"),
        ({"all_finite": -1}, "all_finite must be a bool"),
        ({"all_finite": "Hello"}, "all_finite must be a bool"),
        ({"fetches": "loss"}, "fetches must be a list of str"),
        ({"fetches": ["loss", 1]}, "fetches must be a list of str"),
        ({"optimization_step": -1}, "optimization_step must be a positive int"),
        ({"optimization_step": 1.0}, "optimization_step must be a positive int"),
        ({"step": -1}, "step must be a positive int"),
        ({"step": "Hello"}, "step must be a positive int"),
    ],
)
def test_invalid(kwargs, message):
    arguments = {"optimizer_config": optim.SGDConfig(), **kwargs}
    with pytest.raises(AssertionError) as info:
        TrainStepInfo(**arguments)
    assert str(info.value) == message
