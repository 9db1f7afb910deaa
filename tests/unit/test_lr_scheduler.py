"""LR schedulers (§1.6): sequences against the formulas, written out here independently."""

import math

import numpy as np
import pytest

from orttrainer import TrainStepInfo, optim
from orttrainer.optim import lr_scheduler

LR0 = 0.5
T = 100
WARMUP = 0.1  # W = 10.0 steps
STEPS = [0, 1, 5, 9, 10, 11, 37, 55, 99, 100, 101, 150]


def info(step, lr=LR0):
    return TrainStepInfo(optim.SGDConfig(lr=lr), optimization_step=step)


def lr_at(scheduler, step, lr=LR0):
    values = scheduler._step(info(step, lr))
    assert isinstance(values, list) and len(values) == 1
    return values[0]


def expected_constant(s):
    return LR0 * s / 10.0 if s < 10 else LR0


def expected_linear(s):
    return LR0 * s / 10.0 if s < 10 else LR0 * max(0.0, (T - s) / 90.0)


def expected_cosine(s, cycles=0.5):
    if s < 10:
        return LR0 * s / 10.0
    return LR0 * max(0.0, 0.5 * (1 + math.cos(math.pi * cycles * 2 * (s - 10) / 90.0)))


def expected_poly(s, lr_end=0.01, power=2.0):
    if s < 10:
        return LR0 * s / 10.0
    if s > T:
        return lr_end
    return (LR0 - lr_end) * (1 - (s - 10) / 90.0) ** power + lr_end


@pytest.mark.parametrize(
    "scheduler,expected",
    [
        (lambda: optim.ConstantWarmupLRScheduler(T, WARMUP), expected_constant),
        (lambda: optim.LinearWarmupLRScheduler(T, WARMUP), expected_linear),
        (lambda: optim.CosineWarmupLRScheduler(T, 0.5, WARMUP), expected_cosine),
        (
            lambda: optim.CosineWarmupLRScheduler(T, cycles=1.5, warmup=WARMUP),
            lambda s: expected_cosine(s, 1.5),
        ),
        (lambda: optim.PolyWarmupLRScheduler(T, 0.01, 2.0, WARMUP), expected_poly),
        (
            lambda: optim.PolyWarmupLRScheduler(T, lr_end=0.01, power=0.5, warmup=WARMUP),
            lambda s: expected_poly(s, power=0.5),
        ),
    ],
)
def test_sequences_match_formulas(scheduler, expected):
    sched = scheduler()
    for step in STEPS:
        assert lr_at(sched, step) == pytest.approx(expected(step), rel=1e-12, abs=1e-15), step


def test_hand_computed_points():
    # s = 55 is half-way through the decay (W = 10, T = 100)
    assert lr_at(optim.LinearWarmupLRScheduler(T, WARMUP), 55) == pytest.approx(0.25)
    assert lr_at(optim.CosineWarmupLRScheduler(T, 0.5, WARMUP), 55) == pytest.approx(0.25)
    assert lr_at(optim.PolyWarmupLRScheduler(T, 0.01, 2.0, WARMUP), 55) == pytest.approx(0.49 * 0.25 + 0.01)
    assert lr_at(optim.ConstantWarmupLRScheduler(T, WARMUP), 5) == pytest.approx(0.25)
    assert lr_at(optim.LinearWarmupLRScheduler(T, WARMUP), 150) == 0.0  # clamped at 0 past the end
    assert lr_at(optim.CosineWarmupLRScheduler(T, 0.5, WARMUP), 100) == pytest.approx(0.0, abs=1e-15)


def test_fractional_and_tiny_warmup():
    # W = 3.5: steps 0..3 warm up, 4 is past warm-up
    sched = optim.ConstantWarmupLRScheduler(7, 0.5)
    assert [lr_at(sched, s) for s in range(5)] == pytest.approx(
        [0.0, LR0 / 3.5, 2 * LR0 / 3.5, 3 * LR0 / 3.5, LR0]
    )
    # default warmup 0.002 of 100 steps: W = 0.2 < 1, so only step 0 "warms up" (to 0 / max(1, 0.2))
    sched = optim.LinearWarmupLRScheduler(100)
    assert lr_at(sched, 0) == 0.0
    assert lr_at(sched, 1) == pytest.approx(LR0 * 99 / (100 - 0.2))
    # warmup 0.0: no warm-up at all
    assert lr_at(optim.ConstantWarmupLRScheduler(10, 0.0), 0) == LR0


def test_cosine_positional_order_is_total_cycles_warmup():
    sched = optim.CosineWarmupLRScheduler(50, 2.0, 0.2)
    assert (sched.total_steps, sched.cycles, sched.warmup) == (50, 2.0, 0.2)


def test_poly_positional_order_is_total_lr_end_power_warmup():
    sched = optim.PolyWarmupLRScheduler(50, 1e-4, 3.0, 0.2)
    assert (sched.total_steps, sched.lr_end, sched.power, sched.warmup) == (50, 1e-4, 3.0, 0.2)


def test_defaults():
    assert optim.ConstantWarmupLRScheduler(10).warmup == 0.002
    assert optim.LinearWarmupLRScheduler(10).warmup == 0.002
    cosine = optim.CosineWarmupLRScheduler(10)
    assert (cosine.cycles, cosine.warmup) == (0.5, 0.002)
    poly = optim.PolyWarmupLRScheduler(10)
    assert (poly.lr_end, poly.power, poly.warmup) == (1e-7, 1.0, 0.002)


@pytest.mark.parametrize("lr_end,lr", [(0.5, 0.5), (0.6, 0.5)])
def test_poly_lr_end_not_below_lr_raises_value_error(lr_end, lr):
    sched = optim.PolyWarmupLRScheduler(10, lr_end=lr_end)
    with pytest.raises(ValueError) as exc:
        lr_at(sched, 5, lr=lr)
    assert str(lr_end) in str(exc.value) and str(lr) in str(exc.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.ConstantWarmupLRScheduler(0),
        lambda: optim.ConstantWarmupLRScheduler(10.0),
        lambda: optim.ConstantWarmupLRScheduler(True),
        lambda: optim.LinearWarmupLRScheduler(10, warmup=0),  # int, like legacy
        lambda: optim.LinearWarmupLRScheduler(10, warmup=1.0),
        lambda: optim.LinearWarmupLRScheduler(10, warmup=-0.1),
        lambda: optim.CosineWarmupLRScheduler(10, cycles=1),
        lambda: optim.CosineWarmupLRScheduler(10, cycles=0.0),
        lambda: optim.PolyWarmupLRScheduler(10, lr_end=0),
        lambda: optim.PolyWarmupLRScheduler(10, lr_end=-1e-3),
        lambda: optim.PolyWarmupLRScheduler(10, power=1),
        lambda: optim.PolyWarmupLRScheduler(10, power=-1.0),
    ],
)
def test_invalid_arguments_assert(make):
    with pytest.raises(AssertionError):
        make()


def test_assert_messages():
    with pytest.raises(AssertionError, match=r"warmup must be a float in \[0, 1\), got 0"):
        optim.LinearWarmupLRScheduler(10, warmup=0)
    with pytest.raises(AssertionError, match="total_steps must be a strict positive number, got 0"):
        optim.LinearWarmupLRScheduler(0)


def test_base_class():
    base = lr_scheduler._LRScheduler()
    assert base.get_last_lr() == []
    with pytest.raises(NotImplementedError):
        base.get_lr(info(0))


def test_step_remembers_last_lr_and_state_dict_round_trip():
    sched = optim.LinearWarmupLRScheduler(T, WARMUP)
    assert sched.state_dict() == {"last_lr": []}
    lr_at(sched, 55)
    assert sched.get_last_lr() == [pytest.approx(0.25)]
    state = sched.state_dict()
    assert state == {"last_lr": [pytest.approx(0.25)]}

    restored = optim.LinearWarmupLRScheduler(T, WARMUP)
    restored.load_state_dict({"last_lr": np.array([0.25])})  # as read back from HDF5
    assert restored.get_last_lr() == [0.25] and isinstance(restored.get_last_lr()[0], float)
    state["last_lr"].append(1.0)  # the returned state is a copy
    assert sched.get_last_lr() == [pytest.approx(0.25)]


def test_custom_scheduler_subclass():
    class Halving(lr_scheduler._LRScheduler):
        def get_lr(self, train_step_info):
            return [train_step_info.optimizer_config.lr / 2**train_step_info.optimization_step]

    sched = Halving()
    assert [lr_at(sched, s, lr=1.0) for s in range(3)] == [1.0, 0.5, 0.25]
    assert sched.get_last_lr() == [0.25]
