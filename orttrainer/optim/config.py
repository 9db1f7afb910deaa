"""Optimizer configurations (docs/legacy-api.md §1.5): hyper-parameters only, the backend does the update.

Parameter groups follow PyTorch's idea: each group names model parameters (`'params'`) and overrides
some of the defaults for them. Argument errors are AssertionErrors, as in the legacy API.
"""

from enum import IntEnum, unique

_OPTIMIZER_NAMES = ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _OptimizerConfig:
    r"""Base class of the optimizer configurations.

    Args:
        name (str): one of 'AdamOptimizer', 'LambOptimizer', 'SGDOptimizer'.
        params (list of dict): parameter groups, each `{'params': [names], <hyper-parameter>: value, ...}`;
            every hyper-parameter of a group must exist in `defaults` (`lambda_coef` stands for `lambda`).
        defaults (dict): hyper-parameters for every parameter not in a group; must contain `'lr'`.

    After construction every group holds every default key it did not override (the caller's dicts
    are copied, not completed in place), and a group's `lambda_coef` is renamed to `lambda`.
    """

    def __init__(self, name, params, defaults):
        assert isinstance(name, str), "'name' must be a string"
        assert (
            name in _OPTIMIZER_NAMES
        ), "'name' must be one of 'AdamOptimizer', 'LambOptimizer' or 'SGDOptimizer'"
        assert isinstance(defaults, dict), "'defaults' must be a dict"
        assert "lr" in defaults, "'defaults' must contain a {'lr' : positive number} entry"
        assert _is_number(defaults["lr"]) and defaults["lr"] >= 0, "lr must be a positive number"
        assert isinstance(params, list), "'params' must be a list"
        for group in params:
            assert isinstance(group, dict) and len(group) > 1 and "params" in group, (
                "Each dict inside 'params' must contain a {'params' : [model parameter names]} entry"
                " and additional entries for custom hyper parameter values"
            )
            for key in group:
                if key != "params":
                    assert (
                        key in defaults or key.replace("_coef", "") in defaults
                    ), f"'params' has {key} hyper parameter not present at 'defaults'"

        self.name = name
        self.lr = float(defaults["lr"])
        self.defaults = defaults
        # Every other hyper-parameter is also an attribute (legacy: config.alpha, config.lambda_coef, ...).
        for key, value in defaults.items():
            if key != "lr":
                setattr(self, "lambda_coef" if key == "lambda" else key, value)
        self.params = []
        for group in params:
            self._add_param_group(group)

    def _add_param_group(self, param_group):
        """Appends a copy of `param_group` completed with the defaults it does not override."""
        assert isinstance(param_group, dict), "param group must be a dict"
        group = dict(param_group)
        if "lambda_coef" in group:
            group["lambda"] = group.pop("lambda_coef")
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        self.params.append(group)


def _assert_non_negative(**values):
    for name, value in values.items():
        assert _is_number(value) and value >= 0, f"'{name}' must be a positive number"


def _assert_no_group_lr(params):
    for group in params:
        assert not (isinstance(group, dict) and "lr" in group), "'lr' is not supported inside params"


class SGDConfig(_OptimizerConfig):
    r"""SGD configuration. Parameter groups are not supported: `params` must be empty.

    Args:
        params (list, default is []): must be empty.
        lr (float, default is 0.001): learning rate.
    """

    def __init__(self, params=[], lr=0.001):  # noqa: B006 - legacy signature, never mutated
        super().__init__(name="SGDOptimizer", params=params, defaults={"lr": lr})
        assert (
            isinstance(params, list) and len(params) == 0
        ), "'params' must be an empty list for SGD optimizer"


class AdamConfig(_OptimizerConfig):
    r"""Adam configuration (backend op `AdamOptimizer`).

    Args:
        params (list of dict, default is []): parameter groups (no per-group 'lr').
        lr (float, default is 0.001): learning rate.
        alpha (float, default is 0.9): coefficient of the running average of the gradient.
        beta (float, default is 0.999): coefficient of the running average of the squared gradient.
        lambda_coef (float, default is 0.0): weight decay coefficient (backend attribute `lambda`).
        epsilon (float, default is 1e-8): term added to the denominator.
        max_norm_clip (float, default is 1.0): gradient-norm clipping threshold; must not be 0.
        do_bias_correction (bool, default is True): bias-corrected moments.
        weight_decay_mode (AdamConfig.DecayMode, default is BEFORE_WEIGHT_UPDATE): where decay applies.
    """

    @unique
    class DecayMode(IntEnum):
        BEFORE_WEIGHT_UPDATE = 0
        AFTER_WEIGHT_UPDATE = 1

    def __init__(
        self,
        params=[],
        lr=0.001,
        alpha=0.9,
        beta=0.999,
        lambda_coef=0.0,
        epsilon=1e-8,  # noqa: B006
        max_norm_clip=1.0,
        do_bias_correction=True,
        weight_decay_mode=DecayMode.BEFORE_WEIGHT_UPDATE,
    ):
        _assert_non_negative(lr=lr, alpha=alpha, beta=beta, lambda_coef=lambda_coef, epsilon=epsilon)
        assert max_norm_clip != 0, "'max_norm_clip' must not be 0"
        assert isinstance(do_bias_correction, bool), "'do_bias_correction' must be a boolean"
        assert isinstance(
            weight_decay_mode, AdamConfig.DecayMode
        ), "'weight_decay_mode' must be a AdamConfig.DecayMode"
        _assert_no_group_lr(params)
        defaults = {
            "lr": lr,
            "alpha": alpha,
            "beta": beta,
            "lambda": lambda_coef,
            "epsilon": epsilon,
            "max_norm_clip": max_norm_clip,
            "do_bias_correction": do_bias_correction,
            "weight_decay_mode": weight_decay_mode,
        }
        super().__init__(name="AdamOptimizer", params=params, defaults=defaults)


class LambConfig(_OptimizerConfig):
    r"""LAMB configuration (backend op `LambOptimizer`).

    Args:
        params (list of dict, default is []): parameter groups (no per-group 'lr').
        lr (float, default is 0.001): learning rate.
        alpha (float, default is 0.9): coefficient of the running average of the gradient.
        beta (float, default is 0.999): coefficient of the running average of the squared gradient.
        lambda_coef (float, default is 0.0): weight decay coefficient (backend attribute `lambda`).
        ratio_min (float, default is -inf): lower bound of the trust ratio.
        ratio_max (float, default is inf): upper bound of the trust ratio.
        epsilon (float, default is 1e-6): term added to the denominator.
        max_norm_clip (float, default is 1.0): gradient-norm clipping threshold; must not be 0.
        do_bias_correction (bool, default is False): bias-corrected moments.
    """

    def __init__(
        self,
        params=[],
        lr=0.001,
        alpha=0.9,
        beta=0.999,
        lambda_coef=0.0,  # noqa: B006
        ratio_min=float("-inf"),
        ratio_max=float("inf"),
        epsilon=1e-6,
        max_norm_clip=1.0,
        do_bias_correction=False,
    ):
        _assert_non_negative(lr=lr, alpha=alpha, beta=beta, lambda_coef=lambda_coef)
        assert isinstance(ratio_min, float), "'ratio_min' must be a valid float"
        assert isinstance(ratio_max, float), "'ratio_max' must be a valid float"
        _assert_non_negative(epsilon=epsilon)
        assert max_norm_clip != 0, "'max_norm_clip' must not be 0"
        assert isinstance(do_bias_correction, bool), "'do_bias_correction' must be a boolean"
        _assert_no_group_lr(params)
        defaults = {
            "lr": lr,
            "alpha": alpha,
            "beta": beta,
            "lambda": lambda_coef,
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "epsilon": epsilon,
            "max_norm_clip": max_norm_clip,
            "do_bias_correction": do_bias_correction,
        }
        super().__init__(name="LambOptimizer", params=params, defaults=defaults)
