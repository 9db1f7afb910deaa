"""A trainer's lifetime: no reference cycle keeps a dropped trainer (and its sessions and buffers)
alive until the cyclic GC runs; close() and `with ORTTrainer(...)` free them at once."""

import gc
import weakref

import pytest
import torch
from helpers import training
from helpers.models import MLP, MLP_DESC, cross_entropy

from orttrainer import optim


def make_trainer(**options):
    return training.make_trainer(MLP, MLP_DESC, optim.AdamConfig(lr=1e-2), cross_entropy, seed=0, **options)


def batch(i=0):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)


def refs(trainer):
    session = trainer._training_session
    return {"trainer": weakref.ref(trainer), "training session": weakref.ref(session),
            "runtime": weakref.ref(session.runtime), "lifecycle": weakref.ref(trainer._graphs),
            "state": weakref.ref(trainer._graphs.state)}


@pytest.mark.parametrize("options", [{}, {"batch": {"gradient_accumulation_steps": 2}},
                                     {"utils": {"export_cache": False}}])
def test_dropped_trainer_is_freed_without_the_cyclic_gc(options):
    trainer = make_trainer(**options)
    trainer.train_step(*batch())
    trainer.eval_step(*batch(1))
    trainer.state_dict()
    alive = refs(trainer)
    gc.collect()
    gc.disable()
    try:
        del trainer
        assert [name for name, ref in alive.items() if ref() is not None] == []
    finally:
        gc.enable()


def test_close_frees_the_sessions_and_later_calls_raise():
    trainer = make_trainer()
    trainer.train_step(*batch())
    alive = refs(trainer)
    del alive["trainer"]
    weights = {n: p.detach().clone() for n, p in trainer._torch_model.named_parameters()}
    trainer.close()
    assert [name for name, ref in alive.items() if ref() is not None] == []
    for call in (lambda: trainer.train_step(*batch()), lambda: trainer.eval_step(*batch()), trainer.state_dict,
                 lambda: trainer.load_state_dict({}), lambda: trainer.save_as_onnx("x.onnx")):
        with pytest.raises(RuntimeError, match="was closed"):
            call()
    trainer.close()  # again: nothing happens
    # The torch model keeps the trained weights (its parameters were the trained buffers).
    for name, p in trainer._torch_model.named_parameters():
        assert torch.equal(p.detach(), weights[name])


def test_with_block_closes_the_trainer():
    with make_trainer() as trainer:
        loss = trainer.train_step(*batch())[0]
        assert torch.isfinite(loss)
    with pytest.raises(RuntimeError, match="was closed"):
        trainer.train_step(*batch())
