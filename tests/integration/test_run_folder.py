"""What `orttrainer train` writes into its output folder, through the real CLI: never through a link
(links planted at every name a run writes, pointing at a read-only file and a folder beside the output
folder), and never over the user's files (a folder holding the user's recipe, curves and TensorBoard
events is refused; a rerun into a run's own folder replaces only what the runs wrote). Also the YAML
bomb: a recipe or --set value whose aliases expand to billions of values is refused at once.
"""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from helpers.recipes import RECIPES, SMALL_BERT, sets, train  # noqa: E402
from test_recipes import main  # noqa: E402

from orttrainer.run import hf_models as models  # noqa: E402
from orttrainer.run.lock import LOCK_FILE  # noqa: E402
from orttrainer.run.run_folder import RUN_MARKER  # noqa: E402

RECIPE = "bert-pretrain-tiny.yaml"


def quick(cache, *extra):
    return sets(cache, *SMALL_BERT, "run.max_steps=2", "run.log_every=1", "run.save_every=1",
                "run.eval_every=null", "trainer.lr_scheduler.total_steps=2", *extra)


def error_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def snapshot(folder):
    """{relative path: bytes (files) or None (folders)} of everything under `folder`."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(Path(folder).rglob("*"))}


def victims(tmp_path):
    """A read-only file and a folder holding one, beside the output folder: links point at them."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("the user's file\n")
    (outside / "folder").mkdir()
    (outside / "folder" / "kept.txt").write_text("the user's folder\n")
    for path in (outside / "victim.txt", outside / "folder" / "kept.txt"):
        path.chmod(stat.S_IRUSR | stat.S_IRGRP)
    return outside


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, data_cache):
    """A 2-step run into a folder where every private file name it writes under this PID is already a
    link to a file outside, and the user keeps a notes file."""
    tmp = tmp_path_factory.mktemp("planted")
    outside = victims(tmp)
    before = snapshot(outside)
    out = tmp / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    pid = os.getpid()
    for name in (f".{LOCK_FILE}.{pid}.tmp", f"{RUN_MARKER}.tmp{pid}", f"metrics.jsonl.tmp{pid}",
                 f"recipe.yaml.tmp{pid}", f"results.json.tmp{pid}", f"curves.png.tmp{pid}"):
        (out / name).symlink_to(outside / "victim.txt")
    code = train(RECIPE, out, quick(data_cache))
    return out, outside, before, code


def test_private_files_that_are_links_are_not_written_through(planted_run):
    out, outside, before, code = planted_run
    assert code == 0
    assert snapshot(outside) == before
    assert (out / "notes.txt").read_text() == "mine\n"
    assert not any(p.is_symlink() for p in out.iterdir())  # the links themselves were replaced
    for name in ("metrics.jsonl", "results.json", "recipe.yaml", "curves.png", RUN_MARKER):
        assert (out / name).is_file(), name
    assert [p.name for p in models.complete_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]


@pytest.mark.parametrize("name", [LOCK_FILE, RUN_MARKER, "metrics.jsonl", "results.json", "recipe.yaml",
                                  "curves.png", "tb", "checkpoint-1", "checkpoint-2"])
@pytest.mark.parametrize("resume", [None, "auto"])
def test_a_link_in_the_output_folder_is_refused_and_nothing_outside_changes(planted_run, data_cache, tmp_path,
                                                                             capsys, name, resume):
    out = tmp_path / "run"
    shutil.copytree(planted_run[0], out, symlinks=True)
    outside = victims(tmp_path)
    before = snapshot(outside)
    target = outside / ("folder" if name in ("tb", "checkpoint-1", "checkpoint-2") else "victim.txt")
    path = out / name
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(target)
    overrides = quick(data_cache, "run.max_steps=3", "trainer.lr_scheduler.total_steps=3",
                      "run.overwrite_output_dir=true")
    assert train(RECIPE, out, overrides, resume) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert f"{name} (a link)" in lines[0] or f"{path} is a link" in lines[0], lines
    assert snapshot(outside) == before
    assert path.is_symlink() and not (out / LOCK_FILE).exists() or name == LOCK_FILE


def users_folder(tmp_path):
    """The issue's folder: the user's recipe (with comments) in it, a curves.png, older TensorBoard events."""
    out = tmp_path / "run"
    (out / "tb" / "older-experiment").mkdir(parents=True)
    (out / "tb" / "older-experiment" / "events.out.tfevents.1700000000.host.1.0").write_bytes(b"\x00events")
    (out / "curves.png").write_bytes(b"\x89PNG not ours")
    (out / "recipe.yaml").write_text("# my notes on this experiment\n" + (RECIPES / RECIPE).read_text())
    return out


@pytest.mark.parametrize("extra", [[], ["run.overwrite_output_dir=true"]])
def test_a_fresh_run_into_the_users_files_is_refused_and_they_stay(data_cache, tmp_path, capsys, extra):
    out = users_folder(tmp_path)
    before = snapshot(out)
    argv = ["train", str(out / "recipe.yaml"), "--output-dir", str(out)]
    for item in quick(data_cache, *extra):
        argv += ["--set", item]
    assert main(argv) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"orttrainer train: error: run.output_dir: {out} holds curves.png, recipe.yaml, tb/, "
                               "which no orttrainer run wrote there"), lines
    assert snapshot(out) == before  # nothing replaced, deleted, or added (no marker, no lock)


def test_a_rerun_replaces_only_what_runs_wrote(planted_run, data_cache, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(planted_run[0], out)
    first_events = sorted((out / "tb").glob("events.out.tfevents.*"))
    assert first_events
    (out / "tb" / "older-experiment").mkdir()
    (out / "tb" / "older-experiment" / "events.out.tfevents.1").write_bytes(b"kept")
    assert train(RECIPE, out, quick(data_cache, "run.overwrite_output_dir=true")) == 0
    assert (out / "tb" / "older-experiment" / "events.out.tfevents.1").read_bytes() == b"kept"
    assert (out / "notes.txt").read_text() == "mine\n"
    events = sorted((out / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0] not in first_events  # the first run's events replaced
    # The folder resumed from the resolved recipe the run wrote into it: its files are the run's own.
    assert main(["train", str(out / "recipe.yaml"), "--output-dir", str(out), "--resume", "auto",
                 "--set", "run.max_steps=3", "--set", "trainer.lr_scheduler.total_steps=3"]) == 0
    assert [p.name for p in models.complete_checkpoints(out)][-1] == "checkpoint-3"


def test_a_run_that_fails_at_start_up_leaves_no_marker(data_cache, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert train(RECIPE, out, quick(data_cache, "data.batch_size=100000")) == 2
    assert "data.batch_size" in error_lines(capsys)[-1]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- a YAML bomb

def bomb(levels=9, width=9, anchor="lol"):
    """A "billion laughs" YAML value: `levels` levels of `width` aliases of the level below."""
    lines = [f"- &{anchor}0 [" + ", ".join(["x"] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"- &{anchor}{level} [" + ", ".join([f"*{anchor}{level - 1}"] * width) + "]")
    return lines


BOMB_SCRIPT = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a bomb would need far more
from orttrainer.cli import main
for argv in (sys.argv[1:4], sys.argv[4:7], sys.argv[7:]):
    print("rc", main(argv), flush=True)
"""


@pytest.mark.multiprocess
def test_a_yaml_bomb_is_refused_at_once_in_one_line(tmp_path):
    recipe = (RECIPES / RECIPE).read_text()
    under_unknown_key = tmp_path / "unknown-key.yaml"
    under_unknown_key.write_text(recipe + "bombs:\n" + "".join(f"  {line}\n" for line in bomb()))
    as_list_value = tmp_path / "list-value.yaml"
    as_list_value.write_text(recipe.replace("run:\n", "laughs:\n" + "".join(f"  {line}\n" for line in bomb())
                                            + "run:\n", 1)
                             .replace("  seed: 42", "  seed: 42\n  report_to: *lol8"))
    assert len(under_unknown_key.read_bytes()) - len(recipe) < 1200
    inline = "[" + ", ".join(line[2:] for line in bomb()) + "]"
    argv = ["config", "validate", str(under_unknown_key), "config", "validate", str(as_list_value),
            "config", "validate", str(RECIPES / RECIPE), "--set", f"trainer.utils.frozen_weights={inline}"]
    proc = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, *argv], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["rc", "2", "rc", "2", "rc", "2"], proc.stdout + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3, proc.stderr[-3000:]
    for line, source in zip(lines, (under_unknown_key, as_list_value, "--set trainer.utils.frozen_weights=")):
        assert line.startswith(f"orttrainer config: error: {source}"), line
        assert "YAML refused" in line and "its aliases expand to more than 10,000 values" in line, line


def test_yaml_aliases_of_a_normal_size_still_work(tmp_path, capsys):
    text = (RECIPES / RECIPE).read_text().replace("  log_every: 10", "  log_every: &ten 10") \
        .replace("  eval_every: 100", "  eval_every: *ten")
    path = tmp_path / "aliases.yaml"
    path.write_text(text)
    assert main(["config", "print", str(path)]) == 0
    assert "eval_every: 10\n" in capsys.readouterr().out
