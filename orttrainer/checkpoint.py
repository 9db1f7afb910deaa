"""Checkpoint functions of the legacy API (`orttrainer.checkpoint`, contract §3.4, §3.5).

The public names live here, with the file side of ORTTrainer.save_checkpoint / load_checkpoint
(`_save_checkpoint` / `_load_checkpoint`, used by the trainer and `orttrainer.run`); the state-dict work
is done in `orttrainer/state/`: `aggregation` (aggregate_checkpoints, merging per-rank HDF5 files) and
`experimental_checkpoint` (the deprecated experimental_* API on torch.save files).

This module does not import the trainer (nor torch until a function needs it): the command line
and the trainer both build on it.
"""

from orttrainer import _checkpoint_storage
from orttrainer._utils import (
    HORIZONTAL_PARALLEL_SIZE_KEY, OPTIMIZER_KEY, TRAINER_OPTIONS_KEY, USER_DICT_KEY, ZERO_STAGE_KEY,
)
from orttrainer.state.aggregation import PIPELINE_SIZE_KEY, _to_int, aggregate_checkpoints
from orttrainer.state.errors import _CheckpointError
from orttrainer.state.experimental_checkpoint import (
    experimental_load_checkpoint, experimental_load_state_dict, experimental_save_checkpoint,
    experimental_state_dict,
)
# The original module's private helpers, which its tests and scripts call directly.
from orttrainer.state.aggregation import (  # noqa: F401
    _AGGREGATION_MODE, _add_or_update_sharded_key, _add_or_validate_unsharded_key,
    _aggregate_megatron_partition_info, _aggregate_model_states, _aggregate_optimizer_states,
    _aggregate_over_D_H, _aggregate_over_ranks, _aggregate_trainer_options, _get_parallellism_groups,
    _order_paths, _reshape_states, _to_pytorch_format,
)
from orttrainer.state.experimental_checkpoint import (  # noqa: F401
    _CombineZeroCheckpoint, _get_checkpoint_name, _list_checkpoint_files, _load_multi_checkpoint,
    _load_single_checkpoint, _split_state_dict,
)

__all__ = [
    "aggregate_checkpoints", "experimental_state_dict", "experimental_load_state_dict",
    "experimental_save_checkpoint", "experimental_load_checkpoint",
]


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
            or _to_int(options.get(HORIZONTAL_PARALLEL_SIZE_KEY, 1)) > 1
            or _to_int(options.get(PIPELINE_SIZE_KEY, 1)) > 1):
        # A global looked up at call time: a patch of orttrainer.checkpoint.aggregate_checkpoints (as the
        # upstream checkpoint tests do) reaches this call.
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
