"""TrainerGraphs: which graphs and session serve a trainer's call, and the forward model beside them.

ORTTrainer hands every call's inputs here (`serve`) and runs the returned session (`run`). This
object owns the GraphFactory (`_trainer/factory.py`) and the engine's GraphLifecycle it feeds, takes
each new Build over (input dtypes, index ranges, mixed-precision names, the forward model without its
trained weights), checks graphs from the export cache against the eager model before they train, and
loads model and optimizer values through the TrainingSession (rebuilding when frozen values change).
It holds no reference to the trainer: what it reads (model_desc, options, ...) is passed in, and the
trainer reaches its legacy attributes (`_graphs`, `_build`, `_training_session`, ...) through it.
"""

import functools
import inspect
import logging
import re
import time
import warnings

import torch

from orttrainer.engine.kernels.choice import Kernels
from orttrainer import _utils
from orttrainer.state import load_checks as _load_checks
from orttrainer.state import layout as _layout
from orttrainer._trainer.factory import GraphFactory, TrainingSpec
from orttrainer._trainer.training_session import TrainingSession
from orttrainer.engine.runtime import input_checks as _checks
from orttrainer.placement import process_group as _process_group
from orttrainer.engine.export import torch_export as _export
from orttrainer.placement import device as _placement
from orttrainer.engine.graph import training_graph as tg
from orttrainer.engine.runtime.lifecycle import GraphLifecycle, without_data

logger = logging.getLogger("orttrainer")


class TrainerGraphs:
    """Args: the trainer's model_desc, optim_config, loss_fn, options, torch model (None for an ONNX
    model), process group, the dtype the export traces under, the loss scaler (or None) and which
    kernels compute the matrix products (engine/kernels/choice.py)."""

    def __init__(self, model_desc, optim_config, loss_fn, options, torch_model, group, compute_dtype, loss_scaler,
                 kernels=Kernels()):
        self.model_desc, self.optim_config, self.loss_fn, self.options = model_desc, optim_config, loss_fn, options
        self.torch_model, self.group, self.compute_dtype = torch_model, group, compute_dtype
        self.kernels = kernels
        self.loss_scaler = loss_scaler
        self.torch_state_keys = list(torch_model.state_dict().keys()) if torch_model is not None else []
        if torch_model is not None:
            _warn_dropped_inputs(torch_model, loss_fn, [d.name for d in model_desc.inputs])
        self.adopt_parameters = True  # the trainer's _share_module_parameters, read when a factory is made
        self.factory = None  # GraphFactory: what the lifecycle builds from
        self.graphs = None  # engine.lifecycle.GraphLifecycle: export → training graph → sessions
        self.build = None  # the lifecycle's Build that serves the latest call
        self.training_session = None  # legacy getters over the state (TrainingSession), from the first build
        self.forward_model = None  # the forward ONNX model, trainable weights as data-less stubs
        self.trained_names = set()
        self.frozen_values = {}  # frozen initializers loaded by load_state_dict: override the model's on re-export
        self.input_dtypes = {}  # graph input name -> torch dtype, once the session exists
        self.index_ranges = {}  # inputs used as indices (token ids, labels): checked every step
        self.aliases = {}  # tied torch parameter name -> name of the ONNX initializer holding it
        self.sample = None  # (wrapper, first batch) from which the torch sample outputs are recomputed
        self.given_sample_outputs = None  # only when assigned by the caller
        # Start-up cost in seconds of the first build: export, training_graph (gradient + optimizer),
        # session, first_step (+ export_cache_load, baked_size_detection); every build's: graphs.builds.
        self.startup_seconds = {}

    # ------------------------------------------------------------------ the forward model
    def sample_outputs(self):
        """The torch model's outputs on the first batch, dropout off, recomputed (None before export)."""
        if self.given_sample_outputs is not None or self.sample is None:
            return self.given_sample_outputs
        wrapper, sample = self.sample
        return _export.sample_outputs(wrapper, sample)

    def onnx_model(self):
        """The forward model with the trainable weights the session holds now written in."""
        if self.training_session is not None:
            _layout.write_initializers(self.forward_model, self.current_weights())
        return self.forward_model

    def drop_weight_copies(self):
        """Replace the forward model by one whose trainable initializers are data-less stubs (a new
        model: the caller's own ModelProto, for ONNX-model trainers, is never modified)."""
        self.trained_names = set(self.training_session.graph.weights)  # values: the session's, never the stubs'
        self.forward_model = without_data(self.forward_model, self.trained_names)

    def current_weights(self):
        model_state = self.training_session.get_model_state(include_mixed_precision_weights=False)
        return dict(model_state.get(_utils.FULL_PRECISION_KEY, {}))

    def model_state(self):
        """state_dict['model']: the session's getter plus the kept initializers and tied names."""
        model = dict(self.training_session.get_model_state(include_mixed_precision_weights=False))
        keep = set(self.options.utils.frozen_weights) | set(self.torch_state_keys)
        full = _layout.full_model_state(model.get(_utils.FULL_PRECISION_KEY, {}), self.forward_model, keep,
                                        self.trained_names, self.aliases)
        if full or _utils.FULL_PRECISION_KEY in model:  # a session with no states reports {} (the original)
            model[_utils.FULL_PRECISION_KEY] = full
        return model

    def known_names(self):
        """The model names a state_dict may hold values for: initializers and tied aliases."""
        return {i.name for i in _layout._initializers(self.forward_model)} | set(self.aliases)

    def pending_accumulation(self):
        """Accumulated gradients of an unfinished window (exact mid-window resume needs them)."""
        return {w: t.detach().cpu().numpy().copy() for w, t in self.training_session.accumulators().items()}

    # ------------------------------------------------------------------ graph selection
    def spec(self):
        """What shapes the graphs, frozen now (read at the first step: options may change until then)."""
        return TrainingSpec.of(self.model_desc, self.optim_config, self.loss_fn, self.options, self.compute_dtype,
                               self.kernels)

    def given_model(self, model):
        """An ONNX model given to the trainer: postprocessed, described and its session built."""
        self.graphs = self.new_lifecycle()
        self.forward_model = self.factory.postprocess(model)
        self._describe_types(check=True)
        self.use(self.graphs.given(self.forward_model))

    def serve(self, inputs):
        """Make current the session that serves these inputs (exported and built when none does).
        True when this call made the trainer's first build: a deferred load_state_dict applies now."""
        if self.graphs is None:
            self.graphs = self.new_lifecycle()
        first = self.build is None
        build = self.graphs.serve(inputs)
        if build is self.build:
            return False
        if first and self.torch_model is not None:
            names = [d.name for d in self.model_desc.inputs]
            # Cloned: a data loader may reuse (and overwrite) its batch tensors.
            self.sample = (self.factory.wrapper(), [inputs[n].detach().cpu().clone() for n in names if n in inputs])
        self.use(build)
        if first:
            self.startup_seconds.update(build.startup_seconds)
        cached = build.source == "export cache" and not build.verified
        if cached and not self._cached_graphs_match(inputs, build, first):
            return self.serve(inputs)  # exported again: this trainer reads nothing more from the cache
        if first and self.options.debug.check_model_export:  # before a pending load: it compares initial weights
            try:  # torch's forward before onnxruntime's, as in the cache check (export_cache.mismatch_with_eager)
                torch_outputs = self.sample_outputs()
                self.factory.check_export(self.run("eval", inputs)[0], torch_outputs)
            except RuntimeError:
                self.forget()  # a retry exports and checks again instead of training it
                raise
        return first

    def new_lifecycle(self):
        """The GraphLifecycle, fed by a GraphFactory that holds no reference to the trainer."""
        options = self.options
        if self.factory is None:
            self.factory = GraphFactory(
                self.spec(), self.model_desc, self.torch_model, self.group, _placement.arguments(options),
                functools.partial(_placement.session_options, options), self.frozen_values,
                options.debug.graph_save_paths, adopt_parameters=self.adopt_parameters,
                check_finite=self.loss_scaler is not None,
                allreduce_post_accumulation=options.distributed.allreduce_post_accumulation,
                adasum=options.distributed.enable_adasum)
        factory = self.factory
        if self.torch_model is None:  # an ONNX model: given, never exported
            return GraphLifecycle(build_graph=factory.build_training_graph, make_runtime=factory.make_runtime)
        symbols = {d.name: {axis: dim for axis, dim in enumerate(d.shape) if isinstance(dim, str)}
                   for d in self.model_desc.inputs}
        return GraphLifecycle(
            build_graph=factory.build_training_graph, make_runtime=factory.make_runtime, export=factory.export,
            prepare=factory.prepare_forward, symbols={n: axes for n, axes in symbols.items() if axes},
            cache=factory.export_cache(options.utils), model_names=factory.model_tensors())

    def pipeline_factory(self):
        """A GraphFactory for a pipeline stage's export (engine/parallel/pipeline_stage.py): like new_lifecycle's, without
        the process group and without adopting the torch parameters (the stage keeps its own weights)."""
        options = self.options
        return GraphFactory(self.spec(), self.model_desc, self.torch_model, None, _placement.arguments(options),
                            functools.partial(_placement.session_options, options), self.frozen_values,
                            options.debug.graph_save_paths, adopt_parameters=False, stub_weights=False)

    def forget(self):
        """Drop the sessions and forward model (the next call builds them again)."""
        self.graphs = self.build = self.training_session = self.sample = self.forward_model = None
        self.input_dtypes = {}

    def use(self, build):
        """Make `build` (its forward model and session) the current one."""
        new = self.training_session is None
        self.build = build
        self.forward_model = build.forward
        if new:
            self.training_session = TrainingSession(self.graphs, self.optim_config.name,
                                                    mixed_precision=self.options.mixed_precision.enabled)
            if self.torch_model is not None:
                self.aliases = _export.tied_aliases(self.torch_model, {i.name for i in build.forward.graph.initializer})
                self.index_ranges = _checks.index_ranges(build.forward)
                self._describe_types(check=False)
                if self.compute_dtype not in (None, torch.float32):
                    # Outputs computed in fp16/bf16 under mixed precision (legacy dtype_amp): the
                    # model's own (fp32) output dtypes come from one eager forward.
                    outputs = self.sample_outputs()
                    for index, (desc, output) in enumerate(zip(self.model_desc.outputs, outputs)):
                        if desc.dtype != output.dtype:
                            self.model_desc.add_type_to_output_description(index, output.dtype, dtype_amp=desc.dtype)
        if build.adopted:
            return
        build.adopted = True
        graph = build.runtime.graph
        self.input_dtypes = {i.name: _torch_dtype(i.type.tensor_type.elem_type) for i in build.forward.graph.input}
        if self.loss_scaler is not None:
            self.loss_scaler.input_name = tg.LOSS_SCALE
            self.model_desc.loss_scale_input = tg.LOSS_SCALE
            self.model_desc.all_finite = tg.ALL_FINITE
        if graph.accumulated:
            self.model_desc.gradient_accumulation = tg.accumulation_flag(graph.accumulated[0])
        self.drop_weight_copies()
        build.forward = self.forward_model
        logger.info("training session ready: %d trainable weights, %d frozen/constant initializers",
                    len(graph.weights), len(build.forward.graph.initializer) - len(graph.weights))

    def _cached_graphs_match(self, inputs, build, first):
        """Whether graphs from the export cache compute what the model does: their eval outputs on this
        call's inputs against one eager forward with the same weights, dropout off. For the first build
        any rank's mismatch counts on every rank (they all build it at once). On a mismatch these
        graphs' cache entries are deleted, one warning says so, and the graphs are dropped to be exported."""
        started = time.perf_counter()
        runtime = self.training_session.runtime
        weights = {w: runtime.current(w).detach().cpu() for w in runtime.graph.weights}  # views, not copies
        stale, found = self.factory.cache_mismatch(lambda: self.run("eval", inputs)[0], inputs, weights,
                                                   everywhere=first)
        build.startup_seconds["export_cache_verify"] = time.perf_counter() - started
        if first:
            self.startup_seconds["export_cache_verify"] = build.startup_seconds["export_cache_verify"]
        if not stale:
            build.verified = True
            return True
        cache = self.graphs.cache
        if found:
            logger.warning("export cache entry %s did not match the model's eager outputs (output %r, "
                           "max diff %.3g): rebuilt", cache.path(build.signature), found[0], found[1])
        else:
            logger.warning("export cache entry %s rebuilt with the other ranks': another rank's entry did "
                           "not match the model's eager outputs", cache.path(build.signature))
        cache.invalidate()  # reads nothing more
        if first:
            self.forget()
            self.graphs = self.new_lifecycle()
            self.graphs.cache = cache
        else:
            self.graphs.forget(build)  # the state (trained weights) stays
        return False

    def _describe_types(self, check):
        """model_desc's input and output dtypes, from the forward model's graph."""
        graph = self.forward_model.graph
        inputs = {i.name: i for i in graph.input}
        outputs = {o.name: o for o in graph.output}
        for index, desc in enumerate(self.model_desc.inputs):
            if desc.name not in inputs:
                assert not check, f"ONNX model with unknown input type ({desc.name})"
                continue  # an input the exporter dropped because the graph does not use it
            self.model_desc.add_type_to_input_description(index, _torch_dtype(inputs[desc.name].type.tensor_type.elem_type))
        for index, desc in enumerate(self.model_desc.outputs):
            assert desc.name in outputs, f"ONNX model with unknown output type ({desc.name})"
            self.model_desc.add_type_to_output_description(index, _torch_dtype(outputs[desc.name].type.tensor_type.elem_type))

    # ------------------------------------------------------------------ running
    def run(self, kind, inputs, fetches=None, **scalars):
        """Run the current session; returns (outputs for `fetches` or all described outputs, all_finite)."""
        runtime = self.training_session
        device = runtime.device
        # inputs the graph does not use are accepted and skipped
        feed = {name: t.to(device).contiguous() for name, t in inputs.items() if name in runtime.input_names}
        try:
            if kind == "train":
                return runtime.train(feed, fetches, **scalars)
            return runtime.run(kind, feed, fetches, **scalars)
        except _process_group.DistributedError:
            raise  # already says which collective and rank
        except Exception as exc:  # onnxruntime's own errors say little about which call failed
            missing = re.search(r"Missing Input: (\S+)", str(exc))
            if missing:
                raise ValueError(f"Input {missing.group(1)!r} is needed to compute "
                                 f"{list(fetches or [o.name for o in self.model_desc.outputs])} in this "
                                 f"{kind} step but was not given") from exc
            raise RuntimeError(f"onnxruntime failed to run the {kind} step: {exc}") from exc

    # ------------------------------------------------------------------ loading
    def load(self, model_states, optimizer_states, accumulation, saved_by):
        """Load model values and optimizer states (+ accumulated gradients) through the
        TrainingSession's load_state; frozen values rebuild the session. Everything is checked
        (names, shapes, dtypes, ZeRO-1 segments) before anything changes."""
        session = self.training_session
        layout = session.layout
        model_states = {n: v for n, v in model_states.items() if n not in self.aliases}  # values come as the kept name
        frozen_now = _layout.initializer_values(self.forward_model, set(model_states) - layout.states)
        states, frozen = layout.checked_buffers(session.current, model_states, optimizer_states, frozen_now,
                                                saved_by, (self.group.rank, self.group.world_size))
        gradients = {w: _load_checks.checked(f"{w} (accumulated gradient)", _load_checks.as_numpy(v),
                                             session.current(w))
                     for w, v in (accumulation or {}).items() if w in session.graph.accumulated}
        if frozen:
            self._rebuild_with_frozen_values(frozen)
        session.load_state(states, strict=True)
        session.load_accumulators(gradients)

    def _rebuild_with_frozen_values(self, frozen_updates):
        """Frozen values are constants of every session: rebuild the current one (the state is kept)
        and write them into every later export too. A failed rebuild restores the old constants and
        session, so the trainer stays usable and unchanged."""
        model = self.onnx_model()  # current weights written in while a session can still give them
        old_values = dict(self.frozen_values)
        old_inits = _layout.initializer_values(model, frozen_updates)
        self.frozen_values.update(frozen_updates)
        _layout.write_initializers(model, frozen_updates)
        try:
            self.use(self.graphs.given(model))
        except BaseException:
            self.frozen_values.clear()  # in place: the GraphFactory shares this dict
            self.frozen_values.update(old_values)
            _layout.write_initializers(model, old_inits)
            self.use(self.graphs.given(model))  # the lifecycle kept the state: nothing is lost
            raise


def _torch_dtype(elem_type):
    """The torch dtype of an ONNX element type, None for types torch has no dtype for (e.g. strings)."""
    try:
        return _utils.dtype_onnx_to_torch(elem_type)
    except ValueError:
        return None


def _warn_dropped_inputs(torch_model, loss_fn, names):
    dropped = _export.dropped_inputs(torch_model, loss_fn, names)
    if dropped:
        params = list(inspect.signature(torch_model.forward).parameters)
        label = " (a loss_fn gets only the last input, its label)" if loss_fn is not None else ""
        warnings.warn(f"model_desc inputs {dropped} name no parameter of {type(torch_model).__name__}.forward"
                      f"({', '.join(params)}): they are not passed to the model{label}. Rename them to "
                      "forward()'s parameter names, or drop them from model_desc.")
