"""Evaluation for the recipe loop: metrics of a trained model on a held-out set, and how to rank them.

Runs `trainer.eval_step` (dropout off, no state change) over the eval set in order; the metric set
depends on the recipe kind (see `evaluate`).
"""

import math
import time


class Evaluator:
    """Evaluation of a run: every `every` optimizer steps (`maybe_evaluate`, 0: never) and when told
    (`evaluate`: the end of the run). Keeps the last and the best metrics (`state_dict`), and the
    seconds it took (kept out of the throughput). Each evaluation is one metrics.jsonl record
    (`record`) and one console line (`say`); without an eval set it does nothing.
    """

    def __init__(self, trainer, kind, dataset, input_names, batch_size, max_batches, every, record, say):
        self.trainer, self.kind, self.dataset, self.input_names = trainer, kind, dataset, input_names
        self.batch_size, self.max_batches, self.every = batch_size, max_batches, every
        self.record, self.say = record, say
        self.best = self.best_step = self.last = None
        self.seconds = 0.0

    def state_dict(self):
        return {"best": self.best, "best_step": self.best_step, "last_eval": self.last}

    def load_state_dict(self, state):
        self.best, self.best_step, self.last = state["best"], state["best_step"], state.get("last_eval")

    def maybe_evaluate(self, step):
        """Metrics when `step` is a multiple of the interval (and there is an eval set), else None."""
        if not self.every or step % self.every:
            return None
        return self.evaluate(step)

    def evaluate(self, step):
        if self.dataset is None:
            return None
        started = time.perf_counter()
        metrics = evaluate(self.trainer, self.kind, self.dataset, self.input_names, self.batch_size,
                           self.max_batches)
        self.seconds += time.perf_counter() - started
        if not metrics:
            return None
        self.record({"kind": "eval", "step": step, **metrics})
        self.last = {"step": step, **metrics}
        if better(self.kind, metrics, self.best):
            self.best, self.best_step = dict(metrics), step
        self.say(f"eval at step {step}: {summary(self.kind, metrics)}")
        return metrics


def evaluate(trainer, kind, dataset, input_names, batch_size, max_batches=None):
    """Evaluation metrics over `dataset` (at most `max_batches` batches, in order).

    bert-pretraining: eval_loss (the model's loss, MLM + NSP, over the whole set: the MLM part
    averaged over every masked token of the set, not batch means weighted by examples, as batches
    hold different numbers of masked tokens), mlm_loss, mlm_perplexity, mlm_accuracy, nsp_loss,
    nsp_accuracy. gpt2: eval_loss, perplexity. bert-classification: eval_loss, accuracy, f1 (binary:
    of label index 1; more labels: macro average), majority_baseline (the most frequent label's share).
    """
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    loss_sum = examples = 0.0
    mlm_sum = mlm_count = mlm_correct = nsp_sum = nsp_correct = 0.0
    predictions, labels = [], []
    for index, batch in enumerate(loader):
        if max_batches is not None and index >= max_batches:
            break
        outputs = trainer.eval_step(**{name: batch[name] for name in input_names})
        n = batch["input_ids"].shape[0]
        loss_sum += float(outputs[0]) * n
        examples += n
        if kind == "bert-pretraining":
            logits, target = outputs[1].float(), batch["labels"]
            mask = target != -100
            if mask.any():
                picked = logits[mask]
                mlm_sum += float(torch.nn.functional.cross_entropy(picked, target[mask], reduction="sum"))
                mlm_correct += float((picked.argmax(-1) == target[mask]).sum())
                mlm_count += float(mask.sum())
            nsp_logits, nsp_target = outputs[2].float(), batch["next_sentence_label"]
            nsp_sum += float(torch.nn.functional.cross_entropy(nsp_logits, nsp_target, reduction="sum"))
            nsp_correct += float((nsp_logits.argmax(-1) == nsp_target).sum())
        elif kind == "bert-classification":
            predictions.append(outputs[1].argmax(-1))
            labels.append(batch["labels"])
    if not examples:
        return {}
    metrics = {"eval_loss": loss_sum / examples}
    if kind == "gpt2":
        metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 700.0))
    elif kind == "bert-pretraining":
        if mlm_count:
            metrics["mlm_loss"] = mlm_sum / mlm_count
            metrics["mlm_perplexity"] = math.exp(min(metrics["mlm_loss"], 700.0))
            metrics["mlm_accuracy"] = mlm_correct / mlm_count
            # The model's loss as one batch of the whole set would give it (see the docstring).
            metrics["eval_loss"] = metrics["mlm_loss"] + nsp_sum / examples
        metrics["nsp_loss"] = nsp_sum / examples
        metrics["nsp_accuracy"] = nsp_correct / examples
    else:
        pred, gold = torch.cat(predictions), torch.cat(labels)
        metrics["accuracy"] = float((pred == gold).float().mean())
        metrics["f1"] = f1_score(pred, gold, int(max(int(gold.max()), int(pred.max())) + 1))
        # What always answering the most frequent dev label would score: the bar accuracy must clear.
        metrics["majority_baseline"] = float(torch.bincount(gold).max()) / len(gold)
    metrics["eval_examples"] = int(examples)
    return metrics


def f1_score(pred, gold, num_labels):
    """F1 of label 1 for two labels, else the macro average over labels."""
    def f1_of(label):
        tp = float(((pred == label) & (gold == label)).sum())
        fp = float(((pred == label) & (gold != label)).sum())
        fn = float(((pred != label) & (gold == label)).sum())
        return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)

    if num_labels <= 2:
        return f1_of(1)
    return sum(f1_of(label) for label in range(num_labels)) / num_labels


def summary(kind, metrics):
    """The headline metrics of `kind` as one line ("eval_loss 6.7750, mlm_perplexity 449.23, ...")."""
    keys = {"bert-pretraining": ("eval_loss", "mlm_perplexity", "mlm_accuracy", "nsp_accuracy"),
            "gpt2": ("eval_loss", "perplexity"),
            "bert-classification": ("eval_loss", "accuracy", "f1", "majority_baseline")}[kind]
    parts = []
    for key in keys:
        if key in metrics:
            value = metrics[key]
            parts.append(f"{key} {value:.2f}" if "perplexity" in key else f"{key} {value:.4f}")
    return ", ".join(parts)


def better(kind, metrics, best):
    """Whether `metrics` beat `best` (classification: accuracy; language models: eval loss)."""
    if not metrics:
        return False
    if best is None:
        return True
    if kind == "bert-classification":
        return metrics["accuracy"] > best["accuracy"]
    return metrics["eval_loss"] < best["eval_loss"]
