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


def test_gelu_gradient_from_torch_trains_like_torch():
    torch.manual_seed(0)
    model = GeluMLP()
    ref = copy.deepcopy(model)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.5), loss_fn=cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    contexts_before = set(python_op._live_contexts)
    for x, y in batches():
        loss = trainer.train_step(x, y)[0]
        sgd.zero_grad()
        ref_loss = cross_entropy(ref(x), y)
        ref_loss.backward()
        sgd.step()
        np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-5)
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)

    nodes = trainer._training_session.graph.model.graph.node
    assert not any(n.op_type == "GeluGrad" for n in nodes)
    torch_nodes = [n for n in nodes if n.op_type in ("PythonOp", "PythonOpGrad") and n.name.endswith(("_torch", "_torch_grad"))]
    assert len(torch_nodes) == 4  # a pair per GELU

    # every context of these steps was handed back by its PythonOpGrad (none stays in onnxruntime's pool)
    ours = set(python_op._live_contexts) - contexts_before
    assert len(ours) == 2
    assert all(python_op._live_contexts[key]() is None for key in ours)
