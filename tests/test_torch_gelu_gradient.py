"""GELU's gradient computed by torch inside the session (engine/torch_gelu_gradient.py): training equals
torch's step by step, the kernel is gone from the graph, and no step leaves a context behind."""

import copy

import numpy as np
import torch
import torch.nn.functional as F
from models import cross_entropy

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine import python_op


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

    # every context of these steps was handed back by its PythonOpGrad (none stays in onnxruntime's pool)
    ours = set(python_op._live_contexts) - contexts_before
    assert len(ours) == 2
    assert all(python_op._live_contexts[key]() is None for key in ours)


_CACHED_RUN = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_torch_gelu_gradient import DESC, GeluMLP, batches
from models import cross_entropy
from orttrainer import ORTTrainer, ORTTrainerOptions, optim
torch.manual_seed(0)
trainer = ORTTrainer(GeluMLP(), DESC, optim.SGDConfig(lr=0.5), loss_fn=cross_entropy,
                     options=ORTTrainerOptions({{"device": {{"id": "cpu"}}, "utils": {{"export_cache_dir": {cache!r}}}}}))
x, y = batches(1)[0]
print("loss", trainer.train_step(x, y)[0].item())
print("cached", "export_cache_load" in trainer.startup_seconds)
"""


def test_cached_training_graph_runs_in_a_new_process(tmp_path):
    """The export cache stores the training graph with its GELU PythonOps; a second process that loads
    it must register the Function before the session runs (two fresh interpreters, same cache)."""
    import os
    import subprocess
    import sys

    script = _CACHED_RUN.format(tests=os.path.dirname(__file__), cache=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (dict(line.split(" ", 1) for line in run.stdout.splitlines()) for run in runs)
    assert second["cached"] == "True"
    assert float(first["loss"]) == float(second["loss"])
