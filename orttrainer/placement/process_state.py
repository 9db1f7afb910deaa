"""The state that lives as long as the process, in one documented place: `PROCESS`.

A few things outlive every trainer because onnxruntime or torch.distributed keep them per process:
the PythonOp registry and runners onnxruntime calls back into, the once-per-process checks and
warnings around them, the CPU allocator registered in onnxruntime's environment, the TorchMatMul
library loaded into the process, the tensor-parallel group. Each was a module global of the module that uses it; they are the fields of `ProcessState`
below, each saying what it holds, who writes it and when (if ever) it is reset. A trainer resets none.

Why in the "state and placement" layer: placement is about the process a trainer runs in (its
device, allocators and process groups), and this is the lowest package layer every user reaches by
importing downward (placement/device.py beside it; engine/pyop, engine/graph, engine/parallel above).
The legacy leaf layer is the original's module paths and stays as it was. This module imports
nothing of the package.

The modules that used to hold the globals keep their names (`python_op._functions`,
`runner_check._problem`, ...) for tests and tools, through `keep_module_names`: reading or assigning
the module attribute reads or writes the field, so `monkeypatch.setattr(runner_check, "_problem",
None)` still resets the check (a module `__getattr__` would not see an assignment). Code inside those
modules uses `PROCESS.<field>` itself: a `global` statement would write the module's dict instead.
"""

import dataclasses
import platform
import sys
import types
from typing import Any, Optional, Union


@dataclasses.dataclass
class ProcessState:
    # ---- engine/pyop/python_op.py: PythonOps in the training graph
    functions: dict = dataclasses.field(default_factory=dict)
    """PythonOp func_name -> the torch.autograd.Function class its runners call. Written by
    python_op._register_function when a Function is first exported; never reset (onnxruntime's own
    registry keeps the name until exit)."""

    kept_alive: list = dataclasses.field(default_factory=list)
    """Non-tensor arguments of PythonOps, which the graph refers to by address (id()). Appended to by
    python_op._keep_alive at export; never reset (a graph may run again at any time)."""

    runners: Optional[tuple] = None
    """The (forward, backward) ctypes callbacks registered with onnxruntime, referenced here so that
    they are never freed. Set once by python_op._install_runners; never reset."""

    pending_error: Optional[BaseException] = None
    """The first exception a runner caught during the current session run, re-raised by
    python_op.function_errors; emptied before and after every run it wraps."""

    live_contexts: dict = dataclasses.field(default_factory=dict)
    """Kernel invoke id -> weakref to the ctx of that PythonOp's last forward. Replaced per node run by
    python_op._release_stale_context; runner_check removes its self-test's entries."""

    # ---- engine/pyop/runner_check.py
    runner_problem: Optional[str] = None
    """Whether the runners may be used here: None (not checked yet), "" (yes), else why not. Set once by
    runner_check.problem(); never reset (tests set None to check again)."""

    # ---- engine/graph/torch_gelu_gradient.py
    runners_platform: bool = dataclasses.field(
        default_factory=lambda: sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64"))
    """Whether this platform can run the runners at all (x86-64 Linux): their calling convention. A
    constant of the process, read by torch_gelu_gradient before it asks runner_check."""

    gelu_fallback_warned: bool = False
    """Whether the warning that GELU's gradient stays on GeluGrad (runner_check failed) was given. Set
    by torch_gelu_gradient.gelu_gradient_in_torch; never reset: one warning per process."""

    # ---- placement/device.py
    env_cpu_allocator: Union[None, str, bool] = None
    """The CPU allocator registered in onnxruntime's environment: None (not tried yet), "arena" or
    "plain" (registered by device._env_cpu_allocator), False (registering failed). Set once; never
    reset (onnxruntime takes one per process)."""

    # ---- engine/kernels/library.py: the custom-op library (TorchMatMul, Adam)
    kernel_library: Optional[str] = None
    """The path of the built kernel library loaded into this process. Set by library.problem()
    with the check below; never reset (a loaded library stays loaded)."""

    torch_matmul_problem: Optional[str] = None
    """Whether TorchMatMul nodes can run here: None (not checked yet), "" (built and self-tested),
    else why not. Set once by library.problem(); never reset (tests set it to force a fallback)."""

    adam_problem: Optional[str] = None
    """Whether Adam nodes (com.orttrainer) can run here: None (not checked yet), "" (self-tested against
    AdamOptimizer), else why not. Set once by library.adam_problem(); tests set it to force a fallback."""

    kernel_library_options: list = dataclasses.field(default_factory=list)
    """The SessionOptions the library was registered on (a second registration on the same object
    fails session creation). Appended to by library.register; never reset."""

    # ---- engine/parallel/megatron.py
    tensor_parallel_group: Any = None
    """The torch.distributed group of this rank's tensor-parallel (horizontal) ranks, which the f/g
    PythonOps all-reduce over. Set by megatron.set_group whenever a tensor-parallel trainer is built;
    not cleared."""


PROCESS = ProcessState()


def keep_module_names(module_name, **names):
    """Attributes `old=field` of module `module_name` that read and write `PROCESS.<field>`, for the
    callers of the module's former globals (properties on the module's class: an assignment, as
    monkeypatch makes, goes to the field too)."""
    module = sys.modules[module_name]
    fields = {f.name for f in dataclasses.fields(ProcessState)}
    unknown = set(names.values()) - fields
    if unknown:
        raise AttributeError(f"ProcessState has no field {sorted(unknown)}")
    aliases = {old: property(lambda _, f=field: getattr(PROCESS, f),
                             lambda _, value, f=field: setattr(PROCESS, f, value), doc=f"PROCESS.{field}")
               for old, field in names.items()}
    module.__class__ = type("ModuleWithProcessState", (types.ModuleType,), aliases)
