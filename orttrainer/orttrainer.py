"""`ORTTrainer`: the legacy frontend, driving one onnxruntime session per trainer.

Data path:  PyTorch model + loss_fn ──export (first step)──> forward ONNX model
            ──build_training_graph──> training graph ──Runtime──> train_step / eval_step
The engine's GraphLifecycle (`_graphs`) owns that path: it re-exports when a call's inputs need
sizes the exported graph baked in, keeps one session per such signature, and reads and writes the
export cache. State (weights, optimizer moments, counters) lives in one TrainingState of torch
tensors that every session shares; `_training_session` offers the legacy getters on it. `_onnx_model`
is the current forward model. While a session exists the forward model does not keep its own copy
of the trainable weights: it is rebuilt from the session's buffers when read (see `_onnx_model`).
"""

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import os
import re
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from . import _load_checks, _utils, checkpoint
from . import optim
from ._training_session import TrainingSession
from .amp import DynamicLossScaler
from .engine import checks as _checks
from .engine import distributed as _distributed
from .engine import export as _export
from .engine import export_cache as _export_cache
from .engine import precision as _precision
from .engine import torch_gelu_gradient as _gelu_gradient
from .engine import training_graph as tg
from .engine.lifecycle import GraphLifecycle
from .engine.session import Runtime, default_session_options
from .model_desc_validation import _ORTTrainerModelDesc
from .orttrainer_options import ORTTrainerOptions
from .postprocess import run_postprocess
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
        self._build = None  # the lifecycle's Build that serves the latest call
        self._training_session = None  # legacy getters over the state (TrainingSession), from the first build
        self._wrapper = None  # model + loss_fn as exported
        self._trained_names = set()  # trainable weights: data-less stubs in the forward model
        self._frozen_values = {}  # frozen initializers loaded by load_state_dict: override the model's on re-export
        self._input_dtypes = {}  # graph input name -> torch dtype, once the session exists
        self._load_state_dict = None
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
            self._onnx_model = self._postprocess(model)
            self._type_descriptions_from_onnx(check=True)
            self._graphs = self._new_lifecycle()
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
            self._update_onnx_model_initializers(self._current_weights())
        return self._forward_model

    @_onnx_model.setter
    def _onnx_model(self, model):
        self._forward_model = model

    def train_step(self, *args, **kwargs):
        """One training micro-step; every `gradient_accumulation_steps`-th call updates the weights.

        Returns the described outputs (loss first when a loss_fn is used) as torch tensors, or only
        `_train_step_info.fetches` when set; a single output is returned bare.
        """
        inputs = self._prepare_inputs(args, kwargs)
        first_step = "first_step" not in self.startup_seconds
        self._serve(inputs)
        started = time.perf_counter()
        _checks.check_ranges(self._index_ranges, inputs)
        fetches = self._check_fetches()
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
        inputs = self._prepare_inputs(args, kwargs)
        self._serve(inputs)
        _checks.check_ranges(self._index_ranges, inputs)
        fetches = self._check_fetches()
        outputs, _ = self._run("eval", inputs, fetches)
        return self._select(outputs)

    def save_as_onnx(self, path):
        """Write the forward model with the current (trained) weights to `path`."""
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
        """The trainer's state in the legacy layout (numpy arrays), or a flat torch dict of weights."""
        if self._training_session is None:
            warnings.warn(_NO_SESSION_STATE_DICT)
            return self._load_state_dict.args[0] if self._load_state_dict else {}
        # Built from the session's getters, as the original was (its tests mock them).
        session = self._training_session
        if pytorch_format:
            return self._to_pytorch_format(self._model_states())
        self._check_window_boundary()
        model_states = self._model_states()
        state = {_utils.MODEL_KEY: {_utils.FULL_PRECISION_KEY: model_states}}
        optimizer = session.get_optimizer_state()
        if optimizer:
            state[_utils.OPTIMIZER_KEY] = optimizer
        partition_info = session.get_partition_info_map()
        if partition_info:
            state[_utils.PARTITION_INFO_KEY] = partition_info
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

    # ================================================================== inputs and outputs
    def _prepare_inputs(self, args, kwargs):
        """Match positional and keyword inputs to model_desc; check types and shapes. Changes nothing."""
        if len(args) == 1 and isinstance(args[0], (list, tuple)) and not kwargs:
            args = tuple(args[0])
        names = [d.name for d in self.model_desc.inputs]
        if len(args) > len(names):
            raise ValueError(f"Got {len(args)} positional inputs but model_desc describes {len(names)}: {names}")
        given = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names:
                raise ValueError(f"Unexpected input {name!r}: model_desc inputs are {names}")
            if name in given:
                raise ValueError(f"Input {name!r} was given both positionally and by keyword")
            given[name] = value
        missing = [n for n in names if n not in given]
        if missing and not self._train_step_info.fetches:
            raise ValueError(f"Missing inputs {missing}: model_desc inputs are {names} "
                             "(positional arguments fill them in this order)")
        symbols = {}
        inputs = {}
        for desc in self.model_desc.inputs:
            if desc.name not in given:
                continue
            tensor = given[desc.name]
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"Input {desc.name!r} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dim() != len(desc.shape):
                raise ValueError(f"Input {desc.name!r} has shape {list(tensor.shape)} ({tensor.dim()} dims) but "
                                 f"model_desc describes {desc.shape} ({len(desc.shape)} dims)")
            for axis, (dim, size) in enumerate(zip(desc.shape, tensor.shape)):
                if isinstance(dim, int) and dim != size:
                    raise ValueError(f"Input {desc.name!r} has size {size} on axis {axis} but model_desc fixes it "
                                     f"to {dim} (shape {desc.shape}); use a symbolic name for a varying size")
                if isinstance(dim, str):
                    first = symbols.setdefault(dim, (size, desc.name, axis))
                    if first[0] != size:
                        raise ValueError(f"Dimension {dim!r} is {first[0]} in input {first[1]!r} (axis {first[2]}) "
                                         f"but {size} in input {desc.name!r} (axis {axis}) in the same call")
            expected = self._input_dtypes.get(desc.name)
            if expected is not None and tensor.dtype != expected:
                raise TypeError(f"Input {desc.name!r} has dtype {tensor.dtype} but the model expects {expected}; "
                                f"convert it with .to({expected})")
            inputs[desc.name] = tensor
        return inputs

    def _check_fetches(self):
        fetches = self._train_step_info.fetches
        if fetches:
            known = {o.name for o in self.model_desc.outputs}
            if any(name not in known for name in fetches):
                unknown = [name for name in fetches if name not in known]
                raise RuntimeError(f"The specified fetches list contains invalid output names: {unknown} "
                                   f"(outputs are {sorted(known)})")
        return fetches

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
    def _postprocess(self, model):
        internal = self.options._internal_use
        if internal.enable_internal_postprocess:
            model = run_postprocess(model)
        if internal.extra_postprocess is not None:
            model = internal.extra_postprocess(model)
            assert isinstance(model, onnx.ModelProto), "'extra_postprocess' must return an ONNX ModelProto"
        return model

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
            self._sample = (self._model_wrapper(), [inputs[n].detach().cpu().clone() for n in names if n in inputs])
        self._use(build)
        if first:
            self.startup_seconds.update(build.startup_seconds)
        cached = build.source == "export cache" and not build.verified
        if cached and not self._cached_graphs_match(inputs, build, first):
            return self._serve(inputs)  # exported again: this trainer reads nothing more from the cache
        if first:
            if self.options.debug.check_model_export:  # before a pending load: it compares initial weights
                try:
                    self._check_model_export(inputs, self.torch_sample_outputs)
                except RuntimeError:
                    # Forget the session so a retry exports and checks again instead of training it.
                    self._graphs = self._build = self._training_session = self._sample = None
                    self._onnx_model = None
                    self._input_dtypes = {}
                    raise
            self._apply_pending_load()

    def _new_lifecycle(self):
        if self._torch_model is None:  # an ONNX model: given, never exported
            return GraphLifecycle(build_graph=self._build_training_graph, make_runtime=self._make_runtime)
        symbols = {d.name: {axis: dim for axis, dim in enumerate(d.shape) if isinstance(dim, str)}
                   for d in self.model_desc.inputs}
        return GraphLifecycle(
            build_graph=self._build_training_graph, make_runtime=self._make_runtime, export=self._export,
            prepare=self._prepare_forward, symbols={n: axes for n, axes in symbols.items() if axes},
            cache=self._export_cache(), model_names=self._model_tensors())

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

    def _model_wrapper(self):
        if self._wrapper is None:
            self._wrapper = _export.ModelWithLoss(_on_cpu(self._torch_model), self.loss_fn,
                                                  [d.name for d in self.model_desc.inputs])
        return self._wrapper

    def _export(self, inputs):
        """The torch model (+ loss_fn) exported for these inputs, as the exporter wrote it."""
        names = [d.name for d in self.model_desc.inputs]
        sample = [inputs[n].detach().cpu() for n in names if n in inputs]
        wrapper = self._model_wrapper()
        described = [o.name for o in self.model_desc.outputs]
        dynamic_axes = {}
        for desc in list(self.model_desc.inputs) + list(self.model_desc.outputs):
            axes = {axis: dim for axis, dim in enumerate(desc.shape) if isinstance(dim, str)}
            if axes:
                dynamic_axes[desc.name] = axes
        try:
            outputs = _export.sample_outputs(wrapper, sample)
        except Exception as exc:
            raise _export_error(exc) from exc
        if len(outputs) != len(described):
            what = "loss_fn's loss + the model's outputs" if self.loss_fn else "the model"
            raise ValueError(f"{what} gave {len(outputs)} tensors but model_desc describes {len(described)} "
                             f"outputs {described}; describe every returned tensor, in order")
        _checks.check_outputs(self.model_desc.outputs, outputs, self.loss_fn is not None)
        try:
            with _export.contrib_ops(self.options._internal_use.enable_onnx_contrib_ops,
                                     self.options._internal_use.onnx_opset_version):
                return _export.export(wrapper, sample, names, described, dynamic_axes,
                                      self.options._internal_use.onnx_opset_version,
                                      compute_dtype=self._compute_dtype)
        except Exception as exc:
            raise _export_error(exc) from exc

    def _prepare_forward(self, exported):
        """An exported model made ready to train: postprocessed, frozen values loaded by
        load_state_dict written in, symbolic shapes inferred when the options ask."""
        model = self._postprocess(exported)
        for init in model.graph.initializer:
            if init.name in self._frozen_values:
                init.CopyFrom(numpy_helper.from_array(np.asarray(self._frozen_values[init.name]), init.name))
        if self.options.utils.run_symbolic_shape_infer:
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
            model = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
        return model

    def _model_tensors(self):
        """{initializer name: torch tensor} for every parameter and buffer of the torch model."""
        model = self._torch_model
        return dict(list(model.named_parameters(remove_duplicate=False)) +
                    list(model.named_buffers(remove_duplicate=False)))

    def _export_cache(self):
        """The export cache of this model and these options, or None when the options turn it off."""
        utils, paths = self.options.utils, self.options.debug.graph_save_paths
        if not utils.export_cache or paths.model_after_graph_transforms_path or \
                paths.model_with_gradient_graph_path or paths.model_with_training_graph_path:
            return None  # debug saves need the graphs really built
        tensors = self._model_tensors()

        def model_value(name):
            if name in self._frozen_values:
                return np.asarray(self._frozen_values[name])
            tensor = tensors.get(name)
            return None if tensor is None else tensor.detach().cpu().numpy()

        return _export_cache.ExportCache(utils.export_cache_dir or _export_cache.default_root(),
                                         self._graph_fingerprint(), model_value, utils.export_cache_max_bytes)

    def _graph_fingerprint(self):
        """A digest of everything that changes the exported and training graphs (export_cache.py)."""
        o, internal, distributed = self.options, self.options._internal_use, self.options.distributed
        without_lr = [{k: v for k, v in group.items() if k != "lr"} for group in
                      [self.optim_config.defaults] + list(self.optim_config.params)]
        return _export_cache.digest({
            "model": _export_cache.model_fingerprint(self._torch_model),
            "loss_fn": _export_cache.code_digest(self.loss_fn),
            "model_desc": [[d.name, d.shape] for d in self.model_desc.inputs] +
                          [[d.name, d.shape, d.is_loss] for d in self.model_desc.outputs],
            "optimizer": [self.optim_config.name, without_lr],
            "graph_options": [o.batch.gradient_accumulation_steps, o.utils.grad_norm_clip,
                              sorted(o.utils.frozen_weights), o.utils.run_symbolic_shape_infer,
                              o.mixed_precision.enabled, str(self._compute_dtype), o.debug.deterministic_compute,
                              dataclasses.asdict(tg.RecomputeOptions.from_graph_transformer(o.graph_transformer))],
            "export_options": [internal.enable_internal_postprocess,
                               _export_cache.code_digest(internal.extra_postprocess),
                               internal.onnx_opset_version, internal.enable_onnx_contrib_ops],
            # False where the PythonOp hook failed its check here: such a process builds GeluGrad graphs
            "gelu_gradient_in_torch": _gelu_gradient.enabled(),
            "distributed": [distributed.world_size, distributed.world_rank,
                            distributed.deepspeed_zero_optimization.stage],
            "versions": _export_cache.versions(),
        })

    def _cached_graphs_match(self, inputs, build, first):
        """Whether graphs from the export cache compute what the model does: their eval outputs on this
        call's inputs against one eager forward with the same weights, dropout off. For the first build
        any rank's mismatch counts on every rank (they all build it at once). On a mismatch this
        trainer's entries are deleted, one warning says so, and the graphs are dropped to be exported."""
        started = time.perf_counter()
        ort_outputs, _ = self._run("eval", inputs)
        weights = dict(self._current_weights(), **self._frozen_values)
        sample = [inputs[d.name].detach().cpu() for d in self.model_desc.inputs if d.name in inputs]
        found = _export_cache.mismatch_with_eager([o.name for o in self.model_desc.outputs], ort_outputs,
                                                  self._model_wrapper(), sample, weights, self._compute_dtype)
        stale = found is not None
        if first:
            stale = bool(self._group.all_reduce_(torch.tensor([float(stale)]), "export cache check").item())
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
            self._graphs = self._build = self._training_session = self._sample = None
            self._onnx_model = None
            self._input_dtypes = {}
            self._graphs = self._new_lifecycle()
            self._graphs.cache = cache
        else:
            self._graphs.forget(build)  # the state (trained weights) stays
        return False

    def _check_model_export(self, inputs, torch_outputs):
        ort_outputs, _ = self._run("eval", inputs)
        for name, expected, actual in zip([o.name for o in self.model_desc.outputs], torch_outputs, ort_outputs):
            try:
                np.testing.assert_allclose(expected.float().numpy(), actual.float().cpu().numpy(),
                                           rtol=1e-2, atol=1e-6)
            except AssertionError as exc:
                raise RuntimeError(
                    f"The exported ONNX model disagrees with PyTorch on output {name!r} (dropout off, first "
                    f"batch):\n{exc}\nThe export is likely wrong for this model; set "
                    "options.debug.check_model_export=False to train anyway.") from exc

    # ================================================================== session
    def _build_training_graph(self, model):
        """The training graph of a forward model (weights to train, distributed form, debug saves)."""
        losses = [o for o in self.model_desc.outputs if o.is_loss]
        assert len(losses) == 1, f"Only one loss output is supported ({len(losses)} were specified)"
        initializers = {i.name for i in model.graph.initializer}
        frozen = list(self.options.utils.frozen_weights)
        unused = [name for name in frozen if name not in initializers]
        if unused:
            raise RuntimeError(f"{unused} params from 'frozen_weights' not found in the ONNX model.")
        # The legacy trainer ignored group names matching no weight; a typo then trains with the
        # defaults unnoticed, so say so (a warning, not an error: such configs used to run).
        unknown = [n for group in self.optim_config.params for n in group["params"] if n not in initializers]
        if unknown:
            warnings.warn(f"{unknown} params from the optimizer's parameter groups not found in the ONNX "
                          "model; their groups' settings apply to nothing. Check the names against "
                          "model.named_parameters().", UserWarning)
        candidates = None
        if self._torch_model is not None:
            # Only torch parameters that require grad train; buffers and constants never do.
            candidates = {name for name, p in self._torch_model.named_parameters() if p.requires_grad}
        weights = tg.trainable_weights(model, frozen=set(frozen), candidates=candidates)
        paths = self.options.debug.graph_save_paths
        tg.save_debug_graph(model, paths.model_after_graph_transforms_path)
        graph = tg.build_training_graph(
            model, loss=losses[0].name, outputs=[o.name for o in self.model_desc.outputs], weights=weights,
            optim_config=self.optim_config,
            gradient_accumulation_steps=self.options.batch.gradient_accumulation_steps,
            grad_norm_clip=self.options.utils.grad_norm_clip,
            mixed_precision=self.options.mixed_precision.enabled,
            gradient_graph_path=paths.model_with_gradient_graph_path or None,
            partition=self._partition(model, weights),
            recompute=tg.RecomputeOptions.from_graph_transformer(self.options.graph_transformer),
            deterministic=self.options.debug.deterministic_compute,
        )
        tg.save_debug_graph(graph.model, paths.model_with_training_graph_path)
        return graph

    def _make_runtime(self, graph, state):
        """A session for `graph`; `state` (None for the first) is the trainer's shared TrainingState."""
        providers, provider_options, device = self._providers()
        with self._session_options() as session_options:
            runtime_options = dict(providers=providers, provider_options=provider_options,
                                   session_options=session_options, device=device, state=state)
            if graph.partition is None:
                # The torch model's own parameters become the trained weights (no second copy, as with
                # a torch optimizer); see docs/performance.md "Memory".
                adopt = None
                if state is None and self._torch_model is not None and self._share_module_parameters:
                    adopt = dict(self._torch_model.named_parameters())
                return Runtime(graph, adopt=adopt, **runtime_options)
            distributed = self.options.distributed
            return _distributed.DistributedRuntime(
                graph, self._group, gradient_accumulation_steps=self.options.batch.gradient_accumulation_steps,
                allreduce_post_accumulation=distributed.allreduce_post_accumulation,
                check_finite=self.loss_scaler is not None, **runtime_options)

    def _drop_weight_copies(self):
        """Replace the forward model by one whose trainable initializers are data-less stubs.

        A new model rather than cleared fields: protobuf keeps a message's memory until the whole
        message is freed. The caller's own ModelProto (ONNX-model trainers) is never modified.
        """
        weights = set(self._training_session.graph.weights)
        self._trained_names = weights  # their values are the session's (get_model_state), never the stubs'
        old = self._forward_model
        graph = onnx.GraphProto()
        for field, value in old.graph.ListFields():
            if field.name != "initializer":
                _copy_field(graph, field, value)
        for init in old.graph.initializer:
            if init.name in weights:
                graph.initializer.add(name=init.name, dims=init.dims, data_type=init.data_type)
            else:
                graph.initializer.append(init)
        model = onnx.ModelProto()
        for field, value in old.ListFields():
            if field.name != "graph":
                _copy_field(model, field, value)
        model.graph.CopyFrom(graph)
        self._forward_model = model

    def _apply_pending_load(self):
        """A load_state_dict() called before the session existed is applied now."""
        if self._load_state_dict is not None:
            pending, self._load_state_dict = self._load_state_dict, None
            pending()

    def _partition(self, model, weights):
        """The distributed form of the graph (tg.Partition), or None for one process without ZeRO.

        Several ranks, or ZeRO stage 1 even on one (the legacy trainer ran it), build the form whose
        gradients torch.distributed reduces between runs; ZeRO-1 updates only this rank's segments.
        """
        zero = self.options.distributed.deepspeed_zero_optimization.stage > 0
        if not self._group.active and not zero:
            return None
        if not zero:
            return tg.Partition()
        shapes = {i.name: tuple(i.dims) for i in model.graph.initializer if i.name in set(weights)}
        layout = _distributed.FlatLayout({w: shapes[w] for w in weights}, self._group.world_size)
        return tg.Partition({s.weight: s for s in layout.segments(self._group.rank)})

    @contextlib.contextmanager
    def _session_options(self):
        """The SessionOptions to create a session with: the user's (options.session_options) or the
        trainer's defaults, plus what the trainer needs. SessionOptions cannot be copied, so the
        user's object carries those settings only while the session is created (onnxruntime copies
        the options then) and gets its own values back afterwards."""
        options = self.options.session_options
        if options is None:
            options = default_session_options()
        settings = {}
        if self.options.debug.deterministic_compute:
            settings["use_deterministic_compute"] = True
        threads = _utils.intra_op_threads_per_rank()
        if threads and options.intra_op_num_threads == 0:  # a thread count the user chose is kept
            settings["intra_op_num_threads"] = threads
        path = self.options.debug.graph_save_paths.model_with_training_graph_after_optimization_path
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if os.path.isdir(folder) and os.access(folder, os.W_OK):
                settings["optimized_model_filepath"] = path
            else:  # onnxruntime would fail the session; the original ignored failed debug dumps
                warnings.warn(f"Could not save the optimized graph to {path!r} (its folder does not exist or "
                              "is not writable); training continues without it.")
        saved = {name: getattr(options, name) for name in settings}
        try:
            for name, value in settings.items():
                setattr(options, name, value)
            yield options
        finally:
            for name, value in saved.items():
                setattr(options, name, value)

    def _session_device_type(self):
        """'cuda' when the session will run on a CUDA device (as `_providers` decides), else 'cpu';
        without `_providers`' CPU-fallback warning, which belongs to session creation."""
        if self.options._validated_opts.get("provider_options"):
            return "cpu"  # custom providers: the trainer's tensors live on the CPU
        cuda_ready = torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()
        return "cuda" if self.options.device.id.startswith("cuda") and cuda_ready else "cpu"

    def _providers(self):
        """(providers, provider_options, torch device) from options.device / provider_options."""
        device_id = self.options.device.id
        available = ort.get_available_providers()
        cuda_ready = torch.cuda.is_available() and "CUDAExecutionProvider" in available
        custom = self.options._validated_opts.get("provider_options") or {}
        if custom:
            providers = list(custom) + (["CPUExecutionProvider"] if "CPUExecutionProvider" not in custom else [])
            return providers, [custom.get(p, {}) for p in providers], torch.device("cpu")
        if device_id.startswith("cuda"):
            if cuda_ready:
                index = _utils.get_device_index(device_id)
                cuda_options = {"device_id": index}
                if self.options.device.mem_limit > 0:
                    cuda_options["gpu_mem_limit"] = self.options.device.mem_limit
                return (["CUDAExecutionProvider", "CPUExecutionProvider"], [cuda_options, {}],
                        torch.device("cuda", index))
            if device_id != "cuda":
                raise RuntimeError(f"options.device.id is {device_id!r} but no CUDA device is usable here "
                                   f"(torch.cuda.is_available()={torch.cuda.is_available()}, onnxruntime "
                                   f"providers {available}); use 'cpu' or 'cuda' (which falls back to the CPU).")
            _warn_cpu_fallback_once()
        elif device_id != "cpu":
            raise ValueError(f"options.device.id {device_id!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'")
        return ["CPUExecutionProvider"], [{}], torch.device("cpu")

    # ================================================================== state
    def _current_weights(self):
        model_state = self._training_session.get_model_state(include_mixed_precision_weights=False)
        return dict(model_state.get(_utils.FULL_PRECISION_KEY, {}))

    def _model_states(self, values=True):
        """Trainable weights (the session's get_model_state), frozen weights / buffers that the torch
        model (or options) names, and the other names of tied weights (so a checkpoint converts to a
        complete torch state_dict).
        values=False: the same keys with None values (a layout to check a load against, no copies)."""
        states = self._current_weights() if values else dict.fromkeys(self._training_session.graph.weights)
        frozen = set(self.options.utils.frozen_weights) | set(self._torch_state_keys)
        for init in self._forward_model.graph.initializer:  # frozen ones always hold their data
            if init.name in frozen and init.name not in states and init.name not in self._trained_names:
                states[init.name] = numpy_helper.to_array(init).copy() if values else None
        for alias, source in self._aliases.items():
            if source in states:
                states[alias] = states[source]
        return states

    def _to_pytorch_format(self, model_states):
        order = self._torch_state_keys + [name for name in model_states if name not in self._torch_state_keys]
        return {name: torch.from_numpy(model_states[name]) for name in order if name in model_states}

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

    def _own_segment(self, weight, name, value, state_dict):
        """A loaded moment in the form this trainer keeps: its ZeRO-1 segment, or the whole weight.

        A whole moment (one process's checkpoint, or rank files merged by load_checkpoint) is cut to
        this rank's segment, so any world size resumes any other; a flat moment of a whole weight (a
        one-rank ZeRO-1 state) is reshaped. A partial segment is taken as is only from this same rank
        of the same world size.
        """
        if not name.startswith(("Moment_1_", "Moment_2_")):
            return value  # counters: one value per weight (or shared), never partitioned
        numel = self._training_session.current(weight).numel()
        partition = self._training_session.graph.partition
        segment = partition.segments.get(weight) if partition is not None and partition.segments else None
        if segment is None:
            if value.ndim == 1 and value.size == numel:
                return value.reshape(self._training_session.current(name).shape)
            if value.size == numel:
                return value
            start, stop = 0, numel
        else:
            if value.size == numel:
                return np.ascontiguousarray(value.reshape(-1)[segment.start:segment.stop])
            saved = state_dict.get(_utils.TRAINER_OPTIONS_KEY, {})
            theirs = (int(_as_python(saved.get(_utils.WORLD_RANK_KEY, -1))),
                      int(_as_python(saved.get(_utils.WORLD_SIZE_KEY, -1))))
            if value.shape == (segment.size,) and theirs == (self._group.rank, self._group.world_size):
                return value
            start, stop = segment.start, segment.stop
        raise ValueError(
            f"State {name!r} has {value.size} elements: a ZeRO-1 segment of another rank or world size; this "
            f"trainer (rank {self._group.rank} of {self._group.world_size}) keeps elements {start}:{stop} of "
            f"{weight!r}. Load every rank's file with load_checkpoint(*rank_files): they are merged and re-cut "
            "for this world size.")

    def _update_onnx_model_initializers(self, state_tensors):
        """Write {name: array} into the forward model's initializers (names it does not hold are skipped)."""
        for init in self._forward_model.graph.initializer:
            if init.name in state_tensors:
                init.CopyFrom(numpy_helper.from_array(np.asarray(state_tensors[init.name]), init.name))

    def _load_state_dict_impl(self, state_dict, strict=True):
        """Check everything first, then apply: a rejected state_dict leaves the trainer unchanged."""
        runtime = self._training_session
        # The keys the trainer would save, without copying any tensor (loads of large models).
        current = {_utils.MODEL_KEY: {_utils.FULL_PRECISION_KEY: self._model_states(values=False)}}
        optimizer_layout = self._training_session.optimizer_layout()
        if optimizer_layout:
            current[_utils.OPTIMIZER_KEY] = optimizer_layout
        for key in (_utils.MODEL_KEY, _utils.OPTIMIZER_KEY,
                    _utils.TRAIN_STEP_INFO_KEY):
            if key not in state_dict and (key != _utils.OPTIMIZER_KEY or
                                          key in current):
                warnings.warn(f"Missing key: {key} in state_dict", UserWarning)
        if strict:
            _check_keys(current, state_dict, allow_unexpected=self.options.distributed.deepspeed_zero_optimization.stage > 0)

        states, frozen_updates = {}, {}
        model_key = _utils.MODEL_KEY
        initializers = {i.name: i for i in self._forward_model.graph.initializer}  # only frozen ones are read
        for precision, tensors in state_dict.get(model_key, {}).items():
            for name, value in tensors.items():
                value = _as_numpy(value)
                if name in self._aliases:
                    continue  # another name of a tied weight: its value arrives under the kept name
                if name in runtime.graph.states:
                    states[name] = _checked(name, value, runtime.current(name))
                elif name in initializers:
                    frozen_updates[name] = _checked(name, value, numpy_helper.to_array(initializers[name]))
                elif strict:
                    raise RuntimeError(f"Unexpected key: {name} in state_dict[{model_key}][{precision}]")

        optimizer = state_dict.get(_utils.OPTIMIZER_KEY)
        if optimizer:
            saved_name = state_dict.get(_utils.TRAINER_OPTIONS_KEY, {}).get(
                _utils.OPTIMIZER_NAME_KEY)
            if saved_name is not None:
                saved_name = saved_name.decode() if isinstance(saved_name, bytes) else str(saved_name)
                if saved_name != self.optim_config.name:  # not a bare assert: python -O must not skip it
                    raise AssertionError(f"Optimizer mismatch: expected {self.optim_config.name}, got {saved_name}")
            for weight, per_weight in optimizer.items():
                for key, value in per_weight.items():
                    name = key if weight == "shared_optimizer_state" else f"{key}_{weight}"
                    if name in runtime.graph.states:
                        value = self._own_segment(weight, name, _as_numpy(value), state_dict)
                        states[name] = _checked(name, value, runtime.current(name))

        accumulation = {}
        for weight, value in (state_dict.get(GRADIENT_ACCUMULATION_KEY) or {}).items():
            if weight in runtime.graph.accumulated:
                accumulation[weight] = _checked(f"{weight} (accumulated gradient)", _as_numpy(value),
                                                runtime.current(weight))
        info = state_dict.get(_utils.TRAIN_STEP_INFO_KEY)
        steps = _load_checks.check_step_info(info) if info is not None else None
        scaler_state = _plain_dict(state_dict.get(LOSS_SCALER_KEY))
        if scaler_state is not None and self.loss_scaler is not None:
            _load_checks.checked_load(self.loss_scaler, scaler_state, LOSS_SCALER_KEY)
        counters = _plain_dict(state_dict.get(MIXED_PRECISION_COUNTERS_KEY))
        if counters is not None and self.mixed_precision_counters is not None:
            _load_checks.checked_load(self.mixed_precision_counters, counters, MIXED_PRECISION_COUNTERS_KEY)

        # ---- apply (nothing above changed the trainer)
        if frozen_updates:
            self._rebuild_with_frozen_values(frozen_updates)
        self._training_session.load_state(states, strict=True)
        self._training_session.load_accumulators(accumulation)
        if steps is not None:
            self._train_step_info.optimization_step, self._train_step_info.step = steps
        if scaler_state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        if counters is not None and self.mixed_precision_counters is not None:
            self.mixed_precision_counters.load_state_dict(counters)

    def _rebuild_with_frozen_values(self, frozen_updates):
        """Frozen values are constants of every session: rebuild the current one (the state is kept)
        and write them into every later export too. A failed rebuild restores the old constants and
        session, so the trainer stays usable and unchanged."""
        model = self._onnx_model  # current weights written in while a session can still give them
        old_values = dict(self._frozen_values)
        old_inits = {i.name: numpy_helper.to_array(i).copy() for i in model.graph.initializer
                     if i.name in frozen_updates}
        self._frozen_values.update(frozen_updates)
        self._update_onnx_model_initializers(frozen_updates)
        try:
            self._use(self._graphs.given(model))
        except BaseException:
            self._frozen_values = old_values
            self._update_onnx_model_initializers(old_inits)
            self._use(self._graphs.given(model))  # the lifecycle kept the state: nothing is lost
            raise


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


LOSS_SCALER_KEY = "loss_scaler"
MIXED_PRECISION_COUNTERS_KEY = "mixed_precision_counters"
GRADIENT_ACCUMULATION_KEY = "gradient_accumulation"


def _torch_dtype(elem_type):
    """The torch dtype of an ONNX element type, None for types torch has no dtype for (e.g. strings)."""
    try:
        return _utils.dtype_onnx_to_torch(elem_type)
    except ValueError:
        return None


def _as_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _as_python(value):
    value = value.item() if hasattr(value, "item") else value
    return value.decode() if isinstance(value, bytes) else value


def _checked(name, value, like):
    shape = tuple(like.shape)
    if tuple(value.shape) != shape:
        raise ValueError(f"State {name!r} has shape {list(value.shape)} in the state_dict but {list(shape)} "
                         "in this trainer; the checkpoint is from a different model")
    return _load_checks.check_dtype(name, value, like)


def _plain_dict(state):
    return None if state is None else {k: _as_python(v) for k, v in state.items()}


def _check_keys(current, loaded, allow_unexpected):
    """Legacy strict-key rules: missing keys always fail, unexpected ones unless ZeRO is on."""
    def compare(mine, theirs, where):
        missing = [k for k in mine if k not in theirs]
        if missing:
            raise RuntimeError(f"Missing keys: {missing} in {where}")
        unexpected = [k for k in theirs if k not in mine]
        if unexpected and not allow_unexpected:
            raise RuntimeError(f"Unexpected keys: {unexpected} in {where}")

    model_key, optimizer_key = _utils.MODEL_KEY, _utils.OPTIMIZER_KEY
    if model_key in loaded:
        compare(current[model_key], loaded[model_key], f"state_dict[{model_key}]")
        for precision, tensors in current[model_key].items():
            compare(tensors, loaded[model_key][precision], f"state_dict[{model_key}][{precision}]")
    if optimizer_key in loaded and optimizer_key in current:
        compare(current[optimizer_key], loaded[optimizer_key], f"state_dict[{optimizer_key}]")
        for weight, states in current[optimizer_key].items():
            compare(states, loaded[optimizer_key][weight], f"state_dict[{optimizer_key}][{weight}]")


def _on_cpu(model):
    """`model` when every parameter and buffer is on the CPU, else a CPU copy of it (the export runs
    on the CPU; the caller's model stays where the caller put it). Copied tensor by tensor, so a
    CUDA model is not first duplicated on its device."""
    params, buffers = list(model.parameters()), list(model.buffers())
    if all(t.device.type == "cpu" for t in params + buffers):
        return model
    memo = {id(p): torch.nn.Parameter(p.detach().cpu(), requires_grad=p.requires_grad) for p in params}
    memo.update({id(b): b.detach().cpu() for b in buffers})
    return copy.deepcopy(model, memo)


def _export_error(exc):
    return RuntimeError(
        f"Exporting the model to ONNX failed: {exc}\nThings to try: check that model_desc input names match "
        "forward() parameter names; make forward() return tensors (or tuples/dicts of them); try another "
        "_internal_use.onnx_opset_version; replace unsupported operators.")


@functools.lru_cache(maxsize=None)
def _warn_cpu_fallback_once():
    warnings.warn("options.device.id is 'cuda' but no CUDA device is usable here; training on the CPU. "
                  "Set options.device.id='cpu' to silence this warning.", UserWarning)
