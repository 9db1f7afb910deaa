"""`ORTTrainer`: the legacy frontend, driving one onnxruntime session per trainer.

Data path:  PyTorch model + loss_fn ──export (first step)──> forward ONNX model
            ──build_training_graph──> training graph ──Runtime──> train_step / eval_step
The engine's GraphLifecycle (`_graphs`) owns that path, fed by a GraphFactory (`_graph_factory.py`,
no reference back to the trainer): it re-exports when a call's inputs need sizes the exported graph
baked in, keeps one session per such signature, and reads and writes the export cache. State
(weights, optimizer moments, counters) lives in one TrainingState of torch tensors that every session
shares; `_training_session` is the only way state_dict/load_state_dict reach it. `_onnx_model`
is the current forward model. While a session exists the forward model does not keep its own copy
of the trainable weights: it is rebuilt from the session's buffers when read (see `_onnx_model`).
"""

import functools
import inspect
import logging
import os
import re
import time
import warnings

import onnx
import onnxruntime as ort
import torch

from . import _load_checks, _utils, checkpoint
from . import _state_layout as _layout
from . import optim
from ._training_session import TrainingSession
from .amp import DynamicLossScaler
from .engine import checks as _checks
from .engine import distributed as _distributed
from .engine import export as _export
from .engine import placement as _placement
from .engine import precision as _precision
from .engine import training_graph as tg
from .engine.lifecycle import GraphLifecycle, without_data
from ._graph_factory import GraphFactory, TrainingSpec
from .model_desc_validation import _ORTTrainerModelDesc
from .orttrainer_options import ORTTrainerOptions
from .train_step_info import MixedPrecisionCounters, TrainStepInfo

__all__ = ["ORTTrainer", "TrainStepInfo"]

logger = logging.getLogger("orttrainer")

# onnxruntime logs ~20 INFO lines per session by default.
ort.set_default_logger_severity(3)

_NO_SESSION_STATE_DICT = (
    "ONNX Runtime training session is not initialized yet. Please run train_step or eval_step at least "
    "once before calling ORTTrainer.state_dict()."
)
_NO_SESSION_SAVE_AS_ONNX = (
    "Training session is not initialized yet. 'train_step' or 'eval_step' methods must be executed at "
    "least once before calling 'save_as_onnx()'."
)


class ORTTrainer:
    """Trains a PyTorch or ONNX model with the whole step in one onnxruntime session.

    Args:
        model: a `torch.nn.Module` (exported on the first train_step/eval_step) or an `onnx.ModelProto`
            whose loss is a graph output.
        model_desc: {'inputs': [(name, shape)], 'outputs': [(name, shape[, is_loss])]}.
        optim_config: `optim.SGDConfig`, `optim.AdamConfig` or `optim.LambConfig`.
        loss_fn: optional `loss_fn(model_output, label)`; the label is the last described input and the
            loss must be the first described output.
        options: `ORTTrainerOptions`.
    """

    # The fp32 weights are the torch model's own parameters, trained in place (False: a copy, and
    # the module keeps its initial values, as the original trainer did).
    _share_module_parameters = True

    def __init__(self, model, model_desc, optim_config, loss_fn=None, options=None):
        assert model is not None, "'model' is required and must be either a 'torch.nn.Module' or ONNX model"
        assert isinstance(model_desc, dict), "'model_desc' must be a 'dict'"
        assert isinstance(optim_config, optim._OptimizerConfig), (
            "'optim_config' is required and must be any of 'AdamConfig', 'LambConfig' or 'SGDConfig'"
        )
        assert loss_fn is None or (callable(loss_fn) and len(inspect.signature(loss_fn).parameters) == 2), (
            "'loss_fn' must be either 'None' or a callable with two parameters"
        )
        assert options is None or isinstance(options, ORTTrainerOptions), (
            "'options' must be either 'None' or 'ORTTrainerOptions'"
        )
        self.model_desc = _ORTTrainerModelDesc(model_desc)
        self.optim_config = optim_config
        self.loss_fn = loss_fn
        self.options = options if options is not None else ORTTrainerOptions()
        self.is_rocm_pytorch = False
        self._sample = None  # (wrapper, first batch) from which `torch_sample_outputs` is recomputed
        self._index_ranges = {}  # inputs used as indices (token ids, labels): checked every step
        self._torch_sample_outputs = None  # only when assigned by the caller
        self._torch_model = None
        self._forward_model = None  # the forward ONNX model, see `_onnx_model`
        self._torch_state_keys = []
        self._aliases = {}  # tied torch parameter name -> name of the ONNX initializer holding it
        self._graphs = None  # engine.lifecycle.GraphLifecycle: export → training graph → sessions
        self._factory = None  # GraphFactory: what the lifecycle builds from (_graph_factory.py)
        self._build = None  # the lifecycle's Build that serves the latest call
        self._training_session = None  # legacy getters over the state (TrainingSession), from the first build
        self._trained_names = set()  # trainable weights: data-less stubs in the forward model
        self._frozen_values = {}  # frozen initializers loaded by load_state_dict: override the model's on re-export
        self._input_dtypes = {}  # graph input name -> torch dtype, once the session exists
        self._load_state_dict = None
        self._closed = False
        self._staged_model_states = {}  # model values of a load in progress (_update_onnx_model_initializers)
        self._train_step_info = TrainStepInfo(self.optim_config)
        # Start-up cost in seconds of the first build: export, training_graph (gradient + optimizer),
        # session, first_step (+ export_cache_load, baked_size_detection); every build's: _graphs.builds.
        self.startup_seconds = {}

        # The process group (torch.distributed) when the options ask for several ranks; a mismatch with
        # the launcher is an error here, before any work.
        world_size = self.options.distributed.world_size
        self._group = _distributed.setup_process_group(
            self.options.distributed, self._providers()[2] if world_size > 1 else torch.device("cpu"))

        mixed = self.options.mixed_precision
        # The user's scaler object is used (as in the original), but a default one is never written
        # into the user's options.
        self.loss_scaler = (mixed.loss_scaler or DynamicLossScaler()) if mixed.enabled else None
        # float32, or float16/bfloat16 when mixed precision computes in it (docs/engine.md); checked
        # here so that bfloat16 on the CPU fails before any work.
        self._compute_dtype = _precision.resolve_compute_dtype(
            mixed.compute_dtype, enabled=mixed.enabled, device_type=self._session_device_type(),
            torch_model=isinstance(model, torch.nn.Module))
        if self._compute_dtype == torch.bfloat16 and mixed.loss_scaler is None:
            # bfloat16 has float32's exponent range: gradients do not underflow, no scaling is needed.
            self.loss_scaler = DynamicLossScaler(automatic_update=False, loss_scale=1.0)
        self.mixed_precision_counters = MixedPrecisionCounters() if self.loss_scaler is not None else None

        if isinstance(model, torch.nn.Module):
            self._torch_model = model
            self._torch_state_keys = list(model.state_dict().keys())
        elif isinstance(model, onnx.ModelProto):
            assert loss_fn is None, "'loss_fn' must not be specified when 'model' is an ONNX model"
            self._graphs = self._new_lifecycle()
            self._onnx_model = self._factory.postprocess(model)
            self._type_descriptions_from_onnx(check=True)
            self._use(self._graphs.given(self._forward_model))
        else:
            raise ValueError("'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'")

    # ================================================================== public API
    @property
    def torch_sample_outputs(self):
        """The PyTorch model's outputs (loss first with a loss_fn) on the first batch, dropout off.

        The original kept these tensors alive for the trainer's life (125 MB of logits for a BERT
        batch); they are recomputed from the kept first batch on access instead. None before export.
        """
        if self._torch_sample_outputs is not None or self._sample is None:
            return self._torch_sample_outputs
        wrapper, sample = self._sample
        return _export.sample_outputs(wrapper, sample)

    @torch_sample_outputs.setter
    def torch_sample_outputs(self, value):
        self._torch_sample_outputs = value

    @property
    def _onnx_model(self):
        """The forward ONNX model (legacy attribute), its trainable weights as the session holds them now.

        The original kept the initial weights here for the trainer's life, next to the session's
        trained copy (20 MB for the GPT benchmark model, 43 MB for BERT). This trainer drops that copy
        once the session exists (`_drop_weight_copies`) and writes the current weights in whenever
        the model is read, so a reader always sees the trained values. The engine's own readers use
        `_forward_model`, which never needs them.
        """
        if self._training_session is not None:
            _layout.write_initializers(self._forward_model, self._current_weights())
        return self._forward_model

    @_onnx_model.setter
    def _onnx_model(self, model):
        self._forward_model = model

    def train_step(self, *args, **kwargs):
        """One training micro-step; every `gradient_accumulation_steps`-th call updates the weights.

        Returns the described outputs (loss first when a loss_fn is used) as torch tensors, or only
        `_train_step_info.fetches` when set; a single output is returned bare.
        """
        self._check_open()
        inputs = self._match_inputs(args, kwargs)
        first_step = "first_step" not in self.startup_seconds
        self._serve(inputs)
        started = time.perf_counter()
        _checks.check_ranges(self._index_ranges, inputs)
        fetches = _checks.check_fetches(self._train_step_info.fetches, self.model_desc.outputs)
        info = self._train_step_info
        gas = self.options.batch.gradient_accumulation_steps
        step = info.step + 1
        is_update = step % gas == 0
        lr = self._learning_rate()
        loss_scale = float(self.loss_scaler.loss_scale) if self.loss_scaler else 1.0
        # Gradients are summed over micro-steps and ranks: the scale makes them the global batch's mean.
        scale = 1.0 / (gas * self._group.world_size * loss_scale)
        outputs, all_finite = self._run("train", inputs, fetches, update=is_update, lr=lr, gradient_scale=scale,
                                        loss_scale=loss_scale)
        info.step = step
        if self.mixed_precision_counters is not None:
            self._count_non_finite(outputs, fetches, is_update, all_finite)
        if is_update:
            if self.loss_scaler is not None:
                info.all_finite = all_finite
                self.loss_scaler.update(info)
                if bool(all_finite.item()):
                    info.optimization_step += 1
            else:
                info.optimization_step += 1
        if first_step:
            self.startup_seconds["first_step"] = time.perf_counter() - started
        return self._select(outputs)

    @property
    def last_gradient_norm(self):
        """The global L2 norm of the last optimizer step's gradients (mean over micro-steps and ranks,
        unscaled, before clipping) as a float; None where the graph computes none (no clipping and no
        mixed precision, e.g. SGD) or before the first step. Not in the legacy class (an addition)."""
        runtime = self._training_session
        if runtime is None or not getattr(runtime, "has_gradient_norm", False):
            return None
        norm = float(runtime.gradient_norm)
        return None if norm != norm and self._train_step_info.optimization_step == 0 else norm

    def _count_non_finite(self, outputs, fetches, is_update, all_finite):
        counters = self.mixed_precision_counters
        names = list(fetches or [o.name for o in self.model_desc.outputs])
        loss = next((o.name for o in self.model_desc.outputs if o.is_loss), None)
        if loss in names and not bool(torch.isfinite(outputs[names.index(loss)]).all()):
            counters.nan_steps += 1
        if is_update and all_finite is not None and not bool(all_finite.item()):
            counters.skipped_steps += 1

    def eval_step(self, *args, **kwargs):
        """Forward only, dropout off; changes no weight, optimizer state or counter."""
        self._check_open()
        inputs = self._match_inputs(args, kwargs)
        self._serve(inputs)
        _checks.check_ranges(self._index_ranges, inputs)
        fetches = _checks.check_fetches(self._train_step_info.fetches, self.model_desc.outputs)
        outputs, _ = self._run("eval", inputs, fetches)
        return self._select(outputs)

    def save_as_onnx(self, path):
        """Write the forward model with the current (trained) weights to `path`."""
        self._check_open()
        if self._training_session is None:
            warnings.warn(_NO_SESSION_SAVE_AS_ONNX)
            return
        assert isinstance(path, str), "'path' must be a valid path string"
        dir_name = os.path.dirname(os.path.abspath(path))
        if not os.path.basename(path) or not os.path.isdir(dir_name):
            warnings.warn("'path' is not valid or does not exist")
            return
        with open(path, "wb") as f:
            f.write(self._onnx_model.SerializeToString())
        self._drop_weight_copies()

    def state_dict(self, pytorch_format=False):
        """The trainer's state in the legacy layout (numpy arrays), or a flat torch dict of weights.

        Read through `_training_session`'s getters, as the original was (its tests substitute the session)."""
        self._check_open()
        session = self._training_session
        if session is None:
            warnings.warn(_NO_SESSION_STATE_DICT)
            return self._load_state_dict.args[0] if self._load_state_dict else {}
        model = dict(session.get_model_state(include_mixed_precision_weights=False))
        full = _layout.full_model_state(model.get(_utils.FULL_PRECISION_KEY, {}), self._forward_model,
                                        self._kept_initializers(), self._trained_names, self._aliases)
        if full or _utils.FULL_PRECISION_KEY in model:  # a session with no states reports {} (the original)
            model[_utils.FULL_PRECISION_KEY] = full
        if pytorch_format:
            return _layout.to_pytorch(model[_utils.FULL_PRECISION_KEY], self._torch_state_keys)
        self._check_window_boundary()
        state = {_utils.MODEL_KEY: model, _utils.OPTIMIZER_KEY: session.get_optimizer_state()}
        if self.options.distributed.deepspeed_zero_optimization.stage > 0:
            state[_utils.PARTITION_INFO_KEY] = session.get_partition_info_map()
        state[_utils.TRAINER_OPTIONS_KEY] = self._trainer_options_state()
        info = self._train_step_info
        state[_utils.TRAIN_STEP_INFO_KEY] = {
            _utils.OPTIMIZATION_STEP_KEY: info.optimization_step,
            _utils.STEP_KEY: info.step,
        }
        if self.loss_scaler is not None:
            state[LOSS_SCALER_KEY] = self.loss_scaler.state_dict()
            state[MIXED_PRECISION_COUNTERS_KEY] = self.mixed_precision_counters.state_dict()
        pending = self._pending_accumulation()
        if pending:
            state[GRADIENT_ACCUMULATION_KEY] = pending
        return state

    def load_state_dict(self, state_dict, strict=True):
        """Load a state_dict; before the first step the load is deferred to session creation."""
        self._check_open()
        if self._training_session is None:
            self._load_state_dict = functools.partial(self._load_state_dict_impl, state_dict, strict=strict)
            return
        self._load_state_dict_impl(state_dict, strict=strict)

    def save_checkpoint(self, path, user_dict={}, include_optimizer_states=True, overwrite=False):  # noqa: B006
        """Save `state_dict()` (+ user_dict) to an HDF5 file, atomically; refuses an existing path
        unless `overwrite=True`."""
        state = self.state_dict()
        if not state:
            raise RuntimeError("Nothing to save: run train_step or eval_step at least once before "
                               "save_checkpoint() (the session, and so the weights, do not exist yet).")
        checkpoint._save_checkpoint(state, path, user_dict=user_dict,
                                    include_optimizer_states=include_optimizer_states, overwrite=overwrite)

    def load_checkpoint(self, *paths, strict=True, allow_unsafe_pickle=False):
        """Load checkpoint file(s) (rank files of a partitioned run are aggregated); returns the
        saved user_dict. A file that cannot be read or does not fit leaves the trainer unchanged."""
        state, user_dict = checkpoint._load_checkpoint(paths, allow_unsafe_pickle=allow_unsafe_pickle)
        self.load_state_dict(state, strict=strict)
        return user_dict

    def close(self):
        """Free the sessions and state buffers now, not whenever the trainer is collected. A torch
        model keeps its (trained) parameters. Later steps, state_dict(), load_state_dict(), ...
        raise RuntimeError; close() again does nothing."""
        self._forget_graphs()
        self._factory = self._load_state_dict = None
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("This ORTTrainer was closed (close() or the end of its 'with' block): its "
                               "sessions and state are freed. Create a new ORTTrainer (load a checkpoint "
                               "saved before closing to continue).")

    # ================================================================== inputs and outputs
    def _match_inputs(self, args, kwargs):
        return _checks.match_inputs(self.model_desc.inputs, self._input_dtypes, args, kwargs,
                                    allow_missing=bool(self._train_step_info.fetches))

    def _run(self, kind, inputs, fetches=None, **scalars):
        """Run the session; returns (outputs for `fetches` or all described outputs, all_finite)."""
        runtime = self._training_session
        device = runtime.device
        feed = {}
        for name, tensor in inputs.items():
            if name in runtime.input_names:  # inputs the graph does not use are accepted and skipped
                feed[name] = tensor.to(device).contiguous()
        try:
            if kind == "train":
                return runtime.train(feed, fetches, **scalars)
            return runtime.run(kind, feed, fetches, **scalars)
        except _distributed.DistributedError:
            raise  # already says which collective and rank
        except Exception as exc:  # onnxruntime's own errors say little about which call failed
            missing = re.search(r"Missing Input: (\S+)", str(exc))
            if missing:
                raise ValueError(f"Input {missing.group(1)!r} is needed to compute "
                                 f"{list(fetches or [o.name for o in self.model_desc.outputs])} in this "
                                 f"{kind} step but was not given") from exc
            raise RuntimeError(f"onnxruntime failed to run the {kind} step: {exc}") from exc

    @staticmethod
    def _select(outputs):
        return outputs[0] if len(outputs) == 1 else outputs

    def _learning_rate(self):
        scheduler = self.options.lr_scheduler
        if scheduler is None:
            return float(self.optim_config.lr)
        return float(scheduler._step(self._train_step_info)[0])

    # ================================================================== model preparation
    def _type_descriptions_from_onnx(self, check):
        graph = self._forward_model.graph
        inputs = {i.name: i for i in graph.input}
        outputs = {o.name: o for o in graph.output}
        for index, desc in enumerate(self.model_desc.inputs):
            if desc.name not in inputs:
                assert not check, f"ONNX model with unknown input type ({desc.name})"
                continue  # an input the exporter dropped because the graph does not use it
            dtype = _torch_dtype(inputs[desc.name].type.tensor_type.elem_type)
            self.model_desc.add_type_to_input_description(index, dtype)
        for index, desc in enumerate(self.model_desc.outputs):
            assert desc.name in outputs, f"ONNX model with unknown output type ({desc.name})"
            dtype = _torch_dtype(outputs[desc.name].type.tensor_type.elem_type)
            self.model_desc.add_type_to_output_description(index, dtype)

    # ================================================================== the graph life cycle
    def _serve(self, inputs):
        """Make current the session that serves these inputs (exported and built when none does)."""
        if self._graphs is None:
            self._graphs = self._new_lifecycle()
        first = self._build is None
        build = self._graphs.serve(inputs)
        if build is self._build:
            return
        if first and self._torch_model is not None:
            names = [d.name for d in self.model_desc.inputs]
            # Cloned: a data loader may reuse (and overwrite) its batch tensors.
            self._sample = (self._factory.wrapper(), [inputs[n].detach().cpu().clone() for n in names if n in inputs])
        self._use(build)
        if first:
            self.startup_seconds.update(build.startup_seconds)
        cached = build.source == "export cache" and not build.verified
        if cached and not self._cached_graphs_match(inputs, build, first):
            return self._serve(inputs)  # exported again: this trainer reads nothing more from the cache
        if first:
            if self.options.debug.check_model_export:  # before a pending load: it compares initial weights
                try:
                    self._factory.check_export(self._run("eval", inputs)[0], self.torch_sample_outputs)
                except RuntimeError:
                    self._forget_graphs()  # a retry exports and checks again instead of training it
                    raise
            self._apply_pending_load()

    def _new_lifecycle(self):
        """The GraphLifecycle, fed by a GraphFactory that holds no reference to this trainer."""
        if self._factory is None:
            self._factory = GraphFactory(
                self._training_spec(), self.model_desc, self._torch_model, self._group, self._providers(),
                functools.partial(_placement.session_options, self.options), self._frozen_values,
                self.options.debug.graph_save_paths, adopt_parameters=self._share_module_parameters,
                check_finite=self.loss_scaler is not None,
                allreduce_post_accumulation=self.options.distributed.allreduce_post_accumulation,
                adasum=self.options.distributed.enable_adasum)
        factory = self._factory
        if self._torch_model is None:  # an ONNX model: given, never exported
            return GraphLifecycle(build_graph=factory.build_training_graph, make_runtime=factory.make_runtime)
        symbols = {d.name: {axis: dim for axis, dim in enumerate(d.shape) if isinstance(dim, str)}
                   for d in self.model_desc.inputs}
        return GraphLifecycle(
            build_graph=factory.build_training_graph, make_runtime=factory.make_runtime, export=factory.export,
            prepare=factory.prepare_forward, symbols={n: axes for n, axes in symbols.items() if axes},
            cache=factory.export_cache(self.options.utils), model_names=factory.model_tensors())

    def _training_spec(self):
        """What shapes the graphs, frozen now (read at the first step: options may change until then)."""
        return TrainingSpec.of(self.model_desc, self.optim_config, self.loss_fn, self.options, self._compute_dtype)

    def _forget_graphs(self):
        """Drop the sessions and forward model (the next call builds them again)."""
        self._graphs = self._build = self._training_session = self._sample = None
        self._onnx_model = None
        self._input_dtypes = {}

    def _use(self, build):
        """Make `build` (its forward model and session) the trainer's current one."""
        new = self._training_session is None
        self._build = build
        self._forward_model = build.forward
        if new:
            self._training_session = TrainingSession(self._graphs, self.optim_config.name)
            if self._torch_model is not None:
                self._aliases = _export.tied_aliases(self._torch_model,
                                                     {i.name for i in build.forward.graph.initializer})
                self._index_ranges = _checks.index_ranges(build.forward)
                self._type_descriptions_from_onnx(check=False)
                if self._compute_dtype not in (None, torch.float32):
                    # Outputs computed in fp16/bf16 under mixed precision (legacy dtype_amp): the
                    # model's own (fp32) output dtypes come from one eager forward.
                    outputs = self.torch_sample_outputs
                    for index, (desc, output) in enumerate(zip(self.model_desc.outputs, outputs)):
                        if desc.dtype != output.dtype:
                            self.model_desc.add_type_to_output_description(index, output.dtype, dtype_amp=desc.dtype)
        if build.adopted:
            return
        build.adopted = True
        graph = build.runtime.graph
        self._input_dtypes = {i.name: _torch_dtype(i.type.tensor_type.elem_type) for i in build.forward.graph.input}
        if self.loss_scaler is not None:
            self.loss_scaler.input_name = tg.LOSS_SCALE
            self.model_desc.loss_scale_input = tg.LOSS_SCALE
            self.model_desc.all_finite = tg.ALL_FINITE
        if graph.accumulated:
            self.model_desc.gradient_accumulation = tg.accumulation_flag(graph.accumulated[0])
        self._drop_weight_copies()
        build.forward = self._forward_model
        logger.info("training session ready: %d trainable weights, %d frozen/constant initializers",
                    len(graph.weights), len(build.forward.graph.initializer) - len(graph.weights))

    def _cached_graphs_match(self, inputs, build, first):
        """Whether graphs from the export cache compute what the model does: their eval outputs on this
        call's inputs against one eager forward with the same weights, dropout off. For the first build
        any rank's mismatch counts on every rank (they all build it at once). On a mismatch this
        trainer's entries are deleted, one warning says so, and the graphs are dropped to be exported."""
        started = time.perf_counter()
        stale, found = self._factory.cache_mismatch(self._run("eval", inputs)[0], inputs, self._current_weights(),
                                                    everywhere=first)
        build.startup_seconds["export_cache_verify"] = time.perf_counter() - started
        if first:
            self.startup_seconds["export_cache_verify"] = build.startup_seconds["export_cache_verify"]
        if not stale:
            build.verified = True
            return True
        cache = self._graphs.cache
        if found:
            logger.warning("export cache entry %s did not match the model's eager outputs (output %r, "
                           "max diff %.3g): rebuilt", cache.path(build.signature), found[0], found[1])
        else:
            logger.warning("export cache entry %s rebuilt with the other ranks': another rank's entry did "
                           "not match the model's eager outputs", cache.path(build.signature))
        cache.invalidate()  # reads nothing more
        if first:
            self._forget_graphs()
            self._graphs = self._new_lifecycle()
            self._graphs.cache = cache
        else:
            self._graphs.forget(build)  # the state (trained weights) stays
        return False

    def _drop_weight_copies(self):
        """Replace the forward model by one whose trainable initializers are data-less stubs.

        A new model rather than cleared fields: protobuf keeps a message's memory until the whole
        message is freed. The caller's own ModelProto (ONNX-model trainers) is never modified.
        """
        self._trained_names = set(self._training_session.graph.weights)  # values: the session's, never the stubs'
        self._forward_model = without_data(self._forward_model, self._trained_names)

    def _apply_pending_load(self):
        """A load_state_dict() called before the session existed is applied now."""
        if self._load_state_dict is not None:
            pending, self._load_state_dict = self._load_state_dict, None
            pending()

    def _session_device_type(self):
        """'cuda' when the session will run on a CUDA device, else 'cpu' (engine/placement.py); never
        warns or raises: both belong to session creation."""
        return _placement.device_type(self.options)

    def _providers(self):
        """(providers, provider_options, torch device): the one placement decision (engine/placement.py)."""
        placement = _placement.from_options(self.options)
        if placement.fallback:
            _warn_cpu_fallback_once()
        return placement.session_arguments()

    # ================================================================== state
    def _current_weights(self):
        model_state = self._training_session.get_model_state(include_mixed_precision_weights=False)
        return dict(model_state.get(_utils.FULL_PRECISION_KEY, {}))

    def _kept_initializers(self):
        """Initializers that state_dict reports besides the trained weights: frozen_weights and the
        torch model's state keys (its buffers and frozen parameters)."""
        return set(self.options.utils.frozen_weights) | set(self._torch_state_keys)

    def _trainer_options_state(self):
        distributed = self.options.distributed
        return {
            "mixed_precision": bool(self.options.mixed_precision.enabled),
            "zero_stage": int(distributed.deepspeed_zero_optimization.stage),
            "world_rank": int(distributed.world_rank),
            "world_size": int(distributed.world_size),
            "optimizer_name": self.optim_config.name,
            # The legacy default 1 means "inferred": record the data-parallel group the run really had,
            # which checkpoint aggregation groups the rank files by.
            "data_parallel_size": int(distributed.world_size // (distributed.horizontal_parallel_size
                                      * distributed.pipeline_parallel.pipeline_parallel_size)),
            "horizontal_parallel_size": int(distributed.horizontal_parallel_size),
        }

    def _check_window_boundary(self):
        """Several ranks inside an accumulation window: each holds only its own unreduced part of the
        window's gradients, which no state_dict can carry; a resume from it would silently train a
        different run, so refuse (a warning in N ranks' logs is easy to miss)."""
        gas = self.options.batch.gradient_accumulation_steps
        micro = self._train_step_info.step % gas
        if self._group.active and micro:
            raise RuntimeError(
                f"state_dict()/save_checkpoint() on rank {self._group.rank} of {self._group.world_size} "
                f"{micro} micro-steps into an accumulation window of {gas}: the ranks' unreduced gradients "
                "cannot be saved, so a resume would train a different run. Call it after the window's last "
                "train_step (train_step_info.step a multiple of gradient_accumulation_steps); "
                "state_dict(pytorch_format=True) gives the current weights.")

    def _pending_accumulation(self):
        """Accumulated gradients of an unfinished window (exact mid-window resume needs them)."""
        runtime = self._training_session
        gas = self.options.batch.gradient_accumulation_steps
        if gas == 1 or self._train_step_info.step % gas == 0:
            return {}
        return {w: t.detach().cpu().numpy().copy() for w, t in runtime.accumulators().items()}

    def _load_state_dict_impl(self, state_dict, strict=True):
        """Check everything first, then apply: a rejected state_dict leaves the trainer unchanged.

        The original's steps and hooks (legacy-api.md §3.2): keys against `self.state_dict()`, model
        values to `_update_onnx_model_initializers`, optimizer states to `_init_session`, which loads
        both through `_training_session.load_state` (the upstream tests substitute all three)."""
        for key in (_utils.MODEL_KEY, _utils.OPTIMIZER_KEY, _utils.TRAIN_STEP_INFO_KEY):
            if key not in state_dict and (key != _utils.OPTIMIZER_KEY or self.optim_config.name != "SGDOptimizer"):
                warnings.warn(f"Missing key: {key} in state_dict", UserWarning)
        if strict:
            _load_checks.check_keys(self.state_dict(), state_dict,
                        allow_unexpected=self.options.distributed.deepspeed_zero_optimization.stage > 0)
        known = {i.name for i in _layout._initializers(self._forward_model)} | set(self._aliases)
        model_states = {}
        for precision, tensors in state_dict.get(_utils.MODEL_KEY, {}).items():
            for name, value in tensors.items():
                if name in known:
                    model_states[name] = value
                elif strict:
                    raise RuntimeError(f"Unexpected key: {name} in state_dict[{_utils.MODEL_KEY}][{precision}]")
        saved = state_dict.get(_utils.TRAINER_OPTIONS_KEY) or {}
        optimizer = state_dict.get(_utils.OPTIMIZER_KEY) or {}
        if optimizer and saved.get(_utils.OPTIMIZER_NAME_KEY) is not None:
            saved_name = _load_checks.as_python(saved[_utils.OPTIMIZER_NAME_KEY])
            if str(saved_name) != self.optim_config.name:  # not a bare assert: python -O must not skip it
                raise AssertionError(f"Optimizer mismatch: expected {self.optim_config.name}, got {saved_name}")
        info = state_dict.get(_utils.TRAIN_STEP_INFO_KEY)
        steps = _load_checks.check_step_info(info) if info is not None else None
        scaler_state = _load_checks.plain_dict(state_dict.get(LOSS_SCALER_KEY))
        if scaler_state is not None and self.loss_scaler is not None:
            _load_checks.checked_load(self.loss_scaler, scaler_state, LOSS_SCALER_KEY)
        counters = _load_checks.plain_dict(state_dict.get(MIXED_PRECISION_COUNTERS_KEY))
        if counters is not None and self.mixed_precision_counters is not None:
            _load_checks.checked_load(self.mixed_precision_counters, counters, MIXED_PRECISION_COUNTERS_KEY)

        self._update_onnx_model_initializers(model_states)
        saved_by = (int(_load_checks.as_python(saved.get(_utils.WORLD_RANK_KEY, -1))),
                    int(_load_checks.as_python(saved.get(_utils.WORLD_SIZE_KEY, -1))))
        self._init_session(optimizer, accumulation=state_dict.get(GRADIENT_ACCUMULATION_KEY) or {},
                           saved_by=saved_by)
        # ---- the rest cannot fail: every value was checked above
        if steps is not None:
            self._train_step_info.optimization_step, self._train_step_info.step = steps
        if scaler_state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        if counters is not None and self.mixed_precision_counters is not None:
            self.mixed_precision_counters.load_state_dict(counters)

    def _update_onnx_model_initializers(self, model_states):
        """The model values a load writes ({name: value}, the original's hook). Only staged here:
        `_init_session` checks them with the optimizer states and applies all or nothing."""
        self._staged_model_states = model_states

    def _init_session(self, optimizer_states, accumulation=None, saved_by=(-1, -1)):
        """Load the staged model values and these optimizer states (+ accumulated gradients) through
        `_training_session.load_state`; frozen values rebuild the session. Everything is checked
        (names, shapes, dtypes, ZeRO-1 segments) before anything changes."""
        model_states, self._staged_model_states = self._staged_model_states, {}
        session = self._training_session
        layout = session.layout
        model_states = {n: v for n, v in model_states.items() if n not in self._aliases}  # values come as the kept name
        frozen_now = _layout.initializer_values(self._forward_model, set(model_states) - layout.states)
        states, frozen = layout.checked_buffers(session.current, model_states, optimizer_states, frozen_now,
                                                saved_by, (self._group.rank, self._group.world_size))
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
        model = self._onnx_model  # current weights written in while a session can still give them
        old_values = dict(self._frozen_values)
        old_inits = _layout.initializer_values(model, frozen_updates)
        self._frozen_values.update(frozen_updates)
        _layout.write_initializers(model, frozen_updates)
        try:
            self._use(self._graphs.given(model))
        except BaseException:
            self._frozen_values.clear()  # in place: the GraphFactory shares this dict
            self._frozen_values.update(old_values)
            _layout.write_initializers(model, old_inits)
            self._use(self._graphs.given(model))  # the lifecycle kept the state: nothing is lost
            raise


LOSS_SCALER_KEY = "loss_scaler"
MIXED_PRECISION_COUNTERS_KEY = "mixed_precision_counters"
GRADIENT_ACCUMULATION_KEY = "gradient_accumulation"


def _torch_dtype(elem_type):
    """The torch dtype of an ONNX element type, None for types torch has no dtype for (e.g. strings)."""
    try:
        return _utils.dtype_onnx_to_torch(elem_type)
    except ValueError:
        return None


@functools.lru_cache(maxsize=None)
def _warn_cpu_fallback_once():
    warnings.warn("options.device.id is 'cuda' but no CUDA device is usable here; training on the CPU. "
                  "Set options.device.id='cpu' to silence this warning.", UserWarning)
