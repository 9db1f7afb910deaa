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


def test_parameter_group_naming_no_model_parameter_warns_once():
    """The legacy trainer ignored such names silently (docs/options.md): kept, with one warning."""
    import warnings

    import torch
    from models import MLP, MLP_DESC, cross_entropy

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
