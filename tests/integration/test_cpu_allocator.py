"""One CPU allocator for every session of the process: the trainer's process-wide arena.

onnxruntime-training keeps ONE CPU provider per process, built with the arena flag of the process's
first session (docs/ort-notes.md), so the sessions' own allocators depended on what ran first (the
PythonOp self-test gave BERT an arena, GPT-2 had none). The trainer's defaults therefore take every
CPU buffer from one process-wide BFC arena (`placement.use_cpu_arena_allocator`, kSameAsRequested)
through `session.use_env_allocators`; the opt-in plain allocator (`use_plain_cpu_allocator`) keeps
nothing between steps. Each case runs in a fresh process: allocator registration is process-wide,
and so are glibc's counters.
"""

import json
import subprocess
import sys

import pytest

from orttrainer.placement import device as placement

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

CHILD = r"""
import ctypes, json, sys
import onnxruntime as ort
import torch
import torch.nn.functional as F
from orttrainer import ORTTrainer, ORTTrainerOptions, optim

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info

def in_use_mb():  # glibc: bytes handed out and not freed (heap + mmapped blocks)
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20

class Model(torch.nn.Module):  # F.gelu: its gradient runs in torch through PythonOps
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 2048), torch.nn.Linear(2048, 8)

    def forward(self, x, y):
        return F.cross_entropy(self.b(F.gelu(self.a(x))), y)

torch.manual_seed(0)
model = Model()
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(2048, 32, generator=g), torch.randint(0, 8, (2048,), generator=g)) for _ in range(3)]
desc = {"inputs": [("x", [2048, 32]), ("y", [2048])], "outputs": [("loss", [], True)]}
opts = {"device": {"id": "cpu"}, "utils": {"export_cache": False}}
case = sys.argv[1]
if case == "plain":  # the plain allocator registered first: the defaults then use it
    from orttrainer.placement import device as placement
    assert placement.use_plain_cpu_allocator(ort.SessionOptions())
if case.startswith("old"):  # the defaults before the process-wide arena: each session's own allocator
    so = ort.SessionOptions()
    so.log_severity_level, so.enable_mem_pattern, so.enable_cpu_mem_arena = 3, False, False
    opts["session_options"] = so
if case.endswith("arena_first"):  # an arena-on session first builds the process's one CPU provider
    from onnx import helper as h
    graph = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "first", [h.make_tensor_value_info("x", 1, [2])],
                         [h.make_tensor_value_info("y", 1, [2])])
    first = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    ort.InferenceSession(first.SerializeToString(), ort.SessionOptions(), providers=["CPUExecutionProvider"])
trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3), options=ORTTrainerOptions(opts))
losses = [trainer.train_step(*batches[0]).item()]
after_first = in_use_mb()
losses += [trainer.train_step(*b).item() for b in batches[1:]]
ops = {n.op_type for s in trainer._graphs._sessions.values() for n in s.runtime.graph.model.graph.node}
print("RESULT " + json.dumps({"losses": [x.hex() for x in losses], "in_use_mb": in_use_mb(),
                              "growth_mb": in_use_mb() - after_first, "python_op": "PythonOp" in ops}))
"""


def _run_all(cases):
    """{case: result}, each case in its own fresh process; the processes run side by side (each
    measures only its own heap, and start-up, not compute, is most of their time)."""
    procs = {case: subprocess.Popen([sys.executable, "-c", CHILD, case], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for case in cases}
    results = {}
    try:
        for case, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, (case, stderr[-3000:])
            results[case] = json.loads(lines[0][7:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return results


def _env_allocators(options):
    try:
        return options.get_session_config_entry("session.use_env_allocators")
    except RuntimeError:  # not set
        return None


def test_the_defaults_use_the_process_wide_arena():
    options = placement.default_session_options()
    assert options.enable_cpu_mem_arena is False  # the provider's own arena, should ours be first
    assert _env_allocators(options) == "1"


def test_a_users_session_options_are_used_as_given():
    """The process-wide arena is the trainer's default, not forced on a user's SessionOptions."""
    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    def session_config(session_options):
        torch.manual_seed(0)
        desc = {"inputs": [("x", [4, 3]), ("y", [4])], "outputs": [("loss", [], True), ("out", [4, 2])]}
        model = torch.nn.Linear(3, 2)
        trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1),
                             loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y),
                             options=ORTTrainerOptions({"device": {"id": "cpu"}, "session_options": session_options}))
        loss, _ = trainer.train_step(torch.ones(4, 3), torch.zeros(4, dtype=torch.long))
        return loss.item(), _env_allocators(trainer._build.runtime.session.get_session_options())

    users = ort.SessionOptions()
    (mine, own), (default, env) = session_config(users), session_config(None)
    assert own is None and env == "1"
    assert _env_allocators(users) is None  # the caller's object is not changed either
    assert mine == default


def test_one_allocator_whatever_session_came_first():
    runs = _run_all(("default", "arena_first", "old", "old_arena_first", "plain"))
    assert all(r["python_op"] for r in runs.values())  # the self-test ran: the case that had an arena
    # Bitwise the same training in every case: only who hands out the buffers changed.
    losses = {case: r["losses"] for case, r in runs.items()}
    assert len({tuple(x) for x in losses.values()}) == 1, losses
    # Control: with the sessions' own allocators, an arena-on session made first gives the trainer an
    # arena (regions >= the 16 MB [2048, 2048] activations kept after every run), otherwise none.
    assert runs["old_arena_first"]["in_use_mb"] - runs["old"]["in_use_mb"] > 16, runs
    # The defaults: the same process-wide arena either way, which keeps its buffers between runs.
    assert abs(runs["arena_first"]["in_use_mb"] - runs["default"]["in_use_mb"]) < 4, runs
    assert runs["default"]["in_use_mb"] - runs["old"]["in_use_mb"] > 16, runs
    assert runs["default"]["growth_mb"] < 4 and runs["arena_first"]["growth_mb"] < 4, runs
    # The opt-in plain allocator, registered first, is what the defaults use then: nothing kept.
    assert runs["default"]["in_use_mb"] - runs["plain"]["in_use_mb"] > 16, runs
    assert runs["plain"]["growth_mb"] < 4, runs["plain"]


FAILED_REGISTRATION = r"""
import warnings
import onnxruntime as ort
from orttrainer.placement import device as placement
# The process registered its own CPU allocator first (an arena): ours cannot be registered as well.
info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 1}))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    options = [placement.default_session_options() for _ in range(2)]
    used = [placement.use_plain_cpu_allocator(o) for o in options]
messages = [str(w.message) for w in caught]
assert len(messages) == 1 and "process-wide CPU allocator" in messages[0], messages
assert used == [False, False]
for o in options:
    try:
        o.get_session_config_entry("session.use_env_allocators")
    except RuntimeError:  # not set: the sessions keep their own allocators
        continue
    raise AssertionError("use_env_allocators set although the plain allocator is not registered")
print("OK")
"""


def test_a_failed_registration_warns_once_and_keeps_the_sessions_allocators():
    out = subprocess.run([sys.executable, "-c", FAILED_REGISTRATION], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
