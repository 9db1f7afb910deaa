"""Optimizer configs (§1.5): defaults, parameter groups, legacy assertions."""

import math

import pytest

from orttrainer import optim
from orttrainer.optim.config import _OptimizerConfig


def test_exports():
    assert optim.config._OptimizerConfig is _OptimizerConfig
    assert optim.lr_scheduler._LRScheduler is optim._LRScheduler
    for name in (
        "AdamConfig",
        "LambConfig",
        "SGDConfig",
        "ConstantWarmupLRScheduler",
        "CosineWarmupLRScheduler",
        "LinearWarmupLRScheduler",
        "PolyWarmupLRScheduler",
    ):
        assert hasattr(optim, name)


@pytest.mark.parametrize(
    "optim_name,lr,alpha,group_alpha",
    [
        ("AdamOptimizer", 0.1, 0.2, None),
        ("LambOptimizer", 0.2, 0.3, None),
        ("SGDOptimizer", 0.3, 0.4, None),
        ("SGDOptimizer", 0.3, 0.4, 0.5),
    ],
)
def test_optimizer_config(optim_name, lr, alpha, group_alpha):
    defaults = {"lr": lr, "alpha": alpha}
    params = [
        {"params": ["fc1.weight", "fc2.weight"], "alpha": alpha if group_alpha is None else group_alpha}
    ]
    cfg = _OptimizerConfig(name=optim_name, params=params, defaults=defaults)
    assert cfg.name == optim_name
    assert cfg.lr == lr and isinstance(cfg.lr, float)
    assert cfg.defaults is defaults
    # every group holds every default key, with its own overrides
    assert cfg.params == [
        {
            "params": ["fc1.weight", "fc2.weight"],
            "lr": lr,
            "alpha": alpha if group_alpha is None else group_alpha,
        }
    ]


def test_int_lr_is_stored_as_float():
    cfg = _OptimizerConfig("SGDOptimizer", [], {"lr": 1})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


@pytest.mark.parametrize(
    "optim_name,defaults,params,message",
    [
        ("AdamOptimizer", {"lr": -1}, [], "lr must be a positive number"),
        (
            "FooOptimizer",
            {"lr": 0.001},
            [],
            "'name' must be one of 'AdamOptimizer', 'LambOptimizer' or 'SGDOptimizer'",
        ),
        ("SGDOptimizer", [], [], "'defaults' must be a dict"),
        (optim.AdamConfig, {"lr": 0.003}, [], "'name' must be a string"),
        ("AdamOptimizer", {"lr": None}, [], "lr must be a positive number"),
        ("AdamOptimizer", {"alpha": 0.1}, [], "'defaults' must contain a {'lr' : positive number} entry"),
        ("SGDOptimizer", {"lr": 0.004}, {}, "'params' must be a list"),
        (
            "AdamOptimizer",
            {"lr": 0.005, "alpha": 2},
            [[]],
            "Each dict inside 'params' must contain a {'params' : [model parameter names]} entry"
            " and additional entries for custom hyper parameter values",
        ),
        (
            "AdamOptimizer",
            {"lr": 0.005, "alpha": 2},
            [{"alpha": 1}],
            "Each dict inside 'params' must contain a {'params' : [model parameter names]} entry"
            " and additional entries for custom hyper parameter values",
        ),
        (
            "AdamOptimizer",
            {"lr": 0.005, "alpha": 2},
            [{"params": ["w"]}],
            "Each dict inside 'params' must contain a {'params' : [model parameter names]} entry"
            " and additional entries for custom hyper parameter values",
        ),
        (
            "AdamOptimizer",
            {"lr": 0.005},
            [{"params": "param1", "alpha": 1}],
            "'params' has alpha hyper parameter not present at 'defaults'",
        ),
    ],
)
def test_optimizer_config_invalid_inputs(optim_name, defaults, params, message):
    with pytest.raises(AssertionError) as info:
        _OptimizerConfig(name=optim_name, params=params, defaults=defaults)
    assert str(info.value) == message


def test_sgd_config():
    cfg = optim.SGDConfig()
    assert (cfg.name, cfg.lr, cfg.defaults, cfg.params) == ("SGDOptimizer", 0.001, {"lr": 0.001}, [])
    assert optim.SGDConfig(lr=0.002).lr == 0.002
    with pytest.raises(AssertionError) as info:
        optim.SGDConfig(params=[{"params": ["layer1.weight"], "lr": 0.1}], lr=0.002)
    assert str(info.value) == "'params' must be an empty list for SGD optimizer"


def test_adam_config_defaults():
    cfg = optim.AdamConfig()
    assert cfg.name == "AdamOptimizer"
    assert (cfg.lr, cfg.alpha, cfg.beta, cfg.lambda_coef, cfg.epsilon, cfg.max_norm_clip) == (
        0.001,
        0.9,
        0.999,
        0.0,
        1e-8,
        1.0,
    )
    assert cfg.do_bias_correction is True
    assert cfg.weight_decay_mode is optim.AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE
    assert cfg.defaults == {
        "lr": 0.001,
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "epsilon": 1e-8,
        "max_norm_clip": 1.0,
        "do_bias_correction": True,
        "weight_decay_mode": optim.AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE,
    }


def test_adam_decay_mode():
    mode = optim.AdamConfig.DecayMode
    assert [(m.name, int(m)) for m in mode] == [("BEFORE_WEIGHT_UPDATE", 0), ("AFTER_WEIGHT_UPDATE", 1)]
    cfg = optim.AdamConfig(weight_decay_mode=mode.AFTER_WEIGHT_UPDATE)
    assert cfg.defaults["weight_decay_mode"] == 1


def test_lamb_config_defaults():
    cfg = optim.LambConfig()
    assert cfg.name == "LambOptimizer"
    assert (cfg.lr, cfg.alpha, cfg.beta, cfg.lambda_coef, cfg.epsilon, cfg.max_norm_clip) == (
        0.001,
        0.9,
        0.999,
        0.0,
        1e-6,
        1.0,
    )
    assert cfg.ratio_min == -math.inf and cfg.ratio_max == math.inf
    assert cfg.do_bias_correction is False
    assert list(cfg.defaults) == [
        "lr",
        "alpha",
        "beta",
        "lambda",
        "ratio_min",
        "ratio_max",
        "epsilon",
        "max_norm_clip",
        "do_bias_correction",
    ]


@pytest.mark.parametrize("config", [optim.AdamConfig, optim.LambConfig])
def test_param_groups_are_completed_and_lambda_coef_renamed(config):
    groups = [
        {"params": ["fc1.weight"], "alpha": 0.5, "lambda_coef": 0.01},
        {"params": ["fc2.weight"], "beta": 0.8},
    ]
    given = [dict(group) for group in groups]
    cfg = config(params=groups, alpha=0.85, lambda_coef=0.1)
    first, second = cfg.params
    assert set(first) == set(cfg.defaults) | {"params"}
    assert (first["alpha"], first["lambda"], first["beta"]) == (0.5, 0.01, 0.999)
    assert "lambda_coef" not in first
    assert (second["alpha"], second["lambda"], second["beta"]) == (0.85, 0.1, 0.8)
    assert groups == given  # the caller's groups are not completed in place


@pytest.mark.parametrize("config", [optim.AdamConfig, optim.LambConfig])
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"lr": -0.1}, "'lr' must be a positive number"),
        ({"alpha": -0.1}, "'alpha' must be a positive number"),
        ({"beta": -1}, "'beta' must be a positive number"),
        ({"lambda_coef": -1e-3}, "'lambda_coef' must be a positive number"),
        ({"epsilon": -1e-8}, "'epsilon' must be a positive number"),
        ({"max_norm_clip": 0}, "'max_norm_clip' must not be 0"),
        ({"do_bias_correction": 1}, "'do_bias_correction' must be a boolean"),
        ({"params": [{"params": ["w"], "lr": 0.1}]}, "'lr' is not supported inside params"),
    ],
)
def test_adam_lamb_invalid_arguments(config, kwargs, message):
    with pytest.raises(AssertionError) as info:
        config(**kwargs)
    assert str(info.value) == message


def test_adam_invalid_decay_mode():
    with pytest.raises(AssertionError) as info:
        optim.AdamConfig(weight_decay_mode=0)
    assert str(info.value) == "'weight_decay_mode' must be a AdamConfig.DecayMode"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"ratio_min": 0}, "'ratio_min' must be a valid float"),
        ({"ratio_max": None}, "'ratio_max' must be a valid float"),
    ],
)
def test_lamb_ratio_must_be_float(kwargs, message):
    with pytest.raises(AssertionError) as info:
        optim.LambConfig(**kwargs)
    assert str(info.value) == message
