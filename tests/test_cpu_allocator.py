"""The opt-in plain CPU allocator keeps no CPU arena between steps, also with PythonOps in the graph.

onnxruntime 1.19.2 builds a BFC arena (regions of 1, 2, 4, ... MB, held for the session's life) for
graphs with PythonOps (our torch GELU gradient) even with `enable_cpu_mem_arena = False`;
`placement.use_plain_cpu_allocator` makes sessions use a process-wide plain CPU allocator
(`session.use_env_allocators`) instead. Not the default (it costs speed). Each case runs in a fresh
process: the allocator registration is process-wide and glibc's counters too.
"""

import json
import subprocess
import sys

from orttrainer.engine import placement

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
if sys.argv[1] == "plain":  # the defaults plus the plain allocator
    from orttrainer.engine import placement
    so = placement.default_session_options()
    assert placement.use_plain_cpu_allocator(so)
    opts["session_options"] = so
trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3), options=ORTTrainerOptions(opts))
losses = [trainer.train_step(*batches[0]).item()]
after_first = in_use_mb()
losses += [trainer.train_step(*b).item() for b in batches[1:]]
ops = {n.op_type for s in trainer._graphs._sessions.values() for n in s.runtime.graph.model.graph.node}
print("RESULT " + json.dumps({"losses": [x.hex() for x in losses], "in_use_mb": in_use_mb(),
                              "growth_mb": in_use_mb() - after_first, "python_op": "PythonOp" in ops}))
"""


def _run(case):
    out = subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[0][7:])


def _env_allocators(options):
    try:
        return options.get_session_config_entry("session.use_env_allocators")
    except RuntimeError:  # not set
        return None


def test_the_plain_allocator_is_opt_in():
    options = placement.default_session_options()
    assert options.enable_cpu_mem_arena is False
    assert _env_allocators(options) is None  # default: each session's own allocators (fast)
    assert placement.use_plain_cpu_allocator(options)
    assert _env_allocators(options) == "1"


def test_no_arena_is_kept_between_steps_with_python_ops():
    default, own = _run("plain"), _run("default")
    assert default["python_op"] and own["python_op"]  # the case that kept an arena
    # Bitwise the same training: only who hands out the buffers changed.
    assert default["losses"] == own["losses"]
    # The session's own allocators keep arena regions (>= the 16 MB [2048, 2048] activations) after
    # every run; the plain allocator returns them. Same code in both processes otherwise.
    assert own["in_use_mb"] - default["in_use_mb"] > 16, (own, default)
    assert default["growth_mb"] < 4, default


FAILED_REGISTRATION = r"""
import warnings
import onnxruntime as ort
from orttrainer.engine import placement
# The process registered its own CPU allocator first (an arena): ours cannot be registered as well.
info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 1}))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    options = [placement.default_session_options() for _ in range(2)]
    used = [placement.use_plain_cpu_allocator(o) for o in options]
messages = [str(w.message) for w in caught]
assert len(messages) == 1 and "non-arena CPU allocator" in messages[0], messages
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
