"""The parallel layout: data x tensor (horizontal) x pipeline = world, and every rank's place in it.

One `ParallelDims` is built from the distributed options (or a recipe's, or a checkpoint's
trainer_options); the options check, the process group, Megatron's groups, the pipeline's stages,
checkpoint aggregation and the recipe runner's data slice all read ranks from it, so the rank order
is written once, here:

    rank = (pipeline * data_size + data) * tensor_size + tensor

which is the original's: tensor-parallel groups are consecutive ranks, data-parallel groups strided
by the tensor size, and pipeline ranks stage-major (rank = stage * D + d). Option arithmetic only: no
torch, nothing imported from the package, so the legacy options module below everything can use it.
"""

from dataclasses import dataclass
from typing import NamedTuple


def is_power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


def _factors(tensor, pipeline):
    return (f"distributed.horizontal_parallel_size ({tensor}) x "
            f"distributed.pipeline_parallel.pipeline_parallel_size ({pipeline})")


class Coords(NamedTuple):
    """A rank's place: its index in the data-parallel, tensor-parallel and pipeline dimension."""

    data: int
    tensor: int
    pipeline: int


class LayoutError(ValueError):
    """The parallel sizes do not multiply to the world size."""


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    data: int  # data-parallel size: the ranks that split every global batch
    tensor: int = 1  # horizontal_parallel_size: Megatron's tensor-parallel group
    pipeline: int = 1  # pipeline_parallel_size: the stages
    zero_stage: int = 0
    adasum: bool = False

    def __post_init__(self):
        sizes = {"distributed.world_size": self.world_size, "distributed.data_parallel_size": self.data,
                 "distributed.horizontal_parallel_size": self.tensor,
                 "distributed.pipeline_parallel.pipeline_parallel_size": self.pipeline}
        small = [f"{name}={value}" for name, value in sizes.items()
                 if not isinstance(value, int) or value < 1]
        if small:
            raise LayoutError(f"parallel sizes must be integers >= 1: got {', '.join(small)}")
        if self.data * self.tensor * self.pipeline != self.world_size:
            raise LayoutError(
                f"distributed.data_parallel_size ({self.data}) x {_factors(self.tensor, self.pipeline)} = "
                f"{self.data * self.tensor * self.pipeline} must equal "
                f"distributed.world_size ({self.world_size})")

    @classmethod
    def resolve(cls, world_size, data_parallel_size=1, horizontal_parallel_size=1, pipeline_parallel_size=1,
                zero_stage=0, adasum=False):
        """The layout of the legacy option values: data_parallel_size 1 (the default) means "whatever the
        world leaves", world_size / (horizontal x pipeline). LayoutError names every factor otherwise."""
        h, p = horizontal_parallel_size, pipeline_parallel_size
        data = data_parallel_size
        if data == 1 and isinstance(h, int) and isinstance(p, int) and h >= 1 and p >= 1:
            if world_size % (h * p):
                raise LayoutError(
                    f"{_factors(h, p)} = {h * p} must divide distributed.world_size ({world_size}) "
                    "(distributed.data_parallel_size is 1, so it is taken as world_size / "
                    "(horizontal x pipeline))")
            data = world_size // (h * p)
        return cls(world_size, data, h, p, zero_stage, bool(adasum))

    @classmethod
    def of(cls, distributed):
        """From ORTTrainerOptions.distributed (attributes) or its normalised dict."""
        if isinstance(distributed, dict):
            get = distributed.get
            pipeline = (get("pipeline_parallel") or {}).get("pipeline_parallel_size", 1)
            zero = (get("deepspeed_zero_optimization") or {}).get("stage", 0)
        else:
            get = lambda key, default=None: getattr(distributed, key, default)  # noqa: E731
            pipeline = distributed.pipeline_parallel.pipeline_parallel_size
            zero = distributed.deepspeed_zero_optimization.stage
        return cls.resolve(get("world_size", 1), get("data_parallel_size", 1),
                           get("horizontal_parallel_size", 1), pipeline, zero, get("enable_adasum", False))

    # ---------------------------------------------------------------- flags
    @property
    def zero(self):
        """ZeRO-1: each data-parallel rank updates its own segment of the optimizer state."""
        return self.zero_stage > 0

    @property
    def tensor_parallel(self):
        return self.tensor > 1

    @property
    def pipeline_parallel(self):
        return self.pipeline > 1

    # ---------------------------------------------------------------- ranks
    def rank_of(self, data=0, tensor=0, pipeline=0):
        return (pipeline * self.data + data) * self.tensor + tensor

    def coords(self, rank):
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        rest, tensor = divmod(rank, self.tensor)
        pipeline, data = divmod(rest, self.data)
        return Coords(data, tensor, pipeline)

    def tensor_groups(self):
        """Every tensor-parallel group (consecutive ranks), in rank order."""
        return [[self.rank_of(d, t, p) for t in range(self.tensor)]
                for p in range(self.pipeline) for d in range(self.data)]

    def data_groups(self):
        """Every data-parallel group (ranks strided by the tensor size), ordered by (stage, tensor index)."""
        return [[self.rank_of(d, t, p) for d in range(self.data)]
                for p in range(self.pipeline) for t in range(self.tensor)]

    def pipeline_groups(self):
        """Every pipeline (one rank per stage, stage order), ordered by (data index, tensor index)."""
        return [[self.rank_of(d, t, p) for p in range(self.pipeline)]
                for d in range(self.data) for t in range(self.tensor)]

    def _group_of(self, groups, rank):
        return next(group for group in groups if rank in group)

    def tensor_group(self, rank):
        return self._group_of(self.tensor_groups(), rank)

    def data_group(self, rank):
        return self._group_of(self.data_groups(), rank)

    def pipeline_group(self, rank):
        return self._group_of(self.pipeline_groups(), rank)

    # ---------------------------------------------------------------- what runs
    def unsupported(self):
        """A message for each requested kind of parallelism, or combination, that cannot run (empty: fine)."""
        problems = []
        if self.pipeline_parallel:
            problems += self.pipeline_unsupported()
        problems += self.adasum_unsupported()
        return problems

    def pipeline_unsupported(self):
        """What pipeline parallel (engine/parallel/pipeline_stage.py) does not run with yet."""
        p = self.pipeline
        return [f"{what} with pipeline_parallel_size={p} is not built"
                for flag, what in ((self.zero, "deepspeed_zero_optimization.stage > 0"),
                                   (self.adasum, "distributed.enable_adasum"),
                                   (self.tensor_parallel, "distributed.horizontal_parallel_size > 1"))
                if flag]

    def adasum_unsupported(self):
        """Option combinations Adasum (engine/parallel/adasum.py) cannot run."""
        problems = []
        if not self.adasum:
            return problems
        if not is_power_of_two(self.world_size):
            problems.append(
                f"distributed.enable_adasum=True with distributed.world_size={self.world_size}: Adasum "
                "combines the ranks in pairs by recursive halving, so world_size must be a power of two "
                "(1, 2, 4, 8, ...); run a power-of-two number of ranks or turn enable_adasum off")
        if self.zero:
            problems.append(
                f"distributed.enable_adasum=True with deepspeed_zero_optimization.stage={self.zero_stage}: "
                "Adasum needs every weight's whole update on every rank, ZeRO-1 updates only the rank's own "
                "segment; use one or the other")
        return problems

    def __str__(self):
        return (f"{self.world_size} ranks = {self.data} data-parallel x {self.tensor} tensor-parallel x "
                f"{self.pipeline} pipeline stages")


def unsupported(distributed_options):
    """ParallelDims.unsupported of the options (the layout itself is checked when they are made)."""
    return ParallelDims.of(distributed_options).unsupported()


def pipeline_unsupported(distributed_options):
    return ParallelDims.of(distributed_options).pipeline_unsupported()


def adasum_unsupported(distributed_options):
    return ParallelDims.of(distributed_options).adasum_unsupported()
