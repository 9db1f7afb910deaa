"""The whole legacy surface: every module-level name of the original frontend (tests/helpers/legacy_surface.py)
exists at its path here, with a compatible signature: the original's parameters, in the same order,
with the same defaults (parameters added here have defaults, so the original's calls still bind; a
mutable `{}` / `[]` default may be None here, which means the same)."""

import importlib
import inspect
from pathlib import Path

import pytest
from helpers.legacy_surface import ABSENT, SURFACE

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = [(where, name, spec) for where, names in SURFACE.items() for name, spec in names.items()]


def _resolve(where):
    """A module, or a class given as module.Class."""
    try:
        return importlib.import_module(where)
    except ImportError:
        module, _, attr = where.rpartition(".")
        return getattr(importlib.import_module(module), attr)


def _params(text):
    """'a, b=1, *args' -> [('a', None), ('b', '1'), ('*args', None)] (commas inside brackets kept)."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        items.append(current.strip())
    return [tuple(part.strip() for part in item.split("=", 1)) if "=" in item else (item, None) for item in items]


def _compatible(ours, original, namespace):
    """The problems of `ours` (an inspect.Signature) against the original's parameter list."""
    problems = []
    mine = list(ours.parameters.values())
    positional = [p for p in mine if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword_only = False  # the original's parameters after *args
    for index, (name, default) in enumerate(original):
        if name.startswith("**"):
            if not any(p.kind is p.VAR_KEYWORD for p in mine):
                problems.append(f"no {name}")
            continue
        if name.startswith("*"):
            keyword_only = True
            if not any(p.kind is p.VAR_POSITIONAL for p in mine):
                problems.append(f"no {name}")
            continue
        if keyword_only:
            param = ours.parameters.get(name)
            if param is None or param.kind not in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD):
                problems.append(f"no keyword parameter {name}")
                continue
        elif index >= len(positional) or positional[index].name != name:
            got = positional[index].name if index < len(positional) else "nothing"
            problems.append(f"parameter {index} is {got}, the original's is {name}")
            continue
        else:
            param = positional[index]
        if default is not None:
            expected = eval(default, dict(vars(namespace)))  # noqa: S307 (the data file's own expressions)
            # A mutable {} / [] default may be None here: omitting the argument means the same.
            same = param.default is None and default in ("{}", "[]")
            if not same and (param.default is inspect.Parameter.empty or param.default != expected):
                problems.append(f"{name} defaults to {param.default!r}, the original's to {default}")
    names = {name.lstrip("*") for name, _ in original}
    for p in mine:
        required = p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if p.name not in names and required:
            problems.append(f"{p.name} is required here, the original has no such parameter")
    return problems


@pytest.mark.parametrize("where,name,spec", ENTRIES, ids=[f"{w}.{n}" for w, n, _ in ENTRIES])
def test_every_original_name_exists_with_a_compatible_signature(where, name, spec):
    holder = _resolve(where)
    assert hasattr(holder, name), f"{where} has no {name} (the original had {spec})"
    value = getattr(holder, name)
    kind, _, params = spec.partition(" ")
    if kind == "module":
        assert inspect.ismodule(value), f"{where}.{name} is not a module"
        return
    if kind == "attr":
        return
    assert params.startswith("(") and params.endswith(")"), spec
    if kind == "class":
        assert inspect.isclass(value), f"{where}.{name} is not a class"
        ours = inspect.signature(value.__init__)
        ours = ours.replace(parameters=list(ours.parameters.values())[1:])  # self
    else:
        assert callable(value), f"{where}.{name} is not callable"
        ours = inspect.signature(value)
    namespace = holder if inspect.ismodule(holder) else importlib.import_module(holder.__module__)
    problems = _compatible(ours, _params(params[1:-1]), namespace)
    assert not problems, f"{where}.{name}{ours}: " + "; ".join(problems)


def test_the_signature_check_can_fail():
    def narrower(a, c, b=2):
        return a, b, c

    namespace = importlib.import_module("orttrainer")
    assert _compatible(inspect.signature(narrower), _params("a, b=1"), namespace) == [
        "parameter 1 is c, the original's is b", "c is required here, the original has no such parameter"]
    assert _compatible(inspect.signature(narrower), _params("a, c, b=3"), namespace) == [
        "b defaults to 2, the original's to 3"]


def test_every_deliberately_absent_name_is_recorded_in_the_differences():
    text = (ROOT / "docs/legacy-api.md").read_text(encoding="utf-8")
    for where, names in ABSENT.items():
        for name in names:
            assert f"`{where}.{name}`" in text, f"docs/legacy-api.md does not record the absence of {where}.{name}"
