"""`trainer._training_session`: the legacy TrainingSession getters over the trainer's state.

The original frontend read its state through the C++ session's getters (legacy-api.md §2.9, §3.1)
and scripts and its test suite reach into them. Here they read the one TrainingState that every
session of the trainer shares; any other attribute (`graph`, `session`, `current`, ...) is the
current session's Runtime.
"""

import numpy as np
import torch

from . import _utils


class TrainingSession:
    """Legacy getters: get_state, get_model_state, get_optimizer_state, get_partition_info_map, load_state."""

    def __init__(self, graphs, optimizer_name):
        self._graphs = graphs  # engine.lifecycle.GraphLifecycle
        self._optimizer_name = optimizer_name

    @property
    def runtime(self):
        """The Runtime whose session ran (or will run) the latest call."""
        return self._graphs.current.runtime

    def __getattr__(self, name):
        # Only reached for names this class does not define: the engine's own attributes.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.runtime, name)

    # ------------------------------------------------------------------ the legacy getters
    def get_state(self):
        """Every state tensor by its backend name: `<w>`, `Moment_1_<w>`, `Moment_2_<w>`,
        `Update_Count_<w>` (Adam), `Step` (LAMB) -- numpy copies."""
        return {name: self._read(name) for name in self.runtime.graph.states}

    def get_model_state(self, include_mixed_precision_weights=False):
        """{'full_precision': {trainable weight: array}}. Compute is fp32 here, so there are no fp16
        weight copies: include_mixed_precision_weights adds no 'mixed_precision' entry."""
        return {_utils.FULL_PRECISION_KEY: {w: self._read(w) for w in self.runtime.graph.weights}}

    def get_optimizer_state(self):
        """{weight: {'Moment_1', 'Moment_2'[, 'Update_Count']}} (+ {'shared_optimizer_state': {'Step'}}
        for LAMB); {} for SGD. Under ZeRO-1 only the weights this rank keeps state for, as flat segments."""
        return self.optimizer_layout(self._read)

    def get_partition_info_map(self):
        """ZeRO-1: {weight: {'original_dim', 'megatron_row_partition'}} for the weights whose optimizer
        state this rank holds as a flat segment; {} otherwise."""
        partition = self.runtime.graph.partition
        segments = partition.segments if partition is not None else None
        if not segments:
            return {}
        return {w: {_utils.ORIGINAL_DIM_KEY: np.array(self.runtime.current(w).shape, dtype=np.int64),
                    _utils.MEGATRON_ROW_PARTITION_KEY: np.array(-1, dtype=np.int64)} for w in segments}

    def load_state(self, state, strict=False):
        """Copy {backend name: value} into the state (get_state's layout). Every value is checked first:
        a wrong shape, or with strict=True an unknown name, raises and changes nothing."""
        runtime = self.runtime
        unknown = [name for name in state if name not in runtime.graph.states]
        if unknown and strict:
            raise RuntimeError(f"Unexpected state names {unknown}: this session's states are "
                               f"{sorted(runtime.graph.states)}")
        values = {}
        for name, value in state.items():
            if name in unknown:
                continue
            value = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            current = runtime.current(name)
            if value.size != current.numel():
                raise ValueError(f"State {name!r} has shape {list(value.shape)} but the session holds "
                                 f"{list(current.shape)}")
            values[name] = value
        runtime.load(values)

    # ------------------------------------------------------------------ helpers
    def optimizer_layout(self, read=lambda name: None):
        """get_optimizer_state's layout, each value `read(backend name)` (default None: keys only)."""
        graph = self.runtime.graph
        if self._optimizer_name == "SGDOptimizer":
            return {}
        states = {}
        for w in graph.weights:
            if f"Moment_1_{w}" not in graph.states:
                continue  # ZeRO-1: another rank keeps this weight's optimizer state
            states[w] = {"Moment_1": read(f"Moment_1_{w}"), "Moment_2": read(f"Moment_2_{w}")}
            if self._optimizer_name == "AdamOptimizer":
                states[w]["Update_Count"] = read(f"Update_Count_{w}")
        if self._optimizer_name == "LambOptimizer":
            states[_utils.SHARED_OPTIMIZER_STATE_KEY] = {"Step": read("Step")}
        return states

    def _read(self, name):
        return self.runtime.current(name).detach().cpu().numpy().copy()
