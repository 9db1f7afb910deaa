"""Symbolic shapes on the forward graph before the gradient is built (engine/export/shape_annotation.py):
the same training as without them, the run-time broadcast machinery gone, and a refusal (one warning,
the run-time reductions kept) wherever taking two dims as equal could be wrong."""

import copy
import os
import warnings

import numpy as np
import pytest
import torch
from helpers.models import GPT_DESC, TinyGPT, cross_entropy
from helpers import training
from onnx import TensorProto, helper

from orttrainer import optim
from orttrainer.engine.export import shape_annotation
from orttrainer.engine.graph import training_graph

OPTIONS = {"utils": {"export_cache": False}}  # (CPU: helpers.training) a cached graph skips the builder


def gpt_batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 50, (3, 12), generator=g), torch.randint(0, 50, (3, 12), generator=g))
            for _ in range(n)]


def train(model, annotate, steps=6, monkeypatch=None):
    """(losses, trained state, training graph's node op types) of `steps` Adam steps."""
    if not annotate:
        monkeypatch.setattr(training_graph, "annotate_symbolic_shapes", lambda model: False)
    trainer = training.make_trainer(model, GPT_DESC, optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy,
                                    **OPTIONS)
    losses = training.train(trainer, gpt_batches(steps))
    ops = [n.op_type for n in trainer._training_session.graph.model.graph.node]
    monkeypatch.undo()
    return losses, trainer.state_dict(pytorch_format=True), ops


def test_gpt_trains_bitwise_as_without_the_shapes_and_without_runtime_broadcast_axes(monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no refusal on this model
        losses, state, ops = train(copy.deepcopy(model), True, monkeypatch=monkeypatch)
    plain_losses, plain_state, plain_ops = train(copy.deepcopy(model), False, monkeypatch=monkeypatch)

    # The same math; onnxruntime may group a reduction differently once shapes are known (last-bit
    # differences, 1e-7 relative in these losses).
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for name, value in plain_state.items():
        np.testing.assert_allclose(state[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    # Without the shapes every broadcasting op's gradient asks at run time which axes to reduce, and
    # reduces (copies) even where nothing was broadcast; with them that machinery is gone.
    assert plain_ops.count("BroadcastGradientArgs") > 10
    assert ops.count("BroadcastGradientArgs") == 0
    assert ops.count("ReduceSum") < plain_ops.count("ReduceSum") // 2
    assert len(ops) < 0.8 * len(plain_ops)


class TwoInputs(torch.nn.Module):
    """a[b, n, 8] + c[b, m, 8]: broadcasting when m is 1 at run time, which the graph cannot know.
    (c is reshaped so that onnxruntime's own shapes leave its middle dim unnamed: two different names
    there the gradient builder itself would take as equal — docs/ort-notes.md.)"""

    def __init__(self):
        super().__init__()
        self.wa = torch.nn.Linear(4, 8)
        self.wc = torch.nn.Linear(4, 8)

    def forward(self, x, s):
        return ((self.wa(x) + self.wc(s).reshape(s.shape[0], -1, 8)) ** 2).mean()


TWO_DESC = {"inputs": [("x", ["batch", "n", 4]), ("s", ["batch", "m", 4])], "outputs": [("loss", [], True)]}


def test_a_broadcast_between_two_symbols_is_refused_and_trains_like_torch():
    torch.manual_seed(0)
    model = TwoInputs()
    ref = copy.deepcopy(model)
    shape_annotation._warned.clear()
    with pytest.warns(RuntimeWarning, match=r"refused \(it equated the dims .* of different symbols"):
        trainer = training.make_trainer(model, TWO_DESC, optim.SGDConfig(lr=0.1), **OPTIONS)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(2, 3, 4, generator=g), torch.randn(2, 1, 4, generator=g)) for _ in range(4)]
        sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
        for x, s in batches:
            loss = trainer.train_step(x, s)
            sgd.zero_grad()
            ref_loss = ref(x, s)
            ref_loss.backward()
            sgd.step()
            np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-5)
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    assert "BroadcastGradientArgs" in [n.op_type for n in trainer._training_session.graph.model.graph.node]


@pytest.mark.parametrize("dims, safe", [
    (("seq", "Min(512, seq)"), True),   # BERT's position slice: 1 only when seq is
    (("batch", "n"), False),            # independent symbols: one may be 1 while the other is not
    (("seq", 128), False),              # a symbol taken for a number
])
def test_which_broadcast_merges_are_accepted(dims, safe):
    if safe:
        shape_annotation._check_broadcast_merge(dims, {})
    else:
        with pytest.raises(shape_annotation._Refused):
            shape_annotation._check_broadcast_merge(dims, {})


def _model_with_an_unknown_op():
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Mystery", ["r"], ["u"], domain="example.unknown"),
             helper.make_node("Add", ["u", "x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.unknown", 1)])


def test_an_op_it_does_not_know_stops_the_inference_there_and_writes_nothing_to_the_working_directory(tmp_path):
    """The inference stops at an unknown op; what it derived before it is written (it is right), and
    unlike onnxruntime's infer_shapes() no model is saved into the current directory."""
    model = _model_with_an_unknown_op()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        shape_annotation.annotate(model)
    finally:
        os.chdir(cwd)
    assert os.listdir(tmp_path) == []
    shapes = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.value_info}
    assert shapes.get("r") == ["batch", 4]
    assert "u" not in shapes and "y" not in shapes  # nothing guessed past the unknown op


def test_a_failing_inference_leaves_the_model_as_it_was_with_one_warning(monkeypatch):
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    def broken(self):
        raise AssertionError("a bug in the inference")

    monkeypatch.setattr(SymbolicShapeInference, "_infer_impl", broken)
    shape_annotation._warned.clear()
    model = _model_with_an_unknown_op()
    before = model.SerializeToString()
    with pytest.warns(RuntimeWarning, match=r"AssertionError at test_shape_annotation.py:\d+: a bug in the inference") as caught:
        assert shape_annotation.annotate(model) is False
        assert shape_annotation.annotate(model) is False
    assert len(caught) == 1
    assert model.SerializeToString() == before
