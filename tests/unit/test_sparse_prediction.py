"""The masked-LM head on labelled rows only (engine/graph/sparse_prediction.py), against PyTorch and against
the unrewritten graph; the rewrite applied where the pattern holds and refused everywhere else."""

import copy
import warnings
from unittest import mock

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import training
from onnx import TensorProto, helper, numpy_helper

from orttrainer import amp, optim
from orttrainer.engine.graph import training_graph as tg
from orttrainer.engine.graph.rewrites import decompose_softmax_cross_entropy
from orttrainer.engine.graph.sparse_prediction import sparse_masked_lm_head

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS = 120, 16, 4, 10
INPUTS = [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]),
          ("token_type_ids", ["batch", "seq"]), ("labels", ["batch", "seq"]), ("next_sentence_label", ["batch"])]
LOSS_ONLY = {"inputs": INPUTS, "outputs": [("loss", [], True)]}
ALL_OUTPUTS = {"inputs": INPUTS, "outputs": [("loss", [], True), ("prediction_logits", ["batch", "seq", VOCAB]),
                                             ("seq_relationship_logits", ["batch", 2])]}


class PretrainingLoss(torch.nn.Module):
    """BertForPreTraining returning its own loss (MLM + NSP) only, as bench/train_bench/models.py runs it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids, labels, next_sentence_label):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                          labels=labels, next_sentence_label=next_sentence_label).loss


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForPreTraining(config)


def batches(n, masked=0.15, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g)
        chosen = torch.rand(BATCH, SEQ, generator=g) < masked
        if masked > 0:
            chosen[:, 0] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        out.append((ids, torch.ones(BATCH, SEQ, dtype=torch.long), torch.zeros(BATCH, SEQ, dtype=torch.long),
                    labels, torch.randint(0, 2, (BATCH,), generator=g)))
    return out


def train(module, desc, data, rewrite=True, optim_config=None, **options):
    """(losses, trainer, rewrites made): ORTTrainer with Adam, the rewrite on or switched off."""
    made = []

    def recorded(model):
        made.append(sparse_masked_lm_head(model) if rewrite else 0)

    opts = {"utils": {"grad_norm_clip": False, "export_cache": False}}
    for key, value in options.items():
        opts.setdefault(key, {}).update(value)
    with mock.patch.object(tg, "sparse_masked_lm_head", recorded):
        trainer = training.make_trainer(module, desc, optim_config or optim.AdamConfig(lr=1e-3), **opts)
        losses = training.train(trainer, data)
    return losses, trainer, made


def weights(trainer):
    return {k: v.numpy() for k, v in trainer.state_dict(pytorch_format=True).items()}


def assert_same(a, b, rtol=1e-4, atol=1e-4):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


def test_bert_pretraining_matches_torch_and_the_unrewritten_graph():
    data = batches(STEPS)
    model = PretrainingLoss(tiny_bert())
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    eager = []
    for batch in data:
        optimizer.zero_grad()
        loss = reference(*batch)
        loss.backward()
        optimizer.step()
        eager.append(loss.item())

    losses, trainer, made = train(copy.deepcopy(model), LOSS_ONLY, data)
    assert made == [1]  # the MLM loss; the NSP loss has no ignored rows to drop (no MatMul decoder)
    np.testing.assert_allclose(losses, eager, rtol=1e-4, atol=1e-4)
    assert_same(weights(trainer), {k: v.detach().numpy() for k, v in reference.state_dict().items()})

    plain, plain_trainer, made = train(copy.deepcopy(model), LOSS_ONLY, data, rewrite=False)
    assert made == [0]
    np.testing.assert_allclose(losses, plain, rtol=1e-5, atol=1e-6)
    assert_same(weights(trainer), weights(plain_trainer), rtol=1e-5, atol=1e-6)


def test_logits_described_as_an_output_keep_the_full_head():
    """Legacy `--ort-outputs all`: the logits are a graph output, every row is needed."""
    model = tiny_bert()
    losses, trainer, made = train(model, ALL_OUTPUTS, batches(1))
    assert made == [0]
    assert list(trainer.eval_step(*batches(1)[0])[1].shape) == [BATCH, SEQ, VOCAB]


def test_gradient_accumulation_matches_the_unrewritten_graph():
    data = batches(6, seed=1)
    model = PretrainingLoss(tiny_bert())
    runs = [train(copy.deepcopy(model), LOSS_ONLY, data, rewrite=rewrite, batch={"gradient_accumulation_steps": 3})
            for rewrite in (True, False)]
    assert runs[0][2] == [1]
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    assert_same(weights(runs[0][1]), weights(runs[1][1]), rtol=1e-5, atol=1e-6)


def test_no_labelled_row_behaves_like_the_unrewritten_graph():
    """K = 0: the MLM mean is 0/0 = NaN in both graphs (as in torch), and so is every update."""
    data = batches(1, masked=0.0)
    assert bool((data[0][3] == -100).all())
    model = PretrainingLoss(tiny_bert())
    sparse, sparse_trainer, made = train(copy.deepcopy(model), LOSS_ONLY, data)
    plain, plain_trainer, _ = train(copy.deepcopy(model), LOSS_ONLY, data, rewrite=False)
    assert made == [1]
    with torch.no_grad():
        eager = model(*data[0]).item()
    np.testing.assert_allclose(sparse, plain, equal_nan=True)
    np.testing.assert_allclose(sparse, [eager], equal_nan=True)
    for name, value in weights(sparse_trainer).items():
        np.testing.assert_array_equal(np.isnan(value), np.isnan(weights(plain_trainer)[name]), err_msg=name)


def test_mixed_precision_matches_the_unrewritten_graph():
    data = batches(4, seed=2)
    model = PretrainingLoss(tiny_bert())
    mixed = {"enabled": True, "loss_scaler": None, "compute_dtype": "float16"}
    runs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixed_precision.compute_dtype is 'float16' on the CPU")
        for rewrite in (True, False):
            mixed["loss_scaler"] = amp.DynamicLossScaler(loss_scale=1024.0)
            runs.append(train(copy.deepcopy(model), LOSS_ONLY, data, rewrite=rewrite, mixed_precision=dict(mixed)))
    assert runs[0][2] == [1]
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=2e-3, atol=2e-3)
    assert_same(weights(runs[0][1]), weights(runs[1][1]), rtol=2e-3, atol=2e-3)


def test_export_cache_serves_the_rewritten_graph(tmp_path):
    """The cache keeps the training graph (its key covers the engine's source): a warm start builds
    nothing and trains the rewritten graph, with the same losses."""
    data = batches(3, seed=3)
    model = PretrainingLoss(tiny_bert())
    cache = {"export_cache": True, "export_cache_dir": str(tmp_path)}
    cold, _, made_cold = train(copy.deepcopy(model), LOSS_ONLY, data, utils=cache)
    warm, trainer, made_warm = train(copy.deepcopy(model), LOSS_ONLY, data, utils=cache)
    assert trainer._build.source == "export cache" and made_cold == [1] and made_warm == []
    cached = [onnx.load(str(path), load_external_data=False) for path in tmp_path.rglob("training.onnx")]
    assert len(cached) == 1 and "NonZero" in [n.op_type for n in cached[0].graph.node]
    np.testing.assert_allclose(warm, cold, rtol=1e-6)


# Hand-built heads: h [B, T, H] → MatMul(W) → Add(bias) → Reshape([-1, C]) → SoftmaxCrossEntropyLoss.
B, T, H, C = 2, 5, 3, 7


def head(reduction="mean", ignore_index=-100, tied=True, bias_shape=(C,), logits_output=False, extra_reader=False,
         reshape_to=(-1, C), weight_as_input=False, opset=14):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((C, H)).astype(np.float32)
    inits = [numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array(reshape_to, np.int64), "to_rows"),
             numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    nodes = []
    if tied:
        inits.append(numpy_helper.from_array(table, "table"))
        nodes.append(helper.make_node("Transpose", ["table"], ["w"], perm=[1, 0]))
    elif not weight_as_input:
        inits.append(numpy_helper.from_array(table.T.copy(), "w"))
    attrs = {"reduction": reduction} if ignore_index is None else {"reduction": reduction, "ignore_index": ignore_index}
    nodes += [helper.make_node("MatMul", ["h", "w"], ["mm"]),
              helper.make_node("Add", ["bias", "mm"], ["logits"]),
              helper.make_node("Reshape", ["logits", "to_rows"], ["scores"]),
              helper.make_node("Reshape", ["labels", "flat"], ["labels_flat"]),
              helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels_flat"], ["loss"], **attrs)]
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, [B, T, H]),
              helper.make_tensor_value_info("labels", TensorProto.INT64, [B, T])]
    if weight_as_input:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [H, C]))
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [] if reduction != "none" else None)]
    if logits_output:
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [B, T, C]))
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["logits"], ["logit_sum"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("logit_sum", TensorProto.FLOAT, []))
    graph = helper.make_graph(nodes, "head", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def run(model, h, labels, **feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["loss"], {"h": h, "labels": labels, **feeds})[0]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("masked", [0.3, 0.0], ids=["some-labelled", "none-labelled"])
def test_hand_built_head_is_rewritten_with_the_same_loss(tied, masked):
    model = head(tied=tied)
    rewritten = copy.deepcopy(model)
    assert sparse_masked_lm_head(rewritten) == 1
    onnx.checker.check_model(rewritten)
    ops = [n.op_type for n in rewritten.graph.node]
    # the scores' Reshape gone; h's flatten, NonZero's [1, K] -> [K] and 7 more nodes added
    assert "NonZero" in ops and ops.count("Gather") == 2 and ops.count("Reshape") == 3
    assert len(ops) == len(model.graph.node) - 1 + 9
    loss = next(n for n in rewritten.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")
    assert list(loss.input[:1]) == ["logits"]  # [K, C], read directly
    for graph in (model, rewritten):  # as in the training graph (onnxruntime's kernel fails on 0 rows)
        decompose_softmax_cross_entropy(graph)
    rng = np.random.default_rng(1)
    h = rng.standard_normal((B, T, H)).astype(np.float32)
    labels = rng.integers(0, C, (B, T))
    labels[rng.random((B, T)) >= masked] = -100
    expected = run(model, h, labels)
    np.testing.assert_allclose(run(rewritten, h, labels), expected, rtol=1e-6, equal_nan=True)
    assert np.isnan(expected) == (masked == 0.0)


@pytest.mark.parametrize("change", [
    {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": None}, {"logits_output": True},
    {"extra_reader": True}, {"reshape_to": (B * T, C)}, {"bias_shape": (T, C)}, {"tied": False, "weight_as_input": True},
    {"opset": 12},
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_other_shapes_of_the_pattern_are_left_alone(change):
    model = head(**change)
    before = model.SerializeToString()
    assert sparse_masked_lm_head(model) == 0
    assert model.SerializeToString() == before
