"""Optimizer update rules as ONNX sub-graphs, one block per weight.

Each block reads the current weight and optimizer state (graph inputs) and writes the next values
to named outputs; the runtime binds those outputs to the second buffer of each state pair.
State names follow the legacy backend: `Moment_1_<w>`, `Moment_2_<w>`, `Update_Count_<w>` (Adam)
and one shared `Step` (LAMB). `Update_Count` and `Step` hold the number of the *next* update.
"""

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from .graph_builder import MS_DOMAIN, GraphBuilder

SHARED_STEP = "Step"


@dataclass
class StateSpec:
    """One tensor of training state: its name and initial value; `updated` names the output that
    carries its next value.

    `in_place`: the update may overwrite the input buffer. True for moments (only their own
    elementwise update reads them) and for weights when every update runs after the last reader of
    any weight (see `training_graph._after_every_reader`); false under mixed precision, where a
    non-finite step is discarded by not swapping buffers, so the old values must survive.
    """

    name: str
    initial: np.ndarray
    in_place: bool = False

    @property
    def updated(self):
        return updated_name(self.name)


def hyper_parameters(optim_config, weight_names):
    """Per-weight hyper-parameters: a weight's group values over the defaults, later groups winning."""
    per_weight = {}
    for name in weight_names:
        values = {k: v for k, v in optim_config.defaults.items() if k not in ("lr", "params")}
        for group in optim_config.params:
            if name in group["params"]:
                values.update({k: v for k, v in group.items() if k not in ("lr", "params")})
        for key, value in values.items():
            if not isinstance(value, (int, float)):
                raise ValueError("Optimizer attributes must be either float or int.")
        per_weight[name] = values
    return per_weight


def optimizer_state(optim_name, weights, in_place_moments=True):
    """The optimizer state tensors (name -> StateSpec) for `weights` ({name: np.ndarray}).

    Moments are updated in place unless a step may have to be discarded after it ran (see StateSpec).
    """
    states = {}
    if optim_name in ("AdamOptimizer", "LambOptimizer"):
        for name, value in weights.items():
            for moment in (f"Moment_1_{name}", f"Moment_2_{name}"):
                states[moment] = StateSpec(moment, np.zeros_like(value), in_place=in_place_moments)
            if optim_name == "AdamOptimizer":
                states[f"Update_Count_{name}"] = StateSpec(f"Update_Count_{name}", np.ones([1], np.int64))
    if optim_name == "LambOptimizer":
        states[SHARED_STEP] = StateSpec(SHARED_STEP, np.ones([1], np.int64))
    return states


def updated_name(state_name):
    return f"{state_name}.updated"


def build_sgd(b: GraphBuilder, lr, weight, grad, hp):
    b.op("Sub", [weight, b.op("Mul", [lr, grad])], outputs=[updated_name(weight)])


def build_adam(b: GraphBuilder, lr, weight, grad, hp):
    # The onnxruntime kernel: bias correction, both weight-decay modes. Clipping happened upstream
    # (the CPU kernel ignores its global-norm input), so no norm is passed here.
    b.op(
        "AdamOptimizer",
        [lr, f"Update_Count_{weight}", weight, grad, f"Moment_1_{weight}", f"Moment_2_{weight}"],
        outputs=[updated_name(f"Update_Count_{weight}"), updated_name(f"Moment_1_{weight}"),
                 updated_name(f"Moment_2_{weight}"), updated_name(weight)],
        domain=MS_DOMAIN,
        alpha=float(hp["alpha"]),
        beta=float(hp["beta"]),
        epsilon=float(hp["epsilon"]),
        max_norm_clip=float(hp["max_norm_clip"]),
        do_bias_correction=int(hp["do_bias_correction"]),
        weight_decay_mode=int(hp["weight_decay_mode"]),
        **{"lambda": float(hp["lambda"])},
    )


def build_lamb(b: GraphBuilder, lr, weight, grad, hp, step_float):
    """LAMB composed from standard ops (no CPU LambOptimizer kernel), following onnxruntime's CUDA rule:

    m1 = a·m1 + (1−a)·g;  m2 = b·m2 + (1−b)·g²;  (bias-corrected by 1−a^t, 1−b^t when enabled)
    d = m1ˆ / (√m2ˆ + ε) + λ·w;  r = clamp(‖w‖ / ‖d‖, ratio_min, ratio_max), 1 if either norm is 0
    w ← w − lr·r·d
    """
    alpha, beta = float(hp["alpha"]), float(hp["beta"])
    m1, m2 = f"Moment_1_{weight}", f"Moment_2_{weight}"
    m1_new = b.op("Add", [b.op("Mul", [m1, b.const(alpha)]), b.op("Mul", [grad, b.const(1.0 - alpha)])],
                  outputs=[updated_name(m1)])
    grad_sq = b.op("Mul", [grad, grad])
    m2_new = b.op("Add", [b.op("Mul", [m2, b.const(beta)]), b.op("Mul", [grad_sq, b.const(1.0 - beta)])],
                  outputs=[updated_name(m2)])
    if hp["do_bias_correction"]:
        m1_hat = b.op("Div", [m1_new, b.op("Sub", [b.const(1.0), b.op("Pow", [b.const(alpha), step_float])])])
        m2_hat = b.op("Div", [m2_new, b.op("Sub", [b.const(1.0), b.op("Pow", [b.const(beta), step_float])])])
    else:
        m1_hat, m2_hat = m1_new, m2_new
    direction = b.op("Div", [m1_hat, b.op("Add", [b.op("Sqrt", [m2_hat]), b.const(float(hp["epsilon"]))])])
    if float(hp["lambda"]) != 0.0:
        direction = b.op("Add", [direction, b.op("Mul", [weight, b.const(float(hp["lambda"]))])])
    w_norm = b.op("ReduceL2", [weight], keepdims=0)
    d_norm = b.op("ReduceL2", [direction], keepdims=0)
    ratio = b.op("Clip", [b.op("Div", [w_norm, d_norm]), b.const(float(hp["ratio_min"])),
                          b.const(float(hp["ratio_max"]))])
    either_zero = b.op("Or", [b.op("Equal", [w_norm, b.const(0.0)]), b.op("Equal", [d_norm, b.const(0.0)])])
    ratio = b.op("Where", [either_zero, b.const(1.0), ratio])
    step = b.op("Mul", [b.op("Mul", [lr, ratio]), direction])
    b.op("Sub", [weight, step], outputs=[updated_name(weight)])


def build_optimizer(b: GraphBuilder, optim_name, lr, grads, per_weight_hp):
    """Append the update of every weight; `grads` maps weight name -> final gradient name."""
    step_float = None
    if optim_name == "LambOptimizer":
        step_float = b.op("Cast", [SHARED_STEP], to=TensorProto.FLOAT)
        b.op("Add", [SHARED_STEP, b.const(1, np.int64)], outputs=[updated_name(SHARED_STEP)])
    for weight, grad in grads.items():
        hp = per_weight_hp[weight]
        if optim_name == "SGDOptimizer":
            build_sgd(b, lr, weight, grad, hp)
        elif optim_name == "AdamOptimizer":
            build_adam(b, lr, weight, grad, hp)
        elif optim_name == "LambOptimizer":
            build_lamb(b, lr, weight, grad, hp, step_float)
        else:  # _OptimizerConfig already restricts the name; this guards future additions
            raise ValueError(f"Unsupported optimizer {optim_name!r}")
