"""`orttrainer train --nproc 2`: the tiny BERT recipe on 2 ranks (torchrun, gloo) end to end.

Real processes through the real CLI: the launcher starts the ranks, each reads its slice of every
global batch, rank 0 reports, every rank writes its file into checkpoint-N/ before the COMPLETE
marker. A 2-rank ZeRO-1 run stopped by Ctrl-C to the launcher (torchrun passes it on to every rank)
and resumed with --resume auto logs exactly the metrics of an uninterrupted one and ends with
bitwise the same weights (embeddings frozen, as in test_recipes.py); so does an Adasum run stopped
by SIGTERM to the launcher, every rank resuming from its own file. Each stopped run serves both its
signal test and its resume test: launches cost more than their training.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

pytest.importorskip("transformers")

from test_faults import hooked  # noqa: E402
from helpers.recipes import FROZEN_EMBEDDINGS, RECIPES, ROOT, SMALL_BERT, comparable, records, results, sets  # noqa: E402

from orttrainer import _checkpoint_storage, checkpoint  # noqa: E402
from orttrainer.cli import main  # noqa: E402
from orttrainer.run import hf_models as models  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

TIMEOUT = 300


def signal_after_first_step(argv, out, signum, env=None):
    """Start `argv`, send `signum` once the run has logged a step, wait; returns (process, output)."""
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, output


def argv_2_ranks(out, overrides, resume=None, nproc=2):
    argv = [sys.executable, "-m", "orttrainer", "train", str(RECIPES / "bert-pretrain-tiny.yaml"),
            "--output-dir", str(out), "--nproc", str(nproc)]
    for item in overrides:
        argv += ["--set", item]
    if resume:
        argv += ["--resume", resume]
    return argv


def train_2_ranks(out, overrides, resume=None, nproc=2):
    proc = subprocess.run(argv_2_ranks(out, overrides, resume, nproc), capture_output=True, text=True, cwd=ROOT,
                          timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


def overrides(cache, max_steps):
    return sets(cache, *SMALL_BERT, FROZEN_EMBEDDINGS, f"run.max_steps={max_steps}", "run.log_every=1",
                "run.eval_every=3", "run.save_every=3", "trainer.lr_scheduler.total_steps=6",
                "trainer.distributed.deepspeed_zero_optimization.stage=1")


@pytest.fixture(scope="module")
def cache(data_cache):
    return data_cache


@pytest.fixture(scope="module")
def uninterrupted(two_rank_bert_run):
    return two_rank_bert_run  # overrides(cache, 6), shared with test_export_distributed (conftest.py)


def rank_weights(folder, rank):
    state = _checkpoint_storage.load(models.rank_file(folder, rank), key="model/full_precision")
    return {k: np.asarray(v) for k, v in state.items()}


def test_two_ranks_write_one_report_and_every_rank_file(uninterrupted):
    out, output = uninterrupted
    assert output.count("done: step 6 of 6") == 1  # rank 0 alone prints
    assert [r["step"] for r in records(out, "train")] == list(range(1, 7))  # one metrics line per step
    assert [r["step"] for r in records(out, "eval")] == [3, 6]
    assert results(out)["world_size"] == 2 and results(out)["status"] == "completed"
    for step in (3, 6):
        folder = out / f"checkpoint-{step}"
        marker = json.loads((folder / models.COMPLETE_MARKER).read_text())
        assert marker["world_size"] == 2
        assert models.rank_file(folder, 0).is_file() and models.rank_file(folder, 1).is_file()
        # ZeRO-1: the ranks hold the same weights and different halves of the optimizer state.
        mine, theirs = rank_weights(folder, 0), rank_weights(folder, 1)
        for name in mine:
            np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)
    merged = checkpoint.aggregate_checkpoints([str(models.rank_file(out / "checkpoint-6", r)) for r in (0, 1)],
                                              pytorch_format=False)
    assert merged["trainer_options"]["world_size"] == 1 and merged["optimizer"]


def test_two_ranks_build_the_data_one_process_builds(uninterrupted, cache):
    # Rank 0 of the 2-rank run built the corpus, tokenizer and shards into its own cache; one process
    # builds them (or has built them) from the same settings into data_cache: the same files.
    from orttrainer.run.recipe import data as recipe_data
    from orttrainer.run.recipe.spec import load_recipe

    out, output = uninterrupted
    one = recipe_data.prepare(load_recipe(RECIPES / "bert-pretrain-tiny.yaml", overrides(cache, 6), str(out)),
                              log=lambda line: None)
    assert f"data: {one.description.replace(str(cache), str(out.parent / 'data'))}" in output
    two_cache, one_cache = out.parent / "data", Path(cache)
    built = sorted(str(p.relative_to(two_cache)) for p in two_cache.rglob("*") if p.is_file())
    assert built and set(built) <= {str(p.relative_to(one_cache)) for p in one_cache.rglob("*")}
    for name in built:
        if name.endswith(".hdf5"):
            with h5py.File(two_cache / name, "r") as mine, h5py.File(one_cache / name, "r") as theirs:
                assert set(mine) == set(theirs), name
                for key in mine:
                    np.testing.assert_array_equal(mine[key][()], theirs[key][()], err_msg=f"{name}: {key}")
        elif name.endswith((".txt", "tokenizer.json")):
            assert (two_cache / name).read_bytes() == (one_cache / name).read_bytes(), name


def assert_same_run(out, reference):
    """Metrics and every rank's final weights bitwise those of the uninterrupted run."""
    assert comparable(out) == comparable(reference)
    for rank in (0, 1):
        mine, theirs = rank_weights(out / "checkpoint-6", rank), rank_weights(reference / "checkpoint-6", rank)
        for name in mine:
            np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)


def test_two_rank_checkpoint_starts_a_one_process_run(uninterrupted, cache, tmp_path, capsys):
    reference, _ = uninterrupted
    out = tmp_path / "one"
    argv = argv_2_ranks(out, sets(cache, *SMALL_BERT, FROZEN_EMBEDDINGS, f"run.init_from={reference}",
                                  "run.max_steps=2", "run.log_every=1", "run.eval_every=0", "run.save_every=0"),
                        nproc=1)
    code = main(argv[3:])  # in process: --nproc 1 starts no launcher, a subprocess would add nothing
    output = capsys.readouterr().out
    assert code == 0, output
    assert "init: weights, optimizer state and step count (6)" in output
    assert [r["step"] for r in records(out, "train")] == [7, 8]


def test_nproc_inside_a_torchrun_job_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun gives its ranks
    code = main(["train", str(RECIPES / "bert-pretrain-tiny.yaml"), "--nproc", "2", "--output-dir", str(tmp_path)])
    assert code == 2 and "--nproc inside a torchrun job" in capsys.readouterr().err


def test_recipe_world_size_without_a_launcher_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["train", str(RECIPES / "bert-pretrain-tiny.yaml"), "--output-dir", str(tmp_path / "run"),
                 "--set", "trainer.distributed.world_size=2"])
    assert code == 2
    assert "not started by torchrun; run `orttrainer train RECIPE --nproc 2`" in capsys.readouterr().err
    assert not Path(tmp_path / "run").exists()


def test_ctrl_c_stops_every_rank_which_saves_the_command_exits_130_and_the_run_resumes_exactly(
        uninterrupted, cache, tmp_path):
    reference, _ = uninterrupted
    out = tmp_path / "run"
    # To the launcher alone, as a terminal's Ctrl-C is (torchrun's workers run in their own sessions).
    proc, output = signal_after_first_step(argv_2_ranks(out, overrides(cache, 6)), out, signal.SIGINT,
                                           env=hooked(HOOK_SLEEP=0.3))
    assert proc.returncode == 130, output
    assert "resume with: orttrainer train" in output and "--nproc 2" in output and "Traceback" not in output
    [saved] = models.complete_checkpoints(out)
    assert models.checkpoint_step(saved)[0] < 6 and results(out)["status"] == "interrupted"
    assert models.rank_file(saved, 0).is_file() and models.rank_file(saved, 1).is_file()
    built = sorted(p.name for p in Path(cache).iterdir())
    code, output = train_2_ranks(out, overrides(cache, 6), resume="auto")
    assert code == 0, output
    # Both ranks read the data the first run built (the checkpoint's tokenizer copy names it).
    assert "data: building" not in output and sorted(p.name for p in Path(cache).iterdir()) == built
    assert_same_run(out, reference)


def adasum_overrides(cache):
    adasum = [item for item in overrides(cache, 6) if "deepspeed_zero_optimization" not in item]
    return adasum + ["trainer.distributed.enable_adasum=true"]


@pytest.fixture(scope="module")
def adasum_reference(cache, tmp_path_factory):
    """The uninterrupted 2-rank Adasum run (6 steps)."""
    reference = tmp_path_factory.mktemp("adasum") / "reference"
    code, output = train_2_ranks(reference, adasum_overrides(cache))
    assert code == 0, output
    return reference


def test_sigterm_to_the_launcher_reaches_every_rank_and_the_adasum_run_resumes_exactly(adasum_reference, cache,
                                                                                         tmp_path):
    """What a scheduler does to `orttrainer train --nproc 2` (torchrun in it): SIGTERM to the launcher.
    Adasum: every rank resumes from its own file (its own moments), so the resumed run is bitwise
    the uninterrupted one."""
    moments = [_checkpoint_storage.load(models.rank_file(adasum_reference / "checkpoint-6", r), key="optimizer")
               for r in (0, 1)]
    assert any(not np.array_equal(np.asarray(moments[0][w]["Moment_1"]), np.asarray(moments[1][w]["Moment_1"]))
               for w in moments[0])  # the ranks' moments differ: resuming from rank 0's file would not do
    out = tmp_path / "run"
    proc, output = signal_after_first_step(argv_2_ranks(out, adasum_overrides(cache)), out, signal.SIGTERM,
                                           env=hooked(HOOK_SLEEP=0.3))
    assert proc.returncode == 143, output
    assert output.count("terminated (SIGTERM): saving a checkpoint") == 1, output  # rank 0 speaks
    [saved] = models.complete_checkpoints(out)
    assert json.loads((saved / models.COMPLETE_MARKER).read_text())["world_size"] == 2
    assert models.rank_file(saved, 0).is_file() and models.rank_file(saved, 1).is_file()
    assert models.checkpoint_step(saved)[0] < 6 and results(out)["status"] == "interrupted"
    code, output = train_2_ranks(out, adasum_overrides(cache), resume="auto")
    assert code == 0, output
    assert_same_run(out, adasum_reference)
