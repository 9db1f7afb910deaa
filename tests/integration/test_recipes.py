"""The recipes end to end through `orttrainer train` (in process, plus one real Ctrl-C in a subprocess).

Each tiny recipe trains a few steps at the smallest sizes (a 0.25 MB slice of the stdlib corpus,
vocab 1024, hidden 64) and its loss falls; phase 2 and fine-tuning start from the phase 1 run.
Resume: an interrupted run (stopped at a checkpoint, or by KeyboardInterrupt in the middle of a
gradient-accumulation window) resumed with --resume auto logs exactly the losses and eval metrics
of an uninterrupted run and ends with bitwise the same weights. Those runs freeze the embeddings:
onnxruntime's CPU GatherGrad (the embedding gradient) sums repeated token ids in thread order, so
two runs with trained embeddings differ in the last bits (see docs/recipes.md); dropout stays on.
All data is built once per session into a temporary cache (conftest.py's data_cache).
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("transformers")

from orttrainer.cli import main  # noqa: E402
from orttrainer.run import loop
from orttrainer.run import hf_models as models  # noqa: E402
from orttrainer.run.recipe.spec import RecipeError, load_recipe, parse_yaml, resolve  # noqa: E402

from helpers.recipes import (  # noqa: E402,F401  (the names the other recipe tests import from here)
    FROZEN_EMBEDDINGS, RECIPES, ROOT, SMALL_BERT, SMALL_DATA, TIMING_FIELDS, TINY, comparable, falls, records,
    results, sets, train, train_losses, weights)


# ---------------------------------------------------------------- BERT phase 1 -> phase 2, fine-tuning


@pytest.fixture(scope="module")
def phase1(bert_phase1_run):
    return bert_phase1_run  # 8 steps, eval_every 4, save_every 2, save_total_limit 2; shared with test_export


def test_bert_pretrain_tiny_trains_and_reports(phase1):
    falls(train_losses(phase1))
    assert [r["step"] for r in records(phase1, "train")] == list(range(1, 9))
    assert [r["step"] for r in records(phase1, "eval")] == [4, 8]
    evaluation = records(phase1, "eval")[-1]
    assert {"eval_loss", "mlm_loss", "mlm_perplexity", "mlm_accuracy", "nsp_accuracy"} <= set(evaluation)
    r = results(phase1)
    assert r["status"] == "completed" and r["steps"]["end"] == 8 and r["steps"]["micro_steps"] == 16
    assert r["throughput"]["tokens_per_s"] > 0
    assert {"export", "training_graph", "session", "first_step", "data", "model"} <= set(r["startup_seconds"])
    assert r["final"]["eval"]["step"] == 8
    assert r["best"]["eval_loss"] == min(e["eval_loss"] for e in records(phase1, "eval"))
    # save_every 2 with save_total_limit 2: the two newest complete checkpoints remain.
    assert sorted(p.name for p in phase1.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    for name in (models.COMPLETE_MARKER, models.CHECKPOINT_FILE, models.MODEL_JSON, models.TOKENIZER_JSON):
        assert (phase1 / "checkpoint-8" / name).is_file()


def test_fresh_run_into_an_existing_run_is_refused(phase1, data_cache, capsys):
    assert train("bert-pretrain-tiny.yaml", phase1, sets(data_cache, *SMALL_BERT, "run.max_steps=8")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run (newest: checkpoint-8)" in err[0]
    assert "--resume auto" in err[0]


def test_resume_of_a_finished_run_does_nothing(phase1, data_cache, capsys):
    before = (phase1 / "metrics.jsonl").read_text()
    overrides = sets(data_cache, *SMALL_BERT, "run.max_steps=8")
    assert train("bert-pretrain-tiny.yaml", phase1, overrides, "auto") == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (phase1 / "metrics.jsonl").read_text() == before


def test_bert_phase2_tiny_continues_phase1(phase1, data_cache, tmp_path, capsys):
    out = tmp_path / "phase2"
    overrides = sets(data_cache, "data.batch_size=4", "data.seq_length=128",
                     "data.bert.max_predictions_per_seq=20", f"run.init_from={phase1}", "run.max_steps=6",
                     "run.log_every=1", "run.eval_every=3", "run.save_every=3")
    assert train("bert-pretrain-phase2-tiny.yaml", out, overrides) == 0
    assert "init: weights, optimizer state and step count (8) from" in capsys.readouterr().out
    assert results(out)["steps"]["start"] == 8 and results(out)["steps"]["end"] == 14
    steps = records(out, "train")
    assert [r["step"] for r in steps] == list(range(9, 15))  # the step count continues
    assert steps[0]["lr"] == 0.0  # ... while the learning rate warms up again
    falls([r["loss"] for r in steps])
    assert (out / "checkpoint-14" / models.COMPLETE_MARKER).is_file()
    config = json.loads((out / "checkpoint-14" / models.MODEL_JSON).read_text())["config"]
    assert config["hidden_size"] == 64  # the phase 1 model, not the recipe's default


def test_finetune_tiny_from_pretraining_checkpoint(bert_finetune_run):
    out, printed = bert_finetune_run  # from phase1, 12 steps, lr 5e-3; shared with test_export (conftest.py)
    assert "checkpoint-8" in printed and "new: classifier.weight, classifier.bias" in printed
    falls(train_losses(out))
    steps = records(out, "train")
    # mixed precision is on (fp16 compute), with its counters
    assert all("loss_scale" in r and r["skipped_steps"] == 0 and r["nan_steps"] == 0 for r in steps)
    evaluation = records(out, "eval")[-1]
    assert {"eval_loss", "accuracy", "f1", "majority_baseline"} <= set(evaluation) and 0 <= evaluation["f1"] <= 1
    assert evaluation["majority_baseline"] == 0.25  # the bundled topic task: 4 balanced labels
    r = results(out)
    assert r["best"]["accuracy"] == max(e["accuracy"] for e in records(out, "eval"))
    assert (r["eval_accuracy"], r["majority_baseline"], r["f1"]) == (
        evaluation["accuracy"], evaluation["majority_baseline"], evaluation["f1"])


def test_weights_from_a_checkpoint_and_from_a_hugging_face_folder(phase1, tmp_path):
    torch = pytest.importorskip("torch")
    source = models.weight_source(phase1)  # a run folder: its newest complete checkpoint
    assert source.kind == "checkpoint" and Path(source.folder).name == "checkpoint-8" and source.tokenizer
    saved = models.read_checkpoint_weights(source.path)
    built = models.build_model("bert-classification", {}, seed=0, vocab_size=None, seq_length=64,
                               label_list=["0", "1"], source=source)
    assert built.random_init == ["classifier.weight", "classifier.bias"]
    state = built.model.state_dict()
    for name in ("bert.embeddings.word_embeddings.weight", "bert.pooler.dense.weight",
                 "bert.encoder.layer.1.output.dense.bias"):
        np.testing.assert_array_equal(state[name].numpy(), saved[name])
    assert built.desc["outputs"] == [("loss", [], True), ("logits", ["batch", 2])]

    built.model.save_pretrained(tmp_path / "hf")  # model.safetensors + config.json
    folder = models.weight_source(tmp_path / "hf")
    assert folder.kind == "hf"
    again = models.build_model("bert-classification", {}, seed=1, vocab_size=None, seq_length=64,
                               label_list=["0", "1"], source=folder)
    for name, value in again.model.state_dict().items():
        assert torch.equal(value, state[name]), name


# ---------------------------------------------------------------- GPT-2


def test_gpt2_tiny_trains(gpt2_run):
    out, printed = gpt2_run  # 8 steps, --resume auto over a run that died before saving (conftest.py)
    assert "no complete checkpoint" in printed  # --resume auto starts from scratch
    falls(train_losses(out))
    assert 99.0 not in train_losses(out)
    evaluation = records(out, "eval")[-1]
    assert evaluation["perplexity"] == pytest.approx(np.exp(evaluation["eval_loss"]))
    assert results(out)["final"]["train_loss"]["step"] == 8


# ---------------------------------------------------------------- exact resume


def resume_overrides(cache, max_steps):
    return sets(cache, *SMALL_BERT, FROZEN_EMBEDDINGS, f"run.max_steps={max_steps}", "run.log_every=1",
                "run.eval_every=3", "run.save_every=3", "trainer.lr_scheduler.total_steps=6")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert train("bert-pretrain-tiny.yaml", out, resume_overrides(data_cache, 6)) == 0
    return out


def assert_same_run(out, reference):
    assert comparable(out) == comparable(reference)
    mine, theirs = weights(out / "checkpoint-6"), weights(reference / "checkpoint-6")
    assert mine.keys() == theirs.keys()
    for name in mine:
        np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)


def test_stopped_run_resumed_with_auto_matches_uninterrupted(uninterrupted, data_cache, tmp_path, capsys):
    out = tmp_path / "run"
    assert train("bert-pretrain-tiny.yaml", out, resume_overrides(data_cache, 3)) == 0
    # A save that never finished (no marker) is newer than checkpoint-3: auto resume must skip it.
    shutil.copytree(out / "checkpoint-3", out / "checkpoint-5")
    (out / "checkpoint-5" / models.COMPLETE_MARKER).unlink()
    capsys.readouterr()
    overrides = resume_overrides(data_cache, 6)
    assert train("bert-pretrain-tiny.yaml", out, overrides, str(out / "checkpoint-5")) == 2
    assert "is an incomplete checkpoint" in capsys.readouterr().err
    assert train("bert-pretrain-tiny.yaml", out, resume_overrides(data_cache, 6), "auto") == 0
    assert "skipping" in capsys.readouterr().out
    assert_same_run(out, uninterrupted)
    assert results(out)["steps"] == results(uninterrupted)["steps"]


def test_keyboard_interrupt_mid_window_then_resume_matches_uninterrupted(uninterrupted, data_cache, tmp_path,
                                                                           capsys):
    out = tmp_path / "run"
    recipe = load_recipe(RECIPES / "bert-pretrain-tiny.yaml", resume_overrides(data_cache, 6), out)

    def interrupt(run):
        if run.micro_total == 5:  # step 2 done, 1 of the 2 micro-steps of step 3
            raise KeyboardInterrupt

    assert loop.train(recipe, on_micro_step=interrupt) == loop.EXIT_INTERRUPTED
    printed = capsys.readouterr().out
    assert "interrupted at step 2 (+1 of 2 micro-steps)" in printed
    assert (out / "checkpoint-2-1" / models.COMPLETE_MARKER).is_file()
    assert results(out)["status"] == "interrupted"
    assert loop.train(recipe, resume="auto") == 0
    assert_same_run(out, uninterrupted)


@pytest.mark.multiprocess
def test_ctrl_c_saves_and_exits_130(data_cache, tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "orttrainer", "train", str(RECIPES / "bert-pretrain-tiny.yaml"),
            "--output-dir", str(out)]
    for item in sets(data_cache, *SMALL_BERT, "run.max_steps=500", "run.log_every=1"):
        argv += ["--set", item]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                output = proc.stdout.read() if proc.poll() is not None else ""
                pytest.fail(f"no step logged; output:\n{output}")
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "resume with: orttrainer train" in output and "--resume auto" in output
    saved = models.complete_checkpoints(out)
    assert len(saved) == 1 and results(out)["status"] == "interrupted"
    step = models.checkpoint_step(saved[0])[0]
    assert 1 <= step < 500


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_recipe_validates(name, capsys):
    # --schema-only: fine-tuning and phase 2 start from runs that do not exist here.
    assert main(["config", "validate", "--schema-only", str(RECIPES / name)]) == 0
    assert "valid" in capsys.readouterr().out


def test_tiny_variants_exist():
    names = {p.name for p in RECIPES.glob("*.yaml")}
    for full in ("bert-pretrain-phase1", "bert-pretrain-phase2", "gpt2-pretrain",
                 "bert-finetune-classification"):
        assert f"{full}.yaml" in names
    assert set(TINY) <= names


def one_error_line(capsys, argv, expected_rc=2):
    assert main(argv) == expected_rc
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_unknown_key_says_did_you_mean(tmp_path, capsys):
    text = (RECIPES / "bert-pretrain-tiny.yaml").read_text().replace("  optimizer:", "  optimzer:")
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    line = one_error_line(capsys, ["config", "validate", str(path)])
    assert line.startswith(f"orttrainer config: error: {path}: trainer.optimzer: got {{'lambda_coef': 0.01,")
    assert line.endswith("unknown key, did you mean 'trainer.optimizer'?")


def test_bad_type_names_path_value_and_what_is_allowed(capsys):
    line = one_error_line(capsys, ["train", str(RECIPES / "bert-pretrain-tiny.yaml"),
                                   "--set", "run.max_steps=ten"])
    assert line.endswith("run.max_steps: got 'ten'; expected an int >= 1")
    line = one_error_line(capsys, ["config", "validate", str(RECIPES / "bert-pretrain-tiny.yaml"),
                                   "--set", "trainer.mixed_precision.enabled=1"])
    assert line.endswith("trainer.mixed_precision.enabled: got 1; expected a bool (true/false)")


def test_bad_value_lists_allowed_values(capsys):
    line = one_error_line(capsys, ["config", "validate", str(RECIPES / "gpt2-pretrain-tiny.yaml"),
                                   "--set", "trainer.lr_scheduler.name=cosin"])
    assert line.endswith("trainer.lr_scheduler.name: got 'cosin'; expected one of "
                         "['constant', 'cosine', 'linear', 'poly'], did you mean 'cosine'?")


def test_bad_set_path(capsys):
    line = one_error_line(capsys, ["train", str(RECIPES / "bert-pretrain-tiny.yaml"),
                                   "--set", "run.max_step=5"])
    assert line == ("orttrainer train: error: --set run.max_step=5: unknown key 'run.max_step', "
                    "did you mean 'run.max_steps'?")
    line = one_error_line(capsys, ["config", "print", str(RECIPES / "bert-pretrain-tiny.yaml"),
                                   "--set", "run.max_steps.every=5"])
    assert line.endswith("--set run.max_steps.every=5: run.max_steps is 200, not a mapping, "
                         "so it has no keys")
    line = one_error_line(capsys, ["config", "print", str(RECIPES / "bert-pretrain-tiny.yaml"),
                                   "--set", "seed"])
    assert line.endswith("--set seed: expected KEY.PATH=VALUE (for example run.max_steps=100)")


def test_optimizer_and_model_config_keys_are_checked(capsys):
    line = one_error_line(capsys, ["config", "validate", str(RECIPES / "bert-pretrain-tiny.yaml"),
                                   "--set", "trainer.optimizer.betta=0.9"])
    assert line.endswith("trainer.optimizer.betta: got 0.9; LambConfig has no argument 'betta', "
                         "did you mean 'trainer.optimizer.beta'?")
    line = one_error_line(capsys, ["config", "validate", str(RECIPES / "bert-pretrain-tiny.yaml"),
                                   "--set", "model.config.hiden_size=3"])
    assert line.endswith("model.config.hiden_size: got 3; BertConfig has no such key, "
                         "did you mean 'model.config.hidden_size'?")
    line = one_error_line(capsys, ["config", "validate", str(RECIPES / "bert-pretrain-tiny.yaml"),
                                   "--set", "trainer.lr_scheduler.warmup=1.5"])
    assert "warmup must be a float in [0, 1), got 1.5" in line


def test_several_problems_one_line_each(capsys):
    assert main(["config", "validate", str(RECIPES / "bert-pretrain-tiny.yaml"), "--set", "run.max_steps=0",
                 "--set", "data.batch_size=x"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and any("run.max_steps: got 0" in x for x in lines)
    assert any("data.batch_size: got 'x'" in x for x in lines)


def test_missing_recipe_file(capsys):
    line = one_error_line(capsys, ["train", "no/such/recipe.yaml"])
    assert line == "orttrainer train: error: recipe file not found: no/such/recipe.yaml"


def test_config_print_fills_defaults(capsys):
    argv = ["config", "print", str(RECIPES / "bert-pretrain-tiny.yaml"), "--set", "run.max_steps=30"]
    assert main(argv) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["run"]["output_dir"] == "runs/bert-pretrain-tiny" and doc["run"]["max_steps"] == 30
    assert doc["trainer"]["lr_scheduler"] == {"name": "poly", "total_steps": 30, "warmup": 0.1, "power": 0.5,
                                              "lr_end": 1e-07}
    assert doc["trainer"]["optimizer"]["do_bias_correction"] is False
    assert doc["trainer"]["distributed"]["world_size"] == 1  # ORTTrainerOptions defaults are filled in too
    assert doc["trainer"]["graph_transformer"]["propagate_cast_ops_config"]["strategy"] == "FLOOD_FILL"
    assert doc["data"]["bert"]["masked_lm_prob"] == 0.15 and doc["run"]["save_total_limit"] == 2
    # The printed recipe is itself a valid recipe that resolves to the same thing.
    again = resolve(parse_yaml(yaml.safe_dump(doc)), "bert-pretrain-tiny.yaml")
    assert again.doc == load_recipe(RECIPES / "bert-pretrain-tiny.yaml", ["run.max_steps=30"]).doc


def test_yaml_reads_exponent_floats():
    assert parse_yaml("lr: 1e-3") == {"lr": 0.001}
    with pytest.raises(RecipeError, match="not valid YAML"):
        parse_yaml("a: [1, 2")
