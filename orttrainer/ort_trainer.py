"""The old class (`onnxruntime.capi.ort_trainer`, the seed API of 2020) on the engine of the new one.

`ORTTrainer` here keeps the old signature and behaviour (docs/legacy-api.md, "The old class") and translates
them into the new `orttrainer.ORTTrainer`, which does all the work:

- the learning rate is an input of every train_step (or `get_lr_this_step(global_step_)`): it is fed
  through the new trainer's per-step LR mechanism, `options.lr_scheduler`, by a scheduler that returns
  the value given for this step (`_FedLearningRate`);
- `map_optimizer_attributes(weight_name) -> dict` becomes parameter groups of the optimizer config;
- in mixed precision the loss scale is an input too (from the old `LossScaler`, or from the caller, who
  then gets `all_finite` back): it is fed through a new-class loss scaler that never updates itself;
  the old `LossScaler.update_loss_scale` rule runs here;
- state_dict / load_state_dict use the old flat `{name: tensor}` layout.
"""

import copy
import functools
import inspect
import types
import warnings

import onnx
import torch
from onnx import numpy_helper

from orttrainer import amp
from orttrainer import orttrainer as _new
from orttrainer._old_class.functions import (  # noqa: F401 (the old module's names)
    DEFAULT_OPSET_VERSION, CombineZeroCheckpoint, FuseSofmaxNLLToSoftmaxCE, IODescription, ModelDescription,
    WrapModel, _load_multi_checkpoint, _load_single_checkpoint, delete_input_with_name, dtype_torch_to_numpy,
    get_all_gradients_finite_arg_name, get_checkpoint_name, get_device_index,
    get_group_accumulated_gradients_output_node_arg_name, input_get_device_index, list_checkpoint_files,
    load_checkpoint, model_loss_cls, ort_training_session_run_helper, resolve_symbolic_dimensions, save_checkpoint,
    wrap_for_input_match,
)
from orttrainer._old_class.optim import optimizer_config, trainable_weights
from orttrainer.engine.runtime import input_checks as _checks
from orttrainer.optim.lr_scheduler import _LRScheduler
from orttrainer.orttrainer_options import ORTTrainerOptions

DEFAULT_LOSS_SCALE_INPUT_NAME = "default_loss_scale_input_name"  # the old kwarg for a caller-fed scale


def generate_sample(desc, device=None):
    """A random tensor for `desc`: randint(0, num_classes) when num_classes is set, randn otherwise."""
    size = [s if isinstance(s, int) else 1 for s in desc.shape_]
    if desc.num_classes_:
        return torch.randint(0, desc.num_classes_, size, dtype=desc.dtype_ or torch.int64).to(device)
    return torch.randn(size, dtype=desc.dtype_ or torch.float32).to(device)


class LossScaler:
    """The old loss scaler: doubles the scale after `up_scale_window` finite steps in a row, halves it
    on an overflow (never outside [min_loss_scale, max_loss_scale]); a static one never changes.
    `loss_scale_input_name` is kept but, as in the original, not used."""

    def __init__(self, loss_scale_input_name, is_dynamic_scale, loss_scale=float(1 << 16), up_scale_window=2000,
                 min_loss_scale=1.0, max_loss_scale=float(1 << 24)):
        self.loss_scale_input_name_ = loss_scale_input_name
        self.is_dynamic_scale_ = is_dynamic_scale
        self.initial_loss_scale_ = loss_scale
        self.up_scale_window_ = up_scale_window
        self.min_loss_scale_ = min_loss_scale
        self.max_loss_scale_ = max_loss_scale
        self.loss_scale_ = loss_scale
        self.stable_steps_ = 0

    def update_loss_scale(self, is_all_finite):
        if not self.is_dynamic_scale_:
            return
        if bool(is_all_finite):
            self.stable_steps_ += 1
            if self.stable_steps_ >= self.up_scale_window_:
                self.loss_scale_ = min(self.max_loss_scale_, self.loss_scale_ * 2)
                self.stable_steps_ = 0
        else:
            self.loss_scale_ = max(self.min_loss_scale_, self.loss_scale_ / 2)
            self.stable_steps_ = 0

    def reset(self):
        self.loss_scale_ = self.initial_loss_scale_
        self.stable_steps_ = 0


class _FedLearningRate(_LRScheduler):
    """The new trainer's per-step LR hook (options.lr_scheduler) returning the LR given for this step."""

    def __init__(self):
        super().__init__()
        self.value = None

    def get_lr(self, train_step_info):
        return [self.value]


def _scalar(name, value):
    """A number from the old LR / loss-scale input (a one-element tensor, or a plain number)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name!r} must hold one value (e.g. torch.tensor([0.001])), got shape "
                             f"{list(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name!r} must be a one-element tensor or a number, got {type(value).__name__}")
    value = float(value)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name!r} must be a finite number >= 0, got {value}")
    return value


class ORTTrainer:
    """The old `onnxruntime.capi.ort_trainer.ORTTrainer`; see the module docstring and docs/legacy-api.md."""

    def __init__(self, model, loss_fn, model_desc, training_optimizer_name, map_optimizer_attributes,
                 learning_rate_description, device, gradient_accumulation_steps=1, world_rank=0, world_size=1,
                 use_mixed_precision=False, allreduce_post_accumulation=False, global_step=0,
                 get_lr_this_step=None, loss_scaler=None, deepspeed_zero_stage=0, enable_grad_norm_clip=True,
                 frozen_weights=[], _opset_version=14, _enable_internal_postprocess=True,  # noqa: B006
                 _extra_postprocess=None, _use_deterministic_compute=False, use_memory_efficient_gradient=False,
                 run_symbolic_shape_infer=False, enable_adasum=False, optimized_model_filepath=""):
        if not isinstance(model_desc, ModelDescription):
            raise TypeError(f"'model_desc' must be an ort_trainer.ModelDescription, got {type(model_desc).__name__}")
        if not model_desc.outputs_:
            raise ValueError("'model_desc' has no outputs: the first output must be the loss")
        if not isinstance(learning_rate_description, IODescription):
            raise TypeError("'learning_rate_description' must be an IODescription, e.g. "
                            "IODescription('Learning_Rate', [1], torch.float32)")
        if loss_scaler is not None and not use_mixed_precision:
            # As in the original, which only read the scaler in mixed precision.
            warnings.warn("'loss_scaler' is ignored: use_mixed_precision is False")
        elif loss_scaler is not None and not (hasattr(loss_scaler, "loss_scale_")
                                              and callable(getattr(loss_scaler, "update_loss_scale", None))):
            # The original only read loss_scale_ and called update_loss_scale(all_finite): any such object works.
            raise TypeError("'loss_scaler' must have a 'loss_scale_' attribute and an "
                            "update_loss_scale(is_all_finite) method, like ort_trainer.LossScaler; "
                            f"got {type(loss_scaler).__name__}")
        if get_lr_this_step is not None and not callable(get_lr_this_step):
            raise TypeError("'get_lr_this_step' must be None or a callable global_step -> learning rate")
        if isinstance(model, onnx.ModelProto):
            loss_fn = None  # as in the original: the ONNX model computes the loss itself
        positional = isinstance(model, torch.nn.Module) and _needs_positional_inputs(model, loss_fn, model_desc)
        if positional:
            model = _positional(model)
        self.model_desc_ = model_desc
        self.learning_rate_description_ = learning_rate_description
        self.loss_scaler_ = loss_scaler
        self.get_lr_this_step_ = get_lr_this_step
        self.use_mixed_precision = use_mixed_precision
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.world_rank, self.world_size, self.deepspeed_zero_stage_ = world_rank, world_size, deepspeed_zero_stage
        self.device_ = torch.device(device)
        self.is_train = True

        config = optimizer_config(training_optimizer_name, map_optimizer_attributes,
                                  trainable_weights(model, frozen_weights))
        self._lr = _FedLearningRate()
        # Never updates itself: the scale is set before each step (old LossScaler or caller input).
        self._scale = amp.DynamicLossScaler(automatic_update=False, loss_scale=1.0) if use_mixed_precision else None
        extra = _extra_postprocess
        if extra is not None:
            # The old hook changed the model in place and returned None; the new one returns the model.
            def extra(model, _hook=_extra_postprocess):
                result = _hook(model)
                return model if result is None else result
        options = {
            "batch": {"gradient_accumulation_steps": gradient_accumulation_steps},
            "device": {"id": str(self.device_)},
            "distributed": {"world_rank": world_rank, "world_size": world_size,
                            "allreduce_post_accumulation": allreduce_post_accumulation,
                            "deepspeed_zero_optimization": {"stage": deepspeed_zero_stage},
                            "enable_adasum": enable_adasum},
            "lr_scheduler": self._lr,
            "mixed_precision": {"enabled": use_mixed_precision, "loss_scaler": self._scale},
            # The export cache keys on the model's code and the descriptions, not on how inputs are
            # matched to forward(): the old class's positional matching must not share its graphs.
            "utils": {"frozen_weights": list(frozen_weights), "grad_norm_clip": enable_grad_norm_clip,
                      "export_cache": not positional,
                      "memory_efficient_gradient": use_memory_efficient_gradient,
                      "run_symbolic_shape_infer": run_symbolic_shape_infer},
            "debug": {"deterministic_compute": _use_deterministic_compute,
                      "graph_save_paths": {
                          "model_with_training_graph_after_optimization_path": optimized_model_filepath}},
            "_internal_use": {"enable_internal_postprocess": _enable_internal_postprocess,
                              "extra_postprocess": extra, "onnx_opset_version": _opset_version},
        }
        if not use_mixed_precision:
            del options["mixed_precision"]["loss_scaler"]
        self._trainer = _new.ORTTrainer(model, _new_model_desc(model_desc), config, loss_fn=loss_fn,
                                        options=ORTTrainerOptions(options))
        self._trainer._train_step_info.optimization_step = int(global_step)

    # ------------------------------------------------------------------ legacy attributes
    @property
    def session(self):
        """The training session (legacy getters: get_state, ...); None before the first step."""
        return self._trainer._training_session

    @property
    def onnx_model_(self):
        """The forward ONNX model with the session's current weights; None before the export."""
        return self._trainer._onnx_model

    @property
    def global_step_(self):
        return self._trainer._train_step_info.optimization_step

    @global_step_.setter
    def global_step_(self, value):
        self._trainer._train_step_info.optimization_step = int(value)

    @property
    def current_step(self):
        return self._trainer._train_step_info.step

    @current_step.setter
    def current_step(self, value):
        self._trainer._train_step_info.step = int(value)

    @property
    def loss_scale_input_name(self):
        """The keyword that feeds the loss scale in mixed precision (the old LossScaler's name, or
        'loss_scale'); 'default_loss_scale_input_name' is accepted too, as in the original."""
        if not self.use_mixed_precision:
            return None
        # getattr: a scaler of another class, or a subclass that skips LossScaler.__init__, has no name
        return getattr(self.loss_scaler_, "loss_scale_input_name_", None) or "loss_scale"

    def train(self):
        self.is_train = True

    def eval(self):
        self.is_train = False

    def __call__(self, *args, **kwargs):
        return self.train_step(*args, **kwargs) if self.is_train else self.eval_step(*args, **kwargs)

    # ------------------------------------------------------------------ steps
    def train_step(self, *args, fetches=None, **kwargs):
        """Model inputs, then the learning rate, then (mixed precision) the loss scale, positionally or by
        name. Returns the described outputs; in mixed precision without a LossScaler `all_finite` is
        appended at an update step; with `fetches` only those outputs."""
        names = [d.name_ for d in self.model_desc_.inputs_]
        lr_name = self.learning_rate_description_.name_
        extra = [lr_name]
        if self.use_mixed_precision:
            scale_name = self.loss_scale_input_name
            if DEFAULT_LOSS_SCALE_INPUT_NAME in kwargs:
                kwargs[scale_name] = kwargs.pop(DEFAULT_LOSS_SCALE_INPUT_NAME)
            extra.append(scale_name)
        given = self._bind(args, kwargs, names + extra)
        if self.get_lr_this_step_ is not None and lr_name not in given:
            given[lr_name] = self.get_lr_this_step_(self.global_step_)
        if self.use_mixed_precision and self.loss_scaler_ is not None and scale_name not in given:
            given[scale_name] = self.loss_scaler_.loss_scale_
        missing = [n for n in names + extra if n not in given]
        if missing:
            raise ValueError(f"train_step is missing {missing}: it takes {names + extra} (model inputs, the "
                             "learning rate, and in mixed precision the loss scale), positionally or by name")
        lr = _scalar(lr_name, given[lr_name])
        if self.use_mixed_precision:
            scale = _scalar(scale_name, given[scale_name])
            if scale == 0:
                raise ValueError(f"{scale_name!r} must be a positive loss scale, got 0")
        # Checked, nothing changed yet: now set this step's LR and scale and run.
        self._lr.value = lr
        if self.use_mixed_precision:
            self._scale.loss_scale = scale
        info = self._trainer._train_step_info
        is_update = (info.step + 1) % self.gradient_accumulation_steps == 0
        outputs = self._run(self._trainer.train_step, [given[n] for n in names], fetches)
        if self.use_mixed_precision and is_update:
            all_finite = info.all_finite
            if self.loss_scaler_ is not None:
                self.loss_scaler_.update_loss_scale(all_finite)
            elif not fetches:
                outputs = (outputs if isinstance(outputs, list) else [outputs]) + [all_finite]
        return outputs

    def eval_step(self, *args, fetches=None, **kwargs):
        """Model inputs only (a prefix is enough when `fetches` does not need the rest); no counter changes."""
        names = [d.name_ for d in self.model_desc_.inputs_]
        given = self._bind(args, kwargs, names)
        return self._run(self._trainer.eval_step, [given[n] for n in names if n in given], fetches)

    def _bind(self, args, kwargs, names):
        if len(args) == 1 and isinstance(args[0], list):
            args = tuple(args[0])
        return _checks.bind_inputs(args, kwargs, names, takes="this step takes", listed="this step takes")

    def _run(self, step, inputs, fetches):
        info = self._trainer._train_step_info
        if fetches is not None:
            if isinstance(fetches, str) or not all(isinstance(f, str) for f in fetches):
                raise TypeError(f"'fetches' must be a list of output names, got {fetches!r}")
        saved = info.fetches
        info.fetches = list(fetches) if fetches else []
        try:
            return step(*inputs)
        finally:
            info.fetches = saved

    # ------------------------------------------------------------------ state
    def state_dict(self, include_optimizer_state=True):
        """A flat {name: CPU tensor}: the session's state (weights, optimizer state) and the other
        initializers; include_optimizer_state=False with a torch model keeps the torch state_dict keys."""
        session = self.session
        if session is None:
            warnings.warn("ONNXRuntime training session is not initialized yet. "
                          "Please run train_step or eval_step at least once before calling state_dict().")
            return {}
        state = {name: torch.from_numpy(value) for name, value in session.get_state().items()}
        for init in self.onnx_model_.graph.initializer:
            if init.name not in state:
                state[init.name] = torch.from_numpy(numpy_helper.to_array(init).copy())
        for alias, source in self._trainer._aliases.items():  # other names of tied torch weights
            if source in state:
                state.setdefault(alias, state[source])
        keys = self._trainer._torch_state_keys
        if not include_optimizer_state and keys:
            return {key: state[key] for key in keys if key in state}
        return state

    def load_state_dict(self, state_dict, strict=False):
        """Load a flat state_dict (before the first step it is kept and loaded when the session exists).
        strict=True: a name the model does not hold raises RuntimeError and nothing is loaded."""
        if self.session is None:
            # Loaded by the new trainer as soon as its session exists, before the first step runs.
            self._trainer._load_state_dict = functools.partial(self._load_flat, state_dict, strict)
            return
        self._load_flat(state_dict, strict)

    def _load_flat(self, state_dict, strict):
        self._trainer._load_state_dict_impl(self._nested(state_dict, strict), strict=False)

    def _nested(self, state_dict, strict):
        """The new trainer's layout for a flat old state_dict; unknown names checked (strict) first."""
        states = set(self.session.graph.states)
        initializers = {i.name for i in self._trainer._forward_model.graph.initializer}
        weights = set(self.session.graph.weights)
        model, optimizer = {}, {}
        for name, value in state_dict.items():
            if name.endswith("_fp16") and name[:-len("_fp16")] in weights:
                continue  # the mixed-precision copy of a weight (get_state's): made from the weight
            value = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
            if name in weights or (name in initializers and name not in states) or name in self._trainer._aliases:
                model[name] = value
            elif name in states:
                key, weight = _optimizer_key(name, weights)
                if weight is None:
                    optimizer.setdefault("shared_optimizer_state", {})[key] = value
                else:
                    optimizer.setdefault(weight, {})[key] = value
            elif strict:
                raise RuntimeError(f"Checkpoint tensor: {name} is not present in the model.")
        info = self._trainer._train_step_info
        nested = {"model": {"full_precision": model},
                  "train_step_info": {"optimization_step": info.optimization_step, "step": info.step}}
        if optimizer:
            nested["optimizer"] = optimizer
        return nested

    def save_as_onnx(self, path):
        """Write the forward ONNX model with the session's current weights."""
        if self.session is None:
            warnings.warn("ONNXRuntime training session is not initialized yet. "
                          "Please run train_step or eval_step at least once before calling save_as_onnx().")
            return
        with open(path, "wb") as f:
            f.write(self.onnx_model_.SerializeToString())


def _needs_positional_inputs(model, loss_fn, model_desc):
    """Whether the old class passed the inputs to forward() in order where the new class would match
    some of them by name. The old rule: by name only when every described input names a parameter of
    forward() (+ the loss_fn's label), there are fewer of them, and they are not already in order."""
    params = list(inspect.signature(model.forward).parameters)
    keys = params + (list(inspect.signature(loss_fn).parameters)[1:2] if loss_fn is not None else [])
    names = [d.name_ for d in model_desc.inputs_]
    old_by_name = len(names) < len(keys) and all(n in keys for n in names) and names != keys[:len(names)]
    new_by_name = any(p in names for p in params)
    model_names = names[:-1] if loss_fn is not None else names
    return not old_by_name and new_by_name and model_names != params[:len(model_names)]


def _positional(model):
    """The same module (same parameters, buffers and submodules: a shallow copy) whose forward takes
    its inputs in order, so that the new trainer's export passes them by position."""
    wrapped = copy.copy(model)
    # A bound method, so that a deep copy (the export's CPU copy of a CUDA model) calls its own copy.
    object.__setattr__(wrapped, "forward", types.MethodType(_forward_in_order, wrapped))
    return wrapped


def _forward_in_order(self, *inputs):
    return type(self).forward(self, *inputs)


def _optimizer_key(name, weights):
    """('Moment_1', weight) for 'Moment_1_<weight>', ('Step', None) for a shared state."""
    for prefix in ("Moment_1_", "Moment_2_", "Update_Count_"):
        if name.startswith(prefix) and name[len(prefix):] in weights:
            return prefix[:-1], name[len(prefix):]
    return name, None


def _new_model_desc(model_desc):
    """The new trainer's model_desc dict: the first output is the loss."""
    def shape(desc):
        return list(desc.shape_) if desc.shape_ is not None else []
    return {"inputs": [(d.name_, shape(d)) for d in model_desc.inputs_],
            "outputs": [(d.name_, shape(d), i == 0) for i, d in enumerate(model_desc.outputs_)]}


__all__ = ["IODescription", "LossScaler", "ModelDescription", "ORTTrainer", "generate_sample",
           "resolve_symbolic_dimensions"]
