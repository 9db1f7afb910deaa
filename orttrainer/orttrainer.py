"""`ORTTrainer`: the legacy frontend, driving one onnxruntime session per trainer (one per stage under
pipeline parallel, engine/parallel/pipeline_stage.py). Data path: PyTorch model + loss_fn ──export (first step)──>
forward ONNX model ──build_training_graph──> training graph ──Runtime──> train_step / eval_step.
The facade keeps the public API, the legacy attributes and the order of a step; each part it delegates
to owns one job (docs/engine.md, "Who owns what"): TrainerGraphs (`_trainer/graphs.py`) which session
serves a call (the GraphFactory and the engine's GraphLifecycle, the forward model, running, loading);
StepAccounting (`_trainer/steps.py`) TrainStepInfo, learning rate, loss scaler, counters;
`_training_session` (TrainingSession) the only way state_dict/load_state_dict reach the state, through
a StateLayout (`state/layout.py`); `state/load_checks.py` checks a load before it changes anything.
"""

import functools
import inspect
import os
import time
import warnings

import onnx
import onnxruntime as ort
import torch

from orttrainer import _checkpoint_storage, _utils, amp, checkpoint, optim, postprocess
from orttrainer.state import load_checks as _load_checks  # noqa: F401
from orttrainer.state import layout as _layout
from orttrainer._trainer.steps import StepAccounting
from orttrainer._trainer.graphs import TrainerGraphs
from orttrainer.engine.runtime import input_checks as _checks
from orttrainer.state import megatron as _tp_state
from orttrainer.engine.parallel import megatron as _megatron
from orttrainer.engine.parallel import pipeline_stage as _pipeline
from orttrainer.placement import device as _placement
from orttrainer.engine.graph import precision as _precision
from orttrainer.engine.graph import torch_matmul as _torch_matmul
from orttrainer.engine.kernels.choice import Kernels
from orttrainer.placement import process_group as _process_group
from orttrainer.placement.dims import ParallelDims
from orttrainer.placement.device import warn_cpu_fallback_once as _warn_cpu_fallback_once  # noqa: F401 (tests reset it)
from orttrainer.model_desc_validation import _ORTTrainerModelDesc
from orttrainer.orttrainer_options import ORTTrainerOptions
from orttrainer.train_step_info import TrainStepInfo

__all__ = ["ORTTrainer", "TrainStepInfo"]

# onnxruntime logs ~20 INFO lines per session by default.
ort.set_default_logger_severity(3)

GRADIENT_ACCUMULATION_KEY = "gradient_accumulation"
_NO_SESSION_STATE_DICT = ("ONNX Runtime training session is not initialized yet. Please run train_step or "
                          "eval_step at least once before calling ORTTrainer.state_dict().")
_NO_SESSION_SAVE_AS_ONNX = ("Training session is not initialized yet. 'train_step' or 'eval_step' methods must be "
                            "executed at least once before calling 'save_as_onnx()'.")


class _Kept:
    """A legacy attribute that one of the trainer's parts keeps: reads and writes go to that part."""

    def __init__(self, part, name):
        self.part, self.name = part, name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(getattr(trainer, self.part), self.name)

    def __set__(self, trainer, value):
        setattr(getattr(trainer, self.part), self.name, value)


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
    # the module keeps its initial values, as the original trainer did). Read at the first step.
    _share_module_parameters = True

    # Legacy and private attributes kept by the parts (tests, scripts and orttrainer.run read them).
    _train_step_info = _Kept("_steps", "info")
    loss_scaler = _Kept("_steps", "loss_scaler")
    mixed_precision_counters = _Kept("_steps", "counters")
    _training_session = _Kept("_g", "training_session")
    _graphs = _Kept("_g", "graphs")
    _build = _Kept("_g", "build")
    _factory = _Kept("_g", "factory")
    _forward_model = _Kept("_g", "forward_model")  # the forward model without its trained weights
    _sample = _Kept("_g", "sample")
    _aliases = _Kept("_g", "aliases")
    _torch_state_keys = _Kept("_g", "torch_state_keys")

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
        if not isinstance(model, (torch.nn.Module, onnx.ModelProto)):
            raise ValueError("'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'")
        assert loss_fn is None or isinstance(model, torch.nn.Module), (
            "'loss_fn' must not be specified when 'model' is an ONNX model")
        self.optim_config = optim_config
        self.loss_fn = loss_fn
        self.options = options if options is not None else ORTTrainerOptions()
        self.is_rocm_pytorch = False
        self._torch_model = model if isinstance(model, torch.nn.Module) else None
        self._load_state_dict = None  # a load_state_dict() deferred until the first build (legacy)
        self._staged_model_states = {}  # model values of a load in progress (_update_onnx_model_initializers)
        self._closed = False
        # The process group (torch.distributed) when the options ask for several ranks; a mismatch with
        # the launcher is an error here, before any work.
        self._dims = ParallelDims.of(self.options.distributed)  # every rank's place (placement/dims.py)
        device = self._providers()[2] if self._dims.world_size > 1 else torch.device("cpu")
        world = _process_group.setup_process_group(self.options.distributed, device, self._dims)
        self._group = _megatron.data_parallel_group(world, self._dims)
        mixed = self.options.mixed_precision
        # float32, or float16/bfloat16 when mixed precision computes in it (docs/engine.md); checked
        # here so that bfloat16 on the CPU fails before any work.
        device_type = self._session_device_type()
        compute_dtype = _precision.resolve_compute_dtype(
            mixed.compute_dtype, enabled=mixed.enabled, device_type=device_type,
            torch_model=self._torch_model is not None)
        self._compute_dtype = compute_dtype
        self._steps = StepAccounting(optim_config, self.options, self.model_desc, compute_dtype,
                                     self._dims.data)
        self._g = TrainerGraphs(self.model_desc, optim_config, loss_fn, self.options, self._torch_model,
                                self._group, _precision.export_dtype(compute_dtype, device_type), self.loss_scaler,
                                kernels=Kernels.of(compute_dtype, device_type))
        # None: no pipeline parallel
        self._pipeline = _pipeline.Pipeline.of(self._g, self._group.rank, self._dims)
        self.startup_seconds = self._g.startup_seconds  # every build's: _graphs.builds
        if self._torch_model is None:
            self._g.given_model(model)

    # ================================================================== public API
    @property
    def torch_sample_outputs(self):
        """The PyTorch model's outputs (loss first with a loss_fn) on the first batch, dropout off.

        The original kept these tensors alive for the trainer's life (125 MB of logits for a BERT
        batch); they are recomputed from the kept first batch on access instead. None before export.
        """
        return self._g.sample_outputs()

    @torch_sample_outputs.setter
    def torch_sample_outputs(self, value):
        self._g.given_sample_outputs = value

    @property
    def _onnx_model(self):
        """The forward ONNX model (legacy attribute), its trainable weights as the session holds them now.

        The original kept the initial weights here for the trainer's life, next to the session's
        trained copy (20 MB for the GPT benchmark model, 43 MB for BERT). This trainer drops that copy
        once the session exists and writes the current weights in whenever the model is read, so a
        reader always sees the trained values. The engine's own readers use `_forward_model`.
        """
        return self._g.onnx_model()

    @_onnx_model.setter
    def _onnx_model(self, model):
        self._g.forward_model = model

    def train_step(self, *args, **kwargs):
        """One training micro-step; every `gradient_accumulation_steps`-th call updates the weights.

        Returns the described outputs (loss first when a loss_fn is used) as torch tensors, or only
        `_train_step_info.fetches` when set; a single output is returned bare.
        """
        self._check_open()
        inputs = self._match_inputs(args, kwargs)
        if self._pipeline is not None:  # this rank's stage runs the whole step (engine/parallel/pipeline_stage.py)
            return self._select(self._pipeline.step("train", inputs, self._train_step_info.fetches, self._steps))
        first_step = "first_step" not in self.startup_seconds
        self._serve(inputs)
        started = time.perf_counter()
        _checks.check_ranges(self._g.index_ranges, inputs)
        fetches = _checks.check_fetches(self._train_step_info.fetches, self.model_desc.outputs)
        step = self._steps.next_step()
        outputs = self._steps.run_counted(lambda: self._g.run("train", inputs, fetches, **step), step, fetches)
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

    @property
    def compute_dtype(self):
        """The torch dtype the graph's matmuls compute in: float32, or what mixed_precision.compute_dtype
        resolved to on this host. Not in the legacy class (an addition, for benchmarks and reports)."""
        return self._compute_dtype

    @property
    def matmul_kernels(self):
        """How many matrix products of the training graph each kernel computes: {"mlas": n,
        "torch_float32": n, "torch_bfloat16": n} (docs/performance.md, "Matmul kernels"); None before the
        first step or under pipeline parallel. Not in the legacy class (an addition, for benchmarks and
        reports)."""
        model = self.training_model
        return None if model is None else _torch_matmul.kernel_counts(model)

    @property
    def training_model(self):
        """The onnx.ModelProto of the training graph the session runs (forward, gradient and optimizer);
        None before the first step or under pipeline parallel (each stage runs its own). Read it, do not
        change it. Not in the legacy class (an addition, for benchmarks and reports)."""
        runtime = self._training_session
        return None if runtime is None else runtime.graph.model

    @property
    def step_seconds(self):
        """Seconds spent so far in the parts of the training steps, where a parallel runtime keeps them: data
        parallel {'micro', 'communication', 'apply'}, pipeline parallel {'step', 'wait' (on the other stages),
        'forward' (the forward-only runs)}; {} otherwise. A copy. Not in the legacy class (an addition)."""
        part = self._pipeline if self._pipeline is not None else self._training_session
        return dict(getattr(part, "seconds", None) or {})

    def eval_step(self, *args, **kwargs):
        """Forward only, dropout off; changes no weight, optimizer state or counter."""
        self._check_open()
        inputs = self._match_inputs(args, kwargs)
        if self._pipeline is not None:
            return self._select(self._pipeline.step("eval", inputs, self._train_step_info.fetches))
        self._serve(inputs)
        _checks.check_ranges(self._g.index_ranges, inputs)
        fetches = _checks.check_fetches(self._train_step_info.fetches, self.model_desc.outputs)
        outputs, _ = self._g.run("eval", inputs, fetches)
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
        self._g.drop_weight_copies()

    def state_dict(self, pytorch_format=False):
        """The trainer's state in the legacy layout (numpy arrays), or a flat torch dict of weights.

        Read through `_training_session`'s getters, as the original was (its tests substitute the session)."""
        self._check_open()
        if self._pipeline is not None and self._pipeline.runtime is not None:  # this rank's stage
            return self._pipeline.state_dict(self._steps, self._group, self.optim_config.name, pytorch_format)
        session = self._training_session
        if session is None:
            warnings.warn(_NO_SESSION_STATE_DICT)
            return self._load_state_dict.args[0] if self._load_state_dict else {}
        model = self._g.model_state()
        if pytorch_format:
            _tp_state.warn_incomplete(self.options)
            return _layout.to_pytorch(model[_utils.FULL_PRECISION_KEY], self._torch_state_keys)
        self._steps.check_window_boundary(self._group)
        state = {_utils.MODEL_KEY: model, _utils.OPTIMIZER_KEY: session.get_optimizer_state()}
        _tp_state.add_partition_info(state, self.options, session, self._g.factory)
        state[_utils.TRAINER_OPTIONS_KEY] = _layout.trainer_options_state(self.options, self.optim_config.name)
        state.update(self._steps.state_dict())
        if self._steps.micro_step and (pending := self._g.pending_accumulation()):
            state[GRADIENT_ACCUMULATION_KEY] = pending  # an exact mid-window resume needs them
        return state

    def load_state_dict(self, state_dict, strict=True):
        """Load a state_dict; before the first step the load is deferred to session creation."""
        self._check_open()
        if self._pipeline is not None:  # this stage's part (state/pipeline.py)
            return self._pipeline.load_state_dict(state_dict, strict, self._steps, self.optim_config.name)
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
        self._g.forget()
        self._g.factory = self._load_state_dict = self._pipeline = None
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

    # ================================================================== delegated steps
    def _match_inputs(self, args, kwargs):
        return _checks.match_inputs(self.model_desc.inputs, self._g.input_dtypes, args, kwargs,
                                    allow_missing=bool(self._train_step_info.fetches))

    @staticmethod
    def _select(outputs):
        return outputs[0] if len(outputs) == 1 else outputs

    def _serve(self, inputs):
        """Make current the session that serves these inputs (TrainerGraphs); after the first build a
        deferred load_state_dict is applied."""
        self._g.adopt_parameters = self._share_module_parameters  # may be set per trainer until then
        if self._g.serve(inputs) and self._load_state_dict is not None:
            pending, self._load_state_dict = self._load_state_dict, None
            pending()

    def _training_spec(self):
        """What shapes the graphs (TrainingSpec), from the options as they are now."""
        return self._g.spec()

    def _providers(self):
        """(providers, provider_options, torch device): the one placement decision (placement/device.py)."""
        return _placement.arguments(self.options)

    def _session_device_type(self):
        """'cuda' when the session will run on a CUDA device, else 'cpu'; never warns or raises."""
        return _placement.device_type(self.options)

    # ================================================================== loading (legacy hooks)
    def _load_state_dict_impl(self, state_dict, strict=True):
        """Check everything first, then apply: a rejected state_dict leaves the trainer unchanged.

        The original's steps and hooks (docs/legacy-api.md §3.2): keys against `self.state_dict()`, model
        values to `_update_onnx_model_initializers`, optimizer states to `_init_session`, which loads
        both through `_training_session.load_state` (the upstream tests substitute all three)."""
        state_dict = _tp_state.own_shards(state_dict, self.options, self._g.factory)  # H > 1: re-cut
        model_states, optimizer, saved_by = _load_checks.check_state_dict(
            state_dict, strict, self.optim_config.name, current=self.state_dict, known=self._g.known_names(),
            allow_unexpected=self.options.distributed.deepspeed_zero_optimization.stage > 0)
        apply_steps = self._steps.checked_load(state_dict)
        self._update_onnx_model_initializers(model_states)
        self._init_session(optimizer, accumulation=state_dict.get(GRADIENT_ACCUMULATION_KEY) or {},
                           saved_by=saved_by)
        apply_steps()  # cannot fail: every value was checked above

    def _update_onnx_model_initializers(self, state_tensors):
        """The model values a load writes ({name: value}, the original's hook). Only staged here:
        `_init_session` checks them with the optimizer states and applies all or nothing."""
        self._staged_model_states = state_tensors

    def _init_session(self, optimizer_states, accumulation=None, saved_by=(-1, -1)):
        """Load the staged model values and these optimizer states (+ accumulated gradients) through
        `_training_session.load_state` (TrainerGraphs.load); frozen values rebuild the session."""
        model_states, self._staged_model_states = self._staged_model_states, {}
        self._g.load(model_states, optimizer_states, accumulation, saved_by)
