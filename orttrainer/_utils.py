"""State-dict key names and small converters shared by the trainer and the checkpoint code.

torch is imported inside the functions that need it, so that `orttrainer ckpt inspect`
(which only reads key names) stays light.
"""

import importlib.util
import os
import sys

import numpy as np

# Keys of the state dict (contract §1.11, §3.1).
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
PARTITION_INFO_KEY = "partition_info"
TRAINER_OPTIONS_KEY = "trainer_options"
FULL_PRECISION_KEY = "full_precision"
ORIGINAL_DIM_KEY = "original_dim"
MEGATRON_ROW_PARTITION_KEY = "megatron_row_partition"
SHARDED_OPTIMIZER_KEYS = frozenset({"Moment_1", "Moment_2"})
SHARED_OPTIMIZER_STATE_KEY = "shared_optimizer_state"
USER_DICT_KEY = "user_dict"
TRAIN_STEP_INFO_KEY = "train_step_info"
OPTIMIZATION_STEP_KEY = "optimization_step"
STEP_KEY = "step"
# trainer_options sub-keys
MIXED_PRECISION_KEY = "mixed_precision"
ZERO_STAGE_KEY = "zero_stage"
WORLD_RANK_KEY = "world_rank"
WORLD_SIZE_KEY = "world_size"
DATA_PARALLEL_SIZE_KEY = "data_parallel_size"
HORIZONTAL_PARALLEL_SIZE_KEY = "horizontal_parallel_size"
OPTIMIZER_NAME_KEY = "optimizer_name"


# The legacy accessors (tests and recipes call these).
def state_dict_model_key():
    return MODEL_KEY


def state_dict_optimizer_key():
    return OPTIMIZER_KEY


def state_dict_partition_info_key():
    return PARTITION_INFO_KEY


def state_dict_trainer_options_key():
    return TRAINER_OPTIONS_KEY


def state_dict_full_precision_key():
    return FULL_PRECISION_KEY


def state_dict_original_dimension_key():
    return ORIGINAL_DIM_KEY


def state_dict_sharded_optimizer_keys():
    return set(SHARDED_OPTIMIZER_KEYS)


def state_dict_user_dict_key():
    return USER_DICT_KEY


def state_dict_trainer_options_mixed_precision_key():
    return MIXED_PRECISION_KEY


def state_dict_trainer_options_zero_stage_key():
    return ZERO_STAGE_KEY


def state_dict_trainer_options_world_rank_key():
    return WORLD_RANK_KEY


def state_dict_trainer_options_world_size_key():
    return WORLD_SIZE_KEY


def state_dict_trainer_options_data_parallel_size_key():
    return DATA_PARALLEL_SIZE_KEY


def state_dict_trainer_options_horizontal_parallel_size_key():
    return HORIZONTAL_PARALLEL_SIZE_KEY


def state_dict_trainer_options_optimizer_name_key():
    return OPTIMIZER_NAME_KEY


def state_dict_train_step_info_key():
    return TRAIN_STEP_INFO_KEY


def state_dict_train_step_info_optimization_step_key():
    return OPTIMIZATION_STEP_KEY


def state_dict_train_step_info_step_key():
    return STEP_KEY


def intra_op_threads_per_rank():
    """onnxruntime intra-op threads for one of several ranks on this host: the cores this process may
    run on (its affinity) shared among torchrun's LOCAL_WORLD_SIZE ranks, at least 1. 0 (onnxruntime's
    default: a thread per core) for a single local rank: N ranks each taking every core oversubscribe."""
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local_ranks = 1
    if local_ranks <= 1:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_ranks)


def timeit(enabled=True):
    """Decorator that prints how long each call of the function took (a no-op with enabled=False)."""
    import functools
    import time

    def decorate(function):
        if not enabled:
            return function

        @functools.wraps(function)
        def timed(*args, **kwargs):
            started = time.time()
            result = function(*args, **kwargs)
            print(f"{function.__name__}: took {(time.time() - started) * 1000:.3f}ms to execute")
            return result
        return timed
    return decorate


def get_device_index(device):
    """'cuda:1' -> 1; 'cpu', 'cuda' (and any device without an index) -> 0."""
    import torch

    if isinstance(device, str):
        device = torch.device(device)
    return 0 if device.index is None else device.index


def get_device_index_from_input(input):
    """Device index of a tensor, or of the first tensor of a list/tuple."""
    if isinstance(input, (list, tuple)):
        input = input[0]
    return get_device_index(input.device)


def _session_output_name(session, part):
    names = [output.name for output in session._outputs_meta if part in output.name]
    if len(names) != 1:
        raise RuntimeError(f"'{part}' node not found within training session")
    return names[0]


def get_all_gradients_finite_name_from_session(session):
    """The one output of `session` (its `_outputs_meta`) whose name contains 'all_gradients_finite'."""
    return _session_output_name(session, "all_gradients_finite")


def get_gradient_accumulation_name_from_session(session):
    """The one output of `session` whose name contains 'Group_Accumulated_Gradients'."""
    return _session_output_name(session, "Group_Accumulated_Gradients")


def dtype_torch_to_numpy(torch_dtype):
    """numpy dtype for a torch dtype.

    Legacy mapping kept where numpy has no equivalent: bfloat16 -> float16 and
    complex32 -> complex64 (both lossy; callers that care must cast explicitly).
    Anything else numpy cannot hold (float8, ...) raises ValueError.
    """
    import torch

    mapping = {
        torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
        torch.bfloat16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
        torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
        torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64,
        torch.complex32: np.complex64, torch.complex64: np.complex64,
        torch.complex128: np.complex128, torch.bool: np.bool_,
    }
    try:
        return mapping[torch_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"torch_dtype ({torch_dtype}) type is not supported by Numpy") from None


# ONNX TensorProto.DataType numbers -> torch dtype attribute names. Unlike the original, unsigned
# types map to unsigned torch dtypes (torch has uint16/32/64 since 2.3) and BFLOAT16 to
# torch.bfloat16; STRING and the sub-byte types have no torch dtype and raise ValueError.
_ONNX_TO_TORCH = {
    1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
    9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64",
    15: "complex128", 16: "bfloat16", 17: "float8_e4m3fn", 18: "float8_e4m3fnuz",
    19: "float8_e5m2", 20: "float8_e5m2fnuz",
}
_ONNX_TYPE_NAMES = [
    "UNDEFINED", "FLOAT", "UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "STRING", "BOOL",
    "FLOAT16", "DOUBLE", "UINT32", "UINT64", "COMPLEX64", "COMPLEX128", "BFLOAT16",
    "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "UINT4", "INT4",
]


def dtype_onnx_to_torch(onnx_type):
    """torch dtype for an ONNX element type, given as its number or its name ('FLOAT', 'int64').

    UNDEFINED (0) -> None, as in the original.
    """
    if isinstance(onnx_type, str):
        name = onnx_type.upper()
        if name not in _ONNX_TYPE_NAMES:
            raise ValueError(f"Invalid onnx_type string {onnx_type!r}")
        onnx_type = _ONNX_TYPE_NAMES.index(name)
    elif not isinstance(onnx_type, int) or isinstance(onnx_type, bool):
        raise ValueError("'onnx_type' must be an ONNX type represented by either a string or integer")
    if onnx_type == 0:
        return None
    if onnx_type not in _ONNX_TO_TORCH:
        name = _ONNX_TYPE_NAMES[onnx_type] if 0 <= onnx_type < len(_ONNX_TYPE_NAMES) else onnx_type
        raise ValueError(f"ONNX type {name} has no torch dtype")
    import torch

    return getattr(torch, _ONNX_TO_TORCH[onnx_type])


def static_vars(**kwargs):
    """Decorator that sets `kwargs` as attributes of the decorated function."""

    def decorate(func):
        for key, value in kwargs.items():
            setattr(func, key, value)
        return func

    return decorate


def import_module_from_file(file_path, module_name=None):
    """Import the Python file at `file_path` as `module_name` (default: the file's stem)."""
    if not isinstance(file_path, (str, os.PathLike)) or not os.path.isfile(file_path):
        raise ValueError(f"'file_path' must be the path of an existing python file, got {file_path!r}")
    if module_name is not None and (not isinstance(module_name, str) or not module_name):
        raise ValueError(f"'module_name' must be a non-empty string, got {module_name!r}")
    module_name = module_name or os.path.basename(os.fspath(file_path)).split(".")[0]
    spec = importlib.util.spec_from_file_location(module_name, file_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
