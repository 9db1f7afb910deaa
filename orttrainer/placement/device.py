"""Where a trainer runs: ONE decision for the device, the onnxruntime providers and their options, the
session options and the torch.distributed backend, used by the trainer (orttrainer.py, engine/parallel/data_parallel.py)
and by `orttrainer train`'s ranks (run/ranks.py), so the two can never disagree.

Rules (docs/engine.md, "CUDA path"):
  * `provider_options` naming CUDAExecutionProvider put the trainer on that provider's `device_id`
    (filled in from `device.id` when missing); other custom providers keep the state on the CPU.
  * `device.id='cuda'` (no index) in a run of several ranks takes `cuda:{LOCAL_RANK}`: one GPU per local
    rank. An explicit `cuda:N` is used as given.
  * `'cuda'` without a usable GPU falls back to the CPU (`arguments` warns once); `'cuda:N'` raises.
  * the process-group backend follows the resolved device: NCCL for CUDA, gloo for the CPU.

The CUDA branch was written from onnxruntime's and torch's documentation and sources and was NOT run on a
GPU (none was available to this work); on the CPU its decisions are unit-tested (tests/unit/test_placement.py).
"""

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass

import onnxruntime as ort
import torch

from orttrainer import _utils
from orttrainer.placement.process_state import PROCESS, keep_module_names

CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"


class PlacementError(RuntimeError):
    """The device options cannot be served here, or contradict each other."""


def cuda_ready():
    """A GPU torch can use and the CUDA provider in this onnxruntime (the training wheel lists CUDA even
    on a machine without a GPU, so both are needed)."""
    return torch.cuda.is_available() and CUDA_PROVIDER in ort.get_available_providers()


def launcher_local_rank():
    """torchrun's LOCAL_RANK, or None when no launcher set it."""
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise PlacementError(f"LOCAL_RANK={value!r} is not a number; it is set by the launcher "
                             "(torchrun), do not set it by hand") from None


@dataclass(frozen=True)
class Placement:
    """The decision. `provider_options` are per provider, in `providers` order (copies: never the
    user's dicts). `fallback`: device.id 'cuda' was asked but no GPU is usable (the caller warns)."""

    device: torch.device
    providers: tuple
    provider_options: tuple
    backend: str
    fallback: bool = False

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    def session_arguments(self):
        """(providers, provider_options, device) as the trainer's `_providers()` returns them."""
        return list(self.providers), [dict(o) for o in self.provider_options], self.device


def backend_for(device):
    """The torch.distributed backend for a rank whose trainer state lives on `device`."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def resolve(device_id="cuda", *, mem_limit=0, provider_options=None, world_size=1, local_rank=0):
    """The Placement for these option values (see the module docstring). `local_rank`: this process's
    local rank (options.distributed.local_rank); the launcher's LOCAL_RANK must agree with it."""
    device_id = str(device_id)
    custom = dict(provider_options or {})
    if custom:
        return _custom(custom, device_id, world_size, local_rank)
    if device_id == "cpu":
        return _cpu()
    if device_id != "cuda" and not device_id.startswith("cuda:"):
        raise ValueError(f"options.device.id {device_id!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'")
    index = _cuda_index(device_id, world_size, local_rank)
    if not cuda_ready():
        if device_id != "cuda":
            raise PlacementError(f"options.device.id is {device_id!r} but no CUDA device is usable here "
                                 f"(torch.cuda.is_available()={torch.cuda.is_available()}, onnxruntime "
                                 f"providers {ort.get_available_providers()}); use 'cpu' or 'cuda' (which "
                                 "falls back to the CPU).")
        return _cpu(fallback=True)
    cuda_options = {"device_id": index}
    if mem_limit > 0:
        cuda_options["gpu_mem_limit"] = mem_limit
    return _cuda(index, cuda_options)


def from_options(options):
    """The Placement for an ORTTrainerOptions."""
    distributed = options.distributed
    return resolve(options.device.id, mem_limit=options.device.mem_limit,
                   provider_options=options._validated_opts.get("provider_options"),
                   world_size=distributed.world_size, local_rank=distributed.local_rank)


def arguments(options):
    """(providers, provider_options, torch device) for an ORTTrainerOptions; a fall-back to the CPU
    warns once per process."""
    placement = from_options(options)
    if placement.fallback:
        warn_cpu_fallback_once()
    return placement.session_arguments()


@functools.lru_cache(maxsize=None)
def warn_cpu_fallback_once():
    warnings.warn("options.device.id is 'cuda' but no CUDA device is usable here; training on the CPU. "
                  "Set options.device.id='cpu' to silence this warning.", UserWarning)


def device_type(options):
    """'cuda' or 'cpu' as `from_options` decides, without raising: a bad device option raises where the
    session is created, which names it."""
    try:
        return from_options(options).device.type
    except (ValueError, RuntimeError):
        return "cpu"


def _cpu(fallback=False):
    return Placement(torch.device("cpu"), (CPU_PROVIDER,), ({},), "gloo", fallback)


def _cuda(index, cuda_options, providers=None, provider_options=None):
    providers = providers or (CUDA_PROVIDER, CPU_PROVIDER)
    options = provider_options or (cuda_options, {})
    return Placement(torch.device("cuda", index), tuple(providers), tuple(options), "nccl")


def _cuda_index(device_id, world_size, local_rank):
    """cuda:N -> N; 'cuda' -> this process's local rank when several ranks run, else 0."""
    if device_id != "cuda":
        try:
            index = int(device_id.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"options.device.id {device_id!r} is not a device: use 'cpu', 'cuda' or "
                             "'cuda:N'") from None
        if index < 0:
            raise ValueError(f"options.device.id {device_id!r}: the GPU index must be >= 0")
        return index
    if world_size <= 1:
        return 0
    launcher = launcher_local_rank()
    if launcher is not None and launcher != local_rank:
        raise PlacementError(
            f"distributed.local_rank={local_rank} but the launcher's LOCAL_RANK is {launcher}; device.id 'cuda' "
            "takes the GPU of the local rank. Set distributed.local_rank=int(os.environ['LOCAL_RANK']).")
    return local_rank


def _custom(custom, device_id, world_size, local_rank):
    """provider_options given: those providers (plus the CPU's), and the device of the CUDA provider."""
    providers = list(custom) + ([CPU_PROVIDER] if CPU_PROVIDER not in custom else [])
    options = [dict(custom.get(p) or {}) for p in providers]
    if CUDA_PROVIDER not in custom:
        return Placement(torch.device("cpu"), tuple(providers), tuple(options), "gloo")
    cuda_options = options[providers.index(CUDA_PROVIDER)]
    wanted = device_id if device_id.startswith("cuda") else "cuda"
    index = _cuda_index(wanted, world_size, local_rank)
    if "device_id" in cuda_options:
        try:
            given = int(cuda_options["device_id"])
        except (TypeError, ValueError):
            raise ValueError(f"provider_options['{CUDA_PROVIDER}']['device_id'] is "
                             f"{cuda_options['device_id']!r}; it must be a GPU index") from None
        if device_id.startswith("cuda:") and given != index:
            raise ValueError(f"options.device.id is {device_id!r} but provider_options['{CUDA_PROVIDER}']"
                             f"['device_id'] is {given}; make them name the same GPU (or leave one out)")
        index = given
    cuda_options["device_id"] = index
    if not cuda_ready():
        raise PlacementError(f"provider_options name {CUDA_PROVIDER} but no CUDA device is usable here "
                             f"(torch.cuda.is_available()={torch.cuda.is_available()}); drop it from "
                             "provider_options to train on the CPU.")
    return _cuda(index, None, providers, options)


# ---------------------------------------------------------------------------------- stream ordering
def wait_for_torch(device):
    """Before onnxruntime reads what torch wrote on `device`: onnxruntime's CUDA provider runs on a
    stream of its own that is not ordered with torch's (docs/ort-notes.md, "CUDA streams"), so torch's
    current stream is drained first. The CPU is synchronous: nothing to do."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def default_session_options() -> ort.SessionOptions:
    """The SessionOptions a trainer uses when the user gives none (options.session_options)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # The memory pattern pre-plans one block per input shape on top of the arena: +91 MB (GPT)
    # / +254 MB (BERT) resident for no measurable speed-up (docs/notes/optimisation-log.md).
    options.enable_mem_pattern = False
    # The provider's own arena stays off (its power-of-two regions grew step after step at GPT-2
    # small); the buffers come from the process-wide arena below instead.
    options.enable_cpu_mem_arena = False
    use_cpu_arena_allocator(options)
    return options


def use_cpu_arena_allocator(session_options) -> bool:
    """Sessions made with `session_options` take their CPU buffers from ONE process-wide BFC arena
    that grows by what is asked (`kSameAsRequested`, no power-of-two slack), whatever session the
    process made first. Why (docs/ort-notes.md, "One CPU provider per process"): onnxruntime-training
    keeps one CPU provider per process, built with the arena flag of the FIRST session, so
    `enable_cpu_mem_arena` alone gave BERT (PythonOp self-test first: arena on) and GPT-2 (arena off)
    different allocators. An arena keeps freed buffers for the next run: no mmap/munmap and page
    faults every step (arena off cost +33% CPU on tiny BERT). The trainer's defaults use it; a user's
    own SessionOptions may opt in. If another CPU allocator was registered first (the opt-in plain
    one, or the process's own), that one is used instead; if none can be registered: False, one
    warning, and the options keep the sessions' own allocators."""
    if not _env_cpu_allocator("arena"):
        return False
    session_options.add_session_config_entry("session.use_env_allocators", "1")
    return True


def use_plain_cpu_allocator(session_options) -> bool:
    """Opt in: sessions made with `session_options` take their CPU buffers from one process-wide
    plain (non-arena) allocator. Only if it is registered before the trainer's arena
    (`use_cpu_arena_allocator`; onnxruntime takes one CPU allocator per process): call it before any
    trainer is built. Not the default: it maps and unmaps every large buffer on every run, which cost
    a third of the throughput of the tiny BERT main job (docs/notes/real-size-investigations.md, round 3). False,
    with one warning, if the plain allocator cannot be registered (or another one already was)."""
    if not _env_cpu_allocator("plain") or PROCESS.env_cpu_allocator != "plain":
        _warn_plain_unavailable(PROCESS.env_cpu_allocator)
        return False
    session_options.add_session_config_entry("session.use_env_allocators", "1")
    return True


# PROCESS.env_cpu_allocator: None (not tried yet), "arena" / "plain" (registered by us) or False (failed).
keep_module_names(__name__, _ENV_CPU_ALLOCATOR="env_cpu_allocator")


def _env_cpu_allocator(kind) -> bool:
    """Register onnxruntime's CPU allocator of `kind` ("arena": BFC, kSameAsRequested; "plain") in
    the environment, once per process; later calls keep the first kind. False if registering failed
    (e.g. the process registered its own CPU allocator first): one warning; sessions keep their own
    allocators, as before."""
    if PROCESS.env_cpu_allocator is None:
        if kind == "arena":
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            config = ort.OrtArenaCfg({"arena_extend_strategy": 1})  # 1 = kSameAsRequested
        else:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_DEVICE_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            config = None
        try:
            ort.create_and_register_allocator(info, config)
            PROCESS.env_cpu_allocator = kind
        except Exception as exc:  # onnxruntime raises its own Fail for an allocator already registered
            PROCESS.env_cpu_allocator = False
            warnings.warn(f"Could not register a process-wide CPU allocator with onnxruntime ({exc}); sessions "
                          "keep their own allocators, whose arena setting is that of the process's first "
                          "session (docs/ort-notes.md).")
    return bool(PROCESS.env_cpu_allocator)


@functools.lru_cache(maxsize=None)
def _warn_plain_unavailable(registered):
    if registered:  # ours, of the other kind: the registration failure itself warned otherwise
        warnings.warn("Could not use a non-arena CPU allocator: the trainer's process-wide CPU arena is "
                      "already registered (onnxruntime takes one per process); call "
                      "placement.use_plain_cpu_allocator before building any trainer.")


# ---------------------------------------------------------------------------------- session options
@contextlib.contextmanager
def session_options(options):
    """The SessionOptions to create a session with: the user's (options.session_options) or the
    trainer's defaults, plus what the trainer needs. SessionOptions cannot be copied, so the user's
    object carries those settings only while the session is created (onnxruntime copies the options
    then) and gets its own values back afterwards."""
    session = options.session_options
    if session is None:
        session = default_session_options()
    settings = {}
    if options.debug.deterministic_compute:
        settings["use_deterministic_compute"] = True
    threads = _utils.intra_op_threads_per_rank()
    if threads and session.intra_op_num_threads == 0:  # a thread count the user chose is kept
        settings["intra_op_num_threads"] = threads
    path = options.debug.graph_save_paths.model_with_training_graph_after_optimization_path
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(folder) and os.access(folder, os.W_OK):
            settings["optimized_model_filepath"] = path
        else:  # onnxruntime would fail the session; the original ignored failed debug dumps
            warnings.warn(f"Could not save the optimized graph to {path!r} (its folder does not exist or "
                          "is not writable); training continues without it.")
    saved = {name: getattr(session, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(session, name, value)
        yield session
    finally:
        for name, value in saved.items():
            setattr(session, name, value)
