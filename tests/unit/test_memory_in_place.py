"""The memory path (the torch model's parameters as the trained weights, no second copy) against the
copying path it replaced (`ORTTrainer._share_module_parameters = False`, the earlier behaviour):
20 steps of the same batches must give bitwise equal losses and weights, for SGD, Adam and LAMB,
with gradient accumulation and clipping, and under mixed precision across a forced non-finite step.
"""

import numpy as np
import pytest
import torch
from helpers import training
from helpers.models import GPT_DESC, TinyGPT, cross_entropy
from test_engine_numerics import gpt_batches

from orttrainer import amp, optim
from orttrainer.engine.kernels import choice

STEPS = 20
OVERFLOW_STEP = 9  # under mixed precision: an infinite loss scale makes this step non-finite


def batches(n=STEPS):
    return gpt_batches(n)


def train(share, optim_config, accumulation=1, clip=False, mixed=False):
    torch.manual_seed(0)
    model = TinyGPT()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"batch": {"gradient_accumulation_steps": accumulation}, "utils": {"grad_norm_clip": clip}}
    if mixed:
        options["mixed_precision"] = {"enabled": True, "compute_dtype": "float32",
                                      "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)}
    trainer = training.make_trainer(model, GPT_DESC, optim_config, loss_fn=cross_entropy, **options)
    trainer._share_module_parameters = share
    data = batches()
    if not mixed:
        return trainer, model, initial, training.train(trainer, data), None
    losses = training.train(trainer, data[:OVERFLOW_STEP])
    scale = trainer.loss_scaler.loss_scale
    before = weights(trainer)
    trainer.loss_scaler.loss_scale = float("inf")  # every gradient becomes non-finite
    losses += training.train(trainer, data[OVERFLOW_STEP:OVERFLOW_STEP + 1])
    skipped = (before, weights(trainer), bool(trainer._train_step_info.all_finite))
    trainer.loss_scaler.loss_scale = scale
    losses += training.train(trainer, data[OVERFLOW_STEP + 1:])
    return trainer, model, initial, losses, skipped


def weights(trainer):
    return {k: v.numpy().copy() for k, v in trainer.state_dict(pytorch_format=True).items()}


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


CASES = {
    "sgd": (lambda: optim.SGDConfig(lr=0.05), 1, False),
    "adam-accumulation-clip": (lambda: optim.AdamConfig(lr=1e-2), 2, True),
    "lamb-accumulation-clip": (lambda: optim.LambConfig(lr=1e-2), 2, True),
    "adam-clip": (lambda: optim.AdamConfig(lr=1e-2), 1, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_parameters_train_bitwise_like_a_copy(case):
    make_config, accumulation, clip = CASES[case]
    shared, shared_model, initial, shared_losses, _ = train(True, make_config(), accumulation, clip)
    copied, copied_model, _, copied_losses, _ = train(False, make_config(), accumulation, clip)
    assert shared_losses == copied_losses  # floats compared exactly
    trained = weights(shared)
    assert_bitwise_equal(trained, weights(copied))
    assert not all(np.array_equal(trained[k], initial[k].numpy()) for k in trained)  # it did train
    # Shared: the module's parameters are the trained weights. Copied: the module keeps its start.
    state = shared._training_session.state
    assert state.adopted and set(state.adopted) <= set(dict(shared_model.named_parameters()))
    for name, p in shared_model.named_parameters():
        assert np.array_equal(p.detach().numpy(), trained[name]), name
    for name, p in copied_model.named_parameters():
        assert torch.equal(p.detach(), initial[name]), name
    assert not copied._training_session.state.adopted


@pytest.mark.parametrize("adam", ["orttrainer", "onnxruntime"])
def test_mixed_precision_shares_with_a_skipping_adam_and_skips_a_non_finite_step(adam, monkeypatch):
    """The library's Adam skips a discarded step itself, so mixed precision updates the module's own
    parameters in place; onnxruntime's AdamOptimizer cannot, so there mixed precision keeps two
    buffers per state (a non-finite step is discarded by not swapping) and the module keeps its
    initial values. Either way the skipped step changes nothing, and sharing changes no bit."""
    monkeypatch.setenv(choice.ADAM_ENV, adam)
    runs = [train(share, optim.AdamConfig(lr=1e-2), 2, True, mixed=True) for share in (True, False)]
    (shared, model, initial, shared_losses, skipped), (copied, _, _, copied_losses, _) = runs
    assert shared_losses == copied_losses
    assert_bitwise_equal(weights(shared), weights(copied))
    before, after, all_finite = skipped
    assert not all_finite
    assert_bitwise_equal(before, after)
    if adam == "orttrainer":
        names = sorted(n for n, _ in model.named_parameters())
        assert sorted(shared._training_session.state.adopted) == names
        trained = weights(shared)
        for name, p in model.named_parameters():
            assert np.array_equal(p.detach().numpy(), trained[name]), name
        return
    assert not shared._training_session.state.adopted
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), initial[name]), name


def test_two_trainers_of_one_module_do_not_share_buffers():
    """The second trainer of a module whose parameters another live trainer trains gets a copy."""
    torch.manual_seed(0)
    model = TinyGPT()
    data = batches(4)

    def trainer():
        return training.make_trainer(model, GPT_DESC, optim.AdamConfig(lr=1e-2), loss_fn=cross_entropy)

    first, second = trainer(), trainer()
    first.train_step(*data[0])
    second.train_step(*data[0])  # exports the module as the first trainer left it
    assert first._training_session.state.adopted and not second._training_session.state.adopted
    kept = weights(first)
    second.train_step(*data[1])
    assert_bitwise_equal(weights(first), kept)


def test_the_export_keeps_no_activations_for_a_backward_pass():
    """The TorchScript trace ran with autograd on, which kept every activation of the traced forward
    alive for a backward that never comes (the export set the process's memory peak on the recompute
    GPT: 590 -> 420 MB without it; docs/notes/recompute.md). The exported graph does not depend on it."""
    saved = []

    def pack(tensor):
        saved.append(tensor.shape)
        return tensor

    trainer = training.make_trainer(TinyGPT, GPT_DESC, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy, seed=0)
    x, y = batches(1)[0]
    trainer.train_step(x, y)  # builds the factory; the export below is the one the next build would run
    names = [name for name, _ in trainer._g.factory.spec.inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        exported = trainer._g.factory.export(dict(zip(names, (x, y))))
    assert len(exported.graph.node) > 0
    assert saved == [], f"the export kept {len(saved)} tensors for a backward pass"
