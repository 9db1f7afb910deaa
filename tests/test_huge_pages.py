"""The Adam moments in huge-page-advised mappings (engine/huge_pages.py): zeros, the buffers the
session really writes, training bitwise equal to np.zeros moments, and one warning where madvise fails."""

import mmap
import sys
import types
import warnings

import numpy as np
import pytest
import torch

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine import huge_pages, optimizer_graph

linux_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                               reason="MADV_HUGEPAGE is Linux only")


def vm_flags(address):
    """The VmFlags of the mapping of this process that holds `address` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_thp
def test_large_moments_are_zeros_in_a_huge_page_advised_mapping():
    weight = np.ones((1024, 1280), np.float32)  # 5 MB: above MIN_BYTES
    states = optimizer_graph.optimizer_state("AdamOptimizer", {"w": weight})
    for name in ("Moment_1_w", "Moment_2_w"):
        value = states[name].initial
        assert value.shape == weight.shape and value.dtype == np.float32 and value.flags.writeable
        assert not value.any()
        assert "hg" in vm_flags(value.ctypes.data), "the moment is not in a MADV_HUGEPAGE mapping"


def test_small_arrays_stay_in_the_heap():
    small = huge_pages.zeros((16, 16), np.float32)
    assert small.base is None and not small.any()  # a plain np.zeros owns its data


class Wide(torch.nn.Module):  # one 4.5 MB weight: its moments take the huge-page path
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 1152), torch.nn.Linear(1152, 1024)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def train(steps=4, cache_dir=None):
    torch.manual_seed(0)
    model = Wide()
    desc = {"inputs": [("x", [8, 64]), ("y", [8, 1024])], "outputs": [("loss", [], True)]}
    utils = {"export_cache": True, "export_cache_dir": str(cache_dir)} if cache_dir else {"export_cache": False}
    trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3),
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, "utils": utils}))
    g = torch.Generator().manual_seed(1)
    losses = [trainer.train_step(torch.randn(8, 64, generator=g), torch.randn(8, 1024, generator=g)).item()
              for _ in range(steps)]
    state = trainer._training_session.state
    return trainer, state, losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@linux_thp
def test_training_writes_the_huge_page_moments_and_matches_np_zeros_bitwise(monkeypatch):
    trainer, state, losses, weights = train()
    moment = next(pair[0] for name, pair in state.pairs.items() if name.startswith("Moment_1_") and
                  pair[0].numel() * 4 >= huge_pages.MIN_BYTES)
    assert moment.abs().sum() > 0  # the session updated this very buffer
    assert "hg" in vm_flags(moment.data_ptr())
    del trainer, state
    monkeypatch.setattr(huge_pages, "zeros", lambda shape, dtype: np.zeros(shape, dtype))  # the old path
    _, _, plain_losses, plain_weights = train()
    assert losses == plain_losses
    for name, value in weights.items():
        assert torch.equal(value, plain_weights[name]), name


@linux_thp
def test_a_warm_export_cache_gives_huge_page_moments_too_and_the_same_training(tmp_path):
    """A cache hit restores the moments with np.full, whose malloc path numpy itself advises for huge
    pages (arrays >= 4 MB): the warm path needs no huge_pages.zeros, and trains as the cold one."""
    _, _, cold_losses, cold_weights = train(cache_dir=tmp_path)
    trainer, state, losses, weights = train(cache_dir=tmp_path)
    assert "export_cache_verify" in trainer.startup_seconds, "the second trainer did not hit the cache"
    moment = next(pair[0] for name, pair in state.pairs.items() if name.startswith("Moment_2_") and
                  pair[0].numel() * 4 >= huge_pages.MIN_BYTES)
    assert "hg" in vm_flags(moment.data_ptr())
    assert losses == cold_losses
    for name, value in weights.items():
        assert torch.equal(value, cold_weights[name]), name


def test_a_failing_madvise_warns_once_and_gives_plain_zeros(monkeypatch):
    class Region:
        def __init__(self, *args, **kwargs):
            self.closed = False

        def madvise(self, advice):
            raise OSError(22, "Invalid argument")

        def close(self):
            self.closed = True

    fake = types.SimpleNamespace(MADV_HUGEPAGE=14, MAP_PRIVATE=mmap.MAP_PRIVATE, MAP_ANONYMOUS=mmap.MAP_ANONYMOUS,
                                 mmap=Region)
    monkeypatch.setattr(huge_pages, "mmap", fake)
    monkeypatch.setattr(huge_pages, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = huge_pages.zeros((1024, 1280), np.float32)
        second = huge_pages.zeros((2048, 1024), np.float32)
    assert [str(w.message).split(" (")[0] for w in caught] == ["madvise(MADV_HUGEPAGE) failed"]
    assert first.shape == (1024, 1280) and not first.any() and second.base is None
