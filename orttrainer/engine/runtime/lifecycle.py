"""The graph life cycle of one trainer: export → training graph → session, for each input signature.

    a call's inputs ──signature──> a kept session serves it? ──yes──> that session runs the step
                                          │ no
                                          ▼
         a symbol with a size never seen? ──yes──> export for this call; compare with the export at
               │ no                                the earlier sizes: baked or symbolic? (baked_sizes)
               ▼                                       │ symbolic: the kept session serves the call
         export cache entry? ──no──> export → training graph → stored in the export cache
               │ yes                          │
               ▼                              ▼
         forward + training graph ──> session: a Runtime that adopts the trainer's one TrainingState
                                      ──> kept (least recently used dropped beyond MAX_SESSIONS)

Graphs from the cache are checked by the frontend against an eager forward before they train; one
that fails is dropped (`forget`) and the cache reads nothing more, so the next serve exports.

A signature is the dtypes and ranks of the inputs plus the sizes of the symbols the exported graph
bakes in -- and of those not known yet: a symbol counts as baked until a call with another size of
it shows (by the comparison above, at the cost of one export the call needs anyway if it is baked)
that it is not. A graph without baked sizes then serves every batch and sequence length with one
session; one with baked sizes gets a session per distinct set of them. What is learned is kept in
the export cache. Every session reads and writes the same state tensors (weights, moments, counters,
accumulation buffers, step scalars), so switching between them copies nothing, and a switch inside a
gradient accumulation window keeps the gradients accumulated so far.
"""

import collections
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import onnx

from orttrainer.engine.export import baked_sizes

logger = logging.getLogger("orttrainer")

MAX_SESSIONS = 4  # sessions kept per trainer; the least recently used one is dropped first


@dataclass(frozen=True)
class Signature:
    """What a session was built for: ((input, dtype, rank), ...) and ((baked symbol, size), ...)."""

    types: tuple
    sizes: tuple

    @classmethod
    def of(cls, inputs, symbols, baked):
        types = tuple(sorted((name, str(t.dtype), t.dim()) for name, t in inputs.items()))
        sizes = baked_sizes.input_sizes(inputs, symbols)
        return cls(types, tuple(sorted((s, sizes[s]) for s in baked if s in sizes)))

    def serves(self, call):
        """True when a session built for self runs `call` (a call may leave out inputs)."""
        mine_types, mine_sizes = {t[0]: t for t in self.types}, dict(self.sizes)
        return (all(mine_types.get(t[0], t) == t for t in call.types)
                and all(mine_sizes.get(s, v) == v for s, v in call.sizes))

    def __str__(self):
        return ", ".join(f"{s}={v}" for s, v in self.sizes) or "any sizes"


@dataclass
class Build:
    """One (re)build: the forward model, its session, what it cost and where the graphs came from
    ('export', 'export cache' or 'given')."""

    signature: Signature
    forward: onnx.ModelProto
    runtime: object
    source: str
    sizes: dict  # every symbol's size in the inputs it was built for
    startup_seconds: dict = field(default_factory=dict)
    adopted: bool = False  # set by the frontend once it has taken the build over
    verified: bool = False  # set by the frontend once graphs from the cache matched the model


class GraphLifecycle:
    """Owns a trainer's graphs and sessions; `serve(inputs)` returns the Build that runs a call.

    Args:
        build_graph: forward model -> TrainingGraph.
        make_runtime: (TrainingGraph, TrainingState or None) -> Runtime (None: the first, which creates it).
        export: inputs -> forward ModelProto as exported (None when the forward model is given).
        prepare: forward model as exported -> forward model to train (postprocessing).
        symbols: {input name: {axis: symbol}} -- the symbolic dims of model_desc.
        cache: an ExportCache, or None.
        model_names: initializer names that hold model tensors (not compared between traces).
    """

    def __init__(self, *, build_graph, make_runtime, export=None, prepare=None, symbols=None, cache=None,
                 model_names=(), max_sessions=MAX_SESSIONS):
        self._build_graph = build_graph
        self._make_runtime = make_runtime
        self._export = export
        self._prepare = prepare or (lambda model: model)
        self.symbols = symbols or {}
        self.cache = cache
        self.model_names = set(model_names)
        self.max_sessions = max_sessions
        # What calls have taught about each symbol: True = baked into the graph, False = free. A symbol
        # not known yet counts as baked (a new size of it gets a session of its own) until a call
        # with another size of it lets two exports be compared.
        self.known = {}
        self._reference = None  # (sizes, export without model tensors) that new exports are compared with
        self.state = None
        self.current = None
        self.builds = []  # every build's startup_seconds, in order
        self._sessions = collections.OrderedDict()  # Signature -> Build, least recently used first
        self._knowledge_loaded = False

    @property
    def baked(self):
        """The symbols known to be baked into the exported graph."""
        return frozenset(s for s, baked in self.known.items() if baked)

    def _not_free(self):
        return {s for axes in self.symbols.values() for s in axes.values() if self.known.get(s) is not False}

    # ------------------------------------------------------------------ serving calls
    def serve(self, inputs):
        """The Build whose session runs a call with these inputs (built now if none serves them)."""
        seconds = {}
        if self.cache is not None and not self._knowledge_loaded:
            self.known.update(self.cache.load_baked() or {})
            self._knowledge_loaded = True
        found = self._find(inputs)
        if found is not None:
            return found
        if self._export is None:
            raise RuntimeError(f"No session serves inputs of sizes {baked_sizes.input_sizes(inputs, self.symbols)} "
                               "and the model cannot be re-exported (it was given as an ONNX model)")
        exported = None
        learn = self._unknown_changes(inputs)
        if learn:  # the export is needed anyway if the sizes are baked; compared, it tells whether they are
            exported = self._timed(seconds, "export", self._export, inputs)
            self._timed(seconds, "baked_size_detection", self._learn, inputs, exported, learn)
            found = self._find(inputs)
            if found is not None:
                return found
        return self._build(inputs, Signature.of(inputs, self.symbols, self._not_free()), seconds, exported)

    def _find(self, inputs):
        call = Signature.of(inputs, self.symbols, self._not_free())
        for signature in reversed(self._sessions):
            if signature.serves(call):
                self._sessions.move_to_end(signature)
                self.current = self._sessions[signature]
                return self.current
        return None

    def _unknown_changes(self, inputs):
        """Symbols not known yet whose size differs from the current build's."""
        if self.current is None:
            return set()
        sizes = baked_sizes.input_sizes(inputs, self.symbols)
        return {s for s, size in sizes.items()
                if s not in self.known and self.current.sizes.get(s, size) != size}

    def _learn(self, inputs, exported, symbols):
        """Compare this call's export with one at the current build's sizes: `symbols` become known."""
        sizes = baked_sizes.input_sizes(inputs, self.symbols)
        if self._reference is None:  # the current graphs came from the cache: export at their sizes
            reference_sizes = dict(sizes, **self.current.sizes)
            reference = self._export(baked_sizes.resized_inputs(inputs, self.symbols, reference_sizes))
            self._reference = (reference_sizes, self._stripped(reference))
        reference_sizes, reference = self._reference
        differing = {s for s in sizes if reference_sizes.get(s, sizes[s]) != sizes[s]}
        baked = baked_sizes.baked_symbols(reference, exported, {s: reference_sizes[s] for s in differing},
                                          {s: sizes[s] for s in differing}, skip=self.model_names)
        for symbol in symbols:
            self.known[symbol] = symbol in baked
        if self.cache is not None:
            self.cache.store_baked(self.known)
        logger.info("sizes %s -> %s: %s", {s: reference_sizes[s] for s in differing}, {s: sizes[s] for s in differing},
                    ", ".join(f"{s} {'is baked into the graph' if self.known[s] else 'stays symbolic'}"
                              for s in sorted(symbols)))

    def _stripped(self, model):
        """A copy without the model tensors' data (only constants are compared)."""
        return without_data(model, self.model_names)

    def forget(self, build):
        """Drop a build's session (graphs from the cache that failed the frontend's check); the next
        call with its inputs builds again. The state is kept."""
        self._sessions.pop(build.signature, None)
        if self.current is build:
            self.current = next(reversed(self._sessions.values()), None)

    def given(self, forward):
        """Drop every session and build one from `forward` (a given ONNX model, or the current model
        with new constant values) for the current signature. The state is kept."""
        current = self.current
        signature = current.signature if current is not None else Signature((), ())
        self._sessions.clear()
        self.current = None
        seconds = {}
        graph = self._timed(seconds, "training_graph", self._build_graph, forward)
        return self._finish(signature, forward, graph, "given", seconds, current.sizes if current else {})

    # ------------------------------------------------------------------ building
    def _build(self, inputs, signature, seconds, exported=None):
        seconds.setdefault("export", 0.0)  # every build reports both, 0.0 when skipped
        seconds.setdefault("training_graph", 0.0)
        loaded = None
        if self.cache is not None and exported is None:
            loaded = self._timed(seconds, "export_cache_load", self.cache.load, signature)
        sizes = baked_sizes.input_sizes(inputs, self.symbols)
        if loaded is not None:
            forward, graph = loaded
            return self._finish(signature, forward, graph, "export cache", seconds, sizes)
        if exported is None:
            exported = self._timed(seconds, "export", self._export, inputs)
        if self._reference is None:
            self._reference = (sizes, self._stripped(exported))
        forward = self._timed(seconds, "export", self._prepare, exported)
        graph = self._timed(seconds, "training_graph", self._build_graph, forward)
        if self.cache is not None:
            self._timed(seconds, "export_cache_store", self.cache.store, signature, forward, graph)
        return self._finish(signature, forward, graph, "export", seconds, sizes)

    def _finish(self, signature, forward, graph, source, seconds, sizes):
        runtime = self._timed(seconds, "session", self._make_runtime, graph, self.state)
        if self.state is None:
            self.state = runtime.state
        _drop_initial_values(graph)  # the state holds them now; a kept graph need not
        build = Build(signature, forward, runtime, source, sizes, seconds)
        self._sessions[signature] = build
        while len(self._sessions) > self.max_sessions:
            dropped, _ = self._sessions.popitem(last=False)
            logger.info("dropped the least recently used session (%s)", dropped)
        self.current = build
        self.builds.append(seconds)
        logger.info("graph built for %s from %s: %s", signature, source,
                    ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in seconds.items()))
        return build

    @staticmethod
    def _timed(seconds, key, function, *args):
        started = time.perf_counter()
        try:
            return function(*args)
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - started


def without_data(model, names):
    """A new ModelProto like `model` whose initializers in `names` are data-less stubs.

    Built field by field: a copy made by CopyFrom and then cleared kept the model's whole weight
    data resident for as long as the copy lived (one parameter-sized buffer at GPT-2 2 layers,
    docs/notes/real-size-investigations.md), since protobuf frees a message's memory only with its arena.
    """
    graph = onnx.GraphProto()
    for field, value in model.graph.ListFields():
        if field.name != "initializer":
            _copy_field(graph, field, value)
    for init in model.graph.initializer:
        if init.name in names:
            graph.initializer.add(name=init.name, dims=init.dims, data_type=init.data_type)
        else:
            graph.initializer.append(init)
    stripped = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(stripped, field, value)
    stripped.graph.CopyFrom(graph)
    return stripped


def _copy_field(message, field, value):
    """message.<field> = value for a field as ListFields() gives it (repeated, message or scalar)."""
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.29; `label` before (removed in 7)
    if repeated is None:
        repeated = field.label == field.LABEL_REPEATED
    if repeated:
        getattr(message, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def _drop_initial_values(graph):
    """Replace every state's initial value by a zero-strided stand-in of the same shape and dtype."""
    for spec in graph.states.values():
        spec.initial = np.broadcast_to(np.zeros((), dtype=spec.initial.dtype), spec.initial.shape)
