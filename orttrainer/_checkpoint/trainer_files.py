"""The file side of ORTTrainer.save_checkpoint / load_checkpoint (contract §3.3): one HDF5 file
per rank; rank files of a ZeRO or Megatron run are merged on load."""

from orttrainer import _checkpoint_storage
from orttrainer._checkpoint.aggregation import PIPELINE_SIZE_KEY, _to_int
from orttrainer._checkpoint.errors import _CheckpointError
from orttrainer._utils import (
    HORIZONTAL_PARALLEL_SIZE_KEY, OPTIMIZER_KEY, TRAINER_OPTIONS_KEY, USER_DICT_KEY, ZERO_STAGE_KEY,
)


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
        # Looked up on the public module, so that a patch of orttrainer.checkpoint.aggregate_checkpoints
        # (as the upstream checkpoint tests do) reaches this call.
        from orttrainer import checkpoint

        state_dict = checkpoint.aggregate_checkpoints(paths, pytorch_format=False)
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
