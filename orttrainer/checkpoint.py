"""Merging per-rank checkpoint files, and the deprecated "experimental" checkpoint API.

`aggregate_checkpoints(paths)` merges the HDF5 files that the ranks of a ZeRO-1 and/or Megatron
run saved (contract §3.4). Unlike the original, the order of `paths` does not matter, and a
missing or duplicated rank, mismatched trainer options or a replicated tensor that differs
across ranks raise `ValueError` (also an `AssertionError`, the type the original raised) naming
the file and the tensor.

This module does not import the trainer (nor torch until a function needs it): the command line
and the trainer both build on it.
"""

import enum
import os
import re
import warnings

import numpy as np

from orttrainer import _checkpoint_storage
from orttrainer._utils import (
    DATA_PARALLEL_SIZE_KEY, FULL_PRECISION_KEY, HORIZONTAL_PARALLEL_SIZE_KEY,
    MEGATRON_ROW_PARTITION_KEY, MIXED_PRECISION_KEY, MODEL_KEY, OPTIMIZER_KEY,
    OPTIMIZER_NAME_KEY, ORIGINAL_DIM_KEY, PARTITION_INFO_KEY, SHARDED_OPTIMIZER_KEYS,
    SHARED_OPTIMIZER_STATE_KEY, TRAIN_STEP_INFO_KEY, TRAINER_OPTIONS_KEY, USER_DICT_KEY,
    WORLD_RANK_KEY, WORLD_SIZE_KEY, ZERO_STAGE_KEY,
)

__all__ = [
    "aggregate_checkpoints", "experimental_state_dict", "experimental_load_state_dict",
    "experimental_save_checkpoint", "experimental_load_checkpoint",
]


class _CheckpointError(ValueError, AssertionError):
    """Bad or inconsistent checkpoint files. A ValueError; also an AssertionError because the
    original raised bare assertions here and existing callers may catch those."""


class _AGGREGATION_MODE(enum.Enum):
    Zero = 0
    Megatron = 1


# trainer_options entries that every rank file of one run must share, with the original's wording.
_SHARED_OPTIONS = {
    MIXED_PRECISION_KEY: "Mixed precision state",
    WORLD_SIZE_KEY: "World size state",
    ZERO_STAGE_KEY: "Zero stage",
    OPTIMIZER_NAME_KEY: "Optimizer name",
    DATA_PARALLEL_SIZE_KEY: "Data parallel size",
    HORIZONTAL_PARALLEL_SIZE_KEY: "Horizontal parallel size",
}
# Top-level entries aggregation handles itself; any other entry (user_dict, train_step_info,
# loss_scaler, lr_scheduler, ...) is carried over from the first rank that has it.
_AGGREGATED_KEYS = {MODEL_KEY, OPTIMIZER_KEY, PARTITION_INFO_KEY, TRAINER_OPTIONS_KEY}


# --------------------------------------------------------------------------------------------
# The file side of ORTTrainer.save_checkpoint / load_checkpoint (contract §3.3)
# --------------------------------------------------------------------------------------------

def _save_checkpoint(state_dict, path, user_dict=None, include_optimizer_states=True, overwrite=False):
    """Write `state_dict` (ORTTrainer.state_dict() layout) and `user_dict` to the HDF5 file `path`,
    atomically; an existing `path` raises FileExistsError unless `overwrite=True`."""
    state = dict(state_dict)  # the caller's dict is left as it was
    if user_dict:
        state[USER_DICT_KEY] = _checkpoint_storage.encode_user_dict(user_dict)
    if not include_optimizer_states:
        state.pop(OPTIMIZER_KEY, None)
    _checkpoint_storage.save(state, path, overwrite=overwrite)


def _load_checkpoint(paths, allow_unsafe_pickle=False):
    """Read what ORTTrainer.load_checkpoint(*paths) loads: returns (state_dict, user_dict).

    Rank files of a ZeRO or Megatron run are aggregated (always, as in the original); otherwise
    exactly one file is expected. Everything is read and checked before the caller changes any
    state. A pickled user_dict goes through the restricted unpickler unless allow_unsafe_pickle.
    """
    if not paths:
        raise ValueError("load_checkpoint needs at least one checkpoint file")
    try:
        options = _checkpoint_storage.load(paths[0], key=TRAINER_OPTIONS_KEY)
    except KeyError:
        raise _CheckpointError(f"Missing information: trainer_options in checkpoint file {paths[0]}; "
                               "it was not written by ORTTrainer.save_checkpoint") from None
    if (_to_int(options.get(ZERO_STAGE_KEY, 0)) > 0
            or _to_int(options.get(HORIZONTAL_PARALLEL_SIZE_KEY, 1)) > 1):
        state_dict = aggregate_checkpoints(paths, pytorch_format=False)
    elif len(paths) != 1:
        raise _CheckpointError(f"Expected number of files to load: 1, got {len(paths)} ({paths[0]} is not "
                               "a ZeRO or Megatron rank file)")
    else:
        state_dict = _checkpoint_storage.load(paths[0])
    user_dict = {}
    if USER_DICT_KEY in state_dict:
        user_dict = _checkpoint_storage.decode_user_dict(state_dict.pop(USER_DICT_KEY),
                                                         allow_unsafe_pickle=allow_unsafe_pickle)
    return state_dict, user_dict


# --------------------------------------------------------------------------------------------
# aggregate_checkpoints
# --------------------------------------------------------------------------------------------

def aggregate_checkpoints(paths, pytorch_format=True):
    """Merge the per-rank checkpoint files `paths` (any order) into one state dict.

    ZeRO-1 runs (zero_stage > 0): the files of data-parallel group 0 are merged; Megatron runs
    (horizontal_parallel_size > 1): the files of horizontal group 0; both: every data-parallel
    group is merged, then the results are merged in Megatron mode. Sharded tensors are
    concatenated in rank order (axis 0; the last axis for Megatron weights with
    megatron_row_partition == 0) and reshaped to their `original_dim`; replicated tensors must be
    equal on every rank.

    Returns the ORTTrainer.state_dict() layout (trainer_options of a single-process run; any other
    top-level entry such as user_dict comes from the first rank that has it) or, with
    `pytorch_format=True`, a flat {name: torch.Tensor} of the full-precision weights.
    Returns None, like the original, when the files are neither ZeRO nor Megatron shards: such a
    file is already complete (`_checkpoint_storage.load` reads it).
    """
    paths = [os.fspath(path) if isinstance(path, os.PathLike) else path for path in paths]
    if not paths:
        raise ValueError("aggregate_checkpoints needs at least one checkpoint file")
    reference = _read_trainer_options(paths[0])
    world_size = _to_int(reference[WORLD_SIZE_KEY])
    D = _to_int(reference[DATA_PARALLEL_SIZE_KEY])
    H = _to_int(reference[HORIZONTAL_PARALLEL_SIZE_KEY])
    if min(world_size, D, H) < 1 or world_size % D or world_size % H:
        raise _CheckpointError(
            f"Inconsistent trainer_options in {paths[0]}: world_size {world_size} is not a multiple "
            f"of data_parallel_size {D} and horizontal_parallel_size {H}")
    data_groups, horizontal_groups = _get_parallelism_groups(D, H, world_size)
    rank_paths = _paths_by_rank(paths, reference, world_size)

    combine_zero = _to_int(reference[ZERO_STAGE_KEY]) > 0
    combine_megatron = len(horizontal_groups[0]) > 1
    if combine_zero and combine_megatron:
        needed = [rank for group in horizontal_groups[0] for rank in data_groups[group]]
    elif combine_zero:
        needed = data_groups[0]
    elif combine_megatron:
        needed = horizontal_groups[0]
    else:
        return None
    missing = sorted(set(needed) - set(rank_paths))
    if missing:
        raise _CheckpointError(
            f"Missing checkpoint file for rank(s) {missing}: merging this run (world_size {world_size}, "
            f"data_parallel_size {D}, horizontal_parallel_size {H}) needs ranks {sorted(needed)}; "
            f"got ranks {sorted(rank_paths)} from {paths}")

    if combine_zero and combine_megatron:
        return _aggregate_over_D_H(rank_paths, data_groups, horizontal_groups, pytorch_format)
    mode = _AGGREGATION_MODE.Zero if combine_zero else _AGGREGATION_MODE.Megatron
    return _aggregate_over_ranks(_load_ranks(rank_paths, needed), needed, mode=mode,
                                 pytorch_format=pytorch_format)


def _read_trainer_options(path):
    try:
        options = _checkpoint_storage.load(path, key=TRAINER_OPTIONS_KEY)
    except KeyError:
        raise _CheckpointError(f"Missing information: trainer_options in checkpoint file {path}") from None
    options = dict(options)
    # Files from before Megatron support have no parallel sizes: plain data parallelism.
    options.setdefault(HORIZONTAL_PARALLEL_SIZE_KEY, 1)
    if WORLD_SIZE_KEY in options:
        options.setdefault(DATA_PARALLEL_SIZE_KEY, _to_int(options[WORLD_SIZE_KEY]))
    missing = [key for key in (WORLD_RANK_KEY, *_SHARED_OPTIONS) if key not in options]
    if missing:
        raise _CheckpointError(f"Missing information: trainer_options {missing} in checkpoint file {path}")
    return options


def _paths_by_rank(paths, reference, world_size):
    """{world_rank: path}, checking every file's trainer_options against paths[0]'s."""
    by_rank = {}
    for path in paths:
        options = _read_trainer_options(path)
        _check_same_options(path, options, paths[0], reference)
        rank = _to_int(options[WORLD_RANK_KEY])
        if not 0 <= rank < world_size:
            raise _CheckpointError(f"Unexpected rank in file at path {path}: world_rank {rank} is outside "
                                   f"0..{world_size - 1}")
        if rank in by_rank:
            raise _CheckpointError(f"Duplicate rank {rank}: {by_rank[rank]} and {path} both hold "
                                   f"world_rank {rank}")
        by_rank[rank] = path
    return by_rank


def _check_same_options(path, options, reference_path, reference):
    for key, label in _SHARED_OPTIONS.items():
        value, expected = _plain(options.get(key)), _plain(reference.get(key))
        if value != expected:
            raise _CheckpointError(f"{label} mismatch among checkpoint files. File: {path} has "
                                   f"{key}={value!r}, {reference_path} has {expected!r}")


def _get_parallelism_groups(data_parallel_size, horizontal_parallel_size, world_size):
    """Ranks of each data-parallel group and of each horizontal (Megatron) group."""
    D, H = data_parallel_size, horizontal_parallel_size
    data_groups = [[group + H * r for r in range(D)] for group in range(world_size // D)]
    horizontal_groups = [[group * H + r for r in range(H)] for group in range(world_size // H)]
    return data_groups, horizontal_groups


def _load_ranks(rank_paths, ranks):
    # A generator: one rank file in memory at a time.
    return ((rank_paths[rank], _checkpoint_storage.load(rank_paths[rank])) for rank in ranks)


def _aggregate_over_D_H(rank_paths, data_groups, horizontal_groups, pytorch_format):
    """ZeRO + Megatron: merge each data-parallel group (keeping the Megatron partition_info), then
    merge those partial results over horizontal group 0 in Megatron mode. The original wrote the
    partial results to temporary files; they are kept in memory here, one at a time."""
    original_dims = {}

    def partial_results():
        # Data group g starts with rank g, so its partial result has world_rank g, which is what
        # horizontal group 0 ([0, .., H-1]) expects.
        for group in horizontal_groups[0]:
            ranks = data_groups[group]
            label = f"data group {group} (ranks {ranks}: {', '.join(rank_paths[r] for r in ranks)})"
            yield label, _aggregate_over_ranks(_load_ranks(rank_paths, ranks), ranks, original_dims,
                                               partial_aggregation=True, pytorch_format=False)

    return _aggregate_over_ranks(partial_results(), horizontal_groups[0], original_dims,
                                 mode=_AGGREGATION_MODE.Megatron, pytorch_format=pytorch_format)


def _aggregate_over_ranks(sources, ranks, sharded_states_original_dims=None, mode=_AGGREGATION_MODE.Zero,
                          partial_aggregation=False, pytorch_format=True):
    """Merge `sources`, (name, rank state dict) pairs in the order of `ranks`, into one state dict.

    `sharded_states_original_dims` collects {weight: original_dim} across calls (D+H merging);
    `partial_aggregation` keeps the Megatron partition_info and skips the final reshape.
    """
    state_dict = {}
    original_dims = {} if sharded_states_original_dims is None else sharded_states_original_dims
    first = None  # what later ranks are checked against: (name, trainer_options, train_step_info)
    first_name, mixed_precision = None, False
    for (name, rank_state), rank in zip(sources, ranks):
        _check_rank_state(name, rank_state, rank, first)
        if first is None:
            first = (name, rank_state[TRAINER_OPTIONS_KEY], rank_state.get(TRAIN_STEP_INFO_KEY))
            first_name = name
            mixed_precision = bool(_plain(first[1][MIXED_PRECISION_KEY]))
        _aggregate_model_states(rank_state, original_dims, state_dict, mixed_precision, mode,
                                path=name, reference_path=first_name)
        if pytorch_format:
            continue
        _aggregate_optimizer_states(rank_state, original_dims, state_dict, mode,
                                    path=name, reference_path=first_name)
        if partial_aggregation:
            _aggregate_megatron_partition_info(rank_state, state_dict)
        if TRAINER_OPTIONS_KEY not in state_dict:
            _aggregate_trainer_options(rank_state, state_dict, partial_aggregation)
        for key, value in rank_state.items():
            if key not in _AGGREGATED_KEYS:
                state_dict.setdefault(key, value)

    if not partial_aggregation:
        _reshape_states(original_dims, state_dict, mixed_precision)
    return _to_pytorch_format(state_dict) if pytorch_format else state_dict


def _check_rank_state(name, rank_state, expected_rank, first):
    for key in (PARTITION_INFO_KEY, TRAINER_OPTIONS_KEY):
        if key not in rank_state:
            raise _CheckpointError(f"Missing information: {key} in {name}")
    options = rank_state[TRAINER_OPTIONS_KEY]
    rank = _to_int(options.get(WORLD_RANK_KEY, -1))
    if rank != expected_rank:
        raise _CheckpointError(f"Unexpected rank in file at path {name}. Expected {expected_rank}, "
                               f"got {rank}")
    if first is None:
        return
    first_name, first_options, first_step_info = first
    _check_same_options(name, options, first_name, first_options)
    step_info = _plain(rank_state.get(TRAIN_STEP_INFO_KEY))
    first_step_info = _plain(first_step_info)
    if step_info is not None and first_step_info is not None and step_info != first_step_info:
        raise _CheckpointError(f"train_step_info mismatch among checkpoint files (saved at different "
                               f"steps?). File: {name} has {step_info}, {first_name} has {first_step_info}")


def _aggregate_model_states(rank_state_dict, sharded_states_original_dims, state_dict,
                            mixed_precision_enabled, mode=_AGGREGATION_MODE.Zero, path=None,
                            reference_path=None):
    """Merge the rank's model states into state_dict: weights listed in partition_info are shards
    in Megatron mode, and in ZeRO mode with mixed precision when they are smaller than their
    original_dim (the original partitioned the fp32 master copies then; this trainer's ranks hold
    every weight whole, which partition_info's original_dim shows); other weights are replicas
    that must be equal."""
    if MODEL_KEY not in rank_state_dict:
        return
    merged = state_dict.setdefault(MODEL_KEY, {}).setdefault(FULL_PRECISION_KEY, {})
    partition_info = rank_state_dict.get(PARTITION_INFO_KEY, {})
    for name, value in rank_state_dict[MODEL_KEY].get(FULL_PRECISION_KEY, {}).items():
        sharded = name in partition_info and (
            mode is _AGGREGATION_MODE.Megatron
            or (mixed_precision_enabled and not _is_whole(value, partition_info[name])))
        if sharded:
            _add_or_update_sharded_key(name, value, merged, name, partition_info[name],
                                       sharded_states_original_dims, mode, path=path)
        else:
            _add_or_validate_unsharded_key(name, value, merged, f"Value mismatch for model state {name}",
                                           path=path, reference_path=reference_path)


def _aggregate_optimizer_states(rank_state_dict, sharded_states_original_dims, state_dict,
                                mode=_AGGREGATION_MODE.Zero, path=None, reference_path=None):
    """Merge the rank's optimizer states: Moment_1/Moment_2 of partitioned weights are shards;
    everything else (Update_Count, Step, moments of whole weights) must be equal on every rank."""
    if OPTIMIZER_KEY not in rank_state_dict:
        return
    merged = state_dict.setdefault(OPTIMIZER_KEY, {})
    partition_info = rank_state_dict.get(PARTITION_INFO_KEY, {})
    for weight, states in rank_state_dict[OPTIMIZER_KEY].items():
        merged_states = merged.setdefault(weight, {})
        for key, value in states.items():
            if key in SHARDED_OPTIMIZER_KEYS and weight in partition_info:
                _add_or_update_sharded_key(key, value, merged_states, weight, partition_info[weight],
                                           sharded_states_original_dims, mode, path=path)
            else:
                message = f"Value mismatch for model state {weight} and optimizer state {key}"
                _add_or_validate_unsharded_key(key, value, merged_states, message,
                                               path=path, reference_path=reference_path)


def _is_whole(value, partition_info):
    """True when `value` holds every element of its weight (original_dim), not a ZeRO shard."""
    return np.size(value) == int(np.prod(np.ravel(partition_info[ORIGINAL_DIM_KEY])))


def _add_or_update_sharded_key(state_key, state_value, state_sub_dict, model_state_key, state_partition_info,
                               sharded_states_original_dims, mode, path=None):
    original_dim = np.ravel(state_partition_info[ORIGINAL_DIM_KEY])
    sharded_states_original_dims[model_state_key] = [int(d) for d in original_dim]
    axis = 0
    if (mode is _AGGREGATION_MODE.Megatron
            and _first_int(state_partition_info[MEGATRON_ROW_PARTITION_KEY]) == 0):
        axis = -1  # column partition
    if state_key not in state_sub_dict:
        state_sub_dict[state_key] = state_value
        return
    try:
        state_sub_dict[state_key] = np.concatenate((state_sub_dict[state_key], state_value), axis)
    except ValueError as exc:
        what = state_key if state_key == model_state_key else f"{state_key} of {model_state_key}"
        raise _CheckpointError(f"Cannot concatenate the shard of {what} from {path}: {exc}") from None


def _add_or_validate_unsharded_key(state_key, state_value, state_sub_dict, mismatch_error_string,
                                   path=None, reference_path=None):
    if state_key not in state_sub_dict:
        state_sub_dict[state_key] = state_value
    elif not _equal(state_sub_dict[state_key], state_value):
        where = f": {path} differs from {reference_path}" if path else ""
        raise _CheckpointError(mismatch_error_string + where)


def _aggregate_megatron_partition_info(rank_state_dict, state_dict):
    """Keep partition_info of Megatron-partitioned weights, for the Megatron pass of D+H merging."""
    merged = state_dict.setdefault(PARTITION_INFO_KEY, {})
    for name, info in rank_state_dict[PARTITION_INFO_KEY].items():
        row_partition = info.get(MEGATRON_ROW_PARTITION_KEY)
        if name not in merged and row_partition is not None and _first_int(row_partition) >= 0:
            merged[name] = info


def _aggregate_trainer_options(rank_state_dict, state_dict, partial_aggregation):
    """The merged file describes a single-process run (a partial merge keeps its world_rank)."""
    options = rank_state_dict[TRAINER_OPTIONS_KEY]
    state_dict[TRAINER_OPTIONS_KEY] = {
        MIXED_PRECISION_KEY: options[MIXED_PRECISION_KEY],
        ZERO_STAGE_KEY: 0,
        WORLD_RANK_KEY: options[WORLD_RANK_KEY] if partial_aggregation else 0,
        WORLD_SIZE_KEY: 1,
        OPTIMIZER_NAME_KEY: options[OPTIMIZER_NAME_KEY],
        DATA_PARALLEL_SIZE_KEY: 1,
        HORIZONTAL_PARALLEL_SIZE_KEY: 1,
    }


def _reshape_states(sharded_states_original_dims, state_dict, mixed_precision_enabled):
    """Reshape merged shards to original_dim: moments always, model states with mixed precision
    (in full precision they are whole, or Megatron shards that concatenation already restored)."""
    model = state_dict.get(MODEL_KEY, {}).get(FULL_PRECISION_KEY, {})
    optimizer = state_dict.get(OPTIMIZER_KEY, {})
    for name, original_dim in sharded_states_original_dims.items():
        if mixed_precision_enabled and name in model:
            model[name] = _reshape(model[name], original_dim, f"model state {name}")
        for key, value in optimizer.get(name, {}).items():
            if key in SHARDED_OPTIMIZER_KEYS:
                optimizer[name][key] = _reshape(value, original_dim, f"optimizer state {key} of {name}")


def _reshape(value, original_dim, what):
    try:
        return np.reshape(value, original_dim)
    except ValueError:
        raise _CheckpointError(f"Cannot reshape the merged {what} (shape {list(np.shape(value))}) to its "
                               f"original_dim {original_dim}: a shard is missing or partition_info is "
                               "wrong") from None


def _to_pytorch_format(state_dict):
    """Flat {name: torch.Tensor} of the full-precision model states."""
    import torch

    return {name: torch.tensor(value)
            for name, value in state_dict.get(MODEL_KEY, {}).get(FULL_PRECISION_KEY, {}).items()}


def _plain(value):
    """numpy scalars/arrays and bytes (what HDF5 gives back) as plain Python values."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    return value.decode() if isinstance(value, bytes) else value


def _to_int(value):
    return int(_plain(value))


def _first_int(value):
    return int(np.ravel(value)[0])


def _equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    try:
        return bool(np.array_equal(a, b, equal_nan=True))
    except TypeError:  # equal_nan needs a numeric dtype
        return bool(np.array_equal(a, b))


# --------------------------------------------------------------------------------------------
# Deprecated experimental API: flat {name: tensor} dicts in torch.save files (contract §1.9, §3.5),
# implemented on the trainer's public state_dict()/load_state_dict().
# --------------------------------------------------------------------------------------------

# Flat (backend) names of optimizer states: Moment_1_<w>, Moment_2_<w>, Update_Count_<w>, Step.
_FLAT_OPTIMIZER_PREFIXES = ("Moment_1_", "Moment_2_", "Update_Count_")
_SHARED_STEP = "Step"


def _deprecated(name, replacement):
    warnings.warn(f"{name}() will be deprecated soon. Please use {replacement}() instead.",
                  DeprecationWarning, stacklevel=3)


def experimental_state_dict(ort_trainer, include_optimizer_state=True):
    """Flat {name: torch.Tensor}: weights, plus Moment_1_<w>, Moment_2_<w>, Update_Count_<w>, Step."""
    _deprecated("experimental_state_dict", "ORTTrainer.state_dict")
    return _flat_state(ort_trainer, include_optimizer_state)


def experimental_load_state_dict(ort_trainer, state_dict, strict=False):
    """Load a flat dict as produced by experimental_state_dict (deferred until the session exists)."""
    _deprecated("experimental_load_state_dict", "ORTTrainer.load_state_dict")
    _load_flat_state(ort_trainer, state_dict, strict)


def experimental_save_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix="ORT_checkpoint",
                                 checkpoint_state_dict=None, include_optimizer_state=True):
    """torch.save {'model': flat state, **checkpoint_state_dict} to <dir>/<prefix>.ort.pt, or with
    ZeRO to <dir>/<prefix>.ZeRO.<world_rank>.<world_size - 1>.ort.pt."""
    _deprecated("experimental_save_checkpoint", "ORTTrainer.save_checkpoint")
    import torch

    if not os.path.isdir(checkpoint_dir):
        raise _CheckpointError(f"checkpoint_dir ({checkpoint_dir}) directory doesn't exist")
    state = dict(checkpoint_state_dict or {})
    state["model"] = _flat_state(ort_trainer, include_optimizer_state)
    distributed = ort_trainer.options.distributed
    name = _get_checkpoint_name(checkpoint_prefix, distributed.deepspeed_zero_optimization.stage > 0,
                                distributed.world_rank, distributed.world_size)
    path = os.path.join(checkpoint_dir, name)
    if os.path.exists(path):
        warnings.warn(f"{path} already exists, overwriting.")
    _checkpoint_storage.atomic_write(path, lambda tmp_path: torch.save(state, tmp_path), overwrite=True)


def experimental_load_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix="ORT_checkpoint",
                                 strict=False):
    """Load what experimental_save_checkpoint saved; returns the entries other than 'model'.

    Files are read with torch.load(weights_only=True): tensors and plain containers only.
    """
    _deprecated("experimental_load_checkpoint", "ORTTrainer.load_checkpoint")
    files = _list_checkpoint_files(checkpoint_dir, checkpoint_prefix)
    is_partitioned = len(files) > 1
    if is_partitioned:
        warnings.warn(f"Found more than one file with prefix {checkpoint_prefix} in directory "
                      f"{checkpoint_dir}. Attempting to load ZeRO checkpoint.")
    distributed = ort_trainer.options.distributed
    if is_partitioned and not distributed.deepspeed_zero_optimization.stage:
        # A single-process trainer: merge every rank's shards.
        _load_flat_state(ort_trainer, _CombineZeroCheckpoint(files).aggregate_checkpoints(), strict)
        extras = {}
        for path in files:  # later ranks win for keys saved by several ranks
            state = _torch_load(path)
            state.pop("model", None)
            extras.update(state)
        return extras

    path = os.path.join(checkpoint_dir, _get_checkpoint_name(
        checkpoint_prefix, is_partitioned, distributed.world_rank, distributed.world_size))
    if not os.path.exists(path):
        hint = (f" Optimizer partitioning is enabled using ZeRO. Please make sure the checkpoint file exists "
                f"for rank {distributed.world_rank} of {distributed.world_size}") if is_partitioned else ""
        raise _CheckpointError(f"Couldn't find checkpoint file {path}.{hint}")
    state = _torch_load(path)
    _load_flat_state(ort_trainer, state.pop("model"), strict)
    return state


def _flat_state(ort_trainer, include_optimizer_state):
    import torch

    state = ort_trainer.state_dict()  # warns and returns {} (or the pending dict) before the session exists
    flat = {name: torch.tensor(np.asarray(value))
            for name, value in state.get(MODEL_KEY, {}).get(FULL_PRECISION_KEY, {}).items()}
    if include_optimizer_state:
        for weight, states in state.get(OPTIMIZER_KEY, {}).items():
            for key, value in states.items():
                name = key if weight == SHARED_OPTIMIZER_STATE_KEY else f"{key}_{weight}"
                flat[name] = torch.tensor(np.asarray(value))
    return flat


def _load_flat_state(ort_trainer, flat, strict):
    model, optimizer = {}, {}
    for name, value in flat.items():
        if name.endswith("_fp16"):
            continue  # the fp16 copies are made from the fp32 weights
        value = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
        prefix = next((p for p in _FLAT_OPTIMIZER_PREFIXES if name.startswith(p)), None)
        if prefix:
            optimizer.setdefault(name[len(prefix):], {})[prefix[:-1]] = value
        elif name == _SHARED_STEP:
            optimizer.setdefault(SHARED_OPTIMIZER_STATE_KEY, {})[_SHARED_STEP] = value
        else:
            model[name] = value
    if strict:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            known = set(_flat_state(ort_trainer, include_optimizer_state=True))
        unknown = [name for name in flat if known and name not in known and not name.endswith("_fp16")]
        if unknown:
            raise RuntimeError(f"Checkpoint tensor: {unknown[0]} is not present in the model.")
    state = {MODEL_KEY: {FULL_PRECISION_KEY: model}}
    if optimizer:
        state[OPTIMIZER_KEY] = optimizer
        state[TRAINER_OPTIONS_KEY] = {OPTIMIZER_NAME_KEY: ort_trainer.optim_config.name}
    ort_trainer.load_state_dict(state, strict=False)


def _torch_load(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _list_checkpoint_files(checkpoint_dir, checkpoint_prefix, extension=".ort.pt"):
    names = sorted(name for name in os.listdir(checkpoint_dir)
                   if name.startswith(checkpoint_prefix) and name.endswith(extension))
    if not names:
        raise _CheckpointError(f"No checkpoint found with prefix '{checkpoint_prefix}' at '{checkpoint_dir}'")
    return [os.path.join(checkpoint_dir, name) for name in names]


def _get_checkpoint_name(prefix, is_partitioned, world_rank=None, world_size=None):
    if is_partitioned:
        return f"{prefix}.ZeRO.{world_rank}.{world_size - 1}.ort.pt"  # the last field is world_size - 1
    return f"{prefix}.ort.pt"


def _split_state_dict(state_dict):
    """Split a flat state into 'optimizer', 'fp32_param' and 'fp16_param' by name."""
    split = {"optimizer": {}, "fp32_param": {}, "fp16_param": {}}
    for name, value in state_dict.items():
        if name.endswith("_fp16"):
            kind = "fp16_param"
        elif name.startswith((*_FLAT_OPTIMIZER_PREFIXES, _SHARED_STEP)):
            kind = "optimizer"
        else:
            kind = "fp32_param"
        split[kind][name] = value
    return split


class _CombineZeroCheckpoint:
    """Merge the ZeRO rank files <prefix>.ZeRO.<rank>.<world_size - 1>.ort.pt of the experimental API:
    `_view_<n>` shards are concatenated in rank order and reshaped to the whole weight's shape."""

    _RANK_FILE = re.compile(r"\.ZeRO\.(\d+)\.(\d+)\.ort\.pt$")

    def __init__(self, checkpoint_files, clean_state_dict=None):
        if not checkpoint_files:
            raise _CheckpointError("No checkpoint files passed")
        self.checkpoint_files = list(checkpoint_files)
        self.clean_state_dict = clean_state_dict
        by_rank, sizes = {}, set()
        for path in self.checkpoint_files:
            match = self._RANK_FILE.search(os.fspath(path))
            if not match:
                raise _CheckpointError(f"{path} is not a ZeRO rank file "
                                       "(<prefix>.ZeRO.<rank>.<world_size-1>.ort.pt)")
            rank, last_rank = int(match[1]), int(match[2])
            if rank in by_rank:
                raise _CheckpointError(f"Duplicate rank {rank}: {by_rank[rank]} and {path}")
            by_rank[rank] = path
            sizes.add(last_rank + 1)
        self.world_size = max(sizes)
        if len(sizes) > 1 or sorted(by_rank) != list(range(self.world_size)):
            raise _CheckpointError(f"Could not find {self.world_size} files: got ranks {sorted(by_rank)} "
                                   f"from {self.checkpoint_files}")
        self._ordered_files = [by_rank[rank] for rank in range(self.world_size)]
        self.weight_shape_map = {}
        self.sharded_params = set()

    def _split_name(self, name):
        """'Moment_1_w_view_2' -> ('w', 'Moment_1_', 2, ''); 'w_fp16' -> ('w', '', None, '_fp16')."""
        base, _, view = name.partition("_view_")
        view_num = int(view) if view else None
        optimizer_key = next((p for p in _FLAT_OPTIMIZER_PREFIXES if base.startswith(p)), "")
        mp_suffix = "_fp16" if not optimizer_key and base.endswith("_fp16") else ""
        param_name = base[len(optimizer_key):].split("_fp16")[0]
        return param_name, optimizer_key, view_num, mp_suffix

    def _aggregate(self, param_dict):
        import torch

        merged = self.aggregate_state_dict
        for name, value in param_dict.items():
            weight_name, optimizer_key, view_num, mp_suffix = self._split_name(name)
            if view_num is not None:
                key = optimizer_key + weight_name + mp_suffix
                if key in merged and optimizer_key != "Update_Count_":
                    self.sharded_params.add(key)
                    merged[key] = torch.cat((merged[key], value))
                else:
                    merged[key] = value
            else:
                if name in merged and not torch.equal(merged[name], value):
                    raise _CheckpointError(f"Unsharded params must have the same value: {name}")
                merged.setdefault(name, value)
                self.weight_shape_map.setdefault(weight_name, value.size())

    def aggregate_checkpoints(self):
        _deprecated("_CombineZeroCheckpoint.aggregate_checkpoints", "aggregate_checkpoints")
        self.aggregate_state_dict = {}
        for path in self._ordered_files:
            rank_state = _torch_load(path)
            rank_state = rank_state.get("model", rank_state)
            if self.clean_state_dict:
                rank_state = self.clean_state_dict(rank_state)
            split = _split_state_dict(rank_state)
            for kind in ("fp16_param", "fp32_param", "optimizer"):
                self._aggregate(split[kind])
        for key in self.sharded_params:
            weight_name = self._split_name(key)[0]
            if weight_name not in self.weight_shape_map:
                raise _CheckpointError(f"Cannot reshape {key}: no unsharded weight {weight_name} in the "
                                       "checkpoint")
            merged = self.aggregate_state_dict
            merged[key] = merged[key].reshape(self.weight_shape_map[weight_name])
        return self.aggregate_state_dict
