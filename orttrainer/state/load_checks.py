"""Checks that `ORTTrainer.load_state_dict` runs on every value before it changes anything, so a
rejected state dict leaves the trainer as it was."""

import copy
import warnings

import numpy as np
import torch

from orttrainer import _utils

# dtype kinds a loaded value may have for a state of each kind: a float64 weight (numpy's default)
# loads into a float32 state, an integer never becomes a float, nor a float an integer.
_COMPATIBLE_KINDS = {"f": "f", "i": "iu", "u": "iu", "b": "b"}


def numpy_dtype(like):
    """The numpy dtype of a torch tensor or numpy array."""
    if isinstance(like, torch.Tensor):
        return torch.empty((), dtype=like.dtype).numpy().dtype
    return np.asarray(like).dtype


def compatible_dtype(dtype, target):
    """May a value of numpy `dtype` load into a state of numpy `target` (same kind: float into float,
    int into int; never an int or bool array for a float weight, which would become 0.0 / 1.0)?"""
    return np.dtype(dtype).kind in _COMPATIBLE_KINDS.get(np.dtype(target).kind, np.dtype(target).kind)


def check_dtype(name, value, like):
    """`value` as the dtype of `like`, or TypeError when the kinds differ (an int array for a float
    weight, strings, objects): the value would be converted into something else."""
    target = numpy_dtype(like)
    if not compatible_dtype(value.dtype, target):
        raise TypeError(f"State {name!r} has dtype {value.dtype} in the state_dict but {target} in this "
                        "trainer; the checkpoint is from a different model or was altered")
    return value.astype(target, copy=False)


def check_step_info(info):
    """(optimization_step, step) from state_dict['train_step_info'] as ints >= 0, else ValueError."""
    try:
        steps = tuple(int(np.asarray(info[key]).item()) for key in (_utils.OPTIMIZATION_STEP_KEY, _utils.STEP_KEY))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"state_dict[{_utils.TRAIN_STEP_INFO_KEY}] must hold integer "
                         f"'{_utils.OPTIMIZATION_STEP_KEY}' and '{_utils.STEP_KEY}', got {info!r} ({exc})") from None
    if min(steps) < 0:
        raise ValueError(f"state_dict[{_utils.TRAIN_STEP_INFO_KEY}] has negative step counts {steps}")
    return steps


def checked_load(obj, state, key):
    """Load `state` into a copy of `obj` (a loss scaler or counters) first: a bad value raises
    ValueError here, before the real object (which the caller loads next) is touched."""
    try:
        copy.deepcopy(obj).load_state_dict(state)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"state_dict[{key}] cannot be loaded: {type(exc).__name__}: {exc}") from None


def as_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def as_python(value):
    value = value.item() if hasattr(value, "item") else value
    return value.decode() if isinstance(value, bytes) else value


def checked(name, value, like):
    shape = tuple(like.shape)
    if tuple(value.shape) != shape:
        raise ValueError(f"State {name!r} has shape {list(value.shape)} in the state_dict but {list(shape)} "
                         "in this trainer; the checkpoint is from a different model")
    return check_dtype(name, value, like)


def plain_dict(state):
    return None if state is None else {k: as_python(v) for k, v in state.items()}


def check_keys(current, loaded, allow_unexpected):
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


def check_state_dict(state_dict, strict, optimizer_name, current, known, allow_unexpected):
    """The legacy checks of a whole state_dict (docs/legacy-api.md §3.2), before anything is changed:
    missing top-level keys warn; with `strict` the keys must equal `current()`'s (the trainer's own
    state_dict) and every model value must be one of the `known` initializer names; the saved
    optimizer name must be this trainer's. Returns (model values {name: value} among `known`,
    optimizer states, (rank, world size) that saved it or (-1, -1))."""
    for key in (_utils.MODEL_KEY, _utils.OPTIMIZER_KEY, _utils.TRAIN_STEP_INFO_KEY):
        if key not in state_dict and (key != _utils.OPTIMIZER_KEY or optimizer_name != "SGDOptimizer"):
            warnings.warn(f"Missing key: {key} in state_dict", UserWarning)
    if strict:
        check_keys(current(), state_dict, allow_unexpected=allow_unexpected)
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
        saved_name = as_python(saved[_utils.OPTIMIZER_NAME_KEY])
        if str(saved_name) != optimizer_name:  # not a bare assert: python -O must not skip it
            raise AssertionError(f"Optimizer mismatch: expected {optimizer_name}, got {saved_name}")
    saved_by = (int(as_python(saved.get(_utils.WORLD_RANK_KEY, -1))),
                int(as_python(saved.get(_utils.WORLD_SIZE_KEY, -1))))
    return model_states, optimizer, saved_by
