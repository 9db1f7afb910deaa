"""Freed memory given back to the OS while a forward is traced.

A forward frees most of what it allocates, but glibc keeps freed blocks below its mmap threshold
(which it raises, up to 32 MB, after each large free) in the heap, and the small objects the tracer
keeps for every op pin the heap between them: at the recompute GPT of docs/performance.md ("Recompute") the traced
forward's resident set peaked at 325-415 MB above its start (run to run) while torch's live tensors
never exceeded 128 MB (torch.profiler's memory events). `malloc_trim(0)` returns every free page of
every arena; called after each module's forward, the trace's peak is 150 MB (the whole export's
181 MB), the same in every run; the export takes ~0.3 s longer at GPT-2 small (pages faulted again).
Where the C library has no malloc_trim (musl, macOS, Windows) nothing changes.
"""

import contextlib
import ctypes
import ctypes.util

import torch


def _find_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()


def _after_forward(module, args, output):
    _malloc_trim(0)  # returns None: a forward hook's return value would replace the output


@contextlib.contextmanager
def returned_after_each_module():
    """While active, the free heap is given back to the OS after every module's forward (all modules,
    through torch's global forward hook; removed on exit). It records nothing in a trace."""
    if _malloc_trim is None:
        yield
        return
    handle = torch.nn.modules.module.register_module_forward_hook(_after_forward)
    try:
        yield
    finally:
        handle.remove()
