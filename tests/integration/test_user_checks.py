"""Mistakes a user makes that must stop a run before it builds anything: one line, exit status 2.

A data.cache_dir on a file system that cannot be written (also for root), a model that cannot fit
in this machine's memory, and optimizer parameter groups naming parameters the model lacks.
"""

from pathlib import Path

import pytest

from orttrainer.cli import main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE = RECIPES / "bert-pretrain-tiny.yaml"


def error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["validate", "train"])
def test_cache_dir_on_a_file_system_that_cannot_be_written(tmp_path, capsys, command):
    # /proc refuses new files even to root, whose os.access() answers yes to everything.
    cache = "/proc/orttrainer-cache"
    out = tmp_path / "run"
    argv = ["config", "validate"] if command == "validate" else ["train"]
    argv += [str(RECIPE), "--output-dir", str(out), "--set", f"data.cache_dir={cache}"]
    assert main(argv) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert f"data.cache_dir: got '{cache}'; cannot write in /proc" in lines[0], lines
    assert not out.exists()


def test_parameter_group_naming_no_model_parameter_warns_once():
    """The legacy trainer ignored such names silently (docs/options.md): kept, with one warning."""
    import warnings

    import torch
    from helpers.models import MLP, MLP_DESC, cross_entropy

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    def train_with(groups):
        torch.manual_seed(0)
        options = ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"onnx_opset_version": 17}})
        trainer = ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(params=groups, lr=1e-2), loss_fn=cross_entropy,
                             options=options)
        x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                trainer.train_step(x, y)
        return [str(w.message) for w in caught if "parameter groups" in str(w.message)]

    found = train_with([{"params": ["fc1.weight", "fc9.weight"], "lambda_coef": 0.5}])
    assert len(found) == 1 and "['fc9.weight']" in found[0], found
    assert train_with([{"params": ["fc1.weight"], "lambda_coef": 0.5}]) == []


# ---------------------------------------------------------------- memory estimate


GPT = RECIPES / "gpt2-pretrain-tiny.yaml"


TOO_LARGE = [(GPT, ["model.config.n_layer=10000"]),
             (GPT, ["data.seq_length=65536", "model.config.n_positions=65536"]),
             (RECIPE, ["model.config.num_hidden_layers=10000"])]


def _argv(command, recipe, out, overrides):
    argv = ["config", "validate"] if command == "validate" else ["train"]
    argv += [str(recipe), "--output-dir", str(out)]
    for item in overrides:
        argv += ["--set", item]
    return argv


@pytest.mark.parametrize("recipe, overrides", TOO_LARGE)
def test_a_model_that_cannot_fit_is_refused_by_train_before_building(tmp_path, capsys, recipe, overrides):
    from orttrainer.run import memory_estimate as memory

    out = tmp_path / "run"
    assert main(_argv("train", recipe, out, [f"data.cache_dir={tmp_path / 'data'}", *overrides])) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    free, where = memory.available_memory()
    assert lines[0].startswith("orttrainer train: error: memory: this run needs about "), lines
    assert f"available ({where})" in lines[0] and "run.check_memory=false" in lines[0], lines
    assert not out.exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize("recipe, overrides", TOO_LARGE)
def test_validate_notes_a_model_too_large_for_this_machine(tmp_path, capsys, recipe, overrides):
    """Validating a cluster's recipe on a smaller machine: valid (exit 0), with the estimate and this
    machine's memory as a note; nothing built. run.check_memory=false silences it, as it lets train start."""
    from orttrainer.run import memory_estimate as memory

    out = tmp_path / "run"
    assert main(_argv("validate", recipe, out, [f"data.cache_dir={tmp_path / 'data'}", *overrides])) == 0
    captured = capsys.readouterr()
    assert not captured.err.strip(), captured.err
    lines = captured.out.splitlines()
    free, where = memory.available_memory()
    assert len(lines) == 2 and lines[0].startswith(f"{recipe}: valid ("), lines
    assert lines[1].startswith(f"{recipe}: note: memory: this run needs about "), lines
    assert f"available ({where}): `orttrainer train` refuses to start it here" in lines[1], lines
    assert "run.check_memory=false" in lines[1]
    assert not out.exists() and not (tmp_path / "data").exists()
    assert main(_argv("validate", recipe, out, [*overrides, "run.check_memory=false"])) == 0
    assert "note:" not in capsys.readouterr().out


# Recipes that continue a run of another recipe: their weight source exists once that run is made.
DEPENDS_ON = {"bert-finetune-classification-tiny.yaml": "model.from: runs/bert-pretrain-tiny",
              "bert-finetune-classification.yaml": "model.from: runs/bert-pretrain-phase2",
              "bert-pretrain-phase2-tiny.yaml": "run.init_from: runs/bert-pretrain-tiny",
              "bert-pretrain-phase2.yaml": "run.init_from: runs/bert-pretrain-phase1"}
GIB = 1024 ** 3


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
@pytest.mark.parametrize("memory_gib", [16, 4096])
def test_every_bundled_recipe_validates_and_notes_memory_where_it_is_short(tmp_path, capsys, monkeypatch,
                                                                           name, memory_gib):
    """On a 16 GiB machine and on a 4 TiB one (the available memory faked: the test does not depend on
    this host's): every bundled recipe is valid, the full-size ones with a memory note on the small
    machine, where `train` refuses them."""
    from orttrainer.run import memory_estimate as memory
    from orttrainer.run.recipe.spec import load_recipe

    monkeypatch.setattr(memory, "available_memory", lambda: (memory_gib * GIB, "MemAvailable"))
    monkeypatch.chdir(tmp_path)  # relative output and data folders: nothing lands in the checkout
    recipe = RECIPES / name
    if name in DEPENDS_ON:  # the run it continues is not made here: its schema, and the one problem
        assert main(["config", "validate", str(recipe), "--schema-only"]) == 0
        assert "valid" in capsys.readouterr().out
        assert main(["config", "validate", str(recipe)]) == 2
        lines = error_lines(capsys)
        assert lines == [f"orttrainer config: error: {DEPENDS_ON[name]} does not exist"], lines
        return
    assert main(["config", "validate", str(recipe)]) == 0
    out = capsys.readouterr().out
    estimate = memory.estimate(load_recipe(recipe))
    short = estimate.total > memory_gib * GIB
    assert short == (memory_gib == 16 and name in ("bert-pretrain-phase1.yaml", "gpt2-pretrain.yaml")), estimate
    assert out.startswith(f"{recipe}: valid (") and ("note: memory: this run needs" in out) == short, out
    if short:
        assert f"{estimate.describe()}, but this machine has 16.0 GiB available (MemAvailable)" in out, out
        assert main(["train", str(recipe), "--output-dir", str(tmp_path / "run")]) == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and lines[0].startswith("orttrainer train: error: memory: this run needs"), lines
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", ["bert-pretrain-tiny.yaml", "gpt2-pretrain-tiny.yaml"])
def test_the_tiny_recipes_pass_the_memory_check(recipe, capsys):
    assert main(["config", "validate", str(RECIPES / recipe)]) == 0
    assert "valid" in capsys.readouterr().out


@pytest.mark.parametrize("recipe, overrides", [
    ("bert-pretrain-tiny.yaml", []),
    ("gpt2-pretrain-tiny.yaml", ["model.config.n_inner=96"]),
    ("bert-finetune-classification-tiny.yaml", ["model.from=null", "model.config.num_labels=3"]),
])
def test_parameter_count_is_that_of_the_built_model(recipe, overrides):
    pytest.importorskip("transformers")
    from orttrainer.run import memory_estimate as memory
    from orttrainer.run import hf_models as models
    from orttrainer.run.recipe.spec import load_recipe

    r = load_recipe(RECIPES / recipe, overrides)
    values = memory.model_values(r)
    built = models.build_model(r.kind, r.model.config, seed=0, vocab_size=r.data.vocab_size,
                               seq_length=r.data.seq_length, label_list=[0, 1, 2] if "num_labels=3" in
                               " ".join(overrides) else None)
    assert memory.estimate(r).parameters == sum(p.numel() for p in built.model.parameters())
    assert values["vocab_size"] == built.config.vocab_size


def test_memory_estimate_is_within_a_factor_of_the_measured_peak(data_cache, tmp_path):
    """The estimate against the peak resident memory (ru_maxrss) of a real 2-step run whose activations
    dominate (GPT-2, 4 layers, n_embd 256, micro-batch 16 x 256): calibrated, not a guess."""
    import os
    import signal
    import sys
    import time

    pytest.importorskip("transformers")
    from orttrainer.run import memory_estimate as memory
    from orttrainer.run.recipe import data as recipe_data
    from orttrainer.run.recipe.spec import load_recipe

    sets = [f"data.cache_dir={data_cache}", "data.corpus_max_mb=0.25", "data.vocab_size=1024",
            "data.eval_fraction=0.1", "run.max_steps=2", "run.eval_every=0", "run.save_every=0",
            "model.config.n_embd=256", "model.config.n_layer=4", "model.config.n_head=4",
            "model.config.n_positions=256", "data.seq_length=256", "data.batch_size=16"]
    def argv(out):
        line = ["train", str(GPT), "--output-dir", str(tmp_path / out)]
        for item in sets:
            line += ["--set", item]
        return line

    recipe_data.prepare(load_recipe(GPT, sets), log=lambda line: None)  # data built outside the measure
    pid = os.posix_spawn(sys.executable, [sys.executable, "-m", "orttrainer", *argv("run")], os.environ)
    deadline = time.monotonic() + 300
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.wait4(pid, 0)
            pytest.fail("the measured run did not finish in 300 s")
        time.sleep(0.2)
    assert os.waitstatus_to_exitcode(status) == 0
    peak = usage.ru_maxrss * 1024
    estimate = memory.estimate(load_recipe(GPT, sets)).total
    print(f"estimate {estimate / 2**20:.0f} MiB, measured peak {peak / 2**20:.0f} MiB")
    assert 0.67 < estimate / peak < 1.5, (estimate / 2**20, peak / 2**20)
