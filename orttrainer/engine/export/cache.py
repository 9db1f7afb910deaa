"""Forward and training graphs on disk, so that a second run of the same recipe skips export and graph
building (options.utils.export_cache).

An entry is a folder `<root>/<key>/` whose `manifest.json` names the key, the trainer's fingerprint
and the sha256 of every file in it. An entry is used only when its manifest parses, names the
expected key and every checksum matches; anything else (a truncated file, a crash half-way through a
write, another format) is deleted and rebuilt, never trusted. Entries are written to a temporary
folder and renamed into place, and removed by a rename out of the way, so that a reader (another
process included) sees an entry whole or not at all. After each write the least recently used
entries (a hit touches its folder) are evicted beyond `max_bytes`.

The key (`fingerprint`, cache_key.py) covers what changes the graphs. What it cannot see is caught by
`verify`: the trainer runs graphs that came from the cache once in eval mode on the first batch and
compares them with an eager forward of the model (`mismatch_with_eager`, within what two float32
implementations may differ by: `fp32_tolerance`); on a mismatch `invalidate` deletes every entry of
the fingerprint and the graphs are exported again. Weights are NOT stored: every initializer that
holds a model tensor is kept as a data-less stub and filled from the model on load, so the initial
weights always come from the model.
"""

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from orttrainer.engine.graph import training_graph as tg
from orttrainer.engine.export.cache_key import code_digest, digest, model_fingerprint, versions  # noqa: F401 -- the facade's
from orttrainer.engine.graph.optimizer_graph import StateSpec
from orttrainer.engine.graph.recompute import RecomputeOptions, RecomputePlan
from orttrainer.engine.graph.torch_gelu_gradient import register_if_used

logger = logging.getLogger("orttrainer")

FORMAT = 4
CACHE_DIR_ENV = "ORTTRAINER_CACHE_DIR"
DEFAULT_MAX_BYTES = 4 << 30  # options.utils.export_cache_max_bytes
_MANIFEST = "manifest.json"
_TEMP = ".tmp-"  # folders being written or deleted; never read as entries
_STALE_TEMP_SECONDS = 3600  # a temporary folder this old was left by a writer that crashed


def default_root():
    """$ORTTRAINER_CACHE_DIR, else <user cache dir>/orttrainer/exports ($XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orttrainer" / "exports"


class ExportCache:
    """The entries of one trainer (one fingerprint). `model_value(name)` gives the model's current
    value of an initializer that holds a model tensor (a numpy array), None for any other name."""

    def __init__(self, root, fingerprint, model_value, max_bytes=DEFAULT_MAX_BYTES):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.model_value = model_value
        self.max_bytes = max_bytes
        self.reads = True  # False once an entry failed verification: every graph is rebuilt

    def invalidate(self):
        """Delete every entry of this fingerprint (graphs of all signatures, learned baked sizes) and
        read none from now on: an entry of it computed something other than the model."""
        self.reads = False
        for folder in self._entries():
            try:
                owner = json.loads((folder / _MANIFEST).read_text()).get("fingerprint")
            except (OSError, ValueError, AttributeError):
                continue
            if owner == self.fingerprint:
                self._remove(folder.name)

    # ------------------------------------------------------------------ what the lifecycle stores
    def load_baked(self):
        """{symbol: True if baked into the graph, False if it stays symbolic} learned by earlier runs."""
        files = self._read(self._key("baked")) if self.reads else None
        if files is None:
            return {}
        known = json.loads(files["baked.json"])
        return {str(s): bool(v) for s, v in known.items()} if isinstance(known, dict) else {}

    def store_baked(self, known):
        self._write(self._key("baked"), {"baked.json": json.dumps(known, sort_keys=True).encode()})

    def load(self, signature):
        """(forward model, TrainingGraph) for a signature, with the model's current initializer values;
        None on a miss."""
        files = self._read(self._key("graphs", signature)) if self.reads else None
        if files is None:
            return None
        try:
            forward = onnx.load_from_string(files["forward.onnx"])
            training = onnx.load_from_string(files["training.onnx"])
            register_if_used(training)  # the GELU gradient's PythonOps (torch_gelu_gradient.py)
            meta = json.loads(files["graph.json"])
            # The trained weights stay stubs in the forward model, as after an export: their values
            # are the states' (read from the model once, below), never copied into a ModelProto.
            self._fill(forward, skip={entry["name"] for entry in meta["states"] if entry.get("from_model")})
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

    def path(self, signature):
        """The folder of the entry holding the graphs of a signature."""
        return self.root / self._key("graphs", signature)

    # ------------------------------------------------------------------ entries
    def _key(self, *parts):
        return digest([FORMAT, self.fingerprint, *parts])

    def _read(self, key):
        """The files of an entry, or None. Read through a handle on the folder, so that an entry another
        process replaces or evicts meanwhile is read whole or not at all (a miss, not corruption)."""
        folder = self.root / key
        try:
            handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            manifest = json.loads(_read_at(handle, _MANIFEST))
            if manifest.get("format") != FORMAT or manifest.get("key") != key:
                raise StaleEntry(f"manifest names {manifest.get('key')!r}, format {manifest.get('format')!r}")
            files = {}
            for name, checksum in manifest["files"].items():
                data = _read_at(handle, name)
                if hashlib.sha256(data).hexdigest() != checksum:
                    raise StaleEntry(f"{name} does not match its checksum")
                files[name] = data
            try:
                os.utime(handle)  # least recently used entries are evicted first
            except OSError:  # a folder this user may read but not touch
                pass
            return files
        except (OSError, ValueError, KeyError, TypeError, AttributeError, StaleEntry) as exc:
            if not _same_folder(folder, handle):
                return None  # replaced or evicted while read: the new entry is another process's
            logger.warning("export cache entry %s is corrupt (%s): rebuilding it", folder, exc)
            self._remove(key)
            return None
        finally:
            os.close(handle)

    def _write(self, key, files):
        """Write an entry in a temporary folder and rename it into place: readers see it whole or not at all."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=_TEMP, dir=self.root))
            for name, data in files.items():
                (staging / name).write_bytes(data)
            manifest = {"format": FORMAT, "key": key, "fingerprint": self.fingerprint,
                        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}
            (staging / _MANIFEST).write_text(json.dumps(manifest, indent=1))
            self._remove(key)
            try:
                os.rename(staging, self.root / key)
            except OSError:  # another process wrote the same entry first
                shutil.rmtree(staging, ignore_errors=True)
            self._evict(keep=key)
        except OSError as exc:  # a cache that cannot be written costs the next run time, nothing else
            logger.warning("could not write the export cache entry in %s: %s", self.root, exc)

    def _remove(self, key):
        """Rename the entry out of the way (one atomic step), then delete it."""
        trash = self.root / f"{_TEMP}old-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            os.rename(self.root / key, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _entries(self):
        try:
            return [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        except OSError:
            return []

    def _evict(self, keep):
        """Delete the least recently used entries until the cache holds at most max_bytes (the entry
        just written stays), and temporary folders that crashed writers left behind."""
        now = time.time()
        sizes = {}
        for folder in self._entries():
            try:
                sizes[folder] = (folder.stat().st_mtime, sum(f.stat().st_size for f in folder.iterdir()))
            except OSError:
                continue  # being replaced or evicted by another process
        total = sum(size for _, size in sizes.values())
        for folder, (_, size) in sorted(sizes.items(), key=lambda item: item[1][0]):
            if total <= self.max_bytes:
                break
            if folder.name != keep:
                logger.info("export cache over %d bytes: evicting %s (%d bytes)", self.max_bytes, folder.name, size)
                self._remove(folder.name)
                total -= size
        for temp in self.root.glob(f"{_TEMP}*"):
            try:
                if now - temp.stat().st_mtime > _STALE_TEMP_SECONDS:
                    shutil.rmtree(temp, ignore_errors=True)
            except OSError:
                continue

    def _fill(self, model, skip=frozenset()):
        for init in model.graph.initializer:
            value = None if init.name in skip else self.model_value(init.name)
            if value is None:
                continue
            if tuple(value.shape) != tuple(init.dims) or \
                    onnx.helper.np_dtype_to_tensor_dtype(value.dtype) != init.data_type:
                raise StaleEntry(f"initializer {init.name!r} is {list(init.dims)} in the cache but "
                                 f"{list(value.shape)} {value.dtype} in the model")
            init.CopyFrom(numpy_helper.from_array(value, init.name))


def _read_at(folder_handle, name):
    handle = os.open(name, os.O_RDONLY, dir_fd=folder_handle)
    with os.fdopen(handle, "rb") as file:
        return file.read()


def _same_folder(path, handle):
    """Whether `path` still names the folder `handle` was opened on."""
    try:
        return os.stat(path).st_ino == os.fstat(handle).st_ino
    except OSError:
        return False


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
    from orttrainer.engine.parallel.data_parallel import Segment

    states = {}
    for entry in meta["states"]:
        if entry.get("from_model"):
            value = model_value(entry["name"])
            if value is None or list(value.shape) != entry["shape"]:
                raise StaleEntry(f"state {entry['name']!r} is not a model tensor of shape {entry['shape']}")
            value = np.asarray(value, dtype=entry["dtype"])  # a view: a state that is not the parameter copies it
        elif entry.get("fill", 0) == 0:
            value = np.zeros(entry["shape"], dtype=entry["dtype"])  # untouched pages until the first step
        else:
            value = np.full(entry["shape"], entry["fill"], dtype=entry["dtype"])
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


# ====================================================================== verifying a hit
FP32_ROUNDOFF = 2.0 ** -24  # u: the relative error of rounding one result to float32
AGREEMENT = 16              # C of `fp32_tolerance`


def reduction_sizes(wrapper, sample):
    """(K, L) of `fp32_tolerance`: the longest reduction a forward of the wrapper on `sample` can make
    (the largest dimension of any of its parameters, buffers or inputs: a matmul's inner size, a
    LayerNorm's width, a softmax over the vocabulary or the sequence) and the reductions in sequence
    from input to output (its matrices: parameters of 2 or more dimensions, tied ones once)."""
    matrices = [p for p in wrapper.parameters() if p.dim() >= 2]
    tensors = [*wrapper.parameters(), *wrapper.buffers(), *(t for t in sample if isinstance(t, torch.Tensor))]
    return max((d for t in tensors for d in t.shape), default=1), max(len(matrices), 1)


def fp32_tolerance(scale, longest, depth):
    """How far onnxruntime's and torch's float32 forwards of the same graph may legitimately differ on
    an output of magnitude `scale` (its largest |value|), with reductions of at most `longest` terms,
    `depth` of them in sequence:

        tol = C * u * sqrt(K) * L * S        (C = AGREEMENT, u = 2^-24, K = longest, L = depth, S = scale)

    The two libraries run the same operators with other kernels: a matmul, LayerNorm or softmax over K
    terms adds them in another order (blocking, vector width, threads, AMX/AVX-512 tiles), and exp,
    erf or tanh use other approximations. Rounding each partial sum to float32 leaves a sum of K terms
    within K * u * sum|x_i| of the exact one (the worst case), and typically within sqrt(K) * u *
    sum|x_i|: the roundings are independent and of either sign, so their sum grows like a random walk
    (Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019); two orders
    differ by at most the sum of their errors. In a network of normalised activations and weights,
    sum|x_i| of a layer's products is of the order of its outputs' magnitude, so each of the L
    reductions in sequence adds a relative error of ~sqrt(K) * u, which the later layers carry to the
    output without much gain or damping (residual connections, LayerNorm): ~sqrt(K) * u * L of the
    output's scale. C = 16 covers the two libraries (x2), the largest of up to 1e8 elements against a
    typical one (x6: sqrt(2 ln N) standard deviations) and the weightless reductions and elementwise
    functions between the matrices (x1.5).

    The bound is on max|difference| against the output's scale, not on each element relative to
    itself: an element near zero (a logit) is a sum of large terms that cancel and carries their
    absolute error. (check_model_export's per-element rtol 1e-2 / atol 1e-6, used here before, rejected
    every warm entry on an Intel AMX host.) Measured in units of u * sqrt(K) * L * S, on the GPT of
    bench/models.py (width 256, 4 layers, vocabulary 8192: K = 8192, L = 18, the bound 1.5e-3 of S):
    onnxruntime against torch 0.008 on an AMD EPYC host and ~1.5 on that Intel host (2.1e-4 on logits
    of magnitude ~1.5); torch against itself with every matmul summed term by term 0.006 to 0.02.

    A stale graph computes another function: a changed helper, activation, constant or mask moves
    the outputs by a sizeable fraction of S (tests/integration/test_export_cache_tolerance.py), far above the
    bound of small models (8e-6 of S for a two-layer MLP of width 16, 5e-4 for a 4-layer GPT of width
    64). The bound grows with the model (2.5e-2 of S for BERT-large); a change below it, no larger than
    what two float32 libraries may differ by, cannot be told from rounding by comparing outputs: only
    the key (cache_key.py) sees it."""
    return AGREEMENT * FP32_ROUNDOFF * np.sqrt(longest) * depth * scale


def mismatch_with_eager(names, run_graphs, wrapper, sample, weights, compute_dtype=None):
    """(output name, max |difference|) of the first of the outputs of `run_graphs()` that an eager
    forward of the wrapper on `sample`, with `weights` ({model name: array or CPU tensor}, only read) in
    place of the model's own, does not match; None when all match. In float32 an output matches when
    max|difference| <= fp32_tolerance (its magnitude, the model's reduction sizes).
    Under fp16/bf16 compute the forward runs under autocast, and an output matches within rtol 1e-2 and
    atol 1e-2 of its largest magnitude: a stale graph is off by far more than rounding. Eval mode, no
    grad; the model's modes, weights and the RNG state are left as they were.
    The eager forward runs first: its transient is torch's heap, freed before `run_graphs` grows
    onnxruntime's arena, which keeps what it took (the other order held both at once: a process
    peak 40% above the training steps' on a warm cache, docs/notes/recompute.md)."""
    from orttrainer.engine.export.torch_export import _eval_mode, flatten_outputs

    named = {f"model.{name}": torch.as_tensor(value) for name, value in weights.items()}
    low = compute_dtype not in (None, torch.float32)
    with torch.no_grad(), _eval_mode(wrapper), torch.random.fork_rng(devices=[]), \
            torch.autocast("cpu", dtype=compute_dtype, enabled=low):
        eager = flatten_outputs(torch.func.functional_call(wrapper, named, tuple(sample)))
    longest, depth = reduction_sizes(wrapper, sample)
    for name, want, got in zip(names, eager, run_graphs()):
        want, got = want.float().cpu().numpy(), got.float().cpu().numpy()
        if want.shape != got.shape:
            return name, float("inf")
        scale = float(np.abs(want[np.isfinite(want)]).max(initial=0.0))
        if low:
            rtol, atol = 1e-2, 1e-2 * scale
        else:
            rtol, atol = 0.0, fp32_tolerance(scale, longest, depth)
        if not np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
            return name, float(np.nanmax(np.abs(got - want)))
    return None
