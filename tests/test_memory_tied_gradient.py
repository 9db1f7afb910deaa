"""A tied head's weight gradient accumulated by one Gemm (graph_rewrites.tied_weight_gradient_accumulated):
the same values as the Sum + Transpose it replaces (against onnxruntime on that graph and against PyTorch),
and the pattern left alone where its intermediate results are read elsewhere."""

import copy
import functools
from unittest import mock

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine import training_graph as tg
from orttrainer.engine.graph_rewrites import tied_weight_gradient_accumulated

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS = 120, 16, 4, 6
DESC = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]),
                   ("token_type_ids", ["batch", "seq"]), ("labels", ["batch", "seq"]),
                   ("next_sentence_label", ["batch"])], "outputs": [("loss", [], True)]}


class PretrainingLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids, labels, next_sentence_label):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                          labels=labels, next_sentence_label=next_sentence_label).loss


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return PretrainingLoss(transformers.BertForPreTraining(config))


def batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g)
        ids[:, :4] = 7  # repeated ids: rows of the embedding part that sum several tokens
        chosen = torch.rand(BATCH, SEQ, generator=g) < 0.3
        chosen[:, 0] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        out.append((ids, torch.ones(BATCH, SEQ, dtype=torch.long), torch.zeros(BATCH, SEQ, dtype=torch.long),
                    labels, torch.randint(0, 2, (BATCH,), generator=g)))
    return out


def train(module, data, rewrite):
    made = []

    def recorded(model, shapes):  # min_rows=0: the tiny vocabulary takes the rewrite too
        made.append(tied_weight_gradient_accumulated(model, shapes, min_rows=0) if rewrite else 0)

    opts = {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, "export_cache": False}}
    with mock.patch.object(tg, "tied_weight_gradient_accumulated", recorded):
        trainer = ORTTrainer(module, copy.deepcopy(DESC), optim.AdamConfig(lr=1e-3), options=ORTTrainerOptions(opts))
        losses = [trainer.train_step(*batch).item() for batch in data]
    state = {k: v.numpy().copy() for k, v in trainer.state_dict(pytorch_format=True).items()}
    return losses, state, made


def test_tied_bert_head_trains_like_torch_and_the_unrewritten_graph():
    data = batches()
    model = tiny_bert()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    eager = []
    for batch in data:
        optimizer.zero_grad()
        loss = reference(*batch)
        loss.backward()
        optimizer.step()
        eager.append(loss.item())

    losses, state, made = train(copy.deepcopy(model), data, rewrite=True)
    assert made == [1]  # the word embedding, tied to the decoder
    plain, plain_state, made = train(copy.deepcopy(model), data, rewrite=False)
    assert made == [0]
    np.testing.assert_allclose(losses, eager, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(losses, plain, rtol=1e-5, atol=1e-6)
    torch_state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    assert state.keys() == plain_state.keys() == torch_state.keys()
    for name in state:
        np.testing.assert_allclose(state[name], plain_state[name], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(state[name], torch_state[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert not np.array_equal(state["model.bert.embeddings.word_embeddings.weight"],
                              model.state_dict()["model.bert.embeddings.word_embeddings.weight"].numpy())


def head_graph(product="FusedMatMul", extra_reader=None):
    """dW = Sum(part, Transpose(xᵀ · dy)) as the gradient builder writes it for a tied [V, H] weight."""
    attrs = {"transA": 1, "alpha": 0.5}
    domain = "com.microsoft" if product == "FusedMatMul" else ""
    nodes = [helper.make_node(product, ["x", "dy"], ["p"], domain=domain, **attrs),
             helper.make_node("Transpose", ["p"], ["pt"], perm=[1, 0]),
             helper.make_node("Sum", ["part", "pt"], ["W_grad"])]
    outputs = [helper.make_tensor_value_info("W_grad", TensorProto.FLOAT, [7, 3])]
    if extra_reader:
        nodes.append(helper.make_node("Identity", [extra_reader], ["seen"]))
        outputs.append(helper.make_tensor_value_info("seen", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
              for n, s in (("x", [5, 3]), ("dy", [5, 7]), ("part", [7, 3]))]
    graph = helper.make_graph(nodes, "head", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=8)


def run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["W_grad"], feeds)[0]


@pytest.mark.parametrize("product", ["FusedMatMul", "Gemm"])
def test_hand_built_head_gradient_becomes_one_gemm_with_the_same_values(product):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((5, 3), np.float32), "dy": rng.standard_normal((5, 7), np.float32),
             "part": rng.standard_normal((7, 3), np.float32)}
    model = head_graph(product)
    before = run(model, feeds)
    rewritten = copy.deepcopy(model)
    assert tied_weight_gradient_accumulated(rewritten, {"W": (7, 3)}, min_rows=0) == 1
    assert [n.op_type for n in rewritten.graph.node] == ["Gemm"]
    onnx.checker.check_model(rewritten)
    np.testing.assert_allclose(run(rewritten, feeds), before, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(before, 0.5 * feeds["dy"].T @ feeds["x"] + feeds["part"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["product read elsewhere", "transpose read elsewhere", "small weight",
                                  "not a weight"])
def test_other_shapes_of_the_pattern_are_left_alone(case):
    model = head_graph(extra_reader={"product read elsewhere": "p", "transpose read elsewhere": "pt"}.get(case))
    shapes = {"not a weight": {}, "small weight": {"W": (7, 3)}}.get(case, {"W": (7, 3)})
    rows = 8 if case == "small weight" else 0
    before = [n.op_type for n in model.graph.node]
    assert functools.partial(tied_weight_gradient_accumulated, min_rows=rows)(model, shapes) == 0
    assert [n.op_type for n in model.graph.node] == before
