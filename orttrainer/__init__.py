"""orttrainer: the legacy ONNX Runtime `ORTTrainer` frontend, on today's onnxruntime-training.

Public names are imported lazily (PEP 562) so that light entry points such as
`orttrainer ckpt inspect` do not pay for importing torch and onnxruntime.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = {"amp", "optim", "checkpoint", "model_desc_validation", "postprocess", "ort_trainer"}
# Not in __all__, but reached as attributes by the original's scripts and tests
# (onnxruntime.training.orttrainer.ORTTrainerOptions, onnxruntime.training._checkpoint_storage, ...).
_OTHER_SUBMODULES = {"orttrainer", "orttrainer_options", "_utils", "_checkpoint_storage"}
_NAMES = {
    "ORTTrainer": "orttrainer.orttrainer",
    "ORTTrainerOptions": "orttrainer.orttrainer_options",
    "TrainStepInfo": "orttrainer.train_step_info",
    "PropagateCastOpsStrategy": "orttrainer.orttrainer_options",
}

__all__ = sorted(_SUBMODULES | set(_NAMES) | {"is_ortmodule_available"})


def is_ortmodule_available():
    """False: this package is the ORTTrainer frontend; it has no ORTModule."""
    return False


def __getattr__(name):
    if name in _SUBMODULES or name in _OTHER_SUBMODULES:
        return importlib.import_module(f"orttrainer.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'orttrainer' has no attribute {name!r}")


def __dir__():
    return __all__
