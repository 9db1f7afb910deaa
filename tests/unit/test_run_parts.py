"""The run loop's parts on their own: Checkpointer, Reporter and Evaluator decide their intervals and
round-trip their state_dict, on a tiny real ORTTrainer (no recipe data, no model building)."""

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orttrainer.run import evaluation
from orttrainer.run import hf_models as models
from orttrainer.run.checkpointer import USER_DICT_KEY, Checkpointer
from orttrainer.run.ranks import Ranks
from orttrainer.run.recipe.spec import load_recipe
from orttrainer.run.report.reporter import METRICS_FILE, Console, Reporter, read_metrics

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
VOCAB, LENGTH = 20, 4


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits


DESC = {"inputs": [("input_ids", ["batch", LENGTH]), ("labels", ["batch", LENGTH])],
        "outputs": [("loss", [], True), ("logits", ["batch", LENGTH, VOCAB])]}


def _batch(seed, n=2):
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.roll(1, dims=1)}


@pytest.fixture(scope="module")
def trainer():
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    torch.manual_seed(0)
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"onnx_opset_version": 17}})
    trainer = ORTTrainer(TinyLM(), DESC, optim.AdamConfig(lr=1e-3), options=options)
    trainer.train_step(**_batch(0))  # builds the session: state_dict() holds the weights from here on
    return trainer


class _Counter:
    """A part of the run with state: what the Checkpointer puts into the loop state."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}


def _checkpointer(out, trainer, every, keep=0, states=()):
    return Checkpointer(out, every, keep, trainer, Ranks(), list(states), lambda: {"model.json": "{}"},
                        "recipe: tiny\n", lambda text: None)


def test_checkpointer_saves_at_multiples_of_its_interval_only(trainer, tmp_path):
    counter = _Counter()
    ckpt = _checkpointer(tmp_path, trainer, every=2, states=[counter])
    saved = []
    for step in range(1, 6):
        counter.step = step
        saved.append(ckpt.maybe_save(step))
    assert saved == [None, tmp_path / "checkpoint-2", None, tmp_path / "checkpoint-4", None]
    assert [p.name for p in models.complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    assert ckpt.last == tmp_path / "checkpoint-4"
    assert (tmp_path / "checkpoint-4" / "recipe.yaml").read_text() == "recipe: tiny\n"
    # The loop state of a checkpoint: the parts' state_dicts, the RNG states and the recipe.
    from orttrainer import _checkpoint_storage

    encoded = _checkpoint_storage.load(tmp_path / "checkpoint-4" / models.CHECKPOINT_FILE, key="user_dict")
    state = _checkpoint_storage.decode_user_dict(encoded)[USER_DICT_KEY]
    assert state["version"] == 1 and state["step"] == 4 and state["recipe"] == "recipe: tiny\n"
    assert set(state["rng"]) == {"python", "numpy", "torch"}


def test_checkpointer_interval_zero_never_saves_but_save_forces_and_keep_rotates(trainer, tmp_path):
    ckpt = _checkpointer(tmp_path, trainer, every=0, keep=1)
    assert all(ckpt.maybe_save(step) is None for step in range(1, 5))
    assert not models.complete_checkpoints(tmp_path)
    assert ckpt.save(3, micro=1) == tmp_path / "checkpoint-3-1"
    assert ckpt.save(3, micro=1) == tmp_path / "checkpoint-3-1"  # the same state: not written twice
    ckpt.save(5)
    assert [p.name for p in models.complete_checkpoints(tmp_path)] == ["checkpoint-5"]


def test_checkpointer_state_dict_round_trips_the_rng_states(trainer, tmp_path):
    ckpt = _checkpointer(tmp_path, trainer, every=1)
    state = json.loads(json.dumps(ckpt.state_dict()))  # stored as JSON in the checkpoint
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ckpt.load_state_dict(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


def _reporter(out, trainer, log_every=3, end_step=7):
    recipe = load_recipe(RECIPES / "gpt2-pretrain-tiny.yaml", [f"run.log_every={log_every}"], out)
    stream = io.StringIO()
    reporter = Reporter(out, recipe, Console(False, stream), Ranks(), trainer, end_step=end_step,
                        seq_length=LENGTH, tokens_per_micro=2 * LENGTH, flops_per_token=1.0,
                        matmul_gflops=None, t_start=0.0, lr=lambda: 1e-3)
    return reporter, stream


def test_reporter_logs_every_log_every_steps_and_at_the_last(trainer, tmp_path):
    reporter, stream = _reporter(tmp_path, trainer)
    reporter.open(0, resumed=False)
    logged = []
    for step in range(1, 8):
        reporter.count(1.0 + step, seconds=0.5)
        if reporter.maybe_log(step, 1.0 + step, skipped=0):
            logged.append(step)
    reporter.close()
    assert logged == [3, 6, 7]
    records = list(read_metrics(tmp_path / METRICS_FILE))
    assert [(r["kind"], r["step"]) for r in records] == [("train", 3), ("train", 6), ("train", 7)]
    assert records[0]["loss"] == pytest.approx((2 + 3 + 4) / 3) and records[0]["micro_steps"] == 3
    assert records[0]["tokens_per_s"] == pytest.approx(3 * 2 * LENGTH / 1.5)
    assert [line.split(" | ")[0] for line in stream.getvalue().splitlines()] == \
        ["step 3/7", "step 6/7", "step 7/7"]
    assert reporter.first_loss["step"] == 3 and reporter.last_loss["step"] == 7


def test_reporter_state_dict_round_trip_continues_the_window_and_counters(trainer, tmp_path):
    reporter, _ = _reporter(tmp_path, trainer)
    reporter.count(2.0)  # the first call: start-up, not timed
    reporter.count(4.0, seconds=1.0)
    state = json.loads(json.dumps(reporter.state_dict()))
    resumed, _ = _reporter(tmp_path, trainer)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == reporter.state_dict()
    assert resumed.window["losses"] == 2 and resumed.train_seconds == 1.0
    assert resumed.train_tokens == 2 * LENGTH


def test_evaluator_evaluates_at_multiples_of_its_interval_and_keeps_the_best(trainer):
    records, lines = [], []
    dataset = [{name: tensor[0] for name, tensor in _batch(seed, 1).items()} for seed in range(4)]
    evaluator = evaluation.Evaluator(trainer, "gpt2", dataset, ["input_ids", "labels"], 2, None, 2,
                                     records.append, lines.append)
    results = [evaluator.maybe_evaluate(step) for step in range(1, 6)]
    assert [r is not None for r in results] == [False, True, False, True, False]
    assert [r["step"] for r in records] == [2, 4] and all(r["kind"] == "eval" for r in records)
    assert lines[0].startswith("eval at step 2: eval_loss ")
    assert evaluator.last["step"] == 4 and evaluator.best_step == 2  # no training between: a tie keeps 2
    state = json.loads(json.dumps(evaluator.state_dict()))
    other = evaluation.Evaluator(trainer, "gpt2", dataset, ["input_ids", "labels"], 2, None, 2,
                                 records.append, lines.append)
    other.load_state_dict(state)
    assert other.state_dict() == evaluator.state_dict()
    never = evaluation.Evaluator(trainer, "gpt2", dataset, ["input_ids", "labels"], 2, None, 0,
                                 records.append, lines.append)
    assert all(never.maybe_evaluate(step) is None for step in range(1, 5))
    assert evaluation.Evaluator(trainer, "gpt2", None, [], 2, None, 1, records.append,
                                lines.append).maybe_evaluate(1) is None
