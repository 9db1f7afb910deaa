"""Checkpoints through a real ORTTrainer (docs/legacy-api.md §3 and its "Decisions").

Covers: the state_dict layout of every variant (§3.1), exact resume across processes for SGD,
Adam and LAMB with an LR scheduler and gradient accumulation (mid-window and at a window
boundary, deferred and immediate load), load_state_dict strictness (§3.2) with the trainer left
unchanged by every rejected load, save_checkpoint/load_checkpoint on real files (§3.3), the loss
scaler's state, and the `orttrainer ckpt` command line on a trainer's checkpoint.

The storage layer and rank aggregation are tested on hand-built dicts elsewhere
(test_checkpoint_storage.py, test_aggregate_checkpoints.py, test_cli_ckpt.py).
"""

import copy
import json
import os
import re
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
import torch
from helpers import training
from helpers.models import GPT_DESC, MLP, MLP_DESC, TinyGPT, cross_entropy

from orttrainer import amp, cli, optim

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

NO_SESSION = ("ONNX Runtime training session is not initialized yet. Please run train_step or eval_step "
              "at least once before calling ORTTrainer.state_dict().")
TRAINER_OPTION_KEYS = {"mixed_precision", "zero_stage", "world_rank", "world_size", "optimizer_name",
                       "data_parallel_size", "horizontal_parallel_size"}
MLP_WEIGHTS = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
OPTIMIZERS = {
    "sgd": lambda: optim.SGDConfig(lr=0.1),
    "adam": lambda: optim.AdamConfig(lr=1e-2),
    "lamb": lambda: optim.LambConfig(lr=1e-2),
}
OPTIMIZER_NAMES = {"sgd": "SGDOptimizer", "adam": "AdamOptimizer", "lamb": "LambOptimizer"}


# ------------------------------------------------------------------ helpers (also used by the child process)

def make_trainer(model="mlp", optimizer="adam", seed=0, gas=1, scheduler_steps=None, extra=None,
                 **model_kwargs):
    """A CPU trainer on a freshly seeded MLP or TinyGPT; `scheduler_steps` adds a LinearWarmupLRScheduler."""
    net, desc = (MLP, MLP_DESC) if model == "mlp" else (TinyGPT, GPT_DESC)
    opts = {"batch": {"gradient_accumulation_steps": gas}}
    if scheduler_steps:
        opts["lr_scheduler"] = optim.LinearWarmupLRScheduler(total_steps=scheduler_steps, warmup=0.25)
    opts.update(extra or {})
    return training.make_trainer(lambda: net(**model_kwargs), desc, OPTIMIZERS[optimizer](),
                                 loss_fn=cross_entropy, seed=seed, **opts)


def batch(model, i):
    """The i-th batch (deterministic, independent of any global RNG)."""
    g = torch.Generator().manual_seed(100 + i)
    if model == "mlp":
        return torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)
    return torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)


def train(trainer, model, start, stop):
    """train_steps for batches start..stop-1; returns the losses as floats."""
    return training.train(trainer, (batch(model, i) for i in range(start, stop)))


def flatten(state, prefix=""):
    """{'a/b/c': numpy array} of a nested state_dict (copies)."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "/"))
        else:
            flat[name] = np.array(value, copy=True)
    return flat


def snapshot(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flatten(trainer.state_dict())


def assert_same_state(actual, expected, rtol=0.0, atol=0.0):
    """Flat states: same keys, values equal (exactly by default)."""
    assert sorted(actual) == sorted(expected)
    for key in expected:
        if expected[key].dtype.kind in "fc":
            np.testing.assert_allclose(actual[key], expected[key], rtol=rtol, atol=atol, err_msg=key)
        else:
            np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


# ------------------------------------------------------------------ 1. state_dict layout (§3.1)

@pytest.mark.parametrize("pytorch_format", [False, True])
def test_state_dict_before_first_step_warns_and_is_empty(pytorch_format):
    trainer = make_trainer()
    with pytest.warns(UserWarning) as record:
        assert trainer.state_dict(pytorch_format=pytorch_format) == {}
    assert [str(w.message) for w in record] == [NO_SESSION]


def test_state_dict_before_first_step_returns_pending_load():
    source = make_trainer(seed=3)
    train(source, "mlp", 0, 2)
    state = source.state_dict()
    trainer = make_trainer()
    trainer.load_state_dict(state)
    with pytest.warns(UserWarning, match=re.escape(NO_SESSION)):
        pending = trainer.state_dict()
    assert_same_state(flatten(pending), flatten(state))


@pytest.mark.parametrize("gas, steps, updates", [(1, 3, 3), (2, 5, 2)])
def test_adam_layout_and_update_count(gas, steps, updates):
    trainer = make_trainer(optimizer="adam", gas=gas)
    train(trainer, "mlp", 0, steps)
    state = trainer.state_dict()
    expected_top = {"model", "optimizer", "trainer_options", "train_step_info"}
    if steps % gas:
        expected_top.add("gradient_accumulation")  # unfinished window (this engine's extra key)
    assert set(state) == expected_top  # no partition_info when not partitioned
    assert set(state["model"]) == {"full_precision"}
    weights = state["model"]["full_precision"]
    assert set(weights) == MLP_WEIGHTS
    assert set(state["optimizer"]) == MLP_WEIGHTS
    for name, per_weight in state["optimizer"].items():
        assert set(per_weight) == {"Moment_1", "Moment_2", "Update_Count"}, name
        assert per_weight["Moment_1"].shape == weights[name].shape == per_weight["Moment_2"].shape
        assert per_weight["Moment_1"].dtype == per_weight["Moment_2"].dtype == np.float32
        assert np.any(per_weight["Moment_1"] != 0) and np.all(per_weight["Moment_2"] >= 0)
        assert per_weight["Update_Count"].dtype == np.int64 and per_weight["Update_Count"].shape == (1,)
        assert per_weight["Update_Count"].tolist() == [updates + 1]  # the number of the *next* update
    assert state["train_step_info"] == {"optimization_step": updates, "step": steps}
    assert state["trainer_options"] == {
        "mixed_precision": False, "zero_stage": 0, "world_rank": 0, "world_size": 1,
        "optimizer_name": "AdamOptimizer", "data_parallel_size": 1, "horizontal_parallel_size": 1}


def test_adam_update_count_is_one_before_any_update():
    trainer = make_trainer(optimizer="adam")
    trainer.eval_step(*batch("mlp", 0))
    state = trainer.state_dict()
    for per_weight in state["optimizer"].values():
        assert per_weight["Update_Count"].tolist() == [1]
        assert not per_weight["Moment_1"].any() and not per_weight["Moment_2"].any()
    assert state["train_step_info"] == {"optimization_step": 0, "step": 0}


def test_lamb_layout_has_shared_step_and_no_update_count():
    trainer = make_trainer(optimizer="lamb")
    train(trainer, "mlp", 0, 3)
    state = trainer.state_dict()
    assert set(state) == {"model", "optimizer", "trainer_options", "train_step_info"}
    assert set(state["optimizer"]) == MLP_WEIGHTS | {"shared_optimizer_state"}
    assert set(state["optimizer"]["shared_optimizer_state"]) == {"Step"}
    step = state["optimizer"]["shared_optimizer_state"]["Step"]
    assert step.dtype == np.int64 and step.tolist() == [4]
    for name in MLP_WEIGHTS:
        assert set(state["optimizer"][name]) == {"Moment_1", "Moment_2"}, name
        assert state["optimizer"][name]["Moment_1"].shape == state["model"]["full_precision"][name].shape
    assert state["trainer_options"]["optimizer_name"] == "LambOptimizer"
    assert state["train_step_info"] == {"optimization_step": 3, "step": 3}


def test_sgd_layout_has_an_empty_optimizer_entry():
    """As the original: 'optimizer' is get_optimizer_state(), {} for SGD (its upstream tests check it)."""
    trainer = make_trainer(optimizer="sgd")
    train(trainer, "mlp", 0, 2)
    state = trainer.state_dict()
    assert set(state) == {"model", "optimizer", "trainer_options", "train_step_info"}
    assert state["optimizer"] == {}
    assert set(state["trainer_options"]) == TRAINER_OPTION_KEYS
    assert state["trainer_options"]["optimizer_name"] == "SGDOptimizer"
    assert set(state["model"]["full_precision"]) == MLP_WEIGHTS


def test_model_state_is_the_live_weights_and_a_copy():
    """full_precision holds every weight, trained (not the initial values), and is the trainer's own copy."""
    trainer = make_trainer(optimizer="sgd")
    torch.manual_seed(0)
    initial = MLP().state_dict()
    train(trainer, "mlp", 0, 2)
    weights = trainer.state_dict()["model"]["full_precision"]
    assert set(weights) == set(initial)
    for name, value in weights.items():
        assert isinstance(value, np.ndarray) and value.dtype == np.float32
        assert value.shape == tuple(initial[name].shape)
        assert not np.array_equal(value, initial[name].numpy()), f"{name} did not train"
    weights["fc1.weight"][...] = 0.0
    assert trainer.state_dict()["model"]["full_precision"]["fc1.weight"].any()


def test_gradient_accumulation_key_only_inside_a_window():
    trainer = make_trainer(optimizer="sgd", gas=3)
    train(trainer, "mlp", 0, 2)
    pending = trainer.state_dict()["gradient_accumulation"]
    assert set(pending) == MLP_WEIGHTS
    assert all(np.any(v != 0) for v in pending.values())
    train(trainer, "mlp", 2, 3)
    assert "gradient_accumulation" not in trainer.state_dict()


def test_pytorch_format_tied_gpt_loads_strictly_and_matches_eval_step():
    trainer = make_trainer(model="gpt", optimizer="adam")
    train(trainer, "gpt", 0, 3)
    flat = trainer.state_dict(pytorch_format=True)
    torch.manual_seed(99)
    fresh = TinyGPT()
    assert list(flat) == list(fresh.state_dict())  # every name, in the torch model's order
    assert {"tok.weight", "head.weight"} <= set(flat)  # both names of the tied head
    assert all(isinstance(v, torch.Tensor) for v in flat.values())
    assert torch.equal(flat["head.weight"], flat["tok.weight"])
    for name, value in trainer.state_dict()["model"]["full_precision"].items():
        assert torch.equal(flat[name], torch.from_numpy(value)), name
    fresh.load_state_dict(flat, strict=True)
    fresh.eval()
    ids, labels = batch("gpt", 7)
    ort_loss, ort_logits = trainer.eval_step(ids, labels)
    with torch.no_grad():
        logits = fresh(ids)
        loss = cross_entropy(logits, labels)
    torch.testing.assert_close(ort_logits, logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ort_loss, loss, rtol=1e-4, atol=1e-5)


def test_pytorch_format_mlp_has_no_optimizer_entries():
    trainer = make_trainer(optimizer="adam")
    train(trainer, "mlp", 0, 1)
    flat = trainer.state_dict(pytorch_format=True)
    torch.manual_seed(5)
    model = MLP()
    assert list(flat) == list(model.state_dict())
    model.load_state_dict(flat, strict=True)


# ------------------------------------------------------------------ 2. exact resume across processes

# name: optimizer, model, gradient_accumulation_steps, save step k, load path.
RESUME_CASES = {
    "sgd-mid-window-deferred": ("sgd", "mlp", 2, 5, "deferred"),
    "sgd-boundary-immediate": ("sgd", "mlp", 3, 6, "immediate"),
    "adam-mid-window-immediate": ("adam", "mlp", 3, 7, "immediate"),
    "adam-boundary-deferred": ("adam", "mlp", 2, 4, "deferred"),
    "lamb-boundary-deferred-gpt": ("lamb", "gpt", 2, 6, "deferred"),
    "lamb-mid-window-immediate": ("lamb", "mlp", 3, 4, "immediate"),
}
TOTAL_STEPS = 12

_CHILD = """
import json, os, sys, traceback
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # the test module, helpers/
import test_trainer_checkpoint as t
jobs = json.load(open(sys.argv[2]))
for job in jobs:
    try:
        t.resume_in_child(job)
    except BaseException:
        with open(job["out"] + ".error", "w") as f:
            f.write(traceback.format_exc())
"""


def resume_in_child(job):
    """Run in a new process: fresh trainer (other initial weights, so only a real load can make it match
    the uninterrupted run), load the checkpoint, train to the end."""
    optimizer, model, gas, k, path = job["case"]
    trainer = make_trainer(model, optimizer, seed=1234, gas=gas, scheduler_steps=TOTAL_STEPS // gas)
    report = {}
    if path == "immediate":
        trainer.eval_step(*batch(model, 0))
        user_dict = trainer.load_checkpoint(job["checkpoint"])
        report["info_after_load"] = trainer.state_dict()["train_step_info"]
    else:
        user_dict = trainer.load_checkpoint(job["checkpoint"])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            pending = trainer.state_dict()
        report["pending_warning"] = [str(w.message) for w in record]
        report["pending_info"] = {k: int(v) for k, v in pending["train_step_info"].items()}
    report["user_dict"] = user_dict
    report["losses"] = train(trainer, model, k, TOTAL_STEPS)
    np.savez(job["out"] + ".npz", **flatten(trainer.state_dict()))
    with open(job["out"] + ".json", "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """For every case: the uninterrupted run, the run that saved at step k, and the resumed child run."""
    folder = tmp_path_factory.mktemp("resume")
    runs, jobs = {}, []
    for name, case in RESUME_CASES.items():
        optimizer, model, gas, k, _ = case
        reference = make_trainer(model, optimizer, gas=gas, scheduler_steps=TOTAL_STEPS // gas)
        losses = train(reference, model, 0, TOTAL_STEPS)
        saver = make_trainer(model, optimizer, gas=gas, scheduler_steps=TOTAL_STEPS // gas)
        saver_losses = train(saver, model, 0, k)
        checkpoint = str(folder / f"{name}.ortcp")
        saver.save_checkpoint(checkpoint, user_dict={"case": name, "k": k})
        saver_losses += train(saver, model, k, TOTAL_STEPS)
        runs[name] = {"losses": losses, "state": snapshot(reference), "checkpoint": checkpoint,
                      "saver_losses": saver_losses, "saver_state": snapshot(saver),
                      "out": str(folder / name)}
        jobs.append({"case": list(case), "checkpoint": checkpoint, "out": runs[name]["out"]})
    (folder / "jobs.json").write_text(json.dumps(jobs))
    (folder / "child.py").write_text(_CHILD)
    result = subprocess.run([sys.executable, str(folder / "child.py"), TESTS_DIR, str(folder / "jobs.json")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return runs


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_exact_resume_in_a_new_process(resume_runs, name):
    optimizer, model, gas, k, path = RESUME_CASES[name]
    run = resume_runs[name]
    if os.path.exists(run["out"] + ".error"):
        pytest.fail(f"resumed run failed:\n{open(run['out'] + '.error').read()}")

    # The checkpoint is taken where the case says: inside an accumulation window or at its end.
    with h5py.File(run["checkpoint"], "r") as f:
        assert ("gradient_accumulation" in f) == bool(k % gas)
        assert int(f["train_step_info/step"][()]) == k

    # Saving changes nothing: the run that saved continues exactly like the uninterrupted one.
    assert run["saver_losses"] == run["losses"]
    assert_same_state(run["saver_state"], run["state"])

    report = json.load(open(run["out"] + ".json"))
    assert report["user_dict"] == {"case": name, "k": k}
    if path == "deferred":
        assert report["pending_warning"] == [NO_SESSION]
        assert report["pending_info"] == {"optimization_step": k // gas, "step": k}
    else:
        assert report["info_after_load"] == {"optimization_step": k // gas, "step": k}
    np.testing.assert_allclose(report["losses"], run["losses"][k:], rtol=1e-6, atol=1e-7)
    resumed = dict(np.load(run["out"] + ".npz"))
    expected = run["state"]
    assert expected["train_step_info/step"] == TOTAL_STEPS
    assert_same_state(resumed, expected, rtol=1e-6, atol=1e-7)  # weights, moments, counters, step info


def test_load_into_a_trainer_inside_its_own_window_discards_its_gradients(tmp_path):
    """A trainer half-way through its own accumulation window loads a checkpoint: its gradients go."""
    gas, steps = 3, 9
    reference = make_trainer(optimizer="adam", gas=gas, scheduler_steps=steps // gas)
    expected = train(reference, "mlp", 0, steps)
    saver = make_trainer(optimizer="adam", gas=gas, scheduler_steps=steps // gas)
    paths = {}
    for k in (3, 4):  # a window boundary, then inside a window
        train(saver, "mlp", k - 1 if k == 4 else 0, k)
        paths[k] = str(tmp_path / f"step{k}.ortcp")
        saver.save_checkpoint(paths[k])
    for k, path in paths.items():
        trainer = make_trainer(optimizer="adam", seed=5, gas=gas, scheduler_steps=steps // gas)
        train(trainer, "mlp", 50, 52 if k == 3 else 51)  # its own unfinished window
        assert "gradient_accumulation" in trainer.state_dict()
        trainer.load_checkpoint(path)
        np.testing.assert_allclose(train(trainer, "mlp", k, steps), expected[k:], rtol=1e-6, atol=1e-7)
        assert_same_state(snapshot(trainer), snapshot(reference), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("immediate", [False, True])
def test_resume_restores_frozen_weights(tmp_path, immediate):
    frozen = {"utils": {"frozen_weights": ["fc1.bias"]}}
    reference = make_trainer(optimizer="adam", extra=frozen)
    expected = train(reference, "mlp", 0, 6)
    saver = make_trainer(optimizer="adam", extra=frozen)
    train(saver, "mlp", 0, 3)
    state = saver.state_dict()
    assert set(state["model"]["full_precision"]) == MLP_WEIGHTS  # the frozen weight too
    assert "fc1.bias" not in state["optimizer"]
    path = str(tmp_path / "frozen.ortcp")
    saver.save_checkpoint(path)
    trainer = make_trainer(optimizer="adam", seed=5, extra=frozen)  # another (frozen) fc1.bias
    if immediate:
        trainer.eval_step(*batch("mlp", 0))
    trainer.load_checkpoint(path)
    np.testing.assert_allclose(train(trainer, "mlp", 3, 6), expected[3:], rtol=1e-6, atol=1e-7)
    assert_same_state(snapshot(trainer), snapshot(reference), rtol=1e-6, atol=1e-7)


_OPTIMIZED_CHILD = """
import os, sys, numpy as np
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # the test module, helpers/
assert sys.flags.optimize
import test_trainer_checkpoint as t
trainer = t.make_trainer(optimizer="adam")
trainer.eval_step(*t.batch("mlp", 0))
state = trainer.state_dict()
state["trainer_options"]["optimizer_name"] = "LambOptimizer"
try:
    trainer.load_state_dict(state)
except AssertionError as exc:
    print("raised:", exc)
else:
    print("loaded without error")
"""


@pytest.mark.multiprocess
def test_optimizer_mismatch_is_checked_under_python_O(tmp_path):
    """The contract keeps AssertionError for this check, but not as a bare assert (-O strips those)."""
    script = tmp_path / "child.py"
    script.write_text(_OPTIMIZED_CHILD)
    result = subprocess.run([sys.executable, "-O", str(script), TESTS_DIR], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "raised: Optimizer mismatch: expected AdamOptimizer, got LambOptimizer" in result.stdout


# ------------------------------------------------------------------ 3. load_state_dict strictness (§3.2)

@pytest.fixture
def adam_trainer():
    trainer = make_trainer(optimizer="adam")
    train(trainer, "mlp", 0, 2)
    return trainer


def _different_state(trainer):
    """A valid state_dict for `trainer` whose every value differs from the trainer's."""
    state = copy.deepcopy(trainer.state_dict())
    for precision in state["model"].values():
        for name in precision:
            precision[name] = precision[name] + 0.5
    for per_weight in state.get("optimizer", {}).values():
        for key in per_weight:
            per_weight[key] = per_weight[key] + 1
    state["train_step_info"] = {"optimization_step": 40, "step": 41}
    return state


def _del(path):
    def mutate(state):
        node = state
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


def _set(path, value):
    def mutate(state):
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node.get(path[-1])) if callable(value) else value
    return mutate


REJECTED = {
    "missing-weight": (_del(["model", "full_precision", "fc1.bias"]), RuntimeError,
                       "Missing keys: ['fc1.bias'] in state_dict[model][full_precision]"),
    "missing-precision": (_set(["model"], {}), RuntimeError,
                          "Missing keys: ['full_precision'] in state_dict[model]"),
    "unexpected-weight": (_set(["model", "full_precision", "fc3.weight"], np.zeros(3, np.float32)),
                          RuntimeError,
                          "Unexpected keys: ['fc3.weight'] in state_dict[model][full_precision]"),
    "unexpected-precision": (_set(["model", "mixed_precision"], {}), RuntimeError,
                             "Unexpected keys: ['mixed_precision'] in state_dict[model]"),
    "missing-optimizer-weight": (_del(["optimizer", "fc2.bias"]), RuntimeError,
                                 "Missing keys: ['fc2.bias'] in state_dict[optimizer]"),
    "missing-moment": (_del(["optimizer", "fc1.weight", "Moment_2"]), RuntimeError,
                       "Missing keys: ['Moment_2'] in state_dict[optimizer][fc1.weight]"),
    "unexpected-optimizer-state": (_set(["optimizer", "fc1.weight", "Moment_3"], np.zeros(1, np.float32)),
                                   RuntimeError,
                                   "Unexpected keys: ['Moment_3'] in state_dict[optimizer][fc1.weight]"),
    "optimizer-mismatch": (_set(["trainer_options", "optimizer_name"], "SGDOptimizer"), AssertionError,
                           "Optimizer mismatch: expected AdamOptimizer, got SGDOptimizer"),
    "optimizer-mismatch-bytes": (_set(["trainer_options", "optimizer_name"], b"SGDOptimizer"), AssertionError,
                                 "Optimizer mismatch: expected AdamOptimizer, got SGDOptimizer"),
    "wrong-weight-shape": (_set(["model", "full_precision", "fc1.weight"], np.zeros((16, 5), np.float32)),
                           ValueError, "fc1.weight"),
    "wrong-moment-shape": (_set(["optimizer", "fc2.weight", "Moment_1"], np.zeros((3, 16), np.float32)),
                           ValueError, "fc2.weight"),
    "wrong-weight-dtype": (_set(["model", "full_precision", "fc1.weight"], lambda v: v.astype(np.int64)),
                           TypeError, "State 'fc1.weight' has dtype int64 in the state_dict but float32"),
    "wrong-counter-dtype": (_set(["optimizer", "fc1.bias", "Update_Count"], lambda v: v.astype(np.float32)),
                            TypeError, "State 'Update_Count_fc1.bias' has dtype float32"),
    "bad-step-info": (_set(["train_step_info", "step"], "three"), ValueError,
                      "state_dict[train_step_info] must hold integer 'optimization_step' and 'step'"),
    "missing-step-count": (_del(["train_step_info", "step"]), ValueError,
                           "state_dict[train_step_info] must hold integer"),
}


# Key checks apply with strict=True only (strict=False tolerance is tested separately); optimizer
# name and shape checks apply always.
@pytest.mark.parametrize("case, strict", [(case, True) for case in REJECTED] + [
    (case, False) for case, (_, error, _) in REJECTED.items() if error is not RuntimeError])
def test_rejected_load_names_the_problem_and_changes_nothing(adam_trainer, case, strict):
    mutate, error, message = REJECTED[case]
    trainer = adam_trainer
    state = _different_state(trainer)
    mutate(state)
    before = snapshot(trainer)
    expected_loss = float(trainer.eval_step(*batch("mlp", 2))[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=re.escape(message)):
            trainer.load_state_dict(state, strict=strict)
    assert_same_state(snapshot(trainer), before)
    # Training goes on from the unchanged state (gas=1: the step's loss is the pre-update forward loss).
    assert float(trainer.train_step(*batch("mlp", 2))[0]) == expected_loss
    assert trainer.state_dict()["train_step_info"] == {"optimization_step": 3, "step": 3}


def test_rejected_deferred_load_raises_at_the_first_step_and_leaves_a_fresh_trainer():
    source = make_trainer(seed=3)
    train(source, "mlp", 0, 2)
    state = _different_state(source)
    del state["model"]["full_precision"]["fc1.bias"]
    trainer = make_trainer()
    trainer.load_state_dict(state)
    message = "Missing keys: ['fc1.bias'] in state_dict[model][full_precision]"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        trainer.train_step(*batch("mlp", 0))
    fresh = make_trainer()
    fresh.eval_step(*batch("mlp", 0))
    assert_same_state(snapshot(trainer), snapshot(fresh))
    assert train(trainer, "mlp", 0, 2) == train(fresh, "mlp", 0, 2)


def test_strict_false_tolerates_missing_and_unexpected_keys(adam_trainer):
    trainer = adam_trainer
    before = trainer.state_dict()
    state = _different_state(trainer)
    del state["model"]["full_precision"]["fc1.bias"]
    del state["optimizer"]["fc2.bias"]
    del state["optimizer"]["fc1.weight"]["Moment_2"]
    state["model"]["full_precision"]["fc3.weight"] = np.zeros(3, np.float32)
    state["optimizer"]["fc1.weight"]["Moment_3"] = np.zeros(1, np.float32)
    trainer.load_state_dict(state, strict=False)
    after = trainer.state_dict()
    model = after["model"]["full_precision"]
    assert set(model) == MLP_WEIGHTS
    np.testing.assert_array_equal(model["fc1.weight"], state["model"]["full_precision"]["fc1.weight"])
    np.testing.assert_array_equal(model["fc1.bias"], before["model"]["full_precision"]["fc1.bias"])  # kept
    np.testing.assert_array_equal(after["optimizer"]["fc1.weight"]["Moment_1"],
                                  state["optimizer"]["fc1.weight"]["Moment_1"])
    np.testing.assert_array_equal(after["optimizer"]["fc1.weight"]["Moment_2"],
                                  before["optimizer"]["fc1.weight"]["Moment_2"])  # kept
    for key in ("Moment_1", "Moment_2", "Update_Count"):
        np.testing.assert_array_equal(after["optimizer"]["fc2.bias"][key],
                                      before["optimizer"]["fc2.bias"][key])
    assert after["train_step_info"] == {"optimization_step": 40, "step": 41}
    assert np.isfinite(float(trainer.train_step(*batch("mlp", 0))[0]))


def test_strict_load_applies_every_value(adam_trainer):
    trainer = adam_trainer
    state = _different_state(trainer)
    trainer.load_state_dict(state)
    assert_same_state(snapshot(trainer), flatten(state))


@pytest.mark.parametrize("absent", ["model", "train_step_info", "optimizer"])
def test_absent_top_level_key_warns(adam_trainer, absent):
    trainer = adam_trainer
    before = trainer.state_dict()
    state = _different_state(trainer)
    del state[absent]
    with pytest.warns(UserWarning, match=re.escape(f"Missing key: {absent} in state_dict")):
        trainer.load_state_dict(state)
    after = trainer.state_dict()
    for key in ("model", "optimizer", "train_step_info"):
        source = before if key == absent else state
        assert_same_state(flatten(after[key]), flatten(source[key]))


# ------------------------------------------------------------ 4. save_checkpoint / load_checkpoint (§3.3)

def test_checkpoint_is_plain_hdf5_in_the_legacy_layout(adam_trainer, tmp_path):
    path = tmp_path / "checkpoint0.ortcp"
    adam_trainer.save_checkpoint(str(path))
    state = adam_trainer.state_dict()
    with h5py.File(path, "r") as f:
        # No user_dict entry when it is empty.
        assert set(f) == {"model", "optimizer", "trainer_options", "train_step_info"}
        assert isinstance(f["model"], h5py.Group) and isinstance(f["model/full_precision"], h5py.Group)
        assert set(f["model/full_precision"]) == MLP_WEIGHTS
        for name in MLP_WEIGHTS:
            np.testing.assert_array_equal(f[f"model/full_precision/{name}"][()],
                                          state["model"]["full_precision"][name])
            np.testing.assert_array_equal(f[f"optimizer/{name}/Moment_1"][()],
                                          state["optimizer"][name]["Moment_1"])
            assert f[f"optimizer/{name}/Update_Count"][()].tolist() == [3]
        assert f["trainer_options/optimizer_name"].asstr()[()] == "AdamOptimizer"
        assert set(f["trainer_options"]) == TRAINER_OPTION_KEYS
        assert int(f["train_step_info/step"][()]) == 2
        assert int(f["train_step_info/optimization_step"][()]) == 2


@pytest.mark.parametrize("user_dict, stored_as", [
    ({"epoch": 3, "name": "run", "lrs": [0.1, 0.25], "nested": {"a": None, "b": True}}, "json"),
    ({"epoch": 3, "array": np.arange(4.0), "tensor": torch.tensor([1.5, 2.5]), (1, 2): "tuple key"},
     "pickle"),
])
def test_user_dict_round_trip(adam_trainer, tmp_path, user_dict, stored_as):
    path = str(tmp_path / "c.ortcp")
    adam_trainer.save_checkpoint(path, user_dict=user_dict)
    with h5py.File(path, "r") as f:
        raw = f["user_dict"].asstr()[()]
    if stored_as == "json":
        assert raw.startswith("json:")
    else:
        bytes.fromhex(raw)  # the legacy pickle-hex encoding
    trainer = make_trainer(seed=7)
    trainer.eval_step(*batch("mlp", 0))
    loaded = trainer.load_checkpoint(path)
    assert set(loaded) == set(user_dict)
    for key, value in user_dict.items():
        if isinstance(value, (np.ndarray, torch.Tensor)):
            assert type(loaded[key]) is type(value)
            np.testing.assert_array_equal(np.asarray(loaded[key]), np.asarray(value))
        else:
            assert loaded[key] == value and type(loaded[key]) is type(value)
    assert_same_state(snapshot(trainer), snapshot(adam_trainer))


def test_empty_user_dict_loads_as_empty(adam_trainer, tmp_path):
    path = str(tmp_path / "c.ortcp")
    adam_trainer.save_checkpoint(path)
    trainer = make_trainer(seed=7)
    assert trainer.load_checkpoint(path) == {}


def test_checkpoint_without_optimizer_states(adam_trainer, tmp_path):
    path = str(tmp_path / "c.ortcp")
    adam_trainer.save_checkpoint(path, include_optimizer_states=False)
    with h5py.File(path, "r") as f:
        assert "optimizer" not in f and "model" in f and "trainer_options" in f
    trainer = make_trainer(seed=7)
    trainer.eval_step(*batch("mlp", 0))
    fresh_optimizer = flatten(trainer.state_dict()["optimizer"])
    with pytest.warns(UserWarning, match=re.escape("Missing key: optimizer in state_dict")):
        trainer.load_checkpoint(path, strict=True)
    state = trainer.state_dict()
    assert_same_state(flatten(state["model"]), flatten(adam_trainer.state_dict()["model"]))
    assert_same_state(flatten(state["optimizer"]), fresh_optimizer)  # the trainer keeps its own moments
    assert state["train_step_info"] == {"optimization_step": 2, "step": 2}


def test_existing_path_is_refused_unless_overwrite(adam_trainer, tmp_path):
    path = tmp_path / "c.ortcp"
    adam_trainer.save_checkpoint(str(path))
    content = path.read_bytes()
    train(adam_trainer, "mlp", 2, 3)
    with pytest.raises(FileExistsError, match=re.escape(str(path))):
        adam_trainer.save_checkpoint(str(path))
    assert path.read_bytes() == content
    adam_trainer.save_checkpoint(str(path), overwrite=True)
    with h5py.File(path, "r") as f:
        assert int(f["train_step_info/step"][()]) == 3
    assert os.listdir(tmp_path) == ["c.ortcp"]


def test_save_before_first_step_writes_nothing(tmp_path):
    trainer = make_trainer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="run train_step or eval_step"):
            trainer.save_checkpoint(str(tmp_path / "c.ortcp"))
    assert os.listdir(tmp_path) == []


def test_crash_before_rename_keeps_the_previous_checkpoint(adam_trainer, tmp_path, monkeypatch):
    path = tmp_path / "c.ortcp"
    adam_trainer.save_checkpoint(str(path), user_dict={"epoch": 1})
    content = path.read_bytes()
    train(adam_trainer, "mlp", 2, 4)

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        adam_trainer.save_checkpoint(str(path), user_dict={"epoch": 2}, overwrite=True)
    with pytest.raises(OSError, match="simulated crash"):
        adam_trainer.save_checkpoint(str(tmp_path / "new.ortcp"))
    monkeypatch.undo()
    assert path.read_bytes() == content
    assert os.listdir(tmp_path) == ["c.ortcp"]  # no temporary file, no partial new file
    trainer = make_trainer(seed=7)
    assert trainer.load_checkpoint(str(path)) == {"epoch": 1}
    trainer.eval_step(*batch("mlp", 0))
    assert trainer.state_dict()["train_step_info"] == {"optimization_step": 2, "step": 2}


def _bad_files(tmp_path, source):
    """{name: (paths, error, message)} of checkpoints that cannot be loaded into an Adam MLP trainer."""
    good = tmp_path / "good.ortcp"
    source.save_checkpoint(str(good))
    truncated = tmp_path / "truncated.ortcp"
    data = good.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    text = tmp_path / "text.ortcp"
    text.write_text("this is not a checkpoint\n")
    empty = tmp_path / "empty.ortcp"
    empty.write_bytes(b"")
    no_options = tmp_path / "no_options.ortcp"
    with h5py.File(no_options, "w") as f:
        f["model/full_precision/fc1.weight"] = np.zeros((16, 6), np.float32)
    narrow = make_trainer(optimizer="adam", hidden=8)
    train(narrow, "mlp", 0, 1)
    narrow_path = tmp_path / "narrow.ortcp"
    narrow.save_checkpoint(str(narrow_path))
    gpt = make_trainer(model="gpt", optimizer="adam")
    train(gpt, "gpt", 0, 1)
    gpt_path = tmp_path / "gpt.ortcp"
    gpt.save_checkpoint(str(gpt_path))
    return {
        "missing": ([str(tmp_path / "missing.ortcp")], FileNotFoundError, "missing.ortcp"),
        "truncated": ([str(truncated)], ValueError, "truncated.ortcp is not an hdf5 file"),
        "not-hdf5": ([str(text)], ValueError, "text.ortcp is not an hdf5 file"),
        "empty": ([str(empty)], ValueError, "empty.ortcp is not an hdf5 file"),
        "no-trainer-options": ([str(no_options)], ValueError, "trainer_options"),
        "two-files": ([str(good), str(good)], ValueError, "Expected number of files to load: 1, got 2"),
        "other-shapes": ([str(narrow_path)], ValueError, "'fc1."),  # hidden 8 instead of 16
        "other-model": ([str(gpt_path)], RuntimeError, "Missing keys: ["),
    }


def test_bad_checkpoint_files_give_clear_errors_and_change_nothing(adam_trainer, tmp_path):
    source = make_trainer(seed=11)
    train(source, "mlp", 0, 3)
    trainer = adam_trainer
    before = snapshot(trainer)
    for name, (paths, error, message) in _bad_files(tmp_path, source).items():
        with pytest.raises(error, match=re.escape(message)):
            trainer.load_checkpoint(*paths)
        assert_same_state(snapshot(trainer), before)  # after each rejected file: unchanged
    train(trainer, "mlp", 2, 3)
    assert trainer.state_dict()["train_step_info"]["step"] == 3
    # The good file still loads after all that.
    trainer.load_checkpoint(str(tmp_path / "good.ortcp"))
    assert_same_state(snapshot(trainer), snapshot(source))


def test_bad_checkpoint_file_before_the_first_step_is_not_deferred(tmp_path):
    bad = tmp_path / "bad.ortcp"
    bad.write_text("nope")
    trainer = make_trainer()
    with pytest.raises(ValueError, match="is not an hdf5 file"):
        trainer.load_checkpoint(str(bad))
    with pytest.warns(UserWarning, match=re.escape(NO_SESSION)):
        assert trainer.state_dict() == {}
    fresh = make_trainer()
    assert train(trainer, "mlp", 0, 2) == train(fresh, "mlp", 0, 2)


def test_deferred_load_with_check_model_export(tmp_path):
    """check_model_export compares the export with PyTorch; a deferred load must not make it fail."""
    source = make_trainer(seed=3)
    train(source, "mlp", 0, 2)
    path = str(tmp_path / "c.ortcp")
    source.save_checkpoint(path)
    trainer = make_trainer(extra={"debug": {"check_model_export": True}})
    trainer.load_checkpoint(path)
    assert train(trainer, "mlp", 2, 4) == train(source, "mlp", 2, 4)


# ------------------------------------------------------------------ 5. loss scaler / mixed precision

def _mixed_trainer(seed=0, loss_scale=float(2 ** 10)):
    scaler = amp.DynamicLossScaler(loss_scale=loss_scale, up_scale_window=2)
    return make_trainer(optimizer="adam", seed=seed,
                        extra={"mixed_precision": {"enabled": True, "loss_scaler": scaler}})


def _mixed_run(trainer, start, stop):
    trajectory = []
    for i in range(start, stop):
        loss = float(trainer.train_step(*batch("mlp", i))[0])
        trajectory.append((loss, trainer.loss_scaler.loss_scale))
    return trajectory


def test_loss_scaler_state_is_saved_and_resumed(tmp_path):
    reference = _mixed_trainer()
    expected = _mixed_run(reference, 0, 8)
    assert len({scale for _, scale in expected}) > 2  # the scale really moves in this run

    saver = _mixed_trainer()
    _mixed_run(saver, 0, 3)
    state = saver.state_dict()
    assert state["trainer_options"]["mixed_precision"] is True
    assert state["loss_scaler"] == saver.loss_scaler.state_dict()
    assert state["loss_scaler"] == {"loss_scale": expected[2][1], "stable_steps_count": 1}
    path = str(tmp_path / "mixed.ortcp")
    saver.save_checkpoint(path)

    for immediate in (False, True):
        resumed = _mixed_trainer(seed=5, loss_scale=float(2 ** 16))  # another initial scale
        if immediate:
            resumed.eval_step(*batch("mlp", 0))
        resumed.load_checkpoint(path)
        if immediate:
            assert resumed.loss_scaler.loss_scale == expected[2][1]
        trajectory = _mixed_run(resumed, 3, 8)
        assert [s for _, s in trajectory] == [s for _, s in expected[3:]]  # same scale, same stable count
        np.testing.assert_allclose([loss for loss, _ in trajectory], [loss for loss, _ in expected[3:]],
                                   rtol=1e-6, atol=1e-7)
        assert_same_state(snapshot(resumed), snapshot(reference), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------ 6. the command line on a trainer's checkpoint

@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    trainer = make_trainer(model="gpt", optimizer="adam")
    train(trainer, "gpt", 0, 2)
    path = str(tmp_path_factory.mktemp("cli") / "gpt.ortcp")
    trainer.save_checkpoint(path, user_dict={"epoch": 1})
    ids, labels = batch("gpt", 9)
    loss, logits = trainer.eval_step(ids, labels)
    return path, (ids, labels, loss, logits)


def test_cli_inspect_a_trainer_checkpoint(gpt_checkpoint, capsys):
    path, _ = gpt_checkpoint
    assert cli.main(["ckpt", "inspect", path]) == 0
    out = capsys.readouterr().out
    assert "train_step_info: optimization_step=2, step=2" in out
    assert "optimizer_name=AdamOptimizer" in out and "zero_stage=0" in out
    assert "tok.weight: float32[50, 16]" in out
    assert "blocks.1.qkv.weight: float32[48, 16]" in out
    assert "Update_Count: int64[1] = [3]" in out
    assert "user_dict: json, keys: epoch" in out


def test_cli_to_torch_loads_strictly_into_the_tied_gpt(gpt_checkpoint, tmp_path, capsys):
    path, (ids, labels, loss, logits) = gpt_checkpoint
    out_path = str(tmp_path / "gpt.pt")
    assert cli.main(["ckpt", "to-torch", path, out_path]) == 0
    weights = torch.load(out_path, weights_only=True)
    torch.manual_seed(99)
    model = TinyGPT()
    model.load_state_dict(weights, strict=True)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), logits, rtol=1e-4, atol=1e-5)


def test_cli_to_torch_mlp_pt_and_safetensors(adam_trainer, tmp_path, capsys):
    from safetensors.torch import load_file

    path = str(tmp_path / "mlp.ortcp")
    adam_trainer.save_checkpoint(path)
    expected = adam_trainer.state_dict(pytorch_format=True)
    for suffix, load in ((".pt", lambda p: torch.load(p, weights_only=True)), (".safetensors", load_file)):
        out_path = str(tmp_path / f"mlp{suffix}")
        assert cli.main(["ckpt", "to-torch", path, out_path]) == 0
        weights = load(out_path)
        torch.manual_seed(42)
        model = MLP()
        model.load_state_dict(weights, strict=True)
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), name
