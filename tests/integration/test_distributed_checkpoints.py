"""Rank checkpoints that the trainer itself writes, for every {DP, ZeRO-1} x {fp32, mixed} x {Adam, LAMB}
(issue 19, item 2): 2 gloo ranks train, save and go on training (the uninterrupted run); the files are
aggregated, loaded into one process (accumulating both ranks' halves, docs/ort-notes.md) and into 2
new ranks, and both continuations must equal the uninterrupted run.

One launch of a pair of rank processes runs every combination (tests/helpers/distributed_worker.py), shared
with test_distributed and test_adasum (conftest.py::two_rank_launch).
"""

import numpy as np
import pytest
import torch
from helpers.distributed_worker import STEPS, make_trainer, weights
from test_distributed import WORLD, accumulation_reference, assert_weights, ranks_ok

from orttrainer import _checkpoint_storage, checkpoint

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

# After saving and going on (the uninterrupted run), the ranks resume from the files in new trainers:
# LAMB loads before the first train_step (deferred, as a recipe's --resume does), Adam after it.
SCENARIOS = [dict(name=f"{optim}-{'zero1' if zero else 'dp'}-{'mixed' if mixed else 'fp32'}",
                  optim=optim, zero=zero, mixed=mixed, save=True, resume_saved=True, deferred=optim == "lamb")
             for optim in ("adam", "lamb") for zero in (0, 1) for mixed in (False, True)]
# A skipped (non-finite) step before the save: what 'run.on_nonfinite_loss: skip' recipes meet.
SCENARIOS.append(dict(name="adam-zero1-mixed-skipped", optim="adam", zero=1, mixed=True, save=True,
                      resume_saved=True, poison=(1, 1)))
NAMES = [s["name"] for s in SCENARIOS]
SCENARIOS.append(dict(name="mid-window", optim="adam", zero=1, gas=2, probe_mid_window=True))
BY_NAME = {s["name"]: s for s in SCENARIOS}
ZERO = [name for name in NAMES if BY_NAME[name]["zero"]]


@pytest.fixture(scope="module")
def ranks(two_rank_launch):
    return ranks_ok(two_rank_launch)  # SCENARIOS run in the session's shared 2-rank launch (conftest.py)


def rank_files(ranks, name):
    return [r[name]["checkpoint"] for r in ranks]


def files_to_load(ranks, name):
    """ZeRO-1: every rank's file (merged); data parallel: rank 0's (the files are equal)."""
    files = rank_files(ranks, name)
    return files if BY_NAME[name]["zero"] else files[:1]


@pytest.mark.parametrize("name", ZERO)
def test_zero1_rank_file_holds_whole_weights_and_its_moment_segments(ranks, name):
    files = [_checkpoint_storage.load(path) for path in rank_files(ranks, name)]
    numels = {w: v.size for w, v in files[0]["model"]["full_precision"].items()}
    held = {w: 0 for w in numels}
    for rank, state in enumerate(files):
        # fp32 master weights are whole (and equal) on every rank, with or without mixed precision
        for w, value in state["model"]["full_precision"].items():
            np.testing.assert_array_equal(value, files[0]["model"]["full_precision"][w])
        partitioned = set(state["partition_info"])
        assert partitioned == set(state["optimizer"]) - {"shared_optimizer_state"}
        for w in partitioned:
            assert list(state["partition_info"][w]["original_dim"]) == list(
                state["model"]["full_precision"][w].shape)
            assert state["optimizer"][w]["Moment_1"].ndim == 1
            held[w] += state["optimizer"][w]["Moment_1"].size
        assert int(state["trainer_options"]["world_rank"]) == rank
    assert held == numels  # the segments cover every element exactly once


@pytest.mark.parametrize("name", NAMES)
def test_rank_files_aggregate_to_the_one_process_state(ranks, name):
    scenario = BY_NAME[name]
    files = rank_files(ranks, name)
    merged = checkpoint.aggregate_checkpoints(files, pytorch_format=False)
    if not scenario["zero"]:
        assert merged is None  # data-parallel files are whole already (legacy behaviour)
        merged = _checkpoint_storage.load(files[0])
    else:
        assert_weights(checkpoint.aggregate_checkpoints(files), ranks[0][name]["weights"])
        options = merged["trainer_options"]
        assert (int(options["world_size"]), int(options["zero_stage"])) == (1, 0)
        assert bool(options["mixed_precision"]) == scenario["mixed"]
    # Independent reference: one process accumulating both ranks' halves.
    reference, _ = accumulation_reference(scenario)
    expected = reference.state_dict()
    for w, value in expected["model"]["full_precision"].items():
        np.testing.assert_allclose(merged["model"]["full_precision"][w], value, rtol=1e-6, atol=1e-7, err_msg=w)
    assert merged["optimizer"].keys() == expected["optimizer"].keys()
    for w, states in expected["optimizer"].items():
        for key, value in states.items():
            assert merged["optimizer"][w][key].shape == value.shape, (w, key)
            np.testing.assert_allclose(merged["optimizer"][w][key], value, rtol=1e-5, atol=1e-9, err_msg=f"{w} {key}")
    if scenario["mixed"]:
        assert {k: float(v) for k, v in merged["loss_scaler"].items()} == {
            k: float(v) for k, v in expected["loss_scaler"].items()}


@pytest.mark.parametrize("name", NAMES)
def test_rank_files_continue_in_one_process_like_the_uninterrupted_run(ranks, name):
    scenario = BY_NAME[name]
    trainer = make_trainer(dict(scenario, gas=WORLD, zero=0), seed=5)
    trainer.load_checkpoint(*files_to_load(ranks, name))  # before the session: deferred
    accumulation_reference(scenario, trainer=trainer, first_step=STEPS)
    assert_weights(weights(trainer), ranks[0][name]["weights_after"], rtol=1e-6)
    steps = trainer.state_dict()["train_step_info"]["optimization_step"]
    assert steps == ranks[0][name]["state_dict"]["train_step_info"]["optimization_step"] + STEPS


@pytest.mark.parametrize("name", NAMES)
def test_rank_files_continue_in_two_processes_like_the_uninterrupted_run(ranks, name):
    for rank, result in enumerate(ranks):
        assert_weights(result[name]["resumed_weights"], ranks[0][name]["weights_after"])
        np.testing.assert_array_equal(result[name]["resumed_losses"], ranks[rank][name]["losses_after"])


def test_zero1_mixed_one_process_load_of_the_rank_files_is_exact(ranks):
    # The failing call: a one-process load_checkpoint of ZeRO-1 mixed-precision rank files.
    name = "adam-zero1-mixed"
    trainer = make_trainer(dict(BY_NAME[name], gas=WORLD, zero=0), seed=5)
    x, y = torch.zeros(WORLD, 6), torch.zeros(WORLD, dtype=torch.long)
    trainer.eval_step(x, y)  # the session exists: the load is applied now
    trainer.load_checkpoint(*rank_files(ranks, name))
    assert_weights(weights(trainer), ranks[0][name]["weights"])


def test_multi_rank_state_dict_inside_an_accumulation_window_raises_and_saves_nothing(ranks):
    for rank, result in enumerate(r["mid-window"]["mid_window"] for r in ranks):
        assert result["state_dict"].startswith("RuntimeError"), result["state_dict"]
        assert f"rank {rank} of {WORLD} 1 micro-steps into an accumulation window of 2" in result["state_dict"]
        assert "pytorch_format=True" in result["state_dict"]
        assert result["save"] == result["state_dict"] and not result["saved_file"]
        assert result["weights"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        # the window's end is a boundary again: the state is complete there
        assert result["after_window"] == {"optimization_step": STEPS + 1, "step": 2 * (STEPS + 1)}
