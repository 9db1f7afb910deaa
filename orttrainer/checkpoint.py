"""Checkpoint functions of the legacy API (`orttrainer.checkpoint`, contract §3.4, §3.5).

The public names live here; the work is done in `orttrainer/_checkpoint/`:
`aggregation` (aggregate_checkpoints), `experimental` (the deprecated experimental_* API on
torch.save files), `trainer_files` (the file side of ORTTrainer.save_checkpoint/load_checkpoint,
used by the trainer and `orttrainer.run` as `checkpoint._save_checkpoint/_load_checkpoint`).

This module does not import the trainer (nor torch until a function needs it): the command line
and the trainer both build on it.
"""

from orttrainer._checkpoint.aggregation import aggregate_checkpoints
from orttrainer._checkpoint.errors import _CheckpointError
from orttrainer._checkpoint.experimental import (
    experimental_load_checkpoint, experimental_load_state_dict, experimental_save_checkpoint,
    experimental_state_dict,
)
# The original module's private helpers, which its tests and scripts call directly.
from orttrainer._checkpoint.aggregation import (  # noqa: F401
    _AGGREGATION_MODE, _add_or_update_sharded_key, _add_or_validate_unsharded_key, _aggregate_megatron_partition_info,
    _aggregate_model_states, _aggregate_optimizer_states, _aggregate_over_D_H, _aggregate_over_ranks,
    _aggregate_trainer_options, _get_parallellism_groups, _order_paths, _reshape_states, _to_pytorch_format,
)
from orttrainer._checkpoint.experimental import (  # noqa: F401
    _CombineZeroCheckpoint, _get_checkpoint_name, _list_checkpoint_files, _load_multi_checkpoint,
    _load_single_checkpoint, _split_state_dict,
)
from orttrainer._checkpoint.trainer_files import _load_checkpoint, _save_checkpoint

__all__ = [
    "aggregate_checkpoints", "experimental_state_dict", "experimental_load_state_dict",
    "experimental_save_checkpoint", "experimental_load_checkpoint",
]
