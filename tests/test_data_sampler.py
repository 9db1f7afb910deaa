"""Resumable data order: a loader restored from state_dict continues with the same batches."""

import pytest
import torch
from torch.utils.data import Dataset

from orttrainer.run.data import DataError
from orttrainer.run.data.sampler import ResumableLoader, ResumableSampler


class Numbers(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def _take(gen, k):
    return [next(gen).tolist() for _ in range(k)]


@pytest.mark.parametrize("stop_after", [3, 7, 10, 11])  # mid-epoch, last batch of an epoch, later
def test_resume_gives_the_same_batches(stop_after):
    ds = Numbers(43)
    full = _take(ResumableLoader(ds, 4, seed=5).batches(), 30)

    first = ResumableLoader(ds, 4, seed=5)
    seen = _take(first.batches(), stop_after)
    state = first.state_dict()
    assert set(state) >= {"epoch", "position", "seed"}

    resumed = ResumableLoader(ds, 4, seed=0)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert seen + _take(resumed.batches(), 30 - stop_after) == full


def test_epochs_are_permutations_that_differ_and_leave_global_rng_alone():
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    loader = ResumableLoader(Numbers(20), 5, seed=1)
    epochs = [sum((b.tolist() for b in loader), []) for _ in range(2)]
    assert torch.rand(1) == expected_next
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(20))
    assert epochs[0] != epochs[1]
    assert loader.state_dict()["epoch"] == 2 and len(loader) == 4


def test_drop_last_and_partial_batches():
    keep = ResumableLoader(Numbers(10), 4, shuffle=False, drop_last=False)
    assert [b.tolist() for b in keep] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    drop = ResumableLoader(Numbers(10), 4, shuffle=False)
    assert [len(b) for b in drop] == [4, 4] and len(drop) == 2


def test_ranks_split_one_permutation():
    parts = [list(ResumableSampler(10, seed=3, rank=r, world_size=3)) for r in range(3)]
    assert all(len(p) == 4 for p in parts)  # padded to 12
    assert set(sum(parts, [])) == set(range(10))


def test_worker_processes_do_not_change_position():
    ds = Numbers(40)
    loader = ResumableLoader(ds, 4, seed=2, num_workers=1)
    gen = loader.batches()
    seen = _take(gen, 2)
    state = loader.state_dict()
    assert state["position"] == 8  # batches handed out, not batches prefetched
    resumed = ResumableLoader(ds, 4, seed=2)
    resumed.load_state_dict(state)
    assert seen + _take(resumed.batches(), 3) == _take(ResumableLoader(ds, 4, seed=2).batches(), 5)


def test_mismatched_state_is_refused():
    state = ResumableLoader(Numbers(10), 2).state_dict()
    with pytest.raises(DataError, match="num_samples=10"):
        ResumableLoader(Numbers(12), 2).load_state_dict(state)
    state["position"] = 2
    with pytest.raises(DataError, match="the batch size changed"):
        ResumableLoader(Numbers(10), 4).load_state_dict(state)
