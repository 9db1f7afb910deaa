"""aggregate_checkpoints: merging the per-rank HDF5 files of a ZeRO-1 and/or Megatron run.

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

import numpy as np

from orttrainer import _checkpoint_storage
from orttrainer.placement.dims import LayoutError, ParallelDims
from orttrainer.state.errors import _CheckpointError
from orttrainer._utils import (
    DATA_PARALLEL_SIZE_KEY, FULL_PRECISION_KEY, HORIZONTAL_PARALLEL_SIZE_KEY,
    MEGATRON_ROW_PARTITION_KEY, MIXED_PRECISION_KEY, MODEL_KEY, OPTIMIZER_KEY,
    OPTIMIZER_NAME_KEY, ORIGINAL_DIM_KEY, PARTITION_INFO_KEY, SHARDED_OPTIMIZER_KEYS,
    TRAIN_STEP_INFO_KEY, TRAINER_OPTIONS_KEY, WORLD_RANK_KEY, WORLD_SIZE_KEY, ZERO_STAGE_KEY,
)


# Added to trainer_options by pipeline stage files (the legacy layout has no pipeline key).
PIPELINE_SIZE_KEY = "pipeline_parallel_size"


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
    PIPELINE_SIZE_KEY: "Pipeline parallel size",
}
MEGATRON_STRIDE_KEY = "megatron_stride"  # state/megatron.STRIDE_KEY (no engine import here)
# Top-level entries aggregation handles itself; any other entry (user_dict, train_step_info,
# loss_scaler, lr_scheduler, ...) is carried over from the first rank that has it.
_AGGREGATED_KEYS = {MODEL_KEY, OPTIMIZER_KEY, PARTITION_INFO_KEY, TRAINER_OPTIONS_KEY}


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
    dims = _layout_of(reference, paths[0])
    world_size, D, H = dims.world_size, dims.data, dims.tensor
    data_groups, horizontal_groups = dims.data_groups(), dims.tensor_groups()
    rank_paths = _paths_by_rank(paths, reference, world_size)
    if dims.pipeline_parallel:
        return _aggregate_pipeline(rank_paths, dims, pytorch_format)

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


def _layout_of(options, path):
    """The ParallelDims a rank file's trainer_options record (a stage file records its
    pipeline_parallel_size, state/pipeline.py; other files are one stage)."""
    try:
        sizes = [_to_int(options[key]) for key in (WORLD_SIZE_KEY, DATA_PARALLEL_SIZE_KEY,
                                                   HORIZONTAL_PARALLEL_SIZE_KEY, PIPELINE_SIZE_KEY)]
        return ParallelDims(*sizes, zero_stage=_to_int(options[ZERO_STAGE_KEY]))
    except LayoutError as exc:
        raise _CheckpointError(f"Inconsistent trainer_options in {path}: {exc}") from None


def _aggregate_pipeline(rank_paths, dims, pytorch_format):
    """Pipeline stage files: the stages of data group 0 (stage-major ranks) hold disjoint weights but
    tied ones, which must be equal; merged into the one-process state."""
    P, D = dims.pipeline, dims.data
    if dims.zero or dims.tensor_parallel:
        raise _CheckpointError(f"Inconsistent trainer_options: pipeline_parallel_size {P} with ZeRO or "
                               f"Megatron (zero_stage {dims.zero_stage}, horizontal_parallel_size {dims.tensor})")
    needed = dims.pipeline_groups()[0]
    missing = sorted(set(needed) - set(rank_paths))
    if missing:
        raise _CheckpointError(f"Missing checkpoint file for rank(s) {missing}: merging this pipeline run "
                               f"({P} stages x {D} data-parallel ranks) needs ranks {needed} (the first data-"
                               f"parallel rank of each stage); got ranks {sorted(rank_paths)}")
    return _aggregate_over_ranks(_load_ranks(rank_paths, needed), needed, pytorch_format=pytorch_format)


def _read_trainer_options(path):
    try:
        options = _checkpoint_storage.load(path, key=TRAINER_OPTIONS_KEY)
    except KeyError:
        raise _CheckpointError(f"Missing information: trainer_options in checkpoint file {path}") from None
    options = dict(options)
    # Files from before Megatron support have no parallel sizes: plain data parallelism.
    options.setdefault(HORIZONTAL_PARALLEL_SIZE_KEY, 1)
    options.setdefault(PIPELINE_SIZE_KEY, 1)
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
    dims = ParallelDims(world_size, data_parallel_size, horizontal_parallel_size,
                        world_size // (data_parallel_size * horizontal_parallel_size))
    return dims.data_groups(), dims.tensor_groups()


_get_parallellism_groups = _get_parallelism_groups  # the original's spelling


def _order_paths(paths, D_groups, H_groups):
    """{'D': [[path of each rank of data group g] for g], 'H': [[...] for each horizontal group]}: the
    files sorted by the world_rank they record, arranged in the groups' rank order."""
    by_rank = sorted(paths, key=lambda path: _to_int(_read_trainer_options(path)[WORLD_RANK_KEY]))
    return {"D": [[by_rank[rank] for rank in group] for group in D_groups],
            "H": [[by_rank[rank] for rank in group] for group in H_groups]}


def _sources(ordered_paths):
    """(name, rank state dict) pairs: file paths are loaded one at a time; pairs pass through."""
    for item in ordered_paths:
        if isinstance(item, tuple):
            yield item
        else:
            path = os.fspath(item)
            yield path, _checkpoint_storage.load(path)


def _load_ranks(rank_paths, ranks):
    # A generator: one rank file in memory at a time.
    return ((rank_paths[rank], _checkpoint_storage.load(rank_paths[rank])) for rank in ranks)


def _aggregate_over_D_H(ordered_paths, D_groups, H_groups, pytorch_format):
    """ZeRO + Megatron: merge each data-parallel group (keeping the Megatron partition_info), then
    merge those partial results over horizontal group 0 in Megatron mode. The original wrote the
    partial results to temporary files; they are kept in memory here, one at a time.

    `ordered_paths` is {rank: path}, or the original's {'D': [[path, ...], ...], 'H': ...} (_order_paths).
    """
    data_groups, horizontal_groups = D_groups, H_groups
    rank_paths = ordered_paths
    if "D" in ordered_paths:
        rank_paths = {rank: path for group, paths in zip(D_groups, ordered_paths["D"])
                      for rank, path in zip(group, paths)}
    original_dims = {}

    def partial_results():
        # Data group g starts with rank g, so its partial result has world_rank g, which is what
        # horizontal group 0 ([0, .., H-1]) expects.
        for group in horizontal_groups[0]:
            ranks = data_groups[group]
            label = f"data group {group} (ranks {ranks}: {', '.join(rank_paths[r] for r in ranks)})"
            partial = _aggregate_over_ranks(_load_ranks(rank_paths, ranks), ranks, original_dims,
                                            partial_aggregation=True, pytorch_format=False)
            yield label, _moments_like_weights(partial)

    return _aggregate_over_ranks(partial_results(), horizontal_groups[0], original_dims,
                                 mode=_AGGREGATION_MODE.Megatron, pytorch_format=pytorch_format)


def _moments_like_weights(state_dict):
    """A data group's merged ZeRO-1 moments are flat; a Megatron shard's must have its weight's shape
    before the shards are concatenated along an axis of the weight."""
    model = state_dict.get(MODEL_KEY, {}).get(FULL_PRECISION_KEY, {})
    for weight, states in state_dict.get(OPTIMIZER_KEY, {}).items():
        shape = np.shape(model.get(weight))
        for key in SHARDED_OPTIMIZER_KEYS & set(states):
            if weight in model and np.size(states[key]) == np.size(model[weight]):
                states[key] = np.reshape(states[key], shape)
    return state_dict


def _aggregate_over_ranks(ordered_paths, ranks, sharded_states_original_dims=None, mode=_AGGREGATION_MODE.Zero,
                          partial_aggregation=False, pytorch_format=True):
    """Merge `ordered_paths`, the rank files (or (name, rank state dict) pairs) in the order of `ranks`,
    into one state dict.

    `sharded_states_original_dims` collects {weight: original_dim} across calls (D+H merging);
    `partial_aggregation` keeps the Megatron partition_info and skips the final reshape.
    """
    state_dict = {}
    original_dims = {} if sharded_states_original_dims is None else sharded_states_original_dims
    first = None  # what later ranks are checked against: (name, trainer_options, train_step_info)
    first_name, mixed_precision = None, False
    strides = {}  # Megatron weights of `stride` parts side by side: {name: (stride, axis)}
    for (name, rank_state), rank in zip(_sources(ordered_paths), ranks):
        _check_rank_state(name, rank_state, rank, first)
        if mode is _AGGREGATION_MODE.Megatron:
            strides.update(_megatron_strides(rank_state))
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
        _interleave_strided(state_dict, strides, len(ranks))
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


def _megatron_strides(rank_state_dict):
    """{name: (stride, concatenation axis)} of the Megatron shards with `megatron_stride` > 1 (this
    trainer's extension of partition_info, state/megatron.py; absent in the original's files)."""
    found = {}
    for name, info in rank_state_dict.get(PARTITION_INFO_KEY, {}).items():
        stride = _first_int(info.get(MEGATRON_STRIDE_KEY, 1))
        if stride > 1 and _first_int(info.get(MEGATRON_ROW_PARTITION_KEY, -1)) >= 0:
            found[name] = (stride, -1 if _first_int(info[MEGATRON_ROW_PARTITION_KEY]) == 0 else 0)
    return found


def _interleave_strided(state_dict, strides, horizontal):
    """Shards of a weight of `stride` parts (GPT-2's q|k|v) concatenated in rank order hold
    q0 k0 v0 q1 k1 v1: regroup them to q0 q1 k0 k1 v0 v1, the whole weight (and its moments)."""
    model = state_dict.get(MODEL_KEY, {}).get(FULL_PRECISION_KEY, {})
    optimizer = state_dict.get(OPTIMIZER_KEY, {})
    for name, (stride, axis) in strides.items():
        holders = [(model, name)] + [(optimizer[name], key) for key in SHARDED_OPTIMIZER_KEYS
                                     if key in optimizer.get(name, {})]
        for holder, key in holders:
            if key not in holder:
                continue
            pieces = np.split(np.asarray(holder[key]), horizontal * stride, axis=axis)
            order = [r * stride + j for j in range(stride) for r in range(horizontal)]
            holder[key] = np.concatenate([pieces[i] for i in order], axis=axis)


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
