"""Pipeline parallel checkpoints (docs/distributed.md, "Pipeline parallel"): each rank's state_dict holds
ITS stage in the legacy layout, and a load gives each stage its part of a whole-model state.

A stage's state_dict: `model.full_precision` = the stage's trained weights (whole, legacy names, their
torch shapes), the frozen initializers it reads that the one-process state_dict keeps, and the tied
names of its weights; `optimizer` = their moments in the weights' shapes (the stage session keeps them
flat) and counters; `partition_info` = {} (nothing is sharded: aggregation needs the key);
`trainer_options` = the legacy keys plus PIPELINE_SIZE_KEY and PIPELINE_STAGE_KEY (the legacy layout has
none for pipeline parallel). A weight read by several stages (tied) is in each of their files, equal.

`aggregate_checkpoints(stage files)` merges them (checkpoint aggregation, "pipeline" case) into the
one-process state_dict; `load(...)` takes a one-process (or merged) state on every stage.
"""

import numpy as np
from onnx import numpy_helper

from orttrainer.state import load_checks as _load_checks
from orttrainer.state import layout as _state_layout
from orttrainer import _utils as keys

PIPELINE_SIZE_KEY = "pipeline_parallel_size"
PIPELINE_STAGE_KEY = "pipeline_stage"


def _owned(pipeline):
    """The initializer names this stage's file holds values for (stage 0 also those no stage reads)."""
    names = set(pipeline.stage.weights)
    if pipeline.stage.index == 0:
        read = {w for stage in pipeline.plan for w in stage.weights}
        names |= {i.name for i in pipeline.forward.graph.initializer} - read
    return names


def _keep(pipeline):
    """What the one-process state_dict keeps besides trained weights (frozen_weights, torch state keys)."""
    options = pipeline.options
    torch_model = pipeline.factory.torch_model
    torch_keys = set(torch_model.state_dict().keys()) if torch_model is not None else set()
    return set(options.utils.frozen_weights) | torch_keys


def _read(pipeline, name):
    """A state buffer as numpy, a moment in its weight's shape (the stage session keeps it flat)."""
    value = pipeline.runtime.current(name).detach().cpu().numpy().copy()
    for prefix in ("Moment_1_", "Moment_2_"):
        weight = name[len(prefix):] if name.startswith(prefix) else None
        if weight in pipeline.shapes:
            return value.reshape(pipeline.shapes[weight])
    return value.reshape(pipeline.shapes[name]) if name in pipeline.shapes else value


def state_dict(pipeline, steps, optimizer_name):
    """This stage's state_dict (module docstring); `steps` gives the counters' entries."""
    runtime = pipeline.runtime
    layout = _state_layout.StateLayout.of(runtime.graph, optimizer_name)
    trained = layout.model_state(lambda w: _read(pipeline, w))[keys.FULL_PRECISION_KEY]
    owned = _owned(pipeline)
    frozen_inits = [i for i in pipeline.forward.graph.initializer if i.name in owned]
    model = {w: v for w, v in trained.items()}
    keep = _keep(pipeline)
    for init in frozen_inits:
        if init.name in keep and init.name not in model and init.name not in pipeline.trainable:
            model[init.name] = numpy_helper.to_array(init).copy()
    for alias, source in pipeline.aliases.items():
        if source in model:
            model[alias] = model[source]
    options = _state_layout.trainer_options_state(pipeline.options, optimizer_name)
    options[PIPELINE_SIZE_KEY] = int(pipeline.stages)
    options[PIPELINE_STAGE_KEY] = int(pipeline.stage.index)
    state = {keys.MODEL_KEY: {keys.FULL_PRECISION_KEY: model},
             keys.OPTIMIZER_KEY: layout.optimizer_state(lambda name: _read(pipeline, name)),
             keys.PARTITION_INFO_KEY: {},
             keys.TRAINER_OPTIONS_KEY: options}
    state.update(steps.state_dict())
    return state


def whole_model_keys(pipeline, optimizer_name):
    """The key skeleton of the one-process state_dict of this model ({..: None}), for the legacy
    strict-key checks of a load."""
    model = {}
    keep = _keep(pipeline)
    for init in pipeline.forward.graph.initializer:
        if init.name in pipeline.trainable or init.name in keep:
            model[init.name] = None
    for alias, source in pipeline.aliases.items():
        if source in model:
            model[alias] = None
    per_weight = _state_layout._PER_WEIGHT.get(optimizer_name, ())
    optimizer = {w: dict.fromkeys(per_weight) for w in sorted(pipeline.trainable)} if per_weight else {}
    for key in _state_layout._SHARED.get(optimizer_name, ()):
        optimizer.setdefault(keys.SHARED_OPTIMIZER_STATE_KEY, {})[key] = None
    return {keys.MODEL_KEY: {keys.FULL_PRECISION_KEY: model}, keys.OPTIMIZER_KEY: optimizer}


def load(pipeline, state_dict, strict, steps, optimizer_name):
    """Load a whole-model state_dict (one process's, or stage files merged by load_checkpoint) into this
    stage: everything is checked first, then this stage's weights, moments and counters are set."""
    known = {i.name for i in pipeline.forward.graph.initializer} | set(pipeline.aliases)
    model_states, optimizer, _ = _load_checks.check_state_dict(
        state_dict, strict, optimizer_name, current=lambda: whole_model_keys(pipeline, optimizer_name),
        known=known, allow_unexpected=False)
    model_states = {pipeline.aliases.get(n, n): v for n, v in model_states.items()}
    runtime = pipeline.runtime
    layout = _state_layout.StateLayout.of(runtime.graph, optimizer_name)
    values = {}
    for w in runtime.graph.weights:
        if w in model_states:
            value = _load_checks.as_numpy(model_states[w])
            values[w] = _load_checks.checked(w, value, np.empty(pipeline.shapes[w], np.float32))
    for weight, key, name in layout.optimizer_entries():
        value = (optimizer.get(weight) or {}).get(key)
        if value is None:
            continue
        value = _load_checks.as_numpy(value)
        like = runtime.current(name)
        if value.size != like.numel():
            raise ValueError(f"State {key} of {weight!r} has shape {list(value.shape)} in the state_dict but "
                             f"{like.numel()} elements in this trainer; the checkpoint is from a different model")
        values[name] = _load_checks.check_dtype(name, value.reshape(tuple(like.shape)), like)
    inits = {i.name: i for i in pipeline.forward.graph.initializer}
    for name, value in model_states.items():  # frozen values are constants of the stage's graph
        if name in pipeline.stage.weights and name not in runtime.graph.weights and name in inits:
            if not np.array_equal(_load_checks.as_numpy(value), numpy_helper.to_array(inits[name])):
                raise NotImplementedError(
                    f"state_dict sets frozen initializer {name!r} to a new value: loading frozen values is not "
                    "built under pipeline parallel; load it into a one-process trainer instead")
    apply_steps = steps.checked_load(state_dict)
    runtime.load(values)
    apply_steps()
