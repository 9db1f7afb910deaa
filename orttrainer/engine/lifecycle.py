"""The graph life cycle of one trainer: export → training graph → session, for each input signature.

    a call's inputs ──signature──> a kept session serves it? ──yes──> that session runs the step
                                          │ no
                                          ▼
         export cache entry? ──no──> export (+ baked-size detection, first export only)
               │ yes                   → training graph → stored in the export cache
               ▼                                 │
         forward + training graph ◄──────────────┘
               │
               └──> session: a Runtime that adopts the trainer's one TrainingState ──> kept (LRU, bounded)

A signature is the dtypes and ranks of the inputs plus the sizes the exported graph baked in
(`baked_sizes`): a graph without baked sizes serves every batch and sequence length with one
session; one with baked sizes gets a session per distinct set of them. Every session reads and
writes the same state tensors (weights, moments, counters, accumulation buffers, step scalars), so
switching between them copies nothing, and a switch inside a gradient accumulation window keeps the
gradients accumulated so far.
"""

import collections
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import onnx

from . import baked_sizes

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
    startup_seconds: dict = field(default_factory=dict)
    adopted: bool = False  # set by the frontend once it has taken the build over


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
        self.baked = None if export is not None else frozenset()  # known after the first export
        self.state = None
        self.current = None
        self.builds = []  # every build's startup_seconds, in order
        self._sessions = collections.OrderedDict()  # Signature -> Build, least recently used first

    # ------------------------------------------------------------------ serving calls
    def serve(self, inputs):
        """The Build whose session runs a call with these inputs (built now if none serves them)."""
        seconds = {}
        if self.baked is None:
            return self._first_export(inputs, seconds)
        call = Signature.of(inputs, self.symbols, self.baked)
        for signature in reversed(self._sessions):
            if signature.serves(call):
                self._sessions.move_to_end(signature)
                self.current = self._sessions[signature]
                return self.current
        if self._export is None:
            raise RuntimeError(f"No session serves inputs {call} and the model cannot be re-exported "
                               "(it was given as an ONNX model)")
        return self._build(inputs, call, seconds)

    def given(self, forward, inputs=None):
        """Drop every session and build one from `forward` (a given ONNX model, or the current model
        with new constant values) for the current signature (or `inputs`'). The state is kept."""
        signature = self.current.signature if self.current is not None else Signature((), ())
        if inputs is not None:
            signature = Signature.of(inputs, self.symbols, self.baked or frozenset())
        self._sessions.clear()
        self.current = None
        seconds = {}
        return self._finish(signature, forward, self._timed(seconds, "training_graph", self._build_graph, forward),
                            "given", seconds)

    # ------------------------------------------------------------------ building
    def _first_export(self, inputs, seconds):
        """The first export also learns which sizes the model bakes in (from the cache if it knows)."""
        if self.cache is not None:
            self.baked = self.cache.load_baked()
        exported = None
        if self.baked is None:
            exported = self._timed(seconds, "export", self._export, inputs)
            started = time.perf_counter()
            self.baked = baked_sizes.detect(self._export, inputs, self.symbols, exported, skip=self.model_names)
            seconds["baked_size_detection"] = time.perf_counter() - started
            if self.cache is not None:
                self.cache.store_baked(self.baked)
            if self.baked:
                logger.info("the exported graph bakes in the sizes of %s: one session per distinct set of them",
                            sorted(self.baked))
        return self._build(inputs, Signature.of(inputs, self.symbols, self.baked), seconds, exported)

    def _build(self, inputs, signature, seconds, exported=None):
        seconds.setdefault("export", 0.0)  # every build reports both, 0.0 when skipped
        seconds.setdefault("training_graph", 0.0)
        loaded = None
        if self.cache is not None and exported is None:
            loaded = self._timed(seconds, "export_cache_load", self.cache.load, signature)
        if loaded is not None:
            forward, graph = loaded
            return self._finish(signature, forward, graph, "export cache", seconds)
        if exported is None:
            exported = self._timed(seconds, "export", self._export, inputs)
        forward = self._timed(seconds, "export", self._prepare, exported)
        graph = self._timed(seconds, "training_graph", self._build_graph, forward)
        if self.cache is not None:
            self._timed(seconds, "export_cache_store", self.cache.store, signature, forward, graph)
        return self._finish(signature, forward, graph, "export", seconds)

    def _finish(self, signature, forward, graph, source, seconds):
        runtime = self._timed(seconds, "session", self._make_runtime, graph, self.state)
        if self.state is None:
            self.state = runtime.state
        _drop_initial_values(graph)  # the state holds them now; a kept graph need not
        build = Build(signature, forward, runtime, source, seconds)
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


def _drop_initial_values(graph):
    """Replace every state's initial value by a zero-strided stand-in of the same shape and dtype."""
    for spec in graph.states.values():
        spec.initial = np.broadcast_to(np.zeros((), dtype=spec.initial.dtype), spec.initial.shape)
