"""`trainer._training_session`: the legacy TrainingSession getters over the trainer's state.

The original frontend read its state through the C++ session's getters (docs/legacy-api.md §2.9, §3.1)
and scripts and its test suite reach into them. Here they read the one TrainingState that every
session of the trainer shares; any other attribute (`graph`, `session`, `current`, ...) is the
current session's Runtime.
"""

import numpy as np
import torch

from orttrainer.state.layout import StateLayout

FP16_SUFFIX = "_fp16"  # the original backend's name of a weight's float16 copy
MIXED_PRECISION_KEY = "mixed_precision"  # get_model_state's precision key of those copies


def _is_fp16_copy(name, weights):
    return name.endswith(FP16_SUFFIX) and name[:-len(FP16_SUFFIX)] in weights


class TrainingSession:
    """Legacy getters: get_state, get_model_state, get_optimizer_state, get_partition_info_map, load_state."""

    def __init__(self, graphs, optimizer_name, mixed_precision=False):
        self._graphs = graphs  # engine.lifecycle.GraphLifecycle
        self._optimizer_name = optimizer_name
        self._mixed_precision = mixed_precision

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
        `Update_Count_<w>` (Adam), `Step` (LAMB), and under mixed precision `<w>_fp16` -- numpy copies."""
        state = {name: self._read(name) for name in self.runtime.graph.states}
        state.update({f"{w}{FP16_SUFFIX}": value for w, value in self._fp16_copies().items()})
        return state

    @property
    def layout(self):
        """The StateLayout of the current graph (state_dict names <-> buffers)."""
        return StateLayout.of(self.runtime.graph, self._optimizer_name)

    def get_model_state(self, include_mixed_precision_weights=False):
        """{'full_precision': {trainable weight: array}}; with include_mixed_precision_weights under
        mixed precision also {'mixed_precision': {weight: its float16 copy}}, as the original's backend."""
        state = self.layout.model_state(self._read)
        if include_mixed_precision_weights and self._mixed_precision:
            state[MIXED_PRECISION_KEY] = self._fp16_copies()
        return state

    def _fp16_copies(self):
        """The original's backend kept a float16 copy `<w>_fp16` of every trainable weight under mixed
        precision. Here the graph casts the fp32 master weights to its compute dtype inside the step, so
        the copies are made when asked for: the master weights rounded to float16."""
        if not self._mixed_precision:
            return {}
        return {w: self.runtime.current(w).detach().cpu().to(torch.float16).numpy()
                for w in self.runtime.graph.weights}

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
        # The float16 copies get_state reports are made from the fp32 weights: nothing to load.
        state = {name: value for name, value in state.items() if not _is_fp16_copy(name, runtime.graph.weights)}
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
