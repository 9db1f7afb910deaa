"""Ctrl-C inside ORTTrainer.train_step, through the public API: a real SIGINT from a timer thread while the
session runs. The step is then applied and counted, or neither: a caller that catches KeyboardInterrupt
and feeds the batch of the step the counters say is next trains exactly the uninterrupted run.
"""

import os
import signal
import statistics
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orttrainer import ORTTrainer, optim
from helpers.training import make_options

WIDTH, BATCH, STEPS = 384, 512, 8
DESC = {"inputs": [("x", ["batch", WIDTH]), ("y", ["batch"])], "outputs": [("loss", [], True)]}


class Deep(torch.nn.Module):
    """Slow enough on CPU (tens of ms a step) that a timer lands inside the session run."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(6))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(x, y)


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, WIDTH, (BATCH,), generator=g))
            for _ in range(STEPS)]


def trainer():
    torch.manual_seed(0)
    return ORTTrainer(Deep(), DESC, optim.AdamConfig(lr=1e-3),
                      options=make_options({"batch": {"gradient_accumulation_steps": 1}}))


def weights_and_counts(t):
    state = t.state_dict()
    weights = {k: np.array(v) for k, v in state["model"]["full_precision"].items()}
    counts = {int(np.asarray(s["Update_Count"]).reshape(-1)[0]) for s in state["optimizer"].values()}
    return weights, counts


@pytest.mark.slow
def test_ctrl_c_inside_train_step_applies_and_counts_the_step_or_neither():
    data = batches()
    reference = trainer()
    durations = []
    for x, y in data:
        started = time.perf_counter()
        reference.train_step(x, y)
        durations.append(time.perf_counter() - started)
    expected, expected_counts = weights_and_counts(reference)
    assert len(expected_counts) == 1  # Adam's Update_Count: one per weight, all alike
    delay = statistics.median(durations[1:]) / 2  # the middle of a step (the first one builds the session)

    t = trainer()
    t.train_step(*data[0])  # start-up: not interrupted
    interrupts = 0
    while t._train_step_info.optimization_step < STEPS:
        info = t._train_step_info
        assert info.step == info.optimization_step  # the counters never split
        x, y = data[info.step]
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)) if interrupts < 4 else None
        try:
            if timer is not None:
                timer.start()
            t.train_step(x, y)
            if timer is not None:
                timer.join()
                time.sleep(0.05)  # a signal that came after the call is delivered here, outside it
        except KeyboardInterrupt:
            interrupts += 1
        finally:
            if timer is not None:
                timer.cancel()
    assert interrupts == 4
    got, counts = weights_and_counts(t)
    info = t._train_step_info
    assert (info.step, info.optimization_step) == (STEPS, STEPS) and counts == expected_counts
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
