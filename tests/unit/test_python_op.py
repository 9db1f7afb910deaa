"""Custom torch.autograd.Function inside the training session (engine/pyop/python_op.py).

Each training test runs the same initial weights on the same batches with ORTTrainer and with PyTorch
eager + torch.optim.SGD, and compares losses and final weights. The Functions' backwards differ from
the true gradient of their forwards, so a session that differentiated the forward itself (instead of
calling the user's backward) would train differently and fail.
"""

import copy
import weakref

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers import training

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine.pyop import python_op

STEPS = 6
LR = 0.1


class ScaledGradLinear(torch.autograd.Function):
    """y = x @ w.T + b, whose backward returns 3x the true gradients (and saves its inputs)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = grad @ w if ctx.needs_input_grad[0] else None
        return 3 * grad_x if grad_x is not None else None, 3 * grad.t() @ x, 3 * grad.sum(0)


class ReluWithCount(torch.autograd.Function):
    """relu(x) and, as a second (int64) output, how many entries of each row were positive.
    Backward: the relu gradient times 0.5; it must get zeros (materialized) for the integer output."""

    @staticmethod
    def forward(ctx, x):
        positive = x > 0
        ctx.save_for_backward(positive)
        return x * positive, positive.sum(-1)

    @staticmethod
    def backward(ctx, grad, grad_count):
        (positive,) = ctx.saved_tensors
        assert grad_count is not None and not grad_count.any()
        return 0.5 * grad * positive


class ClampScale(torch.autograd.Function):
    """Non-tensor arguments: a float, an int tuple, a bool, a str and an arbitrary object. Forward:
    clamp(x, -limit, limit) * scale along `dims`; backward: grad * scale * weight_of(obj), ignoring the
    clamp (a straight-through estimator, unlike the true gradient)."""

    @staticmethod
    def forward(ctx, x, limit, dims, flag, tag, config):
        assert limit == 0.3 and dims == (0, 1) and flag is True and tag == "clamp"  # 0.3: a float32 would differ
        ctx.scale = config.scale
        out = x.clamp(-limit, limit) * config.scale
        return out.permute(*dims)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale * 2, None, None, None, None, None


class Config:
    def __init__(self, scale):
        self.scale = scale


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)


class ScaledMLP(TwoLayers):
    def forward(self, x):
        h = torch.relu(ScaledGradLinear.apply(x, self.fc1.weight, self.fc1.bias))
        return self.fc2(h)


class CountingMLP(TwoLayers):
    def forward(self, x):
        h, count = ReluWithCount.apply(self.fc1(x))
        # The integer output is used (as data, not differentiated) in the rest of the graph.
        return self.fc2(h) + count.unsqueeze(-1).to(h.dtype) * 0.01


class ArgsMLP(TwoLayers):
    def __init__(self):
        super().__init__()
        self.config = Config(0.7)

    def forward(self, x):
        h = ClampScale.apply(self.fc1(x), 0.3, (0, 1), True, "clamp", self.config)
        return self.fc2(torch.tanh(h))


def cross_entropy(logits, label):
    return F.cross_entropy(logits, label)


DESC = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 4])]}


def batches(n=STEPS, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def train_both(model_class, steps=STEPS, batch_sizes=None):
    torch.manual_seed(0)
    model = model_class()
    reference = copy.deepcopy(model)
    data = batches(steps)
    if batch_sizes:  # different batch sizes per step: the dynamic axis must survive the Function
        data = [(x[:n], y[:n]) for (x, y), n in zip(data, batch_sizes)]

    sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_losses = []
    for x, y in data:
        sgd.zero_grad()
        loss = F.cross_entropy(reference(x), y)
        loss.backward()
        sgd.step()
        ref_losses.append(loss.item())

    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=LR), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    losses = training.train(trainer, data)
    return reference, ref_losses, trainer, losses


def assert_same_training(reference, ref_losses, trainer, losses):
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)


def python_ops(trainer):
    return [n for n in trainer._onnx_model.graph.node if n.op_type == "PythonOp"]


def test_users_backward_is_honoured():
    reference, ref_losses, trainer, losses = train_both(ScaledMLP)
    assert len(python_ops(trainer)) == 1
    assert_same_training(reference, ref_losses, trainer, losses)


def test_users_backward_differs_from_the_forwards_gradient():
    """Guard for the test above: training with the true gradient gives other weights."""
    torch.manual_seed(0)
    model = ScaledMLP()
    true_grad = copy.deepcopy(model)
    _, ref_losses, trainer, losses = train_both(ScaledMLP)
    sgd = torch.optim.SGD(true_grad.parameters(), lr=LR)
    for x, y in batches():
        sgd.zero_grad()
        F.cross_entropy(F.linear(torch.relu(F.linear(x, true_grad.fc1.weight, true_grad.fc1.bias)),
                                 true_grad.fc2.weight, true_grad.fc2.bias), y).backward()
        sgd.step()
    assert not np.allclose(trainer.state_dict(pytorch_format=True)["fc1.weight"].numpy(),
                           true_grad.fc1.weight.detach().numpy(), rtol=1e-3)


def test_integer_second_output_gets_no_gradient_edge():
    reference, ref_losses, trainer, losses = train_both(CountingMLP)
    assert_same_training(reference, ref_losses, trainer, losses)
    (node,) = python_ops(trainer)
    int_output = node.output[2]
    assert not any(int_output + "_grad" in n.input for n in trainer._training_session.graph.model.graph.node)


def test_scalar_tuple_and_object_arguments():
    reference, ref_losses, trainer, losses = train_both(ArgsMLP)
    assert_same_training(reference, ref_losses, trainer, losses)
    attrs = {a.name for a in python_ops(trainer)[0].attribute}
    assert {"input_int_tuples", "input_bool_scalars", "input_pointer_scalars"} <= attrs


def test_needs_input_grad_follows_the_gradient_graph():
    """x is a graph input (no gradient wanted), w and b are trained weights."""
    seen = []

    class Recording(ScaledGradLinear):
        @staticmethod
        def backward(ctx, grad):
            if isinstance(ctx, python_op.FunctionContext):  # not the eager reference's backward
                seen.append(ctx.needs_input_grad)
            return ScaledGradLinear.backward(ctx, grad)

    class Model(ScaledMLP):
        def forward(self, x):
            return self.fc2(torch.relu(Recording.apply(x, self.fc1.weight, self.fc1.bias)))

    reference, ref_losses, trainer, losses = train_both(Model, steps=2)
    assert seen == [(False, True, True)] * 2
    assert_same_training(reference, ref_losses, trainer, losses)


def test_changing_batch_size_and_eval():
    reference, ref_losses, trainer, losses = train_both(ScaledMLP, batch_sizes=[8, 5, 8, 3, 7, 8])
    assert_same_training(reference, ref_losses, trainer, losses)
    x, y = batches(1, batch=5, seed=3)[0]
    with torch.no_grad():
        expected = reference(x)
    np.testing.assert_allclose(trainer.eval_step(x, y)[1].numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


class SameShape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2

    @staticmethod
    def infer_shape(node, shapes, dtypes):
        return [shapes[0]], [dtypes[0]]


class ShapeHooked(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.function.apply(x)))


def _exported_dims(function):
    trainer = ORTTrainer(ShapeHooked(function), DESC, optim.SGDConfig(lr=LR), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    x, y = batches(1)[0]
    trainer.train_step(x, y)
    model = onnx.shape_inference.infer_shapes(trainer._onnx_model)
    (node,) = [n for n in model.graph.node if n.op_type == "PythonOp"]
    downstream = [n for n in model.graph.node if node.output[1] in n.input][0].output[0]
    info = {v.name: v for v in model.graph.value_info}[downstream]
    return [d.dim_param or d.dim_value for d in info.type.tensor_type.shape.dim]


def test_shape_hook_keeps_symbolic_dims():
    assert _exported_dims(SameShape) == ["batch", 6]


class NoShapeHook(torch.autograd.Function):
    forward = SameShape.forward
    backward = SameShape.backward


def test_without_shape_hook_dims_are_fresh_symbols():
    dims = _exported_dims(NoShapeHook)
    assert dims[0] != "batch" and dims[1] != 6


class TakesTensorList(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, extra):
        return x + extra[0]

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ListModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):
        return TakesTensorList.apply(self.fc(x), [x[:, :4]])


def test_unexportable_function_gives_a_clear_error():
    trainer = ORTTrainer(ListModel(), DESC, optim.SGDConfig(lr=LR), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"TakesTensorList cannot be exported: argument 1 is a list holding "
                                           r"tensors; pass each tensor as its own argument"):
        trainer.train_step(x, y)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward of FailingBackward refuses")


def test_error_in_a_function_reaches_the_caller():
    class Model(ScaledMLP):
        def forward(self, x):
            return self.fc2(FailingBackward.apply(self.fc1(x)))

    trainer = ORTTrainer(Model(), DESC, optim.SGDConfig(lr=LR), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="train step: backward of FailingBackward refuses") as failed:
        trainer.train_step(x, y)
    assert isinstance(failed.value.__cause__, ValueError)  # the Function's own exception, with its traceback
    # the session still works for a run that does not reach the backward
    assert trainer.eval_step(x, y)[1].shape == (8, 4)


def test_eval_runs_release_saved_tensors():
    """An eval run executes PythonOp but not PythonOpGrad: the ctx it leaves in onnxruntime's registry
    drops its saved tensors when the node runs again."""
    contexts = []

    class Recording(ScaledGradLinear):
        @staticmethod
        def forward(ctx, x, w, b):
            contexts.append(weakref.ref(ctx))
            return ScaledGradLinear.forward(ctx, x, w, b)

    class Model(ScaledMLP):
        def forward(self, x):
            return self.fc2(torch.relu(Recording.apply(x, self.fc1.weight, self.fc1.bias)))

    _, _, trainer, _ = train_both(Model, steps=1)
    x, y = batches(1)[0]
    trainer.eval_step(x, y)
    left_behind = contexts[-1]()
    assert left_behind is not None and len(left_behind.saved_tensors) == 2
    trainer.eval_step(x, y)
    assert not vars(left_behind)


def test_gradient_accumulation_and_adam():
    """Micro-steps (forward + backward + accumulate, no update) call the Function's backward too.
    ArgsMLP's backward ignores the clamp: a different direction, not just a scale Adam would undo."""
    torch.manual_seed(0)
    model = ArgsMLP()
    reference = copy.deepcopy(model)
    data = batches(4)
    adam = torch.optim.Adam(reference.parameters(), lr=0.01)
    for i, (x, y) in enumerate(data):
        (cross_entropy(reference(x), y) / 2).backward()
        if i % 2 == 1:
            adam.step()
            adam.zero_grad()
    trainer = ORTTrainer(model, DESC, optim.AdamConfig(lr=0.01), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"},
                                                    "batch": {"gradient_accumulation_steps": 2}}))
    for x, y in data:
        trainer.train_step(x, y)
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
