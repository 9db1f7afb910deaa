"""A tied LM head's weight gradient runs right after the logits' gradient exists
(`engine/memory_order.head_weight_gradient_first`), so the [tokens, vocab] gradient is freed early, as
PyTorch's autograd does; the losses and weights stay bitwise those of the graph without the hint."""

import numpy as np
import onnx
import torch
import torch.nn.functional as F

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine import training_graph

VOCAB, HIDDEN, BATCH, SEQ = 16384, 8, 2, 6  # the hint applies to heads of >= 16384 rows


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids, labels):
        h = torch.tanh(self.mix(self.emb(ids)))
        logits = F.linear(h, self.emb.weight)  # the decoder shares the embedding table
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


DESC = {"inputs": [("ids", [BATCH, SEQ]), ("labels", [BATCH, SEQ])], "outputs": [("loss", [], True)]}


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(n)]


def train(steps, saved=None):
    torch.manual_seed(0)
    options = {"device": {"id": "cpu"}, "utils": {"export_cache": False}}
    if saved:
        options["debug"] = {"graph_save_paths": {"model_with_training_graph_after_optimization_path": saved}}
    trainer = ORTTrainer(TiedLM(), DESC, optim.AdamConfig(lr=1e-2), options=ORTTrainerOptions(options))
    losses = [trainer.train_step(*b).item() for b in batches(steps)]
    return losses, {k: v.numpy().copy() for k, v in trainer.state_dict(pytorch_format=True).items()}


def _producers(path):
    """onnxruntime's optimized graph as saved (in its topological order): tensor -> (position, node)."""
    return {name: (k, node) for k, node in enumerate(onnx.load(path).graph.node) for name in node.output}


def test_head_weight_gradient_runs_before_the_embedding_gradient(tmp_path):
    path = str(tmp_path / "optimized.onnx")
    train(1, saved=path)
    made = _producers(path)
    summed = made["emb.weight_grad"][1]
    assert summed.op_type == "Sum"
    partials = [made[name] for name in summed.input]
    gather = [k for k, node in partials if node.op_type in ("GatherGrad", "ScatterElements")]
    head = [k for k, node in partials if node.op_type not in ("GatherGrad", "ScatterElements")]
    assert len(gather) == 1 and len(head) == 1
    # The decoder's partial (which reads the [tokens, vocab] logits gradient) runs before the
    # embedding's, i.e. before the rest of the backward pass; without the hint it ran after it.
    assert head[0] < gather[0]


def test_losses_and_weights_bitwise_unchanged(monkeypatch):
    hinted = train(6)
    monkeypatch.setattr(training_graph, "head_weight_gradient_first", lambda *a, **k: 0)
    plain = train(6)
    assert hinted[0] == plain[0]
    assert hinted[1].keys() == plain[1].keys()
    for name in hinted[1]:
        assert np.array_equal(hinted[1][name], plain[1][name]), name
