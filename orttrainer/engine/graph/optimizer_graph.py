"""Optimizer update rules as ONNX sub-graphs, one block per weight.

Each block reads the current weight and optimizer state (graph inputs) and writes the next values
to named outputs; the runtime binds those outputs to the second buffer of each state pair.
State names follow the legacy backend: `Moment_1_<w>`, `Moment_2_<w>`, `Update_Count_<w>` (Adam)
and one shared `Step` (LAMB). `Update_Count` and `Step` hold the number of the *next* update.
"""

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from orttrainer.engine.graph.builder import MS_DOMAIN, GraphBuilder
from orttrainer.engine.graph.torch_matmul import DOMAIN as LIBRARY_DOMAIN

SHARED_STEP = "Step"
LIBRARY_ADAM = "Adam"  # engine/kernels/adam.cc, in the kernel library's domain


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
                # np.zeros (calloc) maps zero pages lazily; zeros_like writes every byte of ~1 GB at
                # GPT-2 small before the first step needs it.
                states[moment] = StateSpec(moment, np.zeros(value.shape, value.dtype), in_place=in_place_moments)
            if optim_name == "AdamOptimizer":
                states[f"Update_Count_{name}"] = StateSpec(f"Update_Count_{name}", np.ones([1], np.int64))
    if optim_name == "LambOptimizer":
        states[SHARED_STEP] = StateSpec(SHARED_STEP, np.ones([1], np.int64))
    return states


def updated_name(state_name):
    return f"{state_name}.updated"


@dataclass(frozen=True)
class Target:
    """What one optimizer block updates.

    `weight` keys the optimizer state (`Moment_1_<weight>`...). `param` is the tensor the block reads
    and rewrites: the weight itself, or under ZeRO-1 this rank's flat segment of it. LAMB's trust
    ratio needs norms of the WHOLE weight and direction: `‖w‖` comes from `weight` (every rank holds
    every weight); with `direction_norm` set, ‖d‖ is fed (summed over ranks) instead of computed, and
    the block also outputs its segment's Σd² as `direction_square_sum(weight)`.
    """

    weight: str
    param: str
    direction_norm: str | None = None
    # Tensor parallel: `param` is a shard; group_sum(b, x) sums a scalar over the horizontal group, so
    # LAMB's ‖w‖ and ‖d‖ are the whole weight's (engine/parallel/megatron.py).
    group_sum: object = None

    @classmethod
    def whole(cls, weight):
        return cls(weight, weight)


def direction_square_sum(weight):
    return f"{weight}.lamb_direction_square_sum"


def build_sgd(b: GraphBuilder, lr, target: Target, grad, hp):
    b.op("Sub", [target.param, b.op("Mul", [lr, grad])], outputs=[updated_name(target.param)])


@dataclass(frozen=True)
class AdamKernel:
    """Which node computes Adam's update. `library`: the kernel library's `com.orttrainer::Adam`
    (engine/kernels/adam.cc: AdamOptimizer's arithmetic, multi-threaded) instead of onnxruntime's
    AdamOptimizer; `apply` (library only): a bool [1] tensor, false for a step to discard, which the
    library's Adam then skips -- so its states may be updated in place (StateSpec.in_place)."""

    library: bool = False
    apply: str = ""


def build_adam(b: GraphBuilder, lr, target: Target, grad, hp, kernel=AdamKernel()):
    # Bias correction, both weight-decay modes. Clipping happened upstream (the CPU kernel ignores
    # its global-norm input), so no norm is passed here.
    w = target.weight
    inputs = [lr, f"Update_Count_{w}", target.param, grad, f"Moment_1_{w}", f"Moment_2_{w}"]
    outputs = [updated_name(f"Update_Count_{w}"), updated_name(f"Moment_1_{w}"),
               updated_name(f"Moment_2_{w}"), updated_name(target.param)]
    attrs = dict(alpha=float(hp["alpha"]), beta=float(hp["beta"]), epsilon=float(hp["epsilon"]),
                 do_bias_correction=int(hp["do_bias_correction"]),
                 weight_decay_mode=int(hp["weight_decay_mode"]),
                 **{"lambda": float(hp["lambda"])})
    if kernel.library:
        b.op(LIBRARY_ADAM, inputs + ([kernel.apply] if kernel.apply else []), outputs=outputs,
             domain=LIBRARY_DOMAIN, **attrs)
    else:
        b.op("AdamOptimizer", inputs, outputs=outputs, domain=MS_DOMAIN,
             max_norm_clip=float(hp["max_norm_clip"]), **attrs)


def build_lamb(b: GraphBuilder, lr, target: Target, grad, hp, step_float):
    """LAMB composed from standard ops (no CPU LambOptimizer kernel), following onnxruntime's CUDA rule:

    m1 = a·m1 + (1−a)·g;  m2 = b·m2 + (1−b)·g²;  (bias-corrected by 1−a^t, 1−b^t when enabled)
    d = m1ˆ / (√m2ˆ + ε) + λ·w;  r = clamp(‖w‖ / ‖d‖, ratio_min, ratio_max), 1 if either norm is 0
    w ← w − lr·r·d
    """
    alpha, beta = float(hp["alpha"]), float(hp["beta"])
    m1, m2 = f"Moment_1_{target.weight}", f"Moment_2_{target.weight}"
    param = target.param
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
        direction = b.op("Add", [direction, b.op("Mul", [param, b.const(float(hp["lambda"]))])])
    def whole_norm(x):
        return b.op("Sqrt", [target.group_sum(b, b.op("ReduceSumSquare", [x], keepdims=0))])

    w_norm = whole_norm(target.weight) if target.group_sum else b.op("ReduceL2", [target.weight], keepdims=0)
    if target.direction_norm is not None:  # fed: summed over ranks (and the horizontal group) in torch
        b.op("ReduceSumSquare", [direction], keepdims=0, outputs=[direction_square_sum(target.weight)])
        d_norm = target.direction_norm
    elif target.group_sum is not None:
        d_norm = whole_norm(direction)
    else:
        d_norm = b.op("ReduceL2", [direction], keepdims=0)
    ratio = b.op("Clip", [b.op("Div", [w_norm, d_norm]), b.const(float(hp["ratio_min"])),
                          b.const(float(hp["ratio_max"]))])
    either_zero = b.op("Or", [b.op("Equal", [w_norm, b.const(0.0)]), b.op("Equal", [d_norm, b.const(0.0)])])
    ratio = b.op("Where", [either_zero, b.const(1.0), ratio])
    step = b.op("Mul", [b.op("Mul", [lr, ratio]), direction])
    b.op("Sub", [param, step], outputs=[updated_name(param)])


_BUILDERS = {"SGDOptimizer": build_sgd, "AdamOptimizer": build_adam, "LambOptimizer": build_lamb}


def build_optimizer(b: GraphBuilder, optim_name, lr, grads, per_weight_hp, targets=None, adam=AdamKernel()):
    """Append the update of every weight; `grads` maps weight name -> final gradient name, `targets`
    weight name -> Target (default: every weight updated whole), `adam` the node Adam's updates use."""
    if optim_name not in _BUILDERS:  # _OptimizerConfig already restricts the name; guards additions
        raise ValueError(f"Unsupported optimizer {optim_name!r}")
    extra = []
    if optim_name == "LambOptimizer":
        extra = [b.op("Cast", [SHARED_STEP], to=TensorProto.FLOAT)]
        b.op("Add", [SHARED_STEP, b.const(1, np.int64)], outputs=[updated_name(SHARED_STEP)])
    elif optim_name == "AdamOptimizer":
        extra = [adam]
    for weight, grad in grads.items():
        target = targets[weight] if targets else Target.whole(weight)
        _BUILDERS[optim_name](b, lr, target, grad, per_weight_hp[weight], *extra)
