"""Reproducible data order that can be resumed at an exact position.

The order of epoch ``e`` is a pure function of ``(seed, e, dataset length)``: a
``torch.randperm`` drawn from its own ``torch.Generator`` seeded with ``seed + e``, the
way ``DistributedSampler`` does it. The global torch RNG is neither used nor disturbed
(`ResumableLoader` gives its `DataLoader` a private generator for the worker seeds too).
So the whole data position is three numbers -- epoch, samples consumed in the epoch (by all
ranks), seed -- and a resumed run sees exactly the batches an uninterrupted run would have.

Use `ResumableLoader` in a training loop: it counts the batches actually handed to the
loop (a `DataLoader` with workers prefetches ahead, so counting in the sampler would
over-count), and its `state_dict()` goes into the checkpoint::

    loader = ResumableLoader(dataset, batch_size=32, seed=42)
    loader.load_state_dict(checkpoint["data"])       # when resuming
    for batch in loader.batches():                   # endless, epoch after epoch
        ...train step...
        if time_to_save:
            checkpoint["data"] = loader.state_dict()  # {epoch, position, seed, ...}

Save the state *after* the step that consumed the batch. With several ranks, each one
builds its loader with its `rank` / `world_size`; ranks see disjoint slices of the same
permutation (padded by repeating its start so all ranks get equal counts). The position is a
global cursor into that permutation, so a state resumes on any number of ranks and with any
batch size: the resumed run reads the next samples no rank has seen.
"""

import math

import torch
from torch.utils.data import DataLoader, Sampler

from orttrainer.run.data.common import DataError


class ResumableSampler(Sampler):
    """Indices of epoch `epoch` for this rank, from global position `start` of the epoch's order on.

    The ranks read one global order: micro-step k of a run on W ranks with batch size B consumes
    positions [k*B*W, (k+1)*B*W) of it, rank r every W-th one from r. So a run resumed at any global
    position, on any number of ranks, continues with exactly the samples no rank has seen yet.
    """

    def __init__(self, num_samples, seed=0, shuffle=True, rank=0, world_size=1):
        if num_samples < 1:
            raise DataError("cannot sample from an empty dataset")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in 0..{world_size - 1}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def per_rank(self, start=0):
        """Samples this rank sees in one epoch (from global position `start` on)."""
        return math.ceil(max(0, self.num_samples - start) / self.world_size)

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def epoch_order(self, epoch):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return torch.randperm(self.num_samples, generator=g).tolist()
        return list(range(self.num_samples))

    def epoch_indices(self, epoch, start=0):
        """This rank's indices of the epoch from global position `start`; the rest is padded by repeating
        the order's start, so all ranks get equal counts."""
        order = self.epoch_order(epoch)
        rest = order[start:]
        total = self.per_rank(start) * self.world_size
        rest += order[:total - len(rest)]
        return rest[self.rank:total:self.world_size]

    def __iter__(self):
        return iter(self.epoch_indices(self.epoch, self.start))

    def __len__(self):
        return self.per_rank(self.start)


class ResumableLoader:
    """A `DataLoader` over a `ResumableSampler` that knows its position (see module doc).

    Extra keyword arguments (``num_workers``, ``collate_fn``, ``pin_memory``...) go to
    `DataLoader`. `drop_last=True` keeps every batch the same shape, which a fixed-shape
    ONNX training graph wants.
    """

    def __init__(self, dataset, batch_size, seed=0, shuffle=True, drop_last=True, rank=0, world_size=1,
                 **loader_args):
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.sampler = ResumableSampler(len(dataset), seed, shuffle, rank, world_size)
        self.loader_args = loader_args
        self.epoch = 0
        self.cursor = 0  # global position in the epoch's order: samples of this epoch all ranks consumed

    def __len__(self):
        """Batches in a full epoch."""
        n = self.sampler.per_rank()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    @property
    def position(self):
        """Samples of this epoch handed to this rank (as if the run had always had this many ranks)."""
        return min(math.ceil(self.cursor / self.sampler.world_size), self.sampler.per_rank())

    def __iter__(self):
        """The rest of the current epoch; the epoch counter advances when it is exhausted."""
        start = self.cursor
        self.sampler.set_epoch(self.epoch, start)
        # DataLoader draws its workers' base seed from the *global* RNG unless given a
        # generator; a resumed run would then shift the model's RNG stream (dropout).
        generator = torch.Generator()
        generator.manual_seed(self.sampler.seed + self.epoch)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler,
                            drop_last=self.drop_last, generator=generator, **self.loader_args)
        end = start + len(self.sampler) * self.sampler.world_size
        for batch in loader:
            self.cursor = min(self.cursor + self.batch_size * self.sampler.world_size, end)
            yield batch
        self.epoch += 1
        self.cursor = 0

    def batches(self):
        """Endless batches, epoch after epoch."""
        if len(self) == 0:
            raise DataError(f"batch size {self.batch_size} is larger than the {self.sampler.per_rank()} "
                            "samples per epoch and drop_last is set: no batches")
        while True:
            yield from self

    def state_dict(self):
        s = self.sampler
        return {"epoch": self.epoch, "position": self.position, "cursor": self.cursor, "seed": s.seed,
                "shuffle": s.shuffle, "num_samples": s.num_samples, "batch_size": self.batch_size,
                "world_size": s.world_size}

    def load_state_dict(self, state):
        """Continue where `state` stopped, with any batch size or number of ranks (the global cursor)."""
        s = self.sampler
        if "num_samples" in state and state["num_samples"] != s.num_samples:
            raise DataError(f"cannot resume the data position: the checkpoint has num_samples={state['num_samples']}, "
                            f"this run has {s.num_samples} (the dataset changed)")
        cursor = state.get("cursor")
        if cursor is None:  # saved before the global cursor: a per-rank position on `world_size` ranks
            cursor = int(state["position"]) * int(state.get("world_size", s.world_size))
        self.epoch, self.cursor = int(state["epoch"]), int(cursor)
        s.seed, s.shuffle = int(state["seed"]), bool(state.get("shuffle", s.shuffle))
