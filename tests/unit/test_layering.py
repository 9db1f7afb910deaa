"""The package's layers (docs/engine.md, "Where the code lives"): imports only go down, and no two
modules import each other, not even from inside a function. Every module is named in docs/engine.md."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "orttrainer"

# Lowest first. A module belongs to the layer of the longest prefix naming it (whole dotted parts);
# "orttrainer" alone is the package's lazy __init__.
LAYERS = [
    ("legacy leaf modules", ["orttrainer", "orttrainer.optim", "orttrainer.amp", "orttrainer._utils",
                             "orttrainer._checkpoint_storage", "orttrainer.postprocess",
                             "orttrainer.train_step_info", "orttrainer._config",
                             "orttrainer.model_desc_validation", "orttrainer.orttrainer_options",
                             # the parallel layout: pure arithmetic that the options check reads
                             "orttrainer.placement.dims"]),
    ("state and placement", ["orttrainer.state", "orttrainer.placement"]),
    ("engine", ["orttrainer.engine"]),
    ("the trainer's parts", ["orttrainer._trainer"]),
    ("legacy facade", ["orttrainer.orttrainer", "orttrainer.checkpoint", "orttrainer.ort_trainer",
                       "orttrainer._old_class"]),
    ("recipe runner", ["orttrainer.run"]),
    ("command line", ["orttrainer.cli", "orttrainer.__main__"]),
]


def module_names(package):
    """{dotted module name: path} of every module under `package` (a folder named after its package)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name, path, modules):
    """The package modules `name` imports, anywhere in its code (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def layer_of(name, layers):
    best = None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if name == prefix or (name.startswith(prefix + ".") and prefix != "orttrainer"):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    return None if best is None else best[0]


def layering_problems(package, layers):
    """Every import that goes up a layer, every module in no layer, and every import cycle."""
    modules = module_names(package)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    problems = [f"{name} is in no layer: add it to LAYERS" for name in modules if layer_of(name, layers) is None]
    for name, targets in sorted(graph.items()):
        own = layer_of(name, layers)
        for target in sorted(targets):
            other = layer_of(target, layers)
            if own is not None and other is not None and other > own:
                problems.append(f"{name} ({layers[own][0]}) imports {target} ({layers[other][0]}), a layer above")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return problems


def cycles(graph):
    """One cycle per strongly connected group of modules that import each other (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group) + [sorted(group)[0]])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_imports_only_go_down_and_no_module_imports_its_importer():
    modules = module_names(PACKAGE)
    assert {"orttrainer.orttrainer", "orttrainer.engine.runtime.session", "orttrainer.cli.train"} <= set(modules)
    problems = layering_problems(PACKAGE, LAYERS)
    assert not problems, "\n".join(problems)


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_rule_finds_an_upward_import_a_function_level_cycle_and_an_unplaced_module(tmp_path):
    package = tmp_path / "orttrainer"
    _write(package, {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/session.py": "from orttrainer.run import loop\n",  # upward
        "engine/a.py": "from . import b\n",
        "engine/b.py": "def f():\n    from orttrainer.engine import a\n",  # a cycle closed in a function
        "run/__init__.py": "",
        "run/loop.py": "import orttrainer.engine.session\n",
        "stray.py": "",
    })
    layers = [("base", ["orttrainer"]), ("engine", ["orttrainer.engine"]), ("run", ["orttrainer.run"])]
    problems = layering_problems(package, layers)
    assert problems == [
        "orttrainer.stray is in no layer: add it to LAYERS",
        "orttrainer.engine.session (engine) imports orttrainer.run.loop (run), a layer above",
        "import cycle: orttrainer.engine.a -> orttrainer.engine.b -> orttrainer.engine.a",
        "import cycle: orttrainer.engine.session -> orttrainer.run.loop -> orttrainer.engine.session",
    ]


def code_map_paths(text):
    """The file paths docs/engine.md's tree of the code names: a folder line (`engine/`) opens a folder
    for the lines indented below it, and the `*.py` names on a line are files of the folder it is in."""
    block = text.split("## Where the code lives", 1)[1].split("```")[3]
    paths, folders = set(), []  # folders: (indent, path) of the open folders
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        while folders and folders[-1][0] >= indent and (first.endswith("/") or re.fullmatch(r"[\w/]+\.py,?", first)):
            folders.pop()
        parent = folders[-1][1] if folders else ""
        if first.endswith("/"):
            folders.append((indent, parent + first))
            parent += first
            line = line.split(None, 1)[1] if len(line.split()) > 1 else ""
        paths.update(parent + name for name in re.findall(r"[\w/]+\.py\b", line))
    return paths


def test_every_module_is_named_in_the_code_map():
    """docs/engine.md's map of the code names each module in its folder."""
    named = code_map_paths((ROOT / "docs/engine.md").read_text(encoding="utf-8"))
    assert "orttrainer/engine/runtime/session.py" in named and "bench/train_bench.py" in named
    missing = [str(path.relative_to(ROOT)) for path in module_names(PACKAGE).values()
               if path.name != "__init__.py" and str(path.relative_to(ROOT)) not in named]
    assert not missing, f"add these to docs/engine.md, 'Where the code lives': {missing}"


def test_trainer_facade_stays_a_facade():
    """ORTTrainer keeps the public API, the order of a step and the legacy attributes; graph
    selection, step accounting and state loading live in their own modules (docs/engine.md)."""
    facade = (PACKAGE / "orttrainer.py").read_text(encoding="utf-8")
    for owned_elsewhere in ("GraphLifecycle(", "GraphFactory(", "TrainStepInfo(", "DynamicLossScaler("):
        assert owned_elsewhere not in facade, owned_elsewhere


@pytest.mark.parametrize("legacy", ["orttrainer.orttrainer", "orttrainer.orttrainer_options", "orttrainer.checkpoint",
                                    "orttrainer.model_desc_validation", "orttrainer.train_step_info",
                                    "orttrainer.ort_trainer", "orttrainer._utils", "orttrainer._checkpoint_storage",
                                    "orttrainer.postprocess", "orttrainer.optim", "orttrainer.amp"])
def test_legacy_module_paths_stay_at_the_package_root(legacy):
    assert legacy in module_names(PACKAGE)


def test_legacy_checkpoint_module_keeps_every_name():
    from orttrainer import checkpoint
    from orttrainer.state import aggregation
    from orttrainer.state import experimental_checkpoint as experimental

    assert set(checkpoint.__all__) == {
        "aggregate_checkpoints", "experimental_state_dict", "experimental_load_state_dict",
        "experimental_save_checkpoint", "experimental_load_checkpoint"}
    assert checkpoint.aggregate_checkpoints is aggregation.aggregate_checkpoints
    for name in checkpoint.__all__[1:]:
        assert getattr(checkpoint, name) is getattr(experimental, name)
    # the trainer and orttrainer.run reach the file side through the legacy module
    assert callable(checkpoint._save_checkpoint) and callable(checkpoint._load_checkpoint)
