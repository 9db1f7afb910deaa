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
