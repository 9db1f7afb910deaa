"""GELU's gradient computed by torch inside the session (engine/graph/torch_gelu_gradient.py): training equals
torch's step by step, the kernel is gone from the graph, dx is written into dy's buffer only where
nothing else reads it, and no step leaves a context behind."""

import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.models import cross_entropy
from onnx import TensorProto, helper

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine.pyop import python_op
from orttrainer.engine.graph import torch_gelu_gradient


class GeluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.fc3 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


DESC = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])], "outputs": [("loss", [], True), ("logits", ["batch", 4])]}


def batches(n=8):
    g = torch.Generator().manual_seed(1)
    # x spread over [-6, 6]: GELU's slope varies most there, a wrong gradient shows at once
    return [(torch.randn(16, 6, generator=g) * 3, torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def train_against_torch(trainer, ref, steps=4):
    """`steps` SGD steps of the trainer and of `ref` (torch, lr 0.5) on the same batches: losses and
    trained weights agree."""
    sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in batches(steps):
        loss = trainer.train_step(x, y)[0]
        sgd.zero_grad()
        ref_loss = cross_entropy(ref(x), y)
        ref_loss.backward()
        sgd.step()
        np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-5)
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_gelu_gradient_from_torch_trains_like_torch():
    torch.manual_seed(0)
    model = GeluMLP()
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.5), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    contexts_before = set(python_op._live_contexts)
    train_against_torch(trainer, ref, steps=8)

    nodes = trainer._training_session.graph.model.graph.node
    assert not any(n.op_type == "GeluGrad" for n in nodes)
    torch_nodes = [n for n in nodes if n.op_type in ("PythonOp", "PythonOpGrad") and n.name.endswith(("_torch", "_torch_grad"))]
    assert len(torch_nodes) == 4  # a pair per GELU
    for node in torch_nodes:  # each dx declared as written into its dy (node input 1), which it reads
        if node.op_type == "PythonOpGrad":
            reuse = next(a for a in node.attribute if a.name == "tensor_reuse_map")
            assert list(reuse.ints) == [1, -1]
            assert node.input[1] == next(n for n in nodes if n.name == node.name[:-len("_grad")]).input[0]

    # every context of these steps was handed back by its PythonOpGrad (none stays in onnxruntime's pool)
    ours = set(python_op._live_contexts) - contexts_before
    assert len(ours) == 2
    assert all(python_op._live_contexts[key]() is None for key in ours)


TESTS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers/ lives there
_CACHED_RUN = """
import sys, torch
sys.path[:0] = [{tests!r}, {helpers_root!r}]
from test_torch_gelu_gradient import DESC, GeluMLP, batches
from helpers.models import cross_entropy
from orttrainer import ORTTrainer, ORTTrainerOptions, optim
torch.manual_seed(0)
trainer = ORTTrainer(GeluMLP(), DESC, optim.SGDConfig(lr=0.5), loss_fn=cross_entropy,
                     options=ORTTrainerOptions({{"device": {{"id": "cpu"}}, "utils": {{"export_cache_dir": {cache!r}}}}}))
x, y = batches(1)[0]
print("loss", trainer.train_step(x, y)[0].item())
print("cached", "export_cache_load" in trainer.startup_seconds)
"""


@pytest.mark.multiprocess
def test_cached_training_graph_runs_in_a_new_process(tmp_path):
    """The export cache stores the training graph with its GELU PythonOps; a second process that loads
    it must register the Function before the session runs (two fresh interpreters, same cache)."""
    import os
    import subprocess
    import sys

    script = _CACHED_RUN.format(tests=os.path.dirname(__file__), helpers_root=TESTS_ROOT, cache=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (dict(line.split(" ", 1) for line in run.stdout.splitlines()) for run in runs)
    assert second["cached"] == "True"
    assert float(first["loss"]) == float(second["loss"])


def _gelu_grad_graph(extra_nodes, outputs=("dx",)):
    """dz = Mul(g, s) -> Identity -> dy; GeluGrad(dy, x) -> dx; plus `extra_nodes` reading what they like."""
    shape = ["b", 8]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [helper.make_node("Mul", ["g", "s"], ["dz"]),
             helper.make_node("Identity", ["dz"], ["dy"]),
             helper.make_node("GeluGrad", ["dy", "x"], ["dx"], domain="com.microsoft", name="gelu_grad")]
    graph = helper.make_graph(nodes + extra_nodes, "g", [value("g"), value("s"), value("x")],
                              [value(o) for o in outputs], value_info=[value("dz"), value("dy")])
    return helper.make_model(graph)


@pytest.mark.parametrize("extra, outputs, rewritten", [
    ([], ("dx",), False),                                                   # dx is a graph output
    ([helper.make_node("Relu", ["dx"], ["out"])], ("out",), True),          # only GeluGrad reads dy
    ([helper.make_node("Relu", ["dx"], ["out"]), helper.make_node("Neg", ["dy"], ["dy2"])],
     ("out", "dy2"), False),                                                # dy has another reader
    ([helper.make_node("Relu", ["dx"], ["out"]), helper.make_node("Neg", ["dz"], ["dz2"])],
     ("out", "dz2"), False),                                                # so has the buffer dy views
], ids=["dx-returned", "sole-reader", "dy-read-again", "viewed-buffer-read-again"])
def test_dx_is_written_into_dy_only_where_nothing_else_reads_that_buffer(extra, outputs, rewritten):
    """Writing dx into dy's memory overwrites dy, and through a view op the tensor it views: any other
    reader of either, or a dx the graph returns (its buffer would be freed under the caller), keeps
    onnxruntime's GeluGrad kernel."""
    model = _gelu_grad_graph(extra, outputs)
    assert torch_gelu_gradient.gelu_gradient_in_torch(model) == int(rewritten)
    ops = [n.op_type for n in model.graph.node]
    assert ("GeluGrad" in ops) != rewritten
    assert ("PythonOpGrad" in ops) == rewritten


def test_a_gradient_written_in_place_goes_back_without_holding_the_sessions_buffer():
    """onnxruntime keeps a PythonOpGrad output until the run ends; the view handed back must not keep
    dy's storage (the arena's buffer) alive, and a gradient at another address is refused."""
    dy, x = torch.randn(4, 8), torch.randn(4, 8)
    expected = torch.ops.aten.gelu_backward(dy, x)
    holders = torch._C._storage_Use_Count(dy.untyped_storage()._cdata)
    dx, unused = torch_gelu_gradient.TorchGeluGradient.backward(None, dy, x)
    view = python_op._written_in_place("gelu", dx, dy)
    handed_back = torch.utils.dlpack.to_dlpack(view)  # what the runner gives onnxruntime
    assert view.data_ptr() == dy.data_ptr() and unused is None
    torch.testing.assert_close(view, expected, rtol=0, atol=0)
    assert view.untyped_storage()._cdata != dy.untyped_storage()._cdata  # not dy's storage, nor a view of it
    assert torch._C._storage_Use_Count(dy.untyped_storage()._cdata) == holders
    del handed_back
    with pytest.raises(python_op.UnsupportedFunctionError, match="incoming gradient's own memory"):
        python_op._written_in_place("gelu", dx.clone(), dy)
