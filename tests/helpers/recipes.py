"""Recipe runs through `orttrainer train` (in process), at the tests' smallest sizes, and what they
wrote: metrics.jsonl records, results.json, checkpoint weights."""

import json
from pathlib import Path

import numpy as np

from orttrainer import _checkpoint_storage
from orttrainer.cli import main
from orttrainer.run import hf_models as models

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
TINY = ["bert-pretrain-tiny.yaml", "bert-pretrain-phase2-tiny.yaml", "gpt2-pretrain-tiny.yaml",
        "bert-finetune-classification-tiny.yaml"]

SMALL_DATA = ["data.corpus_max_mb=0.25", "data.vocab_size=1024", "data.eval_fraction=0.1",
              "run.eval_batches=2"]
SMALL_BERT = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "data.batch_size=8",
              "data.seq_length=64", "data.bert.max_predictions_per_seq=10", "data.bert.dupe_factor=1"]
FROZEN_EMBEDDINGS = ("trainer.utils.frozen_weights=[bert.embeddings.word_embeddings.weight,"
                     "bert.embeddings.position_embeddings.weight,"
                     "bert.embeddings.token_type_embeddings.weight]")


def sets(cache, *extra):
    return [f"data.cache_dir={cache}", *SMALL_DATA, *extra]


def train(recipe, out, overrides, resume=None):
    argv = ["train", str(RECIPES / recipe), "--output-dir", str(out)]
    for item in overrides:
        argv += ["--set", item]
    if resume:
        argv += ["--resume", resume]
    return main(argv)


def records(out, kind=None):
    with open(Path(out) / "metrics.jsonl", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return [r for r in lines if kind is None or r["kind"] == kind]


TIMING_FIELDS = ("tokens_per_s", "mfu", "peak_rss_mb")  # measured, not computed: differ between runs


def comparable(out):
    """metrics.jsonl without the timing (and memory) fields."""
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records(out)]


def train_losses(out):
    return [r["loss"] for r in records(out, "train")]


def falls(losses):
    assert len(losses) >= 4, losses
    assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses


def results(out):
    return json.loads((Path(out) / "results.json").read_text())


def weights(folder):
    state = _checkpoint_storage.load(Path(folder) / models.CHECKPOINT_FILE, key="model/full_precision")
    return {k: np.asarray(v) for k, v in state.items()}
