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


def _global_order(n, seed, epoch=0):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def _micro_steps(loaders, k):
    """k micro-steps of loaders that are the ranks of one run: the samples each step consumed."""
    gens = [loader.batches() for loader in loaders]
    return [sum((next(gen).tolist() for gen in gens), []) for _ in range(k)]


@pytest.mark.parametrize("before, after, batch_after", [(2, 1, 4), (1, 2, 4), (2, 3, 2), (3, 2, 4)])
def test_resume_on_another_number_of_ranks_continues_the_global_order(before, after, batch_after):
    """The next unseen samples of the one global order, none twice, whatever the ranks and batch size."""
    n, seed = 97, 11
    first = [ResumableLoader(Numbers(n), 4, seed=seed, rank=r, world_size=before) for r in range(before)]
    seen = sum(_micro_steps(first, 3), [])
    state = first[0].state_dict()
    assert state["cursor"] == 3 * 4 * before
    resumed = [ResumableLoader(Numbers(n), batch_after, seed=0, rank=r, world_size=after) for r in range(after)]
    for loader in resumed:
        loader.load_state_dict(state)
    later = sum(_micro_steps(resumed, 2), [])
    order = _global_order(n, seed)
    assert sorted(seen) == sorted(order[:len(seen)])
    assert sorted(later) == sorted(order[len(seen):len(seen) + len(later)])
    assert not set(seen) & set(later)


def test_a_state_from_before_the_global_cursor_resumes_by_its_per_rank_position():
    loaders = [ResumableLoader(Numbers(40), 4, seed=2, rank=r, world_size=2) for r in range(2)]
    seen = sum(_micro_steps(loaders, 2), [])
    old = {k: v for k, v in loaders[1].state_dict().items() if k != "cursor"}
    assert old["position"] == 8
    single = ResumableLoader(Numbers(40), 4, seed=2)
    single.load_state_dict(old)
    assert single.cursor == 16 and not set(next(single.batches()).tolist()) & set(seen)
