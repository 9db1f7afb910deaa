"""Metric helpers of the recipe loop (orttrainer/run/evaluation.py), against hand-computed values."""

import pytest
import torch

from orttrainer.run import evaluation


def test_f1_binary_is_that_of_label_one():
    pred = torch.tensor([1, 1, 0, 0, 1])
    gold = torch.tensor([1, 0, 0, 1, 1])
    # label 1: tp 2, fp 1, fn 1 -> 2*2 / (4 + 1 + 1)
    assert evaluation.f1_score(pred, gold, 2) == pytest.approx(4 / 6)


def test_f1_multiclass_is_the_macro_average():
    pred = torch.tensor([0, 1, 2, 2])
    gold = torch.tensor([0, 2, 2, 1])
    # label 0: 1.0; label 1: tp 0 -> 0.0; label 2: tp 1, fp 1, fn 1 -> 0.5
    assert evaluation.f1_score(pred, gold, 3) == pytest.approx((1.0 + 0.0 + 0.5) / 3)


def test_better_ranks_classification_by_accuracy_and_language_models_by_loss():
    assert evaluation.better("bert-classification", {"accuracy": 0.6, "eval_loss": 9.0},
                             {"accuracy": 0.5, "eval_loss": 1.0})
    assert not evaluation.better("gpt2", {"eval_loss": 2.0}, {"eval_loss": 1.5})
    assert evaluation.better("gpt2", {"eval_loss": 1.0}, None)
    assert not evaluation.better("gpt2", {}, None)  # no eval examples: nothing to rank


def test_summary_formats_the_headline_metrics():
    line = evaluation.summary("bert-pretraining", {"eval_loss": 6.775, "mlm_perplexity": 449.234,
                                                   "mlm_accuracy": 0.0854, "nsp_accuracy": 0.59375})
    assert line == "eval_loss 6.7750, mlm_perplexity 449.23, mlm_accuracy 0.0854, nsp_accuracy 0.5938"


def test_bert_eval_loss_averages_over_every_masked_token_of_the_set():
    """eval_loss of bert-pretraining against the torch model's loss on the whole eval set in one batch
    (its MLM part: the mean over all masked tokens); the batches hold 1 and 6 masked tokens per example,
    so batch means weighted by examples give a different number."""
    import copy

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim
    from orttrainer.run import hf_models as models

    pytest.importorskip("transformers")
    config = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    built = models.build_model("bert-pretraining", config, seed=3, vocab_size=60, seq_length=16)
    reference = copy.deepcopy(built.model).eval()
    generator = torch.Generator().manual_seed(0)
    dataset = []
    for index in range(8):
        ids = torch.randint(5, 60, (16,), generator=generator)
        labels = torch.full((16,), -100)
        masked = 1 if index < 4 else 6  # batch 1: 4 masked tokens, batch 2: 24
        labels[1:1 + masked] = ids[1:1 + masked]
        dataset.append({"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long),
                        "token_type_ids": torch.zeros(16, dtype=torch.long), "labels": labels,
                        "next_sentence_label": torch.tensor(index % 2)})
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"onnx_opset_version": 17}})
    trainer = ORTTrainer(built.model, built.desc, optim.AdamConfig(lr=1e-3), options=options)
    names = [name for name, _ in built.desc["inputs"]]
    metrics = evaluation.evaluate(trainer, "bert-pretraining", dataset, names, batch_size=4)

    def loss_of(rows):
        batch = {name: torch.stack([row[name] for row in rows]) for name in names}
        with torch.no_grad():
            return float(reference(**batch).loss)

    whole_set = loss_of(dataset)
    per_batch_by_examples = (loss_of(dataset[:4]) + loss_of(dataset[4:])) / 2
    assert abs(whole_set - per_batch_by_examples) > 1e-3  # the two definitions differ on this set
    assert metrics["eval_loss"] == pytest.approx(whole_set, rel=1e-4)
    assert metrics["eval_loss"] == pytest.approx(metrics["mlm_loss"] + metrics["nsp_loss"], rel=1e-6)
