"""Faults a cluster job meets, through the real `orttrainer train` (in process, or in a subprocess
where a real signal is needed): SIGTERM, SIGKILL at random moments, a full disk, damaged
checkpoints, two runs on one folder, a non-finite loss, rotation deleting what a resumed run read.

Every run is the tiny BERT of test_recipes.py with frozen embeddings, so a resumed run must end
with exactly the metrics and weights of the uninterrupted `reference` run.
"""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from helpers.recipes import (  # noqa: E402
    FROZEN_EMBEDDINGS, RECIPES, ROOT, SMALL_BERT, comparable, records, results, sets, train, weights,
)

from orttrainer import _checkpoint_storage  # noqa: E402
from orttrainer.cli import main  # noqa: E402
from orttrainer.run import hf_models as models  # noqa: E402
from orttrainer.run.lock import LOCK_FILE, OutputLock  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

RECIPE = "bert-pretrain-tiny.yaml"
HOOKS = Path(__file__).resolve().parents[1] / "helpers" / "hooks"  # sitecustomize.py: HOOK_* variables reach real CLI runs
STEPS = 6


def fault_sets(cache, *extra):
    return sets(cache, *SMALL_BERT, FROZEN_EMBEDDINGS, f"run.max_steps={STEPS}", "run.log_every=1",
                "run.eval_every=3", "run.save_every=1", "run.save_total_limit=null",
                f"trainer.lr_scheduler.total_steps={STEPS}", *extra)


def cli(out, overrides, resume=None):
    """The argv of a subprocess `orttrainer train`."""
    argv = [sys.executable, "-m", "orttrainer", "train", str(RECIPES / RECIPE), "--output-dir", str(out)]
    for item in overrides:
        argv += ["--set", item]
    if resume:
        argv += ["--resume", resume]
    return argv


def hooked(**variables):
    """The environment of a subprocess run with test hooks (tests/helpers/hooks/sitecustomize.py)."""
    path = os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **{k: str(v) for k, v in variables.items()}}


def assert_same_as(out, reference):
    assert comparable(out) == comparable(reference)
    final = f"checkpoint-{STEPS}"
    mine, theirs = weights(out / final), weights(reference / final)
    assert mine.keys() == theirs.keys()
    for name in mine:
        np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)


def error_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("reference") / "run"
    assert train(RECIPE, out, fault_sets(data_cache)) == 0
    assert [models.checkpoint_step(p)[0] for p in models.complete_checkpoints(out)] == list(range(1, STEPS + 1))
    return out


def copy_run(reference, tmp_path, upto=STEPS):
    """A copy of the reference run as it was after step `upto`."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for folder in models.complete_checkpoints(out):
        if models.checkpoint_step(folder)[0] > upto:
            shutil.rmtree(folder)
    return out


# ---------------------------------------------------------------- signals


def test_sigterm_saves_exits_143_and_resumes_exactly(reference, data_cache, tmp_path, capsys):
    out = tmp_path / "run"
    env = hooked(HOOK_SIGNAL_AT=5)  # 2 steps of 2 micro-steps done, 1 into step 3
    proc = subprocess.run(cli(out, fault_sets(data_cache)), env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 143, output
    assert "terminated (SIGTERM): saving a checkpoint" in output
    assert "interrupted at step 2 (+1 of 2 micro-steps)" in output and "resume with: orttrainer train" in output
    assert (out / "checkpoint-2-1" / models.COMPLETE_MARKER).is_file()
    assert results(out)["status"] == "interrupted" and not (out / LOCK_FILE).exists()
    assert train(RECIPE, out, fault_sets(data_cache), "auto") == 0
    assert_same_as(out, reference)


def test_sigkill_at_random_moments_always_resumes_exactly(reference, data_cache, tmp_path):
    """Kill -9 in start-up, in steps and in saves (save_every=1), then --resume auto, until done."""
    out = tmp_path / "run"
    rng = random.Random(16)
    killed_in_training = 0
    for attempt in range(3):
        proc = subprocess.Popen(cli(out, fault_sets(data_cache), resume="auto"), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            if attempt == 0:
                time.sleep(rng.uniform(0.3, 2.5))  # somewhere in start-up (imports, data, export)
            else:
                steps_before = len(models.complete_checkpoints(out))
                deadline = time.monotonic() + 120
                while len(models.complete_checkpoints(out)) == steps_before and proc.poll() is None:
                    assert time.monotonic() < deadline, "no progress"
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.4))  # somewhere in a step or a save
            if proc.poll() is None:
                killed_in_training += attempt > 0
                proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode in (0, -signal.SIGKILL), err
        if proc.returncode == 0:
            break
    assert killed_in_training >= 1
    assert train(RECIPE, out, fault_sets(data_cache), "auto") == 0  # whatever was left, or nothing to do
    assert_same_as(out, reference)


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of 1.5 checkpoints, or a skip where this process may not mount one."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()

    def make(size):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                              capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        return mount

    yield make
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_full_disk_is_one_error_and_older_checkpoints_stay_resumable(reference, data_cache, tmp_path,
                                                                     small_tmpfs, capsys):
    first = reference / "checkpoint-1"
    size = sum(f.stat().st_size for f in first.iterdir())
    disk = small_tmpfs(int(size * 1.5) // 4096 * 4096)
    out = disk / "run"
    assert train(RECIPE, out, fault_sets(data_cache)) == 1
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert f"cannot write {out / 'checkpoint-2'}: the disk is full:" in lines[0]
    assert "bytes" in lines[0] and "needs" in lines[0]
    assert f"the newest checkpoint is {out / 'checkpoint-1'}" in lines[0]
    assert "resume with:" not in lines[0] or "--resume auto" in lines[0]
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert not [name for name in left if "tmp" in name], left  # no temporary file keeps the disk full
    assert [p.name for p in models.complete_checkpoints(out)] == ["checkpoint-1"]
    assert not (out / "checkpoint-2").exists() and not (out / LOCK_FILE).exists()
    assert models.checkpoint_damage(out / "checkpoint-1") is None
    # Space again (the run moved to a larger disk): it resumes and ends as if nothing happened.
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    assert train(RECIPE, moved, fault_sets(data_cache), "auto") == 0
    assert_same_as(moved, reference)


def test_write_failing_mid_file_leaves_no_temporary_and_the_old_file(tmp_path, small_tmpfs, monkeypatch):
    """ENOSPC from the write itself (the free-space check passed: another writer filled the disk)."""
    disk = small_tmpfs("256k")
    path = disk / "state.ortcp"
    _checkpoint_storage.save({"w": np.zeros(10, np.float32)}, path)
    before = path.read_bytes()
    monkeypatch.setattr(_checkpoint_storage, "check_free_space", lambda *args: None)
    with pytest.raises(_checkpoint_storage.DiskFullError, match=r"needs [\d,]+ bytes"):
        _checkpoint_storage.save({"w": np.zeros(200_000, np.float32)}, path, overwrite=True)
    assert sorted(p.name for p in disk.iterdir()) == ["state.ortcp"] and path.read_bytes() == before


@pytest.mark.parametrize("size", [100, 1400, 1500, 5000])
def test_disk_filling_anywhere_in_a_streamed_save_is_one_error(tmp_path, small_tmpfs, monkeypatch, capfd, size):
    """The file is streamed (no image in memory): a write failing in the data or in HDF5's metadata
    (many groups) must still be one DiskFullError, no HDF5 error cascade, and no temporary file."""
    disk = small_tmpfs("256k")
    state = {"m": {f"w{i}": np.full(size, i, np.float32) for i in range(40)},
             "o": {f"g{i}": {"a": np.zeros(3), "s": "x"} for i in range(200)}}
    monkeypatch.setattr(_checkpoint_storage, "check_free_space", lambda *args: None)
    with pytest.raises(_checkpoint_storage.DiskFullError):
        _checkpoint_storage.save(state, disk / "state.ortcp")
    assert list(disk.iterdir()) == []
    assert "HDF5" not in capfd.readouterr().err


# ---------------------------------------------------------------- damaged checkpoints


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file", [(truncate, models.CHECKPOINT_FILE), (flip_byte, models.CHECKPOINT_FILE),
                                          (flip_byte, models.TOKENIZER_JSON)])
def test_damaged_newest_checkpoint_is_skipped_and_replaced(reference, data_cache, tmp_path, capsys, damage, file):
    out = copy_run(reference, tmp_path)
    bad = out / f"checkpoint-{STEPS}"
    damage(bad / file)
    assert train(RECIPE, out, fault_sets(data_cache), str(bad)) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and f"--resume: {bad} is damaged: {file}" in lines[0], lines
    assert train(RECIPE, out, fault_sets(data_cache), "auto") == 0
    printed = capsys.readouterr().out
    assert f"resume: warning: skipping {bad}: it is damaged ({file}" in printed
    assert models.checkpoint_damage(bad) is None  # step 6 ran again and replaced it
    assert_same_as(out, reference)


def test_resume_from_an_older_checkpoint_replaces_the_ones_it_passes(reference, data_cache, tmp_path):
    out = copy_run(reference, tmp_path)
    written = {p.name: json.loads((p / models.COMPLETE_MARKER).read_text())["time"]
               for p in models.complete_checkpoints(out)}
    assert train(RECIPE, out, fault_sets(data_cache), str(out / "checkpoint-4")) == 0
    rewritten = {p.name: json.loads((p / models.COMPLETE_MARKER).read_text())["time"]
                 for p in models.complete_checkpoints(out)}
    assert [n for n in written if rewritten[n] != written[n]] == ["checkpoint-5", "checkpoint-6"]
    assert_same_as(out, reference)


def test_non_finite_loss_stops_without_saving_over_good_checkpoints(data_cache, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(RECIPE, out, fault_sets(data_cache, "trainer.optimizer.lr=1e20")) == 1
    lines = error_lines(capsys)
    assert len(lines) == 1 and "the loss is nan at step" in lines[0] and "stopped without saving" in lines[0]
    saved = models.complete_checkpoints(out)
    assert saved and [r["step"] for r in records(out, "train")] == [models.checkpoint_step(p)[0] for p in saved]
    for folder in saved:
        assert all(np.isfinite(w).all() for w in weights(folder).values())


def test_skip_mode_trains_exactly_like_stop_mode(reference, data_cache, tmp_path):
    # run.on_nonfinite_loss=skip builds the graph with mixed precision's finiteness check at a fixed
    # scale of 1: the same losses and weights as the plain fp32 run, bit for bit.
    out = tmp_path / "run"
    assert train(RECIPE, out, fault_sets(data_cache, "run.on_nonfinite_loss=skip")) == 0
    assert [r["loss"] for r in records(out, "train")] == [r["loss"] for r in records(reference, "train")]
    assert all(r["loss_scale"] == 1.0 and r["skipped_steps"] == 0 for r in records(out, "train"))
    final = f"checkpoint-{STEPS}"
    mine, theirs = weights(out / final), weights(reference / final)
    for name in mine:
        np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)


def test_skip_mode_discards_non_finite_steps(data_cache, tmp_path, capsys):
    # lr 1e20: the first update makes the weights huge, every later loss is inf; each of those steps
    # is skipped (the checkpoints keep finite weights) until 50 in a row end the run.
    out = tmp_path / "run"
    assert train(RECIPE, out, fault_sets(data_cache, "trainer.optimizer.lr=1e20", "run.on_nonfinite_loss=skip")) == 1
    lines = error_lines(capsys)
    assert len(lines) == 1 and "50 optimizer steps in a row were skipped" in lines[0]
    for folder in models.complete_checkpoints(out):
        assert all(np.isfinite(w).all() for w in weights(folder).values())


def test_resumed_run_outlives_rotation_of_the_checkpoint_it_came_from(data_cache, tmp_path):
    out = tmp_path / "run"
    assert train(RECIPE, out, fault_sets(data_cache, "run.save_total_limit=1", "run.max_steps=2")) == 0
    assert train(RECIPE, out, fault_sets(data_cache, "run.save_total_limit=1", "run.max_steps=5"), "auto") == 0
    assert [p.name for p in models.complete_checkpoints(out)] == ["checkpoint-5"]
    assert (out / "checkpoint-5" / models.TOKENIZER_JSON).is_file()


# ---------------------------------------------------------------- one run per folder


def test_second_run_on_a_locked_folder_is_refused(reference, data_cache, tmp_path, capsys):
    out = copy_run(reference, tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from orttrainer.run.lock import OutputLock; "
         f"OutputLock({str(out)!r}).acquire(print); print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert train(RECIPE, out, fault_sets(data_cache), "auto") == 2
        lines = error_lines(capsys)
        assert len(lines) == 1, lines
        assert f"{out} is in use by process {holder.pid} on host {socket.gethostname()}" in lines[0]
    finally:
        holder.kill()
        holder.wait()
    # Killed without releasing it: the lock file stays, stale; the next run takes it over.
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid
    assert train(RECIPE, out, fault_sets(data_cache), "auto") == 0
    printed = capsys.readouterr().out
    assert f"taking over the stale lock {out / LOCK_FILE} of process {holder.pid}" in printed
    assert "nothing to do" in printed and not (out / LOCK_FILE).exists()


def test_lock_is_taken_and_released(tmp_path):
    lock = OutputLock(tmp_path)
    lock.acquire(print)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(Exception, match="is in use by process"):
        OutputLock(tmp_path).acquire(print)  # a second open file description: flock refuses it
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


# ---------------------------------------------------------------- recipes that ended in a traceback or passed


def recipe_file(tmp_path, edit):
    path = tmp_path / "recipe.yaml"
    path.write_text(edit((RECIPES / RECIPE).read_text()))
    return str(path)


@pytest.mark.parametrize("command", ["train", "validate"])
@pytest.mark.parametrize("recipe, overrides, expected", [
    ("gpt2-pretrain-tiny.yaml", ["model.config.n_embd=66", "model.config.n_head=4"],
     "model.config.n_embd: got 66; it must be a multiple of model.config.n_head (4)"),
    (RECIPE, ["model.config.num_attention_heads=0"], "model.config.num_attention_heads: got 0; expected an integer >= 1"),
    (RECIPE, ["run.save_every=true"], "run.save_every: got True;"),
    (RECIPE, ["model.config.max_position_embeddings=32", "data.seq_length=64"],
     "model.config.max_position_embeddings: got 32; smaller than data.seq_length (64)"),
    (RECIPE, ["data.corpus=/no/such/corpus.txt"], "data.corpus: file not found: /no/such/corpus.txt"),
    (RECIPE, ["run.init_from=/no/such/run"], "run.init_from: /no/such/run does not exist"),
])
def test_recipe_mistakes_are_one_line(tmp_path, capsys, command, recipe, overrides, expected):
    argv = ["train", str(RECIPES / recipe), "--output-dir", str(tmp_path / "run")] if command == "train" else \
        ["config", "validate", str(RECIPES / recipe)]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["--output-dir", "data.cache_dir"])
def test_folders_that_are_files_are_one_line(tmp_path, capsys, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for path, why in ((blocker, "it is a file, not a folder"), (blocker / "sub", f"{blocker} is a file")):
        argv = ["train", str(RECIPES / RECIPE), "--output-dir", str(path if key == "--output-dir" else tmp_path / "o")]
        if key != "--output-dir":
            argv += ["--set", f"data.cache_dir={path}"]
        assert main(argv) == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and why in lines[0], lines
        assert lines[0].startswith(f"orttrainer train: error: {'run.output_dir' if key == '--output-dir' else key}")


def test_duplicate_keys_are_an_error(tmp_path, capsys):
    path = recipe_file(tmp_path, lambda text: text.replace("  kind: bert-pretraining\n",
                                                           "  kind: bert-pretraining\n  kind: gpt2\n", 1))
    assert main(["config", "validate", path]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "duplicate key 'kind' (first given on line" in lines[0], lines


def test_ckpt_inspect_takes_a_checkpoint_folder(reference, capsys):
    assert main(["ckpt", "inspect", str(reference / "checkpoint-1")]) == 0
    assert str(reference / "checkpoint-1" / models.CHECKPOINT_FILE) in capsys.readouterr().out


def test_version():
    proc = subprocess.run([sys.executable, "-m", "orttrainer", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("orttrainer ")
