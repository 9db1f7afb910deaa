"""Mistakes a user makes that must stop a run before it builds anything: one line, exit status 2.

A data.cache_dir on a file system that cannot be written (also for root), a model that cannot fit
in this machine's memory, and optimizer parameter groups naming parameters the model lacks.
"""

from pathlib import Path

import pytest

from orttrainer.cli import main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
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
