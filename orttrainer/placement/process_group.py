"""The process group a trainer trains in: torch.distributed set up from the launcher's environment
(torchrun), checked against the options, with every collective's failure turned into a
DistributedError that says what to look at. Tensor parallel splits it into horizontal and data groups.
"""

import atexit
import datetime
import os
import time
from dataclasses import dataclass

import torch

from orttrainer.placement.dims import ParallelDims
from orttrainer.placement.device import backend_for

TIMEOUT_ENV = "ORTTRAINER_DIST_TIMEOUT"  # seconds; a peer that never answers fails the step, not hangs it
DEFAULT_TIMEOUT_S = 300
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(RuntimeError):
    """A collective failed: another rank exited, crashed or stopped answering."""


class DistributedSetupError(DistributedError):
    """The distributed options and the launcher's environment disagree (or no launcher ran)."""


@dataclass
class ProcessGroup:
    """This process's place in the data-parallel group (world_size 1: no collectives at all)."""

    rank: int
    world_size: int
    backend: str | None = None
    group: object = None  # the torch group of these ranks (tensor parallel's data group); None: WORLD

    @property
    def active(self):
        return self.world_size > 1

    def _collective(self, what, operation, *args, **kwargs):
        if not self.active:
            return
        if self.group is not None and operation is not torch.distributed.barrier:
            kwargs["group"] = self.group
            if "src" in kwargs:  # a rank of this group, not a global rank
                kwargs["group_src"] = kwargs.pop("src")
        try:
            operation(*args, **kwargs)
        except RuntimeError as exc:  # gloo/nccl errors, timeouts included (DistBackendError)
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what} failed: {exc}\nAnother rank has probably "
                f"exited or stopped answering; its own log says why. A silent peer fails a collective after "
                f"{TIMEOUT_ENV}={timeout_seconds():g} s.") from exc

    def all_reduce_(self, tensor, what="all_reduce"):
        self._collective(what, torch.distributed.all_reduce, tensor)
        return tensor

    @property
    def chunks_in_place(self):
        """Whether reduce-scatter and all-gather work inside the flat buffer. gloo's reduce_scatter and
        all_gather allocate several times the buffer per call (measured: +186 / +130 MB of resident
        memory for a 21 MB buffer, docs/ort-notes.md), while its all_reduce and broadcast work in place;
        so on gloo the chunk collectives are made of those. NCCL's are in place as they are."""
        return not self.active or self.backend == "gloo"

    def _chunk(self, flat, rank):
        size = flat.numel() // self.world_size
        return flat[rank * size:(rank + 1) * size]

    def reduce_scatter(self, flat, output=None):
        """This rank's chunk of the sum over ranks of `flat`: a view of `flat` (summed in place), or
        `output` (NCCL's reduce_scatter)."""
        if self.chunks_in_place:
            self.all_reduce_(flat, "all_reduce of the gradients")
            return self._chunk(flat, self.rank)
        self._collective("reduce_scatter of the gradients", torch.distributed.reduce_scatter_single, output, flat)
        return output

    def all_gather_chunks_(self, flat):
        """Every rank's chunk of `flat` copied to every rank, in place."""
        if self.chunks_in_place:
            for rank in range(self.world_size):
                self._collective("broadcast of the updated weights", torch.distributed.broadcast,
                                 self._chunk(flat, rank), src=rank)
            return
        self._collective("all_gather of the updated weights", torch.distributed.all_gather_single, flat,
                         self._chunk(flat, self.rank))

    def broadcast_(self, tensor, source=0):
        self._collective(f"broadcast of rank {source}'s weights", torch.distributed.broadcast, tensor, src=source)
        return tensor

    def barrier(self):
        self._collective("barrier", torch.distributed.barrier)


def setup_process_group(distributed_options, device: torch.device, dims=None) -> ProcessGroup:
    """The process group of every rank the options ask for: the existing default group, or a new one
    initialised from the launcher's environment (gloo on the CPU, nccl on CUDA). Errors name what
    disagrees. Tensor parallel splits it (engine/parallel/megatron.py, `data_parallel_group`)."""
    d = distributed_options
    problems = (dims or ParallelDims.of(d)).unsupported()
    if problems:
        raise NotImplementedError(
            "Not supported: " + "; ".join(problems) + ". What runs: data parallel (world_size > 1) and "
            "ZeRO stage 1 (deepspeed_zero_optimization.stage=1) over torch.distributed, tensor parallel with "
            "world_size == data x horizontal_parallel_size, and pipeline parallel with world_size == "
            "pipeline_parallel_size; see docs/distributed.md.")
    if d.world_rank >= d.world_size:
        raise DistributedSetupError(f"distributed.world_rank={d.world_rank} is not below "
                                    f"distributed.world_size={d.world_size}")
    if d.world_size == 1:
        return ProcessGroup(rank=0, world_size=1)
    if not torch.distributed.is_available():
        raise DistributedSetupError("distributed.world_size > 1 but this torch build has no torch.distributed")
    command = f"torchrun --nproc_per_node={d.world_size} YOUR_SCRIPT.py"
    if torch.distributed.is_initialized():
        size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        source = "the initialised default process group"
    else:
        missing = [name for name in _LAUNCHER_ENV if name not in os.environ]
        if missing:
            raise DistributedSetupError(
                f"distributed.world_size is {d.world_size} but this process was not started by a launcher "
                f"({', '.join(missing)} not set) and no process group is initialised. Start one process per "
                f"rank with `{command}` (orttrainer then initialises the group), or call "
                "torch.distributed.init_process_group() yourself before the first step.")
        size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        source = "the launcher's environment (WORLD_SIZE/RANK)"
    if size != d.world_size or rank != d.world_rank:
        raise DistributedSetupError(
            f"distributed.world_size={d.world_size}, world_rank={d.world_rank} but {source} says world size "
            f"{size}, rank {rank}. Set the options from the launcher (world_size=int(os.environ['WORLD_SIZE']), "
            f"world_rank=int(os.environ['RANK'])) and launch with `torchrun --nproc_per_node={d.world_size} ...`.")
    if not torch.distributed.is_initialized():
        init_process_group(device)  # set_device, then nccl (CUDA) or gloo (CPU)
    return ProcessGroup(rank=rank, world_size=size, backend=torch.distributed.get_backend())


def init_default_group(backend, **kwargs):
    """init_process_group from the launcher's environment, on a store prefix of its own per torchrun
    restart attempt: the agent's store outlives an attempt, and the restarted ranks would otherwise
    read the previous attempt's keys (gloo then connects to the dead ranks' addresses)."""
    timeout = datetime.timedelta(seconds=timeout_seconds())
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        torch.distributed.init_process_group(backend, timeout=timeout, **kwargs)
        return
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, rank, size = next(torch.distributed.rendezvous("env://", rank, size, timeout=timeout))
    store = torch.distributed.PrefixStore(f"orttrainer/attempt_{attempt}/", store)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                                         **kwargs)


def release_at_exit():
    """At exit (registered by init_process_group): destroy the groups -- ours to close, torch warns or
    aborts otherwise -- and let gloo's worker threads go idle while Python is intact.

    A gloo worker drops each finished collective a moment after its caller saw it complete; if that
    releases a tensor whose Python object is gone, it takes the GIL, and a thread that takes the GIL
    while Python finalises aborts the process ("terminate called without an active exception"). A
    two-rank `orttrainer train` whose last collective came just before its exit crashed so in about one
    run in 25 (core dump: a `pt_gloo_runloop` thread in ~AsyncAllreduceWork -> take_gil -> pthread_exit
    during Py_FinalizeEx; docs/distributed.md). destroy_process_group does not stop those threads, so
    wait, with the GIL released, until every one of them sleeps (at most a second)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    deadline, quiet = time.monotonic() + 1.0, 0
    while quiet < 2 and time.monotonic() < deadline:  # asleep in two polls running
        time.sleep(0.005)
        quiet = quiet + 1 if all(state == "S" for state in gloo_thread_states().values()) else 0


def gloo_thread_states():
    """{thread id: state letter} of this process's gloo threads (Linux /proc; elsewhere empty)."""
    states = {}
    try:
        for task in os.scandir("/proc/self/task"):
            with open(os.path.join(task.path, "stat")) as f:
                stat = f.read()
            if stat[stat.index("(") + 1:stat.rindex(")")].startswith("pt_gloo"):
                states[int(task.name)] = stat[stat.rindex(")") + 2]
    except OSError:
        pass
    return states


def timeout_seconds():
    value = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        raise DistributedSetupError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise DistributedSetupError(f"{TIMEOUT_ENV}={value!r} must be positive")
    return seconds


def init_process_group(device):
    """The default process group for a rank on `device`: torch.cuda.set_device first (NCCL's
    communicator and torch's default device are this rank's GPU, not cuda:0 for every rank), and
    `device_id` so NCCL binds eagerly to it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        init_default_group(backend_for(device), device_id=device)
    else:
        init_default_group(backend_for(device))
    atexit.unregister(release_at_exit)  # registered once, however often a process initialises a group
    atexit.register(release_at_exit)
