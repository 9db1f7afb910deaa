"""Runs that come back by themselves, through the real `orttrainer train --nproc 2` (torchrun, gloo):

- `--max-restarts 1` and a rank SIGKILLed after a checkpoint: torchrun restarts the ranks, they resume
  from the newest complete checkpoint without --resume (ZeRO-1: every rank's file), and the metrics
  equal those of the uninterrupted run shared with test_recipes_distributed (conftest.py);
- SIGKILL of the launcher takes its ranks down (and so the folder's lock);
- SIGTERM to one rank only: every rank saves, the job exits 143 and its last line says SIGTERM;
- a resume on another number of ranks (2 -> 1, 1 -> 2 with ZeRO-1) reads the next unseen samples of the
  global order, none twice (the ranks record what they read: tests/helpers/hooks, HOOK_SAMPLES; the one-process
  leg runs in this process with the same recorder patched in);
- a resume whose run.max_steps stretches a decaying schedule warns with the old and the new rate.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_faults import hooked  # noqa: E402
from helpers.recipes import (  # noqa: E402
    FROZEN_EMBEDDINGS, RECIPES, ROOT, SMALL_BERT, comparable, records, sets, train,
)
from test_recipes_distributed import argv_2_ranks, train_2_ranks  # noqa: E402
from test_recipes_distributed import overrides as distributed_overrides  # noqa: E402

from orttrainer import _checkpoint_storage  # noqa: E402
from orttrainer.cli import main  # noqa: E402
from orttrainer.run import hf_models as models  # noqa: E402
from orttrainer.run.checkpointer import USER_DICT_KEY  # noqa: E402
from orttrainer.run.lock import OutputLock  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

TIMEOUT = 300
STEPS = 6


def overrides(cache, max_steps=STEPS, *extra):
    return sets(cache, *SMALL_BERT, FROZEN_EMBEDDINGS, f"run.max_steps={max_steps}", "run.log_every=1",
                "run.eval_every=3", "run.save_every=2", "run.save_total_limit=null",
                f"trainer.lr_scheduler.total_steps={STEPS}", *extra)


def rank_pids(launcher_pid):
    """{RANK: pid} of the launcher's child processes (torchrun's workers)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def alive(pid):
    """Some thread of `pid` has not exited (a zombie leader whose other threads still exit holds its files)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        except OSError:
            pass
    return False


def wait_for(condition, proc, what):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"never {what}: {proc.communicate()[0]}")
        time.sleep(0.1)


def start(argv, env):
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc):
    try:
        return proc.communicate(timeout=TIMEOUT)[0]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def cache(data_cache):
    return data_cache


@pytest.fixture(scope="module")
def uninterrupted(two_rank_bert_run):
    return two_rank_bert_run[0]  # the 2-rank ZeRO-1 run of distributed_overrides(cache, 6) (conftest.py)


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(uninterrupted, cache, tmp_path):
    out = tmp_path / "run"
    proc = start(argv_2_ranks(out, distributed_overrides(cache, STEPS)) + ["--max-restarts", "1"],
                 hooked(HOOK_SLEEP=0.5))
    wait_for(lambda: (out / "checkpoint-3" / models.COMPLETE_MARKER).is_file(), proc, "saved checkpoint-3")
    pids = rank_pids(proc.pid)
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    output = finish(proc)
    assert proc.returncode == 0, output
    assert output.count("restart 1 (torchrun): resuming from the newest complete checkpoint") == 1, output
    assert "done: step 6 of 6" in output
    assert comparable(out) == comparable(uninterrupted)


def test_sigkill_of_the_launcher_takes_its_ranks_and_the_lock_down(cache, tmp_path):
    out = tmp_path / "run"
    proc = start(argv_2_ranks(out, overrides(cache, 500)), hooked(HOOK_SLEEP=0.3))
    wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip(), proc,
             "logged a step")
    pids = rank_pids(proc.pid)
    assert sorted(pids) == [0, 1]
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15  # a killed process with big mappings takes a moment on a busy machine
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids.values()), pids
    lock = OutputLock(out)
    lock.acquire(lambda line: None)  # the flock went with rank 0
    lock.release()


def test_sigterm_to_one_rank_stops_every_rank_with_143(cache, tmp_path):
    """No periodic saves: the step the signal lands on depends on the machine's speed, and with
    save_every=2 a stop after step 2 left two complete checkpoints (the flaky failure). Rank 0 must
    also finish its results and last lines when torchrun sends it SIGTERM once rank 1 has exited."""
    out = tmp_path / "run"
    proc = start(argv_2_ranks(out, overrides(cache, 500, "run.save_every=0")), hooked(HOOK_SLEEP=0.3))
    wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip(), proc,
             "logged a step")
    os.kill(rank_pids(proc.pid)[1], signal.SIGTERM)
    output = finish(proc)
    assert proc.returncode == 143, output
    assert output.count("terminated (SIGTERM): saving a checkpoint") == 1, output  # rank 0, not rank 1's Ctrl-C
    assert "Ctrl-C" not in output
    assert output.strip().splitlines()[-1] == \
        "orttrainer train: stopped by SIGTERM (sent to a rank); exit status 143", output
    [saved] = models.complete_checkpoints(out)  # the interrupt checkpoint only
    assert models.rank_file(saved, 0).is_file() and models.rank_file(saved, 1).is_file()
    step, micro = models.checkpoint_step(saved)
    assert micro == 0
    assert f"interrupted at step {step}: saved {saved}" in output, output
    assert json.loads((out / "results.json").read_text())["status"] == "interrupted"


def read_samples(folder):
    return {int(p.stem[4:]): [int(x) for x in p.read_text().split()] for p in Path(folder).glob("rank*.txt")}


def global_order(folder):
    """The reference: the epoch-0 permutation torch draws for the run's seed and data set size."""
    user = _checkpoint_storage.decode_user_dict(
        _checkpoint_storage.load(folder / models.CHECKPOINT_FILE, key="user_dict"))
    data = user[USER_DICT_KEY]["data"]
    g = torch.Generator()
    g.manual_seed(data["seed"])
    return torch.randperm(data["num_samples"], generator=g).tolist()


def train_recording_samples(argv, nproc, samples, monkeypatch, capsys):
    """Run `argv` and record the sample indices every rank reads into samples/rank{RANK}.txt; returns the
    output. 2 ranks: a real torchrun job with the sitecustomize hook. 1 process: main() in this process
    with the same recorder patched in (what is proven is the data order, not the process; a fresh python
    only added its start-up)."""
    if nproc > 1:
        proc = subprocess.run(argv, env=hooked(HOOK_SAMPLES=samples), cwd=ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr
    from orttrainer.run.data import sampler

    original = sampler.ResumableSampler.__iter__

    def recording(self):
        with open(samples / "rank0.txt", "a", encoding="utf-8") as f:
            for index in original(self):
                f.write(f"{index}\n")
                yield index

    with monkeypatch.context() as patch:
        patch.setattr(sampler.ResumableSampler, "__iter__", recording)
        patch.delenv("RANK", raising=False)
        patch.delenv("WORLD_SIZE", raising=False)
        capsys.readouterr()
        code = main(argv[3:])  # argv[:3] is `python -m orttrainer`
        printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    return printed.out + printed.err


@pytest.mark.parametrize("before, after, zero", [(2, 1, 0), (1, 2, 1)], ids=["2to1", "1to2-zero1"])
def test_resume_on_another_number_of_ranks_reads_the_next_unseen_samples(cache, tmp_path, before, after, zero,
                                                                         monkeypatch, capsys):
    out = tmp_path / "run"
    gas = 2
    extra = [f"trainer.distributed.deepspeed_zero_optimization.stage={zero}", "run.eval_every=0",
             f"trainer.batch.gradient_accumulation_steps={gas}"]
    runs = []
    for nproc, steps, resume in ((before, 3, None), (after, 5, "auto")):
        samples = tmp_path / f"samples{len(runs)}"
        samples.mkdir()
        output = train_recording_samples(argv_2_ranks(out, overrides(cache, steps, *extra), resume, nproc=nproc),
                                         nproc, samples, monkeypatch, capsys)
        runs.append((read_samples(samples), output))
    assert f"resume: saved on {before} data rank(s), now {after}" in runs[1][1]
    assert [r["step"] for r in records(out, "train")] == [1, 2, 3, 4, 5]
    batch = 8  # per rank and micro-step; 3 steps, then 2 more, of `gas` micro-steps each
    (first, _), (second, _) = runs
    assert sorted(first) == list(range(before)) and sorted(second) == list(range(after))
    assert all(len(s) == 3 * gas * batch for s in first.values())
    assert all(len(s) == 2 * gas * batch for s in second.values())
    order = global_order(out / "checkpoint-5")
    read_first = sum(first.values(), [])
    read_second = sum(second.values(), [])
    cut = len(read_first)
    assert sorted(read_first) == sorted(order[:cut])  # the start of the global order
    assert sorted(read_second) == sorted(order[cut:cut + len(read_second)])  # then the next unseen samples
    assert len(set(read_first + read_second)) == len(read_first) + len(read_second)  # no sample twice


def test_raising_max_steps_on_resume_warns_with_the_old_and_new_learning_rate(cache, tmp_path, capsys):
    from orttrainer.run.recipe.spec import load_recipe

    out, out2 = tmp_path / "run", tmp_path / "run2"
    base = sets(cache, *SMALL_BERT, FROZEN_EMBEDDINGS, "run.log_every=1", "run.eval_every=0")
    assert train("bert-pretrain-tiny.yaml", out, base + ["run.max_steps=3"]) == 0
    shutil.copytree(out, out2)  # the same 3-step run, for the resume that keeps the old length
    capsys.readouterr()
    assert train("bert-pretrain-tiny.yaml", out, base + ["run.max_steps=6"], resume="auto") == 0
    text = capsys.readouterr().out
    recipe = load_recipe(str(RECIPES / "bert-pretrain-tiny.yaml"), base + ["run.max_steps=6"], None)
    section = recipe.trainer["lr_scheduler"]
    assert section["name"] == "poly"
    lr0, lr_end, power = recipe.trainer["optimizer"]["lr"], section.get("lr_end") or 1e-7, section["power"]

    def lr_at(s, total):  # the legacy poly schedule after its warm-up (docs/legacy-api.md)
        warmup = section["warmup"] * total
        return lr_end if s > total else (lr0 - lr_end) * (1 - (s - warmup) / (total - warmup)) ** power + lr_end

    line = [x for x in text.splitlines() if "the learning-rate schedule changed" in x]
    assert len(line) == 1, text
    assert "trainer.lr_scheduler.total_steps 3 -> 6" in line[0]
    # The 4th step runs at optimization_step 3 (0-based).
    assert f"at step 4 is {lr_at(3, 6):.6g}, the checkpoint's schedule gives {lr_at(3, 3):.6g}" in line[0]
    assert "--set trainer.lr_scheduler.total_steps=3" in line[0]
    # Keeping the old length: no warning.
    assert train("bert-pretrain-tiny.yaml", out2, base + ["run.max_steps=6", "trainer.lr_scheduler.total_steps=3"],
                 resume="auto") == 0
    assert "the learning-rate schedule changed" not in capsys.readouterr().out


def test_max_restarts_needs_several_processes(capsys):
    assert main(["train", str(RECIPES / "bert-pretrain-tiny.yaml"), "--max-restarts", "2"]) == 2
    assert "--max-restarts: got 2; expected 0 or more, with --nproc N" in capsys.readouterr().err


def test_a_mid_window_checkpoint_resumes_only_on_its_number_of_ranks(cache, tmp_path):
    from orttrainer.run import loop

    out = tmp_path / "run"

    def interrupt(run):
        if run.calls == 3:  # 1 step + 1 of 2 micro-steps
            raise KeyboardInterrupt

    from orttrainer.run.recipe.spec import load_recipe

    recipe = load_recipe(str(RECIPES / "bert-pretrain-tiny.yaml"), overrides(cache, 4), str(out))
    assert loop.train(recipe, on_micro_step=interrupt) == 130
    assert [p.name for p in models.complete_checkpoints(out)] == ["checkpoint-1-1"]
    code, output = train_2_ranks(out, overrides(cache, 4), resume="auto")
    assert code == 2, output
    assert "checkpoint-1-1 was saved 1 micro-steps into an accumulation window by 1 process(es)" in output
