"""Reproducible data order that can be resumed at an exact position.

The order of epoch ``e`` is a pure function of ``(seed, e, dataset length)``: a
``torch.randperm`` drawn from its own ``torch.Generator`` seeded with ``seed + e``, the
way ``DistributedSampler`` does it. The global torch RNG is neither used nor disturbed
(`ResumableLoader` gives its `DataLoader` a private generator for the worker seeds too).
So the whole data position is three numbers -- epoch, samples consumed in the epoch, seed
-- and a resumed run sees exactly the batches an uninterrupted run would have.

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
permutation (padded by repeating its start so all ranks get equal counts).
"""

import math

import torch
from torch.utils.data import DataLoader, Sampler

from orttrainer.run.data.common import DataError


class ResumableSampler(Sampler):
    """Indices of epoch `epoch` for this rank, starting at sample `start`."""

    def __init__(self, num_samples, seed=0, shuffle=True, rank=0, world_size=1):
        if num_samples < 1:
            raise DataError("cannot sample from an empty dataset")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in 0..{world_size - 1}")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def per_rank(self):
        """Samples this rank sees in one epoch."""
        return math.ceil(self.num_samples / self.world_size)

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def epoch_indices(self, epoch):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        total = self.per_rank() * self.world_size
        order += order[:total - len(order)]
        return order[self.rank:total:self.world_size]

    def __iter__(self):
        return iter(self.epoch_indices(self.epoch)[self.start:])

    def __len__(self):
        return max(0, self.per_rank() - self.start)


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
        self.position = 0  # samples of this epoch already handed out

    def __len__(self):
        """Batches in a full epoch."""
        n = self.sampler.per_rank()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self):
        """The rest of the current epoch; the epoch counter advances when it is exhausted."""
        self.sampler.set_epoch(self.epoch, self.position)
        # DataLoader draws its workers' base seed from the *global* RNG unless given a
        # generator; a resumed run would then shift the model's RNG stream (dropout).
        generator = torch.Generator()
        generator.manual_seed(self.sampler.seed + self.epoch)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler,
                            drop_last=self.drop_last, generator=generator, **self.loader_args)
        for batch in loader:
            self.position = min(self.position + self.batch_size, self.sampler.per_rank())
            yield batch
        self.epoch += 1
        self.position = 0

    def batches(self):
        """Endless batches, epoch after epoch."""
        if len(self) == 0:
            raise DataError(f"batch size {self.batch_size} is larger than the {self.sampler.per_rank()} "
                            "samples per epoch and drop_last is set: no batches")
        while True:
            yield from self

    def state_dict(self):
        s = self.sampler
        return {"epoch": self.epoch, "position": self.position, "seed": s.seed, "shuffle": s.shuffle,
                "num_samples": s.num_samples, "batch_size": self.batch_size, "world_size": s.world_size}

    def load_state_dict(self, state):
        s = self.sampler
        for key, mine in (("num_samples", s.num_samples), ("world_size", s.world_size)):
            if key in state and state[key] != mine:
                raise DataError(f"cannot resume the data position: the checkpoint has {key}={state[key]}, "
                                f"this run has {mine} (the dataset or the number of ranks changed)")
        if state["position"] % self.batch_size and state["position"] != s.per_rank():
            raise DataError(f"cannot resume at sample {state['position']} with batch size {self.batch_size}: "
                            "the batch size changed")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        s.seed, s.shuffle = int(state["seed"]), bool(state.get("shuffle", s.shuffle))
