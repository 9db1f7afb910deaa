"""`trainer._training_session`: the legacy TrainingSession getters over the trainer's state.

The original frontend read its state through the C++ session's getters (docs/legacy-api.md §2.9, §3.1)
and scripts and its test suite reach into them. Here they read the one TrainingState that every
session of the trainer shares; any other attribute (`graph`, `session`, `current`, ...) is the
current session's Runtime.
"""

import numpy as np
import torch

from ._state_layout import StateLayout


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

    @property
    def layout(self):
        """The StateLayout of the current graph (state_dict names <-> buffers)."""
        return StateLayout.of(self.runtime.graph, self._optimizer_name)

    def get_model_state(self, include_mixed_precision_weights=False):
        """{'full_precision': {trainable weight: array}}. The master weights are fp32 here (low-precision
        compute casts them inside the graph), so include_mixed_precision_weights adds no entry."""
        return self.layout.model_state(self._read)

    def get_optimizer_state(self):
        """{weight: {'Moment_1', 'Moment_2'[, 'Update_Count']}} (+ {'shared_optimizer_state': {'Step'}}
        for LAMB); {} for SGD. Under ZeRO-1 only the weights this rank keeps state for, as flat segments."""
        return self.layout.optimizer_state(self._read)

    def get_partition_info_map(self):
        """ZeRO-1: {weight: {'original_dim', 'megatron_row_partition'}} for the weights whose optimizer
        state this rank holds as a flat segment; {} otherwise."""
        return self.layout.partition_info(lambda w: self.runtime.current(w).shape)

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
    def _read(self, name):
        return self.runtime.current(name).detach().cpu().numpy().copy()
