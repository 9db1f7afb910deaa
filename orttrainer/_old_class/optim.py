"""The old class's optimizer arguments as a new optimizer config (docs/legacy-api.md, "The old class" §1).

The old class named the optimizer ('SGDOptimizer', 'AdamOptimizer', 'LambOptimizer') and called
`map_optimizer_attributes(weight_name) -> dict` once per trainable weight; the backend turned float
values into float attributes and int/bool values into int attributes of that weight's optimizer node.
Here the weights that share one attribute dict become one parameter group of `optim.*Config`.
"""

import onnx
import torch

from orttrainer import optim

# Per-weight attributes each optimizer accepts, and the kind of value the backend took for each.
_FLOAT, _INT = "float", "int"
_ATTRIBUTES = {
    "SGDOptimizer": {},
    "AdamOptimizer": {"alpha": _FLOAT, "beta": _FLOAT, "lambda": _FLOAT, "epsilon": _FLOAT,
                      "do_bias_correction": _INT, "weight_decay_mode": _INT},
    "LambOptimizer": {"alpha": _FLOAT, "beta": _FLOAT, "lambda": _FLOAT, "epsilon": _FLOAT,
                      "ratio_min": _FLOAT, "ratio_max": _FLOAT, "do_bias_correction": _INT},
}
_CONFIGS = {"SGDOptimizer": optim.SGDConfig, "AdamOptimizer": optim.AdamConfig, "LambOptimizer": optim.LambConfig}


def trainable_weights(model, frozen_weights):
    """The weights the old class called map_optimizer_attributes for, in model order: a torch model's
    parameters (tied ones once, by their first name), an ONNX model's float initializers; without
    `frozen_weights` (an unknown frozen name is an error, as in the original)."""
    if isinstance(model, torch.nn.Module):
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        known = set(model.state_dict().keys())
    elif isinstance(model, onnx.ModelProto):
        floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)
        names = [i.name for i in model.graph.initializer if i.data_type in floats]
        known = {i.name for i in model.graph.initializer}
    else:
        raise ValueError("'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'")
    unknown = [n for n in frozen_weights if n not in known]
    if unknown:
        raise RuntimeError(f"{unknown} params from 'frozen_weights' not found in the model; its weights are "
                           f"{sorted(known)}")
    frozen = set(frozen_weights)
    return [n for n in names if n not in frozen]


def optimizer_config(name, map_optimizer_attributes, weights):
    """`optim.<Name>Config` whose parameter groups hold what map_optimizer_attributes gives each weight."""
    if name not in _CONFIGS:
        raise ValueError(f"training_optimizer_name {name!r} is not one of {sorted(_CONFIGS)}")
    if map_optimizer_attributes is not None and not callable(map_optimizer_attributes):
        raise TypeError("'map_optimizer_attributes' must be None or a callable weight_name -> dict")
    groups = []  # [(attributes, [weights])], in first-seen order
    for weight in weights if map_optimizer_attributes is not None else []:
        attributes = map_optimizer_attributes(weight)
        if attributes is None:
            attributes = {}
        if not isinstance(attributes, dict):
            raise TypeError(f"map_optimizer_attributes({weight!r}) must return a dict, got "
                            f"{type(attributes).__name__}")
        attributes = _checked(name, weight, attributes)
        if not attributes:
            continue  # the optimizer's defaults
        for known, members in groups:
            if known == attributes:
                members.append(weight)
                break
        else:
            groups.append((attributes, [weight]))
    params = [{"params": members, **attributes} for attributes, members in groups]
    return _CONFIGS[name](params=params) if params else _CONFIGS[name]()


def _checked(name, weight, attributes):
    allowed = _ATTRIBUTES[name]
    out = {}
    for key, value in attributes.items():
        if key not in allowed:
            raise ValueError(f"map_optimizer_attributes({weight!r}) returned {key!r}, which {name} does not take "
                             f"per weight; it takes {sorted(allowed) or 'no attributes'}")
        if isinstance(value, bool) or isinstance(value, int):
            kind = _INT
        elif isinstance(value, float):
            kind = _FLOAT
        else:
            raise ValueError(f"map_optimizer_attributes({weight!r})[{key!r}] is {value!r} "
                             f"({type(value).__name__}): only float, int and bool values are supported")
        if allowed[key] == _INT:
            if kind != _INT:
                raise ValueError(f"map_optimizer_attributes({weight!r})[{key!r}] must be an int or bool, got {value!r}")
            value = bool(value) if key == "do_bias_correction" else optim.AdamConfig.DecayMode(int(value))
        else:
            value = float(value)  # the backend read 0 for 'lambda' as an int attribute; the value is the same
        out[key] = value
    return out
