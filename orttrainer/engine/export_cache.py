"""Forward and training graphs on disk, so that a second run of the same recipe skips export and graph
building (options.utils.export_cache).

An entry is a folder `<root>/<key>/` whose `manifest.json` names the key and the sha256 of every file
in it. An entry is used only when its manifest parses, names the expected key and every checksum
matches; anything else (a truncated file, a crash half-way through a write, another format) is
deleted and rebuilt, never trusted. Entries are written to a temporary folder and renamed into place.

The key (`fingerprint`) covers what changes the graphs: the model's code (the source of every module
class), structure and plain attributes, its parameter and buffer names, shapes and dtypes, the loss
function's code, model_desc, the options that act on the graph, and the versions of torch, onnx,
onnxruntime and orttrainer (with a digest of orttrainer's own source). Weights are NOT stored: every
initializer that holds a model tensor is kept as a data-less stub and filled from the model on load,
so the initial weights always come from the model.
"""

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import marshal
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from . import training_graph as tg
from .optimizer_graph import StateSpec
from .recompute import RecomputeOptions, RecomputePlan
from .torch_gelu_gradient import register_if_used

logger = logging.getLogger("orttrainer")

FORMAT = 3
CACHE_DIR_ENV = "ORTTRAINER_CACHE_DIR"
_MANIFEST = "manifest.json"


def default_root():
    """$ORTTRAINER_CACHE_DIR, else <user cache dir>/orttrainer/exports ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orttrainer" / "exports"


def digest(value):
    """sha256 (hex) of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


class ExportCache:
    """The entries of one trainer (one fingerprint). `model_value(name)` gives the model's current
    value of an initializer that holds a model tensor (a numpy array), None for any other name."""

    def __init__(self, root, fingerprint, model_value):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.model_value = model_value

    # ------------------------------------------------------------------ what the lifecycle stores
    def load_baked(self):
        """{symbol: True if baked into the graph, False if it stays symbolic} learned by earlier runs."""
        files = self._read(self._key("baked"))
        if files is None:
            return {}
        known = json.loads(files["baked.json"])
        return {str(s): bool(v) for s, v in known.items()} if isinstance(known, dict) else {}

    def store_baked(self, known):
        self._write(self._key("baked"), {"baked.json": json.dumps(known, sort_keys=True).encode()})

    def load(self, signature):
        """(forward model, TrainingGraph) for a signature, with the model's current initializer values;
        None on a miss."""
        files = self._read(self._key("graphs", signature))
        if files is None:
            return None
        try:
            forward = onnx.load_from_string(files["forward.onnx"])
            training = onnx.load_from_string(files["training.onnx"])
            register_if_used(training)  # the GELU gradient's PythonOps (torch_gelu_gradient.py)
            meta = json.loads(files["graph.json"])
            self._fill(forward)
            self._fill(training)
            graph = _graph_from_json(training, meta, self.model_value)
        except Exception as exc:  # noqa: BLE001 -- whatever is wrong with an entry, it is rebuilt
            logger.warning("export cache entry for %s is unusable (%s): rebuilding it", signature, exc)
            self._remove(self._key("graphs", signature))
            return None
        return forward, graph

    def store(self, signature, forward, graph):
        if any(node.op_type == "PythonOp" for node in forward.graph.node):
            # Its nodes name torch.autograd.Functions (and constant objects) registered in this process.
            logger.info("not caching the graphs of %s: they call torch.autograd.Functions of this process", signature)
            return
        try:
            meta = _graph_to_json(graph, self.model_value)
        except StaleEntry as exc:  # a state that is neither a model tensor nor a constant: not cacheable
            logger.info("not caching the graphs of %s: %s", signature, exc)
            return
        self._write(self._key("graphs", signature), {
            "forward.onnx": _without_model_values(forward, self.model_value).SerializeToString(),
            "training.onnx": _without_model_values(graph.model, self.model_value).SerializeToString(),
            "graph.json": json.dumps(meta).encode(),
        })

    # ------------------------------------------------------------------ entries
    def _key(self, *parts):
        return digest([FORMAT, self.fingerprint, *parts])

    def _read(self, key):
        folder = self.root / key
        if not folder.is_dir():
            return None
        try:
            manifest = json.loads((folder / _MANIFEST).read_text())
            if manifest.get("format") != FORMAT or manifest.get("key") != key:
                raise StaleEntry(f"manifest names {manifest.get('key')!r}, format {manifest.get('format')!r}")
            files = {}
            for name, checksum in manifest["files"].items():
                data = (folder / name).read_bytes()
                if hashlib.sha256(data).hexdigest() != checksum:
                    raise StaleEntry(f"{name} does not match its checksum")
                files[name] = data
            return files
        except (OSError, ValueError, KeyError, TypeError, AttributeError, StaleEntry) as exc:
            logger.warning("export cache entry %s is corrupt (%s): rebuilding it", folder, exc)
            self._remove(key)
            return None

    def _write(self, key, files):
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
            for name, data in files.items():
                (staging / name).write_bytes(data)
            manifest = {"format": FORMAT, "key": key,
                        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}
            (staging / _MANIFEST).write_text(json.dumps(manifest, indent=1))
            self._remove(key)
            try:
                os.replace(staging, self.root / key)
            except OSError:  # another process wrote the same entry first
                shutil.rmtree(staging, ignore_errors=True)
        except OSError as exc:  # a cache that cannot be written costs the next run time, nothing else
            logger.warning("could not write the export cache entry in %s: %s", self.root, exc)

    def _remove(self, key):
        shutil.rmtree(self.root / key, ignore_errors=True)

    def _fill(self, model):
        for init in model.graph.initializer:
            value = self.model_value(init.name)
            if value is None:
                continue
            if tuple(value.shape) != tuple(init.dims) or \
                    onnx.helper.np_dtype_to_tensor_dtype(value.dtype) != init.data_type:
                raise StaleEntry(f"initializer {init.name!r} is {list(init.dims)} in the cache but "
                                 f"{list(value.shape)} {value.dtype} in the model")
            init.CopyFrom(numpy_helper.from_array(value, init.name))


class StaleEntry(ValueError):
    """A cache entry that does not fit: rebuilt, never used."""


def _without_model_values(model, model_value):
    """A copy whose initializers that hold model tensors are data-less stubs."""
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    for init in stripped.graph.initializer:
        if model_value(init.name) is not None:
            init.CopyFrom(onnx.TensorProto(name=init.name, dims=init.dims, data_type=init.data_type))
    return stripped


def _graph_to_json(graph, model_value):
    states = []
    for spec in graph.states.values():
        value = spec.initial
        entry = {"name": spec.name, "shape": list(value.shape), "dtype": str(value.dtype), "in_place": spec.in_place}
        if model_value(spec.name) is not None:
            entry["from_model"] = True
        elif value.size and np.all(value == value.flat[0]):
            entry["fill"] = value.flat[0].item()
        elif value.size:
            raise StaleEntry(f"state {spec.name!r} starts from values that are neither a model tensor nor a constant")
        states.append(entry)
    partition = None
    if graph.partition is not None:
        segments = graph.partition.segments
        partition = {"segments": None if segments is None else
                     {w: [s.start, s.stop, s.flat_start] for w, s in segments.items()}}
    recompute = None
    if graph.recompute is not None:
        plan = graph.recompute
        recompute = {"options": dataclasses.asdict(plan.options), "forward_tensors": sorted(plan.forward_tensors),
                     "loss": plan.loss, "weights": list(plan.weights)}
    meta = {"states": states, "partition": partition, "recompute": recompute}
    for field in dataclasses.fields(tg.TrainingGraph):  # every other field is a plain value
        if field.name not in ("model", *meta):
            value = getattr(graph, field.name)
            try:
                json.dumps(value)
            except TypeError:
                raise StaleEntry(f"TrainingGraph.{field.name} ({type(value).__name__}) has no cache form") from None
            meta[field.name] = value
    return meta


def _graph_from_json(model, meta, model_value):
    from .distributed import Segment

    states = {}
    for entry in meta["states"]:
        if entry.get("from_model"):
            value = model_value(entry["name"])
            if value is None or list(value.shape) != entry["shape"]:
                raise StaleEntry(f"state {entry['name']!r} is not a model tensor of shape {entry['shape']}")
            value = np.array(value, dtype=entry["dtype"])
        else:
            value = np.full(entry["shape"], entry.get("fill", 0), dtype=entry["dtype"])
        states[entry["name"]] = StateSpec(entry["name"], value, in_place=entry["in_place"])
    partition = None
    if meta["partition"] is not None:
        segments = meta["partition"]["segments"]
        partition = tg.Partition(None if segments is None else
                                 {w: Segment(w, *bounds) for w, bounds in segments.items()})
    recompute = None
    if meta["recompute"] is not None:
        plan = meta["recompute"]
        recompute = RecomputePlan(RecomputeOptions(**plan["options"]), frozenset(plan["forward_tensors"]),
                                  plan["loss"], tuple(plan["weights"]))
    plain = {k: v for k, v in meta.items() if k not in ("states", "partition", "recompute")}
    return tg.TrainingGraph(model=model, states=states, partition=partition, recompute=recompute, **plain)


# ====================================================================== the fingerprint's parts
def versions():
    """Versions of everything that writes the graphs, orttrainer's own source included."""
    import onnxruntime

    import orttrainer

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "orttrainer": orttrainer.__version__, "orttrainer_source": _source_digest(),
            "orttrainer_live_code": _live_code_digest()}


@functools.lru_cache(maxsize=None)
def _source_digest():
    package = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(list(package.glob("*.py")) + list(package.glob("engine/*.py"))):
        h.update(path.name.encode())
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
    except (OSError, TypeError):
        return f"{function.__module__}.{function.__qualname__}"


def model_fingerprint(model: torch.nn.Module):
    """The model's structure and code: every module's class source and plain attributes, every
    parameter's and buffer's name, shape, dtype (and whether it trains), and which names share a tensor."""
    modules = [(name, _class_digest(type(m)), _plain_attributes(m)) for name, m in model.named_modules()]
    params = [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers(remove_duplicate=False)]
    unique = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return digest([modules, params, buffers, unique])


def code_digest(obj):
    """A digest of a callable's code (function source, or its class's for a callable object)."""
    if obj is None:
        return None
    function = getattr(obj, "__func__", obj)
    if inspect.isfunction(function):
        try:
            code = inspect.getsource(function)
        except (OSError, TypeError):
            code = hashlib.sha256(marshal.dumps(function.__code__)).hexdigest()
        # What the code reads besides its arguments: closure cells, defaults, and module globals
        # (only their plain values: a function or module there is named, not followed).
        closure = [_stable(_cell_contents(cell), depth=2) for cell in function.__closure__ or ()]
        defaults = _stable([function.__defaults__, function.__kwdefaults__], depth=2)
        module_globals = {name: _stable(function.__globals__[name], depth=2)
                          for name in function.__code__.co_names if name in function.__globals__}
        return digest([function.__module__, function.__qualname__, code, closure, defaults, module_globals])
    if isinstance(obj, torch.nn.Module):
        return model_fingerprint(obj)
    return digest([_class_digest(type(obj)), _plain_attributes(obj)])


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
