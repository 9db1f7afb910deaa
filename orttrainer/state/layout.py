"""StateLayout: where each entry of the legacy state_dict lives among the session's state buffers.

The one translator between the two namings (docs/legacy-api.md §3.1):

    state_dict['model']['full_precision'][w]          <->  buffer `w`
    state_dict['optimizer'][w]['Moment_1' | ...]      <->  buffer `Moment_1_w`, `Moment_2_w`, `Update_Count_w`
    state_dict['optimizer']['shared_optimizer_state'] <->  buffer `Step` (LAMB)
    state_dict['partition_info'][w]                   <->  the weight's ZeRO-1 segment (a flat slice)

and of the partitions a buffer may hold: the whole weight, or this rank's ZeRO-1 segment (a Megatron
shard would be one more case of `own_part`). The TrainingSession reads through it, the facade loads
through it; nothing else translates names.
"""

import numpy as np
import torch
from onnx import numpy_helper

from orttrainer import _utils
from orttrainer.placement.dims import ParallelDims
from orttrainer.state import load_checks as _load_checks

_PER_WEIGHT = {"AdamOptimizer": ("Moment_1", "Moment_2", "Update_Count"),
               "LambOptimizer": ("Moment_1", "Moment_2")}
_SHARED = {"LambOptimizer": ("Step",)}


class StateLayout:
    """The state_dict <-> buffer map of one training graph.

    Args:
        optimizer_name: 'SGDOptimizer', 'AdamOptimizer' or 'LambOptimizer'.
        weights: the trainable weights, in graph order.
        states: the buffer names the graph holds (weights, moments, counters).
        segments: {weight: Segment(start, stop, size)} under ZeRO-1, else None.
    """

    def __init__(self, optimizer_name, weights, states, segments=None):
        self.optimizer_name = optimizer_name
        self.weights = list(weights)
        self.states = set(states)
        self.segments = segments or None

    @classmethod
    def of(cls, graph, optimizer_name):
        partition = graph.partition
        return cls(optimizer_name, graph.weights, graph.states,
                   partition.segments if partition is not None else None)

    # ------------------------------------------------------------------ buffers -> state_dict
    def optimizer_entries(self):
        """[(weight or 'shared_optimizer_state', key, buffer name)] this graph holds."""
        entries = []
        for w in self.weights:
            keys = [k for k in _PER_WEIGHT.get(self.optimizer_name, ()) if f"{k}_{w}" in self.states]
            entries += [(w, k, f"{k}_{w}") for k in keys]  # none: ZeRO-1 gave the weight to another rank
        entries += [(_utils.SHARED_OPTIMIZER_STATE_KEY, k, k) for k in _SHARED.get(self.optimizer_name, ())]
        return entries

    def optimizer_state(self, read):
        """get_optimizer_state's layout, each value `read(buffer name)`."""
        state = {}
        for weight, key, name in self.optimizer_entries():
            state.setdefault(weight, {})[key] = read(name)
        return state

    def model_state(self, read):
        """get_model_state's layout: {'full_precision': {weight: read(weight)}}."""
        return {_utils.FULL_PRECISION_KEY: {w: read(w) for w in self.weights}}

    def partition_info(self, shape_of):
        """{weight: {'original_dim': [int, ...], 'megatron_row_partition': [-1]}} for each ZeRO-1 segment
        ({} otherwise): lists of int, the layout of the original's get_partition_info_map."""
        if not self.segments:
            return {}
        return {w: {_utils.ORIGINAL_DIM_KEY: [int(d) for d in shape_of(w)],
                    _utils.MEGATRON_ROW_PARTITION_KEY: [-1]} for w in self.segments}

    # ------------------------------------------------------------------ state_dict -> buffers
    def buffer_name(self, weight, key):
        """The buffer holding state_dict['optimizer'][weight][key], or None when this graph has none."""
        name = key if weight == _utils.SHARED_OPTIMIZER_STATE_KEY else f"{key}_{weight}"
        return name if name in self.states else None

    def checked_buffers(self, current, model_states, optimizer_states, frozen_now, saved_by, me):
        """({buffer: value}, {frozen initializer: value}) of a load, every value checked against what
        the trainer holds now (`current(buffer)`, `frozen_now`): names, shapes, dtypes, segments."""
        states, frozen = {}, {}
        for name, value in model_states.items():
            like = current(name) if name in self.states else frozen_now[name]
            (states if name in self.states else frozen)[name] = _load_checks.checked(
                name, _load_checks.as_numpy(value), like)
        for weight, per_weight in optimizer_states.items():
            for key, value in per_weight.items():
                name = self.buffer_name(weight, key)
                if name is None:
                    continue
                like = current(name)
                whole = current(weight).numel() if weight in self.states else like.numel()
                value = self.own_part(weight, name, _load_checks.as_numpy(value), whole, like.shape, saved_by, me)
                states[name] = _load_checks.checked(name, value, like)
        return states, frozen

    def own_part(self, weight, name, value, numel, shape, saved_by, me):
        """A loaded moment in the form this graph keeps it: this rank's ZeRO-1 segment, or the whole weight.

        A whole moment (one process's checkpoint, or rank files merged by load_checkpoint) is cut to
        this rank's segment, so any world size resumes any other; a flat moment of a whole weight (a
        one-rank ZeRO-1 state) is reshaped. A partial segment is taken as is only from this same rank
        of the same world size (`saved_by` == `me`, both (rank, world size)).
        """
        if not name.startswith(("Moment_1_", "Moment_2_")):
            return value  # counters: one value per weight (or shared), never partitioned
        segment = self.segments.get(weight) if self.segments else None
        if segment is None:
            if value.ndim == 1 and value.size == numel:
                return value.reshape(shape)
            if value.size == numel:
                return value
            start, stop = 0, numel
        else:
            if value.size == numel:
                return np.ascontiguousarray(value.reshape(-1)[segment.start:segment.stop])
            if value.shape == (segment.size,) and saved_by == me:
                return value
            start, stop = segment.start, segment.stop
        raise ValueError(
            f"State {name!r} has {value.size} elements: a ZeRO-1 segment of another rank or world size; this "
            f"trainer (rank {me[0]} of {me[1]}) keeps elements {start}:{stop} of {weight!r}. Load every "
            "rank's file with load_checkpoint(*rank_files): they are merged and re-cut for this world size.")


# ---------------------------------------------------------------------- the forward model's side
def full_model_state(trained, forward_model, keep, trained_names, aliases):
    """state_dict['model']['full_precision']: the session's trained weights, the forward model's frozen
    initializers that `keep` names (frozen_weights, torch state keys), and each tied weight's other
    names (so a checkpoint converts to a complete torch state_dict). A None `trained` value means
    keys only (no copies)."""
    states = dict(trained)
    keys_only = any(v is None for v in states.values())
    for init in _initializers(forward_model):
        if init.name in keep and init.name not in states and init.name not in trained_names:
            states[init.name] = None if keys_only else numpy_helper.to_array(init).copy()
    for alias, source in aliases.items():
        if source in states:
            states[alias] = states[source]
    return states


def write_initializers(forward_model, values):
    """Write {name: array} into the forward model's initializers (names it does not hold are skipped)."""
    for init in _initializers(forward_model):
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(np.asarray(values[init.name]), init.name))


def initializer_values(forward_model, names):
    """{name: array copy} of the forward model's initializers among `names`."""
    return {i.name: numpy_helper.to_array(i).copy() for i in _initializers(forward_model) if i.name in names}


def trainer_options_state(options, optimizer_name):
    """state_dict['trainer_options']: what checkpoint loading and aggregation check and group by."""
    distributed = options.distributed
    return {
        _utils.MIXED_PRECISION_KEY: bool(options.mixed_precision.enabled),
        _utils.ZERO_STAGE_KEY: int(distributed.deepspeed_zero_optimization.stage),
        _utils.WORLD_RANK_KEY: int(distributed.world_rank),
        _utils.WORLD_SIZE_KEY: int(distributed.world_size),
        _utils.OPTIMIZER_NAME_KEY: optimizer_name,
        # The legacy default 1 means "inferred": record the data-parallel group the run really had,
        # which checkpoint aggregation groups the rank files by.
        _utils.DATA_PARALLEL_SIZE_KEY: ParallelDims.of(distributed).data,
        _utils.HORIZONTAL_PARALLEL_SIZE_KEY: int(distributed.horizontal_parallel_size),
    }


def to_pytorch(model_states, torch_keys):
    """state_dict(pytorch_format=True): {name: torch tensor}, in the torch model's key order first."""
    order = list(torch_keys) + [name for name in model_states if name not in torch_keys]
    return {name: torch.from_numpy(np.asarray(model_states[name])) for name in order if name in model_states}


def _initializers(forward_model):
    graph = getattr(forward_model, "graph", None)
    try:
        return list(graph.initializer) if graph is not None else []
    except TypeError:  # a substituted model (a test's mock) without initializers
        return []
