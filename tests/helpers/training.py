"""A CPU trainer, built and trained the one way the tests share."""

import copy

import torch

from orttrainer import ORTTrainer, ORTTrainerOptions


def make_options(extra=None):
    """ORTTrainerOptions on the CPU, deep-merged (one level) with `extra`."""
    opts = {"device": {"id": "cpu"}}
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(opts.get(key), dict):
            opts[key] = {**opts[key], **value}
        else:
            opts[key] = value
    return ORTTrainerOptions(opts)


def make_trainer(model, desc, optim_config, loss_fn=None, seed=None, **options):
    """ORTTrainer on the CPU of `model` (built by `model()` after seeding when it is a class or a
    function), a copy of `desc`, and `options` merged into the CPU options."""
    if seed is not None:
        torch.manual_seed(seed)
    if not isinstance(model, torch.nn.Module):
        model = model()
    return ORTTrainer(model, copy.deepcopy(desc), optim_config, loss_fn=loss_fn, options=make_options(options))


def train(trainer, batches):
    """One train_step per batch; the losses as floats."""
    losses = []
    for batch in batches:
        out = trainer.train_step(*batch)
        losses.append(float((out[0] if isinstance(out, (tuple, list)) else out).item()))
    return losses


def cache_key(trainer):
    """The trainer's export cache key: the digest of its TrainingSpec (+ model and versions)."""
    return trainer._training_spec().fingerprint(trainer._torch_model)
