"""Shared fixtures: tiny models, their model_desc, batches and CPU options (tests/helpers/), an export
cache of the session's own, and the tiers' markers: every test under integration/ is `slow`; a test
that starts processes (ranks, torchrun, a subprocess) is `multiprocess`. The fast tier is
`pytest -m "not slow and not multiprocess"`.
"""

import copy
import os
from pathlib import Path

import pytest
import torch
from helpers.models import CLASSES, D_IN, MLP, MLP_DESC, export_mlp_with_loss
from helpers.training import make_options

INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _export_cache_in_a_tmp_dir(tmp_path_factory):
    """The export cache (on by default) writes under a folder of this test session, never the user's;
    child processes started by tests inherit it."""
    os.environ["ORTTRAINER_CACHE_DIR"] = str(tmp_path_factory.mktemp("export_cache"))
    yield


@pytest.fixture
def cpu_options():
    """Factory: cpu_options({'batch': {...}}) -> ORTTrainerOptions with device.id='cpu'."""
    return make_options


@pytest.fixture
def mlp_desc():
    return copy.deepcopy(MLP_DESC)


@pytest.fixture
def make_mlp():
    """Factory: make_mlp(seed=0, dropout=0.0) -> MLP with deterministic weights."""

    def make(seed=0, dropout=0.0):
        torch.manual_seed(seed)
        return MLP(dropout=dropout)

    return make


@pytest.fixture
def make_batch():
    """Factory: make_batch(batch=8, seed=0) -> (x float32 [batch, 6], y int64 [batch])."""

    def make(batch=8, seed=0):
        g = torch.Generator().manual_seed(1000 + seed)
        x = torch.randn(batch, D_IN, generator=g)
        y = torch.randint(0, CLASSES, (batch,), generator=g)
        return x, y

    return make


@pytest.fixture(scope="session")
def mlp_onnx_bytes():
    return export_mlp_with_loss()


@pytest.fixture
def mlp_onnx(mlp_onnx_bytes):
    """A fresh onnx.ModelProto of MLPWithLoss (each test may modify its own copy)."""
    import onnx

    return onnx.load_from_string(mlp_onnx_bytes)
