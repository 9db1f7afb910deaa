"""Optimizer configurations and learning-rate schedulers of the legacy ORTTrainer API."""

from orttrainer.optim import config, lr_scheduler
from orttrainer.optim.config import AdamConfig, LambConfig, SGDConfig, _OptimizerConfig
from orttrainer.optim.lr_scheduler import (
    ConstantWarmupLRScheduler,
    CosineWarmupLRScheduler,
    LinearWarmupLRScheduler,
    PolyWarmupLRScheduler,
    _LRScheduler,
)

__all__ = [
    "config",
    "lr_scheduler",
    "_OptimizerConfig",
    "AdamConfig",
    "LambConfig",
    "SGDConfig",
    "_LRScheduler",
    "ConstantWarmupLRScheduler",
    "CosineWarmupLRScheduler",
    "LinearWarmupLRScheduler",
    "PolyWarmupLRScheduler",
]
