"""The guard on onnxruntime's PythonOp hook (engine/pyop/runner_check.py) and its fallbacks.

The check is made to fail the ways another onnxruntime build would (another version, a self-test
whose results are wrong, a runner that raises); then GeluGrad must stay onnxruntime's kernel with one
warning and training must still equal PyTorch, a custom torch.autograd.Function must get a clear
error, and the export cache must not hand out a graph built with the rewrite on. Also: a runner error
left over from one session run is never reported as the cause of another run's failure.
"""

import copy
import io
import logging
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from helpers.models import cross_entropy
from test_torch_gelu_gradient import DESC, GeluMLP, batches, train_against_torch

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine.pyop import python_op
from orttrainer.engine.pyop import runner_check
from orttrainer.engine.graph import torch_gelu_gradient


@pytest.fixture
def fresh_check(monkeypatch):
    """The once-per-process check and warning made to run again in this test (restored after it)."""
    monkeypatch.setattr(runner_check, "_problem", None)
    monkeypatch.setattr(torch_gelu_gradient, "_warned", False)
    return monkeypatch


def gelu_trainer(cache_dir=None):
    utils = {"export_cache_dir": str(cache_dir)} if cache_dir else {"export_cache": False}
    torch.manual_seed(0)
    model = GeluMLP()
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.5), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, "utils": utils}))
    return trainer, copy.deepcopy(model)


def op_types(trainer):
    return [n.op_type for n in trainer._training_session.graph.model.graph.node]


def test_the_check_passes_here_and_runs_once(fresh_check):
    assert runner_check.problem() == ""
    fresh_check.setattr(runner_check, "_self_test", lambda: pytest.fail("the self-test ran twice"))
    assert runner_check.problem() == ""
    assert torch_gelu_gradient.enabled()


def test_another_onnxruntime_version_keeps_gelugrad_with_one_warning(fresh_check):
    fresh_check.setattr(onnxruntime, "__version__", "1.20.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, ref = gelu_trainer()
        train_against_torch(trainer, ref)
        second, _ = gelu_trainer()  # a second trainer in the same process: no second warning
        second.train_step(*batches(1)[0])
    ours = [w for w in caught if "GeluGrad" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "onnxruntime is 1.20.0; the runners are written for 1.19.2" in str(ours[0].message)
    for t in (trainer, second):
        assert op_types(t).count("GeluGrad") == 2
        assert "PythonOp" not in op_types(t)


def test_a_self_test_with_wrong_results_disables_the_hook(fresh_check, tmp_path, caplog):
    # A graph built with the rewrite on goes into this cache first: a process whose check fails must
    # not be handed it (the key holds whether the rewrite is on; the versions are the same).
    trainer, _ = gelu_trainer(tmp_path)
    trainer.train_step(*batches(1)[0])
    assert "PythonOp" in op_types(trainer)

    def off_by_one(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    fresh_check.setattr(runner_check._SelfTest, "forward", staticmethod(off_by_one))
    fresh_check.setattr(runner_check, "_problem", None)  # checked again, now with the broken Function
    assert "self-test gave wrong results" in runner_check.problem()
    assert not torch_gelu_gradient.enabled()
    with pytest.warns(RuntimeWarning, match="stays on onnxruntime's GeluGrad kernel"):
        with caplog.at_level(logging.WARNING, logger="orttrainer"):
            trainer, ref = gelu_trainer(tmp_path)
            train_against_torch(trainer, ref, steps=2)
    assert trainer._build.source == "export"  # a cache miss, not the cached graph with PythonOps
    assert not [r for r in caplog.records if "unusable" in r.getMessage()]
    assert op_types(trainer).count("GeluGrad") == 2


def test_a_runner_that_raises_in_the_self_test_disables_the_hook(fresh_check):
    def refuse(ctx, dy):
        raise ValueError("this build's backward runner is broken")

    fresh_check.setattr(runner_check._SelfTest, "backward", staticmethod(refuse))
    assert runner_check.problem() == ("the PythonOp self-test failed: ValueError: this build's backward "
                                      "runner is broken")
    assert python_op._pending_error is None  # nothing left behind for a later run


class Doubling(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class DoublingMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):
        return self.fc(Doubling.apply(x))


def test_custom_function_gets_a_clear_error_when_the_hook_is_off(fresh_check):
    fresh_check.setattr(onnxruntime, "__version__", "1.20.0")
    trainer = ORTTrainer(DoublingMLP(), DESC, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, "utils": {"export_cache": False}}))
    with pytest.raises(RuntimeError, match=r"torch.autograd.Function test_runner_check.Doubling needs onnxruntime's "
                                           r"PythonOp hook, which is disabled in this process: onnxruntime is 1.20.0; "
                                           r"the runners are written for 1.19.2\. Install onnxruntime-training==1.19.2"):
        trainer.train_step(*batches(1)[0])


# --------------------------------------------------------------------------- the runner-error slot
FAIL = {"forward": False}


class MaybeFailing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if FAIL["forward"]:
            raise ValueError("MaybeFailing refuses (an earlier, unrelated run)")
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class ReshapeTo16(torch.nn.Module):
    """Computes its own loss; reshapes to a fixed batch of 16, so another batch fails inside onnxruntime."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x, y):
        logits = self.fc(x.reshape(16, 6))
        return F.cross_entropy(logits, y), logits


def test_an_earlier_runner_error_is_not_the_cause_of_a_later_failure(tmp_path):
    # 1. a Function fails inside a session the trainer does not run (the user's own, on the saved model)
    class Model(DoublingMLP):
        def forward(self, x):
            return self.fc(MaybeFailing.apply(x))

    trainer = ORTTrainer(Model(), DESC, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, "utils": {"export_cache": False}}))
    x, y = batches(1)[0]
    trainer.train_step(x, y)
    trainer.save_as_onnx(str(tmp_path / "model.onnx"))
    own = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    FAIL["forward"] = True
    try:
        with pytest.raises(Exception, match="PythonOp"):
            own.run(None, {"x": x.numpy(), "y": y.numpy()})
    finally:
        FAIL["forward"] = False

    # 2. an unrelated trainer fails inside onnxruntime: its error is onnxruntime's, not the stale one
    torch.manual_seed(0)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ReshapeTo16(), (torch.randn(16, 6), torch.randint(0, 4, (16,))), buffer,
                          input_names=["x", "y"], output_names=["loss", "logits"], dynamo=False,
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}, "logits": {0: "batch"}},
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, opset_version=14)
    other = ORTTrainer(onnx.load_from_string(buffer.getvalue()), DESC, optim.SGDConfig(lr=0.1),
                       options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    other.train_step(x, y)
    with pytest.raises(RuntimeError, match="onnxruntime failed to run the eval step") as failed:
        other.eval_step(x[:4], y[:4])
    assert "MaybeFailing" not in str(failed.value)
    assert not isinstance(failed.value.__cause__, ValueError)

    # 3. and the trainer whose Function it was still reports its own Function's errors
    FAIL["forward"] = True
    try:
        with pytest.raises(RuntimeError, match="MaybeFailing refuses") as failed:
            trainer.train_step(x, y)
    finally:
        FAIL["forward"] = False
    assert isinstance(failed.value.__cause__, ValueError)
