"""Tensor parallel (Megatron) state in the legacy layout: each rank's state_dict holds its shards.

    state_dict['model']['full_precision'][w]      this rank's shard of a cut weight (whole otherwise)
    state_dict['optimizer'][w]['Moment_1'|...]    moments of the shard's shape
    state_dict['partition_info'][w]               {'original_dim': the whole shape,
                                                   'megatron_row_partition': [0 | 1],
                                                   'megatron_stride': [s]}  (an extension key)

`megatron_row_partition` keeps the legacy aggregation meaning: 0 = the shards are concatenated along
the LAST axis, 1 = along axis 0 (a GPT-2 Conv1D column weight [in, out] is 0, a BERT nn.Linear column
weight [out, in] is 1). `megatron_stride` > 1 marks a weight made of `s` equal parts side by side,
each cut alike (GPT-2's q|k|v): concatenating the rank shards gives q0 k0 v0 q1 k1 v1, which
checkpoint.aggregate_checkpoints re-interleaves to q0 q1 k0 k1 v0 v1. Files without the key
(stride 1) aggregate as before.

Loading re-cuts: a whole value (one process's state, or rank files merged by load_checkpoint) is cut
to this rank's shard, so any horizontal size resumes any other; a value of the shard's shape is
taken as it is.
"""

import warnings

import numpy as np

from orttrainer import _utils
from orttrainer.placement.dims import ParallelDims
from orttrainer.state import load_checks as _load_checks
from orttrainer.state.aggregation import MEGATRON_STRIDE_KEY as STRIDE_KEY
_MOMENTS = ("Moment_1", "Moment_2")


def _cuts(options, factory):
    """{weight: megatron.Cut} of this rank, or {} without tensor parallel."""
    if options.distributed.horizontal_parallel_size <= 1 or factory is None:
        return {}
    return factory.tensor_parallel_cuts or {}


def partition_info(cuts):
    """state_dict['partition_info'] entries of the cut weights."""
    info = {}
    for name, cut in cuts.items():
        last = cut.axis == len(cut.shape) - 1
        info[name] = {_utils.ORIGINAL_DIM_KEY: np.array(cut.shape, dtype=np.int64),
                      _utils.MEGATRON_ROW_PARTITION_KEY: np.array([0 if last else 1], dtype=np.int64),
                      STRIDE_KEY: np.array([cut.stride], dtype=np.int64)}
    return info


def add_partition_info(state, options, session, factory):
    """state_dict()'s partition_info: ZeRO-1 segments (stage > 0) and Megatron shards (H > 1)."""
    info = {}
    if options.distributed.deepspeed_zero_optimization.stage > 0:
        info.update(session.get_partition_info_map())
    info.update(partition_info(_cuts(options, factory)))
    # As the original: present in every ZeRO or Megatron rank's state (empty when nothing was cut, e.g.
    # an ONNX model), which aggregation requires of every rank file.
    if options.distributed.deepspeed_zero_optimization.stage > 0 or options.distributed.horizontal_parallel_size > 1:
        state[_utils.PARTITION_INFO_KEY] = info


def warn_incomplete(options):
    """state_dict(pytorch_format=True) under H > 1 holds shards, as the original warned."""
    if options.distributed.horizontal_parallel_size > 1:
        warnings.warn("Incomplete state_dict: Megatron enabled", UserWarning)


def shard(value, cut, rank, horizontal):
    """This rank's part of a whole value (any layout of cut.shape's elements)."""
    value = np.asarray(value).reshape(cut.shape)
    parts = np.split(value, cut.stride, axis=cut.axis)
    return np.ascontiguousarray(np.concatenate(
        [np.split(p, horizontal, axis=cut.axis)[rank] for p in parts], axis=cut.axis))


def own_shards(state_dict, options, factory):
    """A copy of `state_dict` whose whole cut weights and moments are cut to this rank's shards (the
    shapes are checked by the load afterwards); `state_dict` itself is left as it was."""
    cuts = _cuts(options, factory)
    if not cuts:
        return state_dict
    d = options.distributed
    dims = ParallelDims.of(d)
    rank, horizontal = dims.coords(d.world_rank).tensor, dims.tensor

    def own(value, cut):
        if value is None or np.size(value) != int(np.prod(cut.shape)):
            return value  # a shard (or a wrong value: the load's shape check names it)
        return shard(_load_checks.as_numpy(value), cut, rank, horizontal)

    state = dict(state_dict)
    if _utils.MODEL_KEY in state:
        state[_utils.MODEL_KEY] = {
            precision: {n: own(v, cuts[n]) if n in cuts else v for n, v in tensors.items()}
            for precision, tensors in state[_utils.MODEL_KEY].items()}
    if state.get(_utils.OPTIMIZER_KEY):
        state[_utils.OPTIMIZER_KEY] = {
            w: {k: own(v, cuts[w]) if w in cuts and k in _MOMENTS else v for k, v in per.items()}
            if isinstance(per, dict) else per
            for w, per in state[_utils.OPTIMIZER_KEY].items()}
    state.pop(_utils.PARTITION_INFO_KEY, None)  # describes the saving run's shards, not this one's
    return state
