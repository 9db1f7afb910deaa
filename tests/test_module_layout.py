"""The code's layout rules (issue 21): no module over 600 lines; legacy module paths keep their names."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
# Modules allowed over MAX_LINES while being split (their current length): none now.
NOT_YET = {}


def test_no_module_outside_tests_is_over_600_lines():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert "bench/train_bench.py" in files and "orttrainer/checkpoint.py" in files  # the listing works
    sizes = {name: len((ROOT / name).read_text(encoding="utf-8").splitlines())
             for name in files if not name.startswith("tests/") and (ROOT / name).exists()}
    too_long = {name: n for name, n in sizes.items() if n > NOT_YET.get(name, MAX_LINES)}
    assert not too_long, f"split these by job (docs/engine.md, 'Where the code lives'): {too_long}"


def test_trainer_facade_stays_a_facade():
    """ORTTrainer keeps the public API, the order of a step and the legacy attributes; graph
    selection, step accounting and state loading live in their own modules (docs/engine.md)."""
    facade = (ROOT / "orttrainer/orttrainer.py").read_text(encoding="utf-8")
    assert len(facade.splitlines()) <= 350
    for owned_elsewhere in ("GraphLifecycle(", "GraphFactory(", "TrainStepInfo(", "DynamicLossScaler("):
        assert owned_elsewhere not in facade, owned_elsewhere


def test_legacy_checkpoint_module_keeps_every_name():
    from orttrainer import checkpoint
    from orttrainer._checkpoint import aggregation, experimental, trainer_files

    assert set(checkpoint.__all__) == {
        "aggregate_checkpoints", "experimental_state_dict", "experimental_load_state_dict",
        "experimental_save_checkpoint", "experimental_load_checkpoint"}
    assert checkpoint.aggregate_checkpoints is aggregation.aggregate_checkpoints
    for name in checkpoint.__all__[1:]:
        assert getattr(checkpoint, name) is getattr(experimental, name)
    # the trainer and orttrainer.run reach the file side through the legacy module
    assert checkpoint._save_checkpoint is trainer_files._save_checkpoint
    assert checkpoint._load_checkpoint is trainer_files._load_checkpoint
