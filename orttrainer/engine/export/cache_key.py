"""The export cache's key (cache.py): digests of what changes the exported and training graphs.

For the model: every module class's source and plain attributes, parameter and buffer names, shapes
and dtypes, the code its methods reach (functions, classes and globals of user modules, followed
recursively through co_names, closures and defaults), its config objects (Hugging Face configs with
their private choices such as _attn_implementation), and the versions of the packages its classes
come from. Library code (stdlib, site-packages, torch, orttrainer) is covered by versions, not read.
"""

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import site
import sys
import sysconfig
from pathlib import Path

import onnx
import torch


def digest(value):
    """sha256 (hex) of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def versions():
    """Versions of everything that writes the graphs, orttrainer's own source included."""
    import onnxruntime

    import orttrainer

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "orttrainer": orttrainer.__version__, "orttrainer_source": _source_digest(),
            "orttrainer_live_code": _live_code_digest()}


@functools.lru_cache(maxsize=None)
def _source_digest():
    import orttrainer

    package = Path(orttrainer.__file__).resolve().parent
    h = hashlib.sha256()
    # Everything below the run layer may shape a graph; the recipe runner and the CLI cannot.
    for path in sorted(p for p in package.rglob("*.py") if p.relative_to(package).parts[0] not in ("run", "cli")):
        h.update(path.relative_to(package).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _live_code_digest():
    """The functions the graph-building modules hold right now, by source: a function replaced at run
    time (a test's monkeypatch, a bench ablation) changes the key, so its graphs are built, not loaded."""
    parts = []
    for name in sorted(m for m in list(sys.modules) if m.startswith("orttrainer.engine.")
                       or m in ("orttrainer.orttrainer", "orttrainer.postprocess")):
        for attr, value in sorted(vars(sys.modules[name]).items()):
            if inspect.isclass(value) and value.__module__ == name:
                parts += [(f"{name}.{attr}.{k}", _callable_source(v)) for k, v in sorted(vars(value).items())
                          if callable(v)]
            elif callable(value) and not inspect.isclass(value):
                parts.append((f"{name}.{attr}", _callable_source(value)))
    return digest(parts)


def _callable_source(value):
    if inspect.isfunction(value):
        return _function_source(value)
    return f"{type(value).__module__}.{type(value).__qualname__}"  # a builtin, a mock, a partial ...


@functools.lru_cache(maxsize=None)
def _function_source(function):
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):  # no source file (exec'd code): its bytecode and constants
        return _bytecode(function.__code__)


def _bytecode(code):
    consts = [_bytecode(c) if inspect.iscode(c) else repr(c) for c in code.co_consts]
    return digest([code.co_code.hex(), consts, code.co_names])


def model_fingerprint(model: torch.nn.Module):
    """The model's structure and code: every module's class source and plain attributes, every
    parameter's and buffer's name, shape, dtype (and whether it trains), which names share a tensor,
    the functions and globals its methods reach, its config objects, and the versions of the
    packages its classes come from."""
    if id(model) in _IN_PROGRESS:  # the model reached from its own code (a global holding it)
        return f"{type(model).__module__}.{type(model).__qualname__}"
    _IN_PROGRESS.add(id(model))
    try:
        return _model_fingerprint(model)
    finally:
        _IN_PROGRESS.discard(id(model))


_IN_PROGRESS = set()


def _model_fingerprint(model):
    modules = [(name, _class_digest(type(m)), _plain_attributes(m)) for name, m in model.named_modules()]
    params = [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers(remove_duplicate=False)]
    unique = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    classes = list(dict.fromkeys(klass for m in model.modules() for klass in type(m).__mro__))
    methods = [f for klass in classes if not _is_library(klass.__module__) for f in _methods(klass)]
    return digest([modules, params, buffers, unique, _reached(methods), _configs(model), package_versions(classes)])


def code_digest(obj):
    """A digest of a callable's code (function source, or its class's for a callable object) and of
    what it reads besides its arguments: closure cells, defaults, module globals, and -- recursively --
    the code of the functions and classes of user modules it reaches through them."""
    if obj is None:
        return None
    function = getattr(obj, "__func__", obj)
    if inspect.isfunction(function):
        return digest([function.__module__, function.__qualname__, _reached([function])])
    if isinstance(obj, torch.nn.Module):
        return model_fingerprint(obj)
    return digest([_class_digest(type(obj)), _plain_attributes(obj)])


def _reached(functions):
    """{qualified name: code and the values it reads} of `functions` and of every function, method
    and class of a user module they reach through closures and module globals (co_names). Library
    code (stdlib, site-packages, torch, orttrainer) is named, not followed: package versions cover it."""
    parts, seen, todo = {}, set(), list(functions)
    while todo:
        function = todo.pop()
        if function in seen:
            continue
        seen.add(function)
        reads = {}

        def follow(name, value):
            if inspect.isfunction(value) or inspect.isclass(value):
                qualified = f"{value.__module__}.{value.__qualname__}"
                if not _is_library(value.__module__):
                    todo.extend([value] if inspect.isfunction(value) else _methods(value))
                    if inspect.isclass(value):
                        parts[qualified] = _class_digest(value)
                return qualified
            if inspect.ismodule(value):
                return f"module {value.__name__}"
            return _stable(value, depth=2)

        names = _code_names(function.__code__)
        for name in names:
            if name in function.__globals__:
                value = function.__globals__[name]
                reads[name] = follow(name, value)
                if inspect.ismodule(value) and not _is_library(value.__name__):
                    # `helpers.activation(x)`: the module's attributes this code names
                    reads.update({f"{name}.{attr}": follow(attr, getattr(value, attr))
                                  for attr in names if attr in vars(value)})
        closure = [follow(None, _cell_contents(cell)) for cell in function.__closure__ or ()]
        defaults = _stable([function.__defaults__, function.__kwdefaults__], depth=2)
        parts[f"{function.__module__}.{function.__qualname__}"] = [_function_source(function), reads, closure,
                                                                   defaults]
    return digest(parts)


def _code_names(code):
    """The global and attribute names a code object and the code objects nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names.update(_code_names(const))
    return sorted(names)


def _methods(klass):
    """The plain functions a class defines (methods, static and class methods, property accessors)."""
    found = []
    for value in vars(klass).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            found += [f for f in (value.fget, value.fset, value.fdel) if inspect.isfunction(f)]
        elif inspect.isfunction(value):
            found.append(value)
    return found


@functools.lru_cache(maxsize=None)
def _is_library(module_name):
    """True for code whose version, not its source, goes into the key: the stdlib, installed packages
    (site-packages), torch and orttrainer itself (its source digest is part of versions())."""
    module_name = module_name or ""
    root = module_name.partition(".")[0]
    if root in sys.stdlib_module_names or root in ("builtins", "torch", "orttrainer"):
        return True
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if path is None:
        return module is not None  # a builtin or namespace module; an unknown one is user code
    path = os.path.realpath(path)
    return any(path.startswith(prefix + os.sep) for prefix in _library_paths())


@functools.lru_cache(maxsize=None)
def _library_paths():
    paths = set(site.getsitepackages() + [site.getusersitepackages()])
    paths |= {sysconfig.get_path(key) for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return tuple(os.path.realpath(p) for p in paths if p)


def _configs(model):
    """The config objects of the model's modules (a Hugging Face PretrainedConfig: all of to_dict(),
    plus private choices such as _attn_implementation that to_dict leaves out)."""
    found = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or isinstance(config, torch.nn.Module) or id(config) in found:
            continue
        try:
            items = dict(vars(config))
        except TypeError:
            items = {}
        if callable(getattr(config, "to_dict", None)):
            items["to_dict"] = config.to_dict()
        items["_attn_implementation"] = getattr(config, "_attn_implementation", None)
        found[id(config)] = [name, type(config).__qualname__, _stable(items)]
    return sorted(found.values(), key=lambda entry: entry[0])


def package_versions(classes):
    """{root package: installed version} for the packages `classes` come from (transformers, ...)."""
    versions = {}
    for root in sorted({klass.__module__.partition(".")[0] for klass in classes}):
        if root in sys.stdlib_module_names or root == "builtins":
            continue
        try:
            versions[root] = importlib.metadata.version(root)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            dists = _packages_distributions().get(root, [])
            versions[root] = sorted(_version_or_none(d) or "" for d in dists) or None
    return versions


@functools.lru_cache(maxsize=None)
def _packages_distributions():
    return importlib.metadata.packages_distributions()


def _version_or_none(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


@functools.lru_cache(maxsize=None)
def _class_digest(cls):
    parts = []
    for klass in cls.__mro__:
        if klass in (torch.nn.Module, object):
            break
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            source = f"{klass.__module__}.{klass.__qualname__}"
        parts.append(source)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _plain_attributes(obj):
    try:
        items = vars(obj).items()
    except TypeError:
        return None
    return {k: _stable(v) for k, v in sorted(items) if not k.startswith("_") and k != "training"}


def _stable(value, depth=0):
    """A representation of an attribute that is equal across runs (no memory addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return str(value)
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        return [list(data.shape), str(data.dtype),
                hashlib.sha256(data.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                if data.numel() <= 1 << 16 else None]
    if isinstance(value, torch.nn.Module):
        return model_fingerprint(value)
    if depth > 3:
        return type(value).__qualname__
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [_stable(v, depth + 1) for v in items]
    if isinstance(value, dict):
        return {str(k): _stable(v, depth + 1) for k, v in value.items()}
    if callable(getattr(value, "to_dict", None)):  # e.g. a Hugging Face config
        return _stable(value.to_dict(), depth + 1)
    if callable(value) or inspect.ismodule(value):
        name = getattr(value, "__qualname__", getattr(value, "__name__", None))
        return code_digest(value) if depth < 2 else [type(value).__qualname__, name]
    return [type(value).__qualname__, _plain_attributes(value) if depth < 2 else None]
