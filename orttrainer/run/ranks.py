"""This process's place in a multi-process run, and the few collectives the loop itself needs.

`orttrainer train` runs one process per rank under torchrun (`torchrun --nproc_per_node=N -m
orttrainer train RECIPE`, or `orttrainer train RECIPE --nproc N`, which starts torchrun). The loop
initialises torch.distributed's default group from torchrun's environment before anything else, so
the ranks can agree on data building, stopping and saving; the trainer then uses that same group
for its gradients. Rank 0 alone prints, and writes metrics, results and the shared checkpoint files.
"""

import datetime
import os
import signal
import sys
from dataclasses import dataclass

from orttrainer.run.recipe.spec import RecipeError

LAUNCHER_PID_ENV = "ORTTRAINER_LAUNCHER_PID"  # set by `orttrainer train --nproc N` for its ranks
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun: 0 on the first attempt, k on the k-th restart
# Ranks wait for rank 0 to build the data (minutes for large corpora): far beyond a collective's timeout.
DATA_BUILD_TIMEOUT = datetime.timedelta(hours=6)


def restart_attempt():
    """torchrun's restart attempt of this process: 0 on the first start (and without torchrun)."""
    try:
        return int(os.environ.get(RESTART_ENV, "0") or 0)
    except ValueError:
        return 0


def die_with_launcher():
    """A rank of `orttrainer train --nproc N` is SIGKILLed by the kernel when its launcher dies
    (PR_SET_PDEATHSIG): torchrun's agent starts each rank in a session of its own, so a SIGKILL of
    the launcher would otherwise leave the ranks training as orphans, holding the folder's lock."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        print(f"orttrainer train: warning: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}); this rank "
              "will not stop by itself if its launcher is killed", file=sys.stderr)
        return
    if os.getppid() != int(launcher):  # the launcher died before prctl (or the rank was started by another)
        try:
            os.kill(int(launcher), 0)
        except ProcessLookupError:
            os._exit(128 + signal.SIGKILL)
        except PermissionError:
            pass


@dataclass
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    _control = None  # a gloo group for the loop's CPU collectives when the default group is NCCL

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def active(self):
        return self.world_size > 1

    @classmethod
    def from_environment(cls, recipe_world_size, trainer=None):
        """From torchrun's RANK/WORLD_SIZE/LOCAL_RANK; one process when they are not set. `trainer`: the
        recipe's `trainer:` section, whose device decides the process-group backend (placement)."""
        if "WORLD_SIZE" not in os.environ:
            if recipe_world_size != 1:
                raise RecipeError(f"trainer.distributed.world_size: got {recipe_world_size}, but this process was "
                                  "not started by torchrun; run `orttrainer train RECIPE --nproc "
                                  f"{recipe_world_size}` (or torchrun --nproc_per_node={recipe_world_size} -m "
                                  "orttrainer train RECIPE)")
            return cls()
        try:
            ranks = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
        except (KeyError, ValueError) as exc:
            raise RecipeError(f"the launcher's environment is incomplete or not numbers: {exc}") from None
        if recipe_world_size not in (1, ranks.world_size):
            raise RecipeError(f"trainer.distributed.world_size: got {recipe_world_size}, but torchrun started "
                              f"{ranks.world_size} processes; leave it at 1 (the number of processes decides) "
                              "or make them agree")
        if ranks.active:
            ranks._init_process_group(ranks.placement(trainer or {}))
        return ranks

    def placement(self, trainer):
        """The placement the trainer of this rank will use (placement/device.py): device.id 'cuda' is
        cuda:{LOCAL_RANK} on several ranks. An explicit 'cuda:N' in the recipe (the same on every rank)
        would put every local rank on one GPU: a RecipeError."""
        from orttrainer.placement import device as placement

        device = trainer.get("device") or {}
        device_id = str(device.get("id", "cuda"))
        try:
            decided = placement.resolve(device_id, mem_limit=device.get("mem_limit", 0),
                                        provider_options=trainer.get("provider_options"),
                                        world_size=self.world_size, local_rank=self.local_rank)
        except (ValueError, RuntimeError) as exc:
            raise RecipeError(f"trainer.device: {exc}") from None
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        if decided.is_cuda and local_ranks > 1 and device_id.startswith("cuda:"):
            raise RecipeError(f"trainer.device.id: {device_id!r} puts all {local_ranks} ranks of this host on one "
                              "GPU; use 'cuda' (rank k of a host takes cuda:k)")
        return decided

    def _init_process_group(self, placement):
        import torch.distributed as dist

        from orttrainer.placement.process_group import init_process_group

        if not dist.is_initialized():
            init_process_group(placement.device)  # set_device, then nccl on CUDA, gloo on the CPU
        if dist.get_backend() != "gloo":
            self._control = dist.new_group(backend="gloo")

    def check_same_settings(self, settings):
        """RecipeError on every rank when the ranks were given different settings (a nested dict: the
        resolved recipe, --resume): each rank parses its own command line, and ranks that train with
        different learning rates, batch sizes or sequence lengths would otherwise finish "fine" with
        different weights, or hang in a collective that names nothing. Digests first; the full
        settings travel only when they differ, to name the first key that does."""
        if not self.active:
            return
        import hashlib
        import json

        import torch.distributed as dist

        flat = {k: v for k, v in _flatten(settings).items() if k not in _MAY_DIFFER}
        digest = hashlib.sha256(json.dumps(flat, sort_keys=True, default=repr).encode()).hexdigest()
        digests = [None] * self.world_size
        dist.all_gather_object(digests, digest, group=self._control)
        if len(set(digests)) == 1:
            return
        every = [None] * self.world_size
        dist.all_gather_object(every, flat, group=self._control)
        rank = next(r for r, d in enumerate(digests) if d != digests[0])
        mine, theirs = every[0], every[rank]
        key = next(k for k in [*mine, *theirs] if mine.get(k, _MISSING) != theirs.get(k, _MISSING))
        raise RecipeError(f"{key}: rank 0 has {_shown(mine.get(key, _MISSING))} but rank {rank} has "
                          f"{_shown(theirs.get(key, _MISSING))}; every rank must run the same recipe with the "
                          "same --set, --output-dir and --resume")

    def options(self):
        """The trainer's `distributed` keys for this process."""
        return {"world_rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank}

    # ------------------------------------------------------------------ collectives (no-ops on one rank)
    def any(self, flag):
        """True on every rank when it is True on some rank (e.g. Ctrl-C reached only one of them)."""
        return bool(self.max(1 if flag else 0))

    def max(self, value):
        """The largest of an integer over the ranks (e.g. the number of the signal one rank received)."""
        if not self.active:
            return int(value)
        import torch
        import torch.distributed as dist

        total = torch.tensor([int(value)], dtype=torch.int32)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self._control)
        return int(total.item())

    def mean(self, value):
        """The mean of a float over the ranks (the logged loss of the global batch)."""
        if not self.active:
            return value
        import torch
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self._control)
        return float(total.item()) / self.world_size

    def barrier(self, timeout=None):
        if not self.active:
            return
        import torch.distributed as dist

        if timeout is None:
            dist.barrier(group=self._control)
        else:
            dist.monitored_barrier(group=self._control, timeout=timeout)

    def close(self):
        import torch.distributed as dist

        if self.active and dist.is_initialized():
            dist.destroy_process_group()


_MISSING = object()
# Per-process by nature: which device this rank uses, and its place (set from the launcher anyway).
_MAY_DIFFER = {"trainer.device.id", "trainer.distributed.world_rank", "trainer.distributed.local_rank"}


def _flatten(tree, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": 1}, in the tree's order."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown(value):
    return "no such key" if value is _MISSING else repr(value)
