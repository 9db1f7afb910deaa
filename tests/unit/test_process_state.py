"""The process-wide state's one holder (orttrainer/placement/process_state.py): every field documented,
and the modules that held it as globals keep those names for readers and writers."""

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

from orttrainer.placement import process_state
from orttrainer.placement.process_state import PROCESS, ProcessState

# module: {its former global: the field}
OLD_NAMES = {
    "orttrainer.engine.pyop.python_op": {"_functions": "functions", "_kept_alive": "kept_alive",
                                         "_runners": "runners", "_pending_error": "pending_error",
                                         "_live_contexts": "live_contexts"},
    "orttrainer.engine.pyop.runner_check": {"_problem": "runner_problem"},
    "orttrainer.engine.graph.torch_gelu_gradient": {"_RUNNERS_WORK": "runners_platform",
                                                    "_warned": "gelu_fallback_warned"},
    "orttrainer.placement.device": {"_ENV_CPU_ALLOCATOR": "env_cpu_allocator"},
    "orttrainer.engine.parallel.megatron": {"_group": "tensor_parallel_group"},
    "orttrainer.engine.kernels.library": {"_path": "kernel_library", "_problem": "torch_matmul_problem",
                                          "_adam_problem": "adam_problem",
                                          "_registered": "kernel_library_options"},
}
CASES = [(module, old, field) for module, names in OLD_NAMES.items() for old, field in names.items()]


def test_every_field_has_a_docstring_and_a_former_name():
    tree = ast.parse(Path(process_state.__file__).read_text(encoding="utf-8"))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ProcessState").body
    documented = {node.target.id for node, after in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}
    fields = {f.name for f in dataclasses.fields(ProcessState)}
    assert documented == fields
    assert {field for _, _, field in CASES} == fields


@pytest.mark.parametrize("module, old, field", CASES)
def test_the_former_global_reads_and_writes_the_field(module, old, field, monkeypatch):
    mod = importlib.import_module(module)
    assert old not in vars(mod)  # no second copy the module's own code could read
    assert getattr(mod, old) is getattr(PROCESS, field)  # containers: the very same objects
    before = getattr(PROCESS, field)
    marker = object()
    with monkeypatch.context() as patch:
        patch.setattr(mod, old, marker)
        assert getattr(PROCESS, field) is marker and getattr(mod, old) is marker
    assert getattr(PROCESS, field) is before  # monkeypatch's undo writes the field back


def test_an_unknown_field_is_refused():
    with pytest.raises(AttributeError, match="no field"):
        process_state.keep_module_names(__name__, _x="no_such_field")
