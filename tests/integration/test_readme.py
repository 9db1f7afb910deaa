"""The README's Python example and commands are what a newcomer runs first: they must work as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_the_python_example_trains_and_saves_a_checkpoint_that_loads(tmp_path, monkeypatch):
    (example,) = blocks("python")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer._train_step_info.optimization_step == 20
    torch.manual_seed(0)  # the example's model before training: the same seed, the same first line
    untrained = eval(example.splitlines()[3].split("=", 1)[1], namespace)
    first = torch.nn.functional.cross_entropy(untrained(namespace["x"]), namespace["y"])
    assert namespace["loss"].item() < first.item() - 0.02  # the example's 20 Adam steps lowered the loss
    saved = trainer.state_dict()
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    again = ORTTrainer(namespace["model"], namespace["model_desc"], optim.AdamConfig(lr=1e-3),
                       loss_fn=namespace["loss_fn"], options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    again.load_checkpoint(str(tmp_path / "mlp.ortcp"))
    again.train_step(namespace["x"], namespace["y"])  # the state is applied at the first step
    assert again._train_step_info.optimization_step == 21
    assert set(again.state_dict()["model"]["full_precision"]) == set(saved["model"]["full_precision"])


def test_the_test_command_is_what_ci_runs_and_the_fast_tier_uses_the_markers():
    commands = [line for block in blocks("sh") for line in block.splitlines() if "pytest" in line]
    assert commands == [".venv/bin/python -m pytest -q",
                        '.venv/bin/python -m pytest -q -m "not slow and not multiprocess"']
    assert commands[0] in (ROOT / ".ci/run").read_text(encoding="utf-8").replace("|| status=$?", "")
    markers = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    assert "slow:" in markers and "multiprocess:" in markers


@pytest.mark.multiprocess
def test_every_cli_subcommand_the_readme_shows_exists():
    shown = {tuple(line.split()[1:3]) for block in blocks("sh") for line in block.splitlines()
             if line.startswith(".venv/bin/orttrainer ")}
    assert shown
    for command, sub in shown:
        words = [command] + ([sub] if command in ("config", "ckpt") else [])
        result = subprocess.run([sys.executable, "-m", "orttrainer", *words, "--help"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, (words, result.stderr[-500:])
