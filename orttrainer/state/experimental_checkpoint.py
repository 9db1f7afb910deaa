"""Deprecated experimental checkpoint API: flat {name: tensor} dicts in torch.save files
(contract §1.9, §3.5), implemented on the trainer's public state_dict()/load_state_dict(), and
_CombineZeroCheckpoint, which merges that API's ZeRO rank files."""

import os
import re
import warnings

import numpy as np

from orttrainer import _checkpoint_storage
from orttrainer.state.errors import _CheckpointError
from orttrainer._utils import (
    FULL_PRECISION_KEY, MODEL_KEY, OPTIMIZER_KEY, OPTIMIZER_NAME_KEY, SHARED_OPTIMIZER_STATE_KEY,
    TRAINER_OPTIONS_KEY,
)

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
    if is_partitioned and not ort_trainer.options.distributed.deepspeed_zero_optimization.stage:
        return _load_multi_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix, strict)
    return _load_single_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix, is_partitioned, strict)


def _load_multi_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix, strict):
    """A single-process trainer: merge every rank's shards; returns the other entries of the files
    (later ranks win for keys saved by several ranks)."""
    files = _list_checkpoint_files(checkpoint_dir, checkpoint_prefix)
    _load_flat_state(ort_trainer, _CombineZeroCheckpoint(files).aggregate_checkpoints(), strict)
    extras = {}
    for path in files:
        state = _torch_load(path)
        state.pop("model", None)
        extras.update(state)
    return extras


def _load_single_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix, is_partitioned, strict):
    """Load this trainer's file (its own rank's file when `is_partitioned`); returns its other entries."""
    distributed = ort_trainer.options.distributed
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
