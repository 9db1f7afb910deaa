"""Behavioural tests of the ORTTrainer API (docs/legacy-api.md §1.2, §2.1-2.8 and the Decisions; issue 3).

Numerical equivalence with torch.optim lives in test_engine_numerics.py; here each test checks one
behaviour of the frontend: construction checks, input matching and its errors, return values, step
counters, fetches, the ONNX-model path, save_as_onnx and the options that act in the engine.
"""

import copy
import os
import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import orttrainer
import orttrainer.orttrainer as orttrainer_module
from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.postprocess import run_postprocess

from helpers.models import CLASSES, D_IN, MLP, MLPWithLoss, MLP_DESC, mlp_loss
from helpers.training import make_options

NO_CUDA = not torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- helpers
def mlp_trainer(extra_options=None, optim_config=None, seed=0, desc=None, dropout=0.0):
    torch.manual_seed(seed)
    model = MLP(dropout=dropout)
    return ORTTrainer(model, copy.deepcopy(desc or MLP_DESC), optim_config or optim.SGDConfig(lr=0.1),
                      loss_fn=mlp_loss, options=make_options(extra_options))


def batch(n=8, seed=0):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(n, D_IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def weights(trainer):
    """{name: numpy copy} of the trainer's weights (full precision)."""
    return {k: np.array(v, copy=True) for k, v in trainer.state_dict()["model"]["full_precision"].items()}


def counters(trainer):
    return trainer._train_step_info.step, trainer._train_step_info.optimization_step


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def train_losses(trainer, steps=3):
    x, y = batch()
    return [trainer.train_step(x, y)[0].item() for _ in range(steps)]


# ========================================================================== imports
def test_public_names_importable_from_package_and_module():
    from orttrainer import ORTTrainer as A
    from orttrainer import TrainStepInfo as B
    from orttrainer.orttrainer import ORTTrainer as C
    from orttrainer.orttrainer import TrainStepInfo as D

    assert A is C and B is D
    assert "ORTTrainer" in orttrainer.__all__ and "TrainStepInfo" in orttrainer.__all__
    trainer = mlp_trainer()
    assert isinstance(trainer._train_step_info, B)
    assert trainer._train_step_info.optimizer_config is trainer.optim_config


# ========================================================================== construction (§2.1)
def test_model_none_is_rejected(mlp_desc):
    with pytest.raises(AssertionError, match=re.escape(
            "'model' is required and must be either a 'torch.nn.Module' or ONNX model")):
        ORTTrainer(None, mlp_desc, optim.SGDConfig(), options=make_options())


def test_model_desc_must_be_a_dict(make_mlp):
    with pytest.raises(AssertionError, match=re.escape("'model_desc' must be a 'dict'")):
        ORTTrainer(make_mlp(), list(MLP_DESC.items()), optim.SGDConfig(), loss_fn=mlp_loss,
                   options=make_options())


@pytest.mark.parametrize("bad", [None, {"lr": 0.1}, "SGDOptimizer"])
def test_optim_config_must_be_an_optimizer_config(make_mlp, mlp_desc, bad):
    with pytest.raises(AssertionError, match="optim_config"):
        ORTTrainer(make_mlp(), mlp_desc, bad, loss_fn=mlp_loss, options=make_options())


def test_torch_optimizer_is_not_an_optim_config(make_mlp, mlp_desc):
    model = make_mlp()
    with pytest.raises(AssertionError, match="optim_config"):
        ORTTrainer(model, mlp_desc, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=mlp_loss,
                   options=make_options())


@pytest.mark.parametrize("loss_fn", [lambda a: a, lambda a, b, c: a, "cross_entropy", 3],
                         ids=["one-param", "three-params", "str", "int"])
def test_loss_fn_must_take_two_parameters(make_mlp, mlp_desc, loss_fn):
    with pytest.raises(AssertionError, match=re.escape(
            "'loss_fn' must be either 'None' or a callable with two parameters")):
        ORTTrainer(make_mlp(), mlp_desc, optim.SGDConfig(), loss_fn=loss_fn, options=make_options())


def test_options_must_be_trainer_options(make_mlp, mlp_desc):
    with pytest.raises(AssertionError, match="options"):
        ORTTrainer(make_mlp(), mlp_desc, optim.SGDConfig(), loss_fn=mlp_loss,
                   options={"device": {"id": "cpu"}})


def test_loss_fn_with_onnx_model_is_rejected(mlp_onnx, mlp_desc):
    with pytest.raises(AssertionError, match=re.escape(
            "'loss_fn' must not be specified when 'model' is an ONNX model")):
        ORTTrainer(mlp_onnx, mlp_desc, optim.SGDConfig(), loss_fn=mlp_loss, options=make_options())


@pytest.mark.parametrize("model", ["model.onnx", object(), b"\x08\x07"], ids=["str", "object", "bytes"])
def test_unsupported_model_type(mlp_desc, model):
    with pytest.raises(ValueError) as info:
        ORTTrainer(model, mlp_desc, optim.SGDConfig(), options=make_options())
    assert str(info.value) == "'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'"


def test_serialized_onnx_bytes_are_not_a_model(mlp_onnx_bytes, mlp_desc):
    message = "'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'"
    with pytest.raises(ValueError, match=re.escape(message)):
        ORTTrainer(mlp_onnx_bytes, mlp_desc, optim.SGDConfig(), options=make_options())


def test_invalid_model_desc_raises_value_error(make_mlp):
    desc = {"inputs": [("x", ["batch", D_IN])], "outputs": [(True, [])]}
    with pytest.raises(ValueError, match=r"^Invalid model_desc: "):
        ORTTrainer(make_mlp(), desc, optim.SGDConfig(), loss_fn=mlp_loss, options=make_options())


def test_construction_leaves_torch_model_alone(make_mlp, mlp_desc):
    model = make_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ORTTrainer(model, mlp_desc, optim.SGDConfig(), loss_fn=mlp_loss, options=make_options())
    assert trainer._training_session is None and trainer._onnx_model is None  # export waits for a batch
    assert trainer._torch_model is model and trainer.loss_fn is mlp_loss
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_torch_model_no_state_before_first_step():
    trainer = mlp_trainer()
    with pytest.warns(UserWarning, match="ONNX Runtime training session is not initialized yet"):
        assert trainer.state_dict() == {}


def test_zero_loss_outputs_rejected_at_session_creation(mlp_onnx):
    desc = {"inputs": [("x", ["batch", D_IN]), ("y", ["batch"])],
            "outputs": [("loss", []), ("logits", ["batch", CLASSES])]}
    message = "Only one loss output is supported (0 were specified)"
    with pytest.raises(AssertionError, match=re.escape(message)):
        ORTTrainer(mlp_onnx, desc, optim.SGDConfig(), options=make_options())


# ========================================================================== ONNX-model path
def test_onnx_model_session_exists_at_construction(mlp_onnx, mlp_desc):
    expected = {i.name: numpy_helper.to_array(i) for i in mlp_onnx.graph.initializer}
    trainer = ORTTrainer(mlp_onnx, mlp_desc, optim.SGDConfig(lr=0.1), options=make_options())
    assert trainer._training_session is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "session is not initialized" warning
        state = trainer.state_dict()
    assert state["train_step_info"] == {"optimization_step": 0, "step": 0}
    full = state["model"]["full_precision"]
    assert set(full) == set(expected) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    for name, value in expected.items():
        np.testing.assert_array_equal(full[name], value)
    # Described dtypes come from the ONNX graph.
    assert [d.dtype for d in trainer.model_desc.inputs] == [torch.float32, torch.int64]
    assert [d.dtype for d in trainer.model_desc.outputs] == [torch.float32, torch.float32]


def test_onnx_model_train_step_lowers_loss(mlp_onnx, mlp_desc):
    trainer = ORTTrainer(mlp_onnx, mlp_desc, optim.SGDConfig(lr=0.5), options=make_options())
    x, y = batch()
    losses = [trainer.train_step(x, y)[0].item() for _ in range(6)]
    assert losses[-1] < losses[0] - 0.1
    assert all(b < a for a, b in zip(losses, losses[1:]))
    assert counters(trainer) == (6, 6)


def test_onnx_model_matches_its_torch_source(mlp_onnx_bytes, mlp_desc):
    """The ONNX path computes what the torch module that produced the graph computes."""
    trainer = ORTTrainer(onnx.load_from_string(mlp_onnx_bytes), mlp_desc, optim.SGDConfig(),
                         options=make_options())
    torch.manual_seed(0)
    source = MLPWithLoss()  # same seed as the exported one
    x, y = batch(5)
    loss, logits = trainer.eval_step(x, y)
    with torch.no_grad():
        ref_loss, ref_logits = source(x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)


def test_onnx_model_unknown_input_name(mlp_onnx):
    desc = {"inputs": [("x", ["batch", D_IN]), ("label", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", CLASSES])]}
    with pytest.raises(AssertionError, match=re.escape("ONNX model with unknown input type (label)")):
        ORTTrainer(mlp_onnx, desc, optim.SGDConfig(), options=make_options())


def test_onnx_model_unknown_output_name(mlp_onnx):
    desc = {"inputs": [("x", ["batch", D_IN]), ("y", ["batch"])],
            "outputs": [("loss", [], True), ("scores", ["batch", CLASSES])]}
    with pytest.raises(AssertionError, match=re.escape("ONNX model with unknown output type (scores)")):
        ORTTrainer(mlp_onnx, desc, optim.SGDConfig(), options=make_options())


def test_onnx_model_save_as_onnx_without_a_step(mlp_onnx, mlp_desc, tmp_path):
    trainer = ORTTrainer(mlp_onnx, mlp_desc, optim.SGDConfig(), options=make_options())
    path = str(tmp_path / "m.onnx")
    trainer.save_as_onnx(path)
    saved = onnx.load(path)
    assert {i.name for i in saved.graph.initializer} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


# ========================================================================== the forward model (_onnx_model)
def _values(model):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _holds_data(init):
    return bool(init.raw_data or init.float_data or init.int64_data or init.double_data or init.int32_data)


def test_forward_model_keeps_no_copy_of_the_trained_weights():
    trainer = mlp_trainer({"utils": {"frozen_weights": ["fc1.bias"]}})
    trainer.train_step(*batch())
    inits = {i.name: i for i in trainer._forward_model.graph.initializer}
    assert set(inits) == set(MLP().state_dict())
    assert [name for name, init in inits.items() if _holds_data(init)] == ["fc1.bias"]  # frozen: kept
    assert all(list(inits[w].dims) == list(v.shape) for w, v in weights(trainer).items())


def test_onnx_model_reads_back_the_current_weights():
    trainer = mlp_trainer({"utils": {"frozen_weights": ["fc1.bias"]}})
    initial = {k: v.detach().numpy().copy() for k, v in trainer._torch_model.state_dict().items()}
    for seed in range(3):
        trainer.train_step(*batch(seed=seed))
    values = _values(trainer._onnx_model)
    trained = weights(trainer)
    assert set(values) == set(initial)
    for name, value in values.items():
        np.testing.assert_array_equal(value, trained.get(name, initial[name]))
    assert not np.array_equal(values["fc2.weight"], initial["fc2.weight"])  # it did train
    onnx.checker.check_model(trainer._onnx_model)
    # Reading the model does not disturb training; the next read has the newer weights.
    trainer.train_step(*batch(seed=4))
    np.testing.assert_array_equal(_values(trainer._onnx_model)["fc2.weight"], weights(trainer)["fc2.weight"])


def test_save_as_onnx_writes_trained_weights_and_drops_them_again(tmp_path):
    trainer = mlp_trainer()
    for seed in range(2):
        trainer.train_step(*batch(seed=seed))
    path = str(tmp_path / "m.onnx")
    trainer.save_as_onnx(path)
    saved = _values(onnx.load(path))
    for name, value in weights(trainer).items():
        np.testing.assert_array_equal(saved[name], value)
    assert not any(_holds_data(i) for i in trainer._forward_model.graph.initializer)


def test_onnx_model_trainer_leaves_the_callers_model_intact(mlp_onnx, mlp_desc):
    before = _values(mlp_onnx)
    trainer = ORTTrainer(mlp_onnx, mlp_desc, optim.SGDConfig(lr=0.5), options=make_options())
    trainer.train_step(*batch())
    after = _values(mlp_onnx)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)
    assert not np.array_equal(_values(trainer._onnx_model)["fc1.weight"], before["fc1.weight"])


# ========================================================================== return values (§2.5)
def test_train_and_eval_return_list_in_model_desc_order():
    trainer = mlp_trainer()
    x, y = batch(5)
    for out in (trainer.train_step(x, y), trainer.eval_step(x, y)):
        assert isinstance(out, list) and len(out) == 2
        loss, logits = out
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.dtype == torch.float32
        assert isinstance(logits, torch.Tensor) and logits.shape == (5, CLASSES)
        assert loss.device.type == "cpu"
        # The loss is the loss_fn applied to the returned logits.
        torch.testing.assert_close(loss, F.cross_entropy(logits, y), rtol=1e-5, atol=1e-6)


class SelfLossMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D_IN, CLASSES)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y)


def test_single_output_is_returned_bare():
    torch.manual_seed(0)
    desc = {"inputs": [("x", ["batch", D_IN]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(SelfLossMLP(), desc, optim.SGDConfig(lr=0.1), options=make_options())
    x, y = batch()
    out = trainer.train_step(x, y)
    assert isinstance(out, torch.Tensor) and out.dim() == 0
    out_eval = trainer.eval_step(x, y)
    assert isinstance(out_eval, torch.Tensor) and out_eval.dim() == 0
    assert out_eval.item() < out.item()  # eval after one update


def test_returned_tensors_are_not_overwritten_by_later_steps():
    trainer = mlp_trainer()
    x, y = batch()
    first = trainer.train_step(x, y)
    kept = [t.clone() for t in first]
    for _ in range(3):
        trainer.train_step(x, y)
    trainer.eval_step(x, y)
    for a, b in zip(first, kept):
        assert torch.equal(a, b)


def test_export_records_sample_outputs_and_types():
    trainer = mlp_trainer()
    x, y = batch()
    trainer.train_step(x, y)
    assert isinstance(trainer._onnx_model, onnx.ModelProto)
    assert len(trainer.torch_sample_outputs) == 2
    assert [d.dtype for d in trainer.model_desc.inputs] == [torch.float32, torch.int64]
    init_names = {i.name for i in trainer._onnx_model.graph.initializer}
    assert init_names == set(MLP().state_dict())  # initializer names == torch state_dict names


@pytest.mark.parametrize("share", [False, True])
def test_torch_sample_outputs_are_the_first_batch_through_the_torch_model(share):
    # Recomputed on access (not kept alive): the first batch's eval-mode outputs, even after the
    # caller overwrote its batch tensors in place. With a copy of the weights (share=False) that is
    # the module's initial weights, as the original kept them; when the trainer trains the module's
    # own parameters (the default, docs/performance.md "Memory"), the module's current weights.
    trainer = mlp_trainer()
    trainer._share_module_parameters = share
    x, y = batch()
    model = trainer._torch_model
    with torch.no_grad():
        expected_logits = model.eval()(x).clone()
        expected_loss = torch.nn.functional.cross_entropy(expected_logits, y)
    model.train()
    trainer.train_step(x, y)
    x.fill_(7.0)
    for _ in range(2):
        trainer.train_step(*batch(seed=1))
    if share:
        with torch.no_grad():
            expected_logits = model.eval()(batch()[0]).clone()
            expected_loss = torch.nn.functional.cross_entropy(expected_logits, y)
        model.train()
        assert trainer._training_session.state.adopted
    loss, logits = trainer.torch_sample_outputs
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    trainer.torch_sample_outputs = ["assigned"]  # legacy scripts may set the attribute
    assert trainer.torch_sample_outputs == ["assigned"]


# ========================================================================== step counters
def test_step_counters_with_gradient_accumulation():
    trainer = mlp_trainer({"batch": {"gradient_accumulation_steps": 3}})
    x, y = batch()
    trainer.train_step(x, y)
    previous = weights(trainer)
    assert counters(trainer) == (1, 0)
    for step in range(2, 8):
        trainer.train_step(x, y)
        assert counters(trainer) == (step, step // 3)
        now = weights(trainer)
        moved = any(not np.array_equal(now[k], previous[k]) for k in now)
        assert moved == (step % 3 == 0), f"step {step}: weights moved={moved}"
        previous = now


def test_eval_step_does_not_count():
    trainer = mlp_trainer({"batch": {"gradient_accumulation_steps": 2}})
    x, y = batch()
    trainer.train_step(x, y)
    for _ in range(3):
        trainer.eval_step(x, y)
    assert counters(trainer) == (1, 0)
    trainer.train_step(x, y)
    assert counters(trainer) == (2, 1)


# ========================================================================== fetches
def test_fetches_subset_and_order():
    trainer = mlp_trainer()
    x, y = batch()
    loss0, logits0 = trainer.eval_step(x, y)
    trainer._train_step_info.fetches = ["logits", "loss"]
    out = trainer.eval_step(x, y)
    assert isinstance(out, list) and len(out) == 2
    torch.testing.assert_close(out[0], logits0)
    torch.testing.assert_close(out[1], loss0)
    trainer._train_step_info.fetches = ["logits"]
    only = trainer.eval_step(x, y)
    assert isinstance(only, torch.Tensor) and only.shape == (8, CLASSES)
    trainer._train_step_info.fetches = ["loss"]
    loss = trainer.train_step(x, y)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    torch.testing.assert_close(loss, loss0)
    # Fetches restrict what is returned, not what is trained.
    assert counters(trainer) == (1, 1)
    trainer._train_step_info.fetches = []
    assert trainer.eval_step(x, y)[0].item() < loss0.item()


@pytest.mark.parametrize("method", ["train_step", "eval_step"])
def test_unknown_fetch_name_raises_and_trainer_recovers(method):
    trainer = mlp_trainer()
    x, y = batch()
    trainer.train_step(x, y)
    before = weights(trainer)
    trainer._train_step_info.fetches = ["loss", "probabilities"]
    with pytest.raises(RuntimeError, match="probabilities"):
        getattr(trainer, method)(x, y)
    assert counters(trainer) == (1, 1)
    assert_same_weights(weights(trainer), before)
    trainer._train_step_info.fetches = []
    loss, _ = trainer.train_step(x, y)
    assert counters(trainer) == (2, 2)
    assert torch.isfinite(loss)


def test_unknown_fetch_before_the_session_exists():
    trainer = mlp_trainer()
    trainer._train_step_info.fetches = ["nope"]
    with pytest.raises(RuntimeError, match="nope"):
        trainer.train_step(*batch())
    trainer._train_step_info.fetches = []
    trainer.train_step(*batch())
    assert counters(trainer) == (1, 1)


def test_fetches_allow_eval_without_the_label():
    trainer = mlp_trainer()
    x, y = batch()
    trainer.train_step(x, y)  # no eval binding exists yet
    trainer._train_step_info.fetches = ["logits"]
    logits = trainer.eval_step(x)
    trainer._train_step_info.fetches = []
    torch.testing.assert_close(logits, trainer.eval_step(x, y)[1])


@pytest.mark.parametrize("method", ["train_step", "eval_step"])
def test_missing_input_is_never_taken_from_an_earlier_call(method):
    trainer = mlp_trainer()
    x, y = batch()
    y_other = (y + 1) % CLASSES
    for _ in range(2):  # bindings now exist for every kind/parity, with y_other bound
        trainer.train_step(x, y_other)
        trainer.eval_step(x, y_other)
    trainer._train_step_info.fetches = ["loss"]  # the loss needs y, which this call does not give
    with pytest.raises((ValueError, RuntimeError), match=r"\by\b"):
        getattr(trainer, method)(x)


# ========================================================================== eval_step changes nothing
def test_eval_step_changes_no_state():
    trainer = mlp_trainer(optim_config=optim.AdamConfig(lr=0.01))
    x, y = batch()
    for _ in range(2):
        trainer.train_step(x, y)
    before = trainer.state_dict()
    for n in (3, 8, 5):
        trainer.eval_step(*batch(n, seed=n))
    after = trainer.state_dict()
    assert after["train_step_info"] == before["train_step_info"] == {"optimization_step": 2, "step": 2}
    assert_same_weights(after["model"]["full_precision"], before["model"]["full_precision"])
    for w, states in before["optimizer"].items():
        assert_same_weights(after["optimizer"][w], states)


def test_eval_step_turns_dropout_off():
    torch.manual_seed(0)
    model = MLP(dropout=0.5)
    trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.1), loss_fn=mlp_loss,
                         options=make_options())
    x, y = batch()
    first = trainer.eval_step(x, y)  # exports; no training yet, so the torch model's weights apply
    second = trainer.eval_step(x, y)
    assert torch.equal(first[1], second[1])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(first[1], model(x), rtol=1e-5, atol=1e-6)
    # train_step does apply dropout: its logits differ from the eval logits for the same weights.
    train_logits = trainer.train_step(x, y)[1]
    assert not torch.allclose(train_logits, first[1])


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_dropout_of_zero_is_no_node_and_trains_as_torch_does(p):
    """torch returns its input when p is 0; so does the training graph (no copy, no mask kept for the
    backward pass: 240 MB per attention layer at GPT-2 small seq 1024). p > 0 keeps its Dropout."""
    torch.manual_seed(0)
    model = MLP()
    model.drop = torch.nn.Dropout(p)  # MLP itself uses Identity for p = 0
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.1), loss_fn=mlp_loss,
                         options=make_options())
    x, y = batch()
    loss = trainer.train_step(x, y)[0]
    assert "Dropout" in [n.op_type for n in trainer._onnx_model.graph.node]  # the export has it
    ops = [n.op_type for n in trainer._training_session.graph.model.graph.node]
    assert ("Dropout" in ops) == (p > 0)
    if p == 0:
        ref.train()
        torch.testing.assert_close(loss, mlp_loss(ref(x), y), rtol=1e-6, atol=1e-7)
        for _ in range(3):  # SGD steps against torch's, train mode throughout
            trainer.train_step(x, y)
        sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(4):
            sgd.zero_grad()
            mlp_loss(ref(x), y).backward()
            sgd.step()
        trained = trainer.state_dict(pytorch_format=True)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ========================================================================== input matching (§2.4)
def test_inputs_positional_keyword_and_single_list_agree():
    x, y = batch()
    calls = [
        lambda t: t.train_step(x, y),
        lambda t: t.train_step(x=x, y=y),
        lambda t: t.train_step(y=y, x=x),
        lambda t: t.train_step(x, y=y),
        lambda t: t.train_step([x, y]),
        lambda t: t.train_step((x, y)),
    ]
    results = []
    for call in calls:
        trainer = mlp_trainer()
        losses = [call(trainer)[0].item() for _ in range(3)]
        results.append((losses, trainer.eval_step([x, y])[1]))
    for losses, logits in results[1:]:
        assert losses == results[0][0]
        assert torch.equal(logits, results[0][1])


def test_eval_step_keyword_and_list_inputs():
    trainer = mlp_trainer()
    x, y = batch()
    ref = trainer.eval_step(x, y)
    for out in (trainer.eval_step(y=y, x=x), trainer.eval_step([x, y]), trainer.eval_step(x, y=y)):
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


# ========================================================================== bad input (issue 3)
def _bad_calls():
    x, y = batch()
    return {
        "missing": ((x,), {}, ValueError, r"'y'"),
        "missing-keyword": ((), {"x": x}, ValueError, r"'y'"),
        "extra-keyword": ((x, y), {"z": x}, ValueError, r"'z'"),
        "misspelt-keyword": ((), {"x": x, "labels": y}, ValueError, r"'labels'"),
        "too-many-positional": ((x, y, y), {}, ValueError, r"3 positional"),
        "twice": ((x, y), {"y": y}, ValueError, r"'y'"),
        "numpy": ((x.numpy(), y), {}, TypeError, r"'x'"),
        "python-list": ((x, y.tolist()), {}, TypeError, r"'y'"),
        "float64": ((x.double(), y), {}, TypeError, r"'x'.*float64"),
        "int32-label": ((x, y.int()), {}, TypeError, r"'y'.*int32"),
        "static-dim": ((torch.randn(8, D_IN + 1), y), {}, ValueError, r"'x'.*axis 1"),
        "rank": ((x.unsqueeze(0), y), {}, ValueError, r"'x'"),
        "symbolic-two-sizes": ((x, y[:5]), {}, ValueError, r"'batch'.*'x'.*'y'"),
    }


BAD_CALLS = list(_bad_calls())


@pytest.mark.parametrize("method", ["train_step", "eval_step"])
@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_raises_clear_error_and_trainer_stays_usable(case, method):
    trainer = mlp_trainer()
    x, y = batch()
    trainer.train_step(x, y)  # the session exists: dtypes are known
    before = weights(trainer)
    args, kwargs, exc_type, pattern = _bad_calls()[case]
    with pytest.raises(exc_type, match=pattern):
        getattr(trainer, method)(*args, **kwargs)
    assert counters(trainer) == (1, 1)
    assert_same_weights(weights(trainer), before)
    loss, logits = trainer.train_step(x, y)
    assert counters(trainer) == (2, 2)
    assert logits.shape == (8, CLASSES) and torch.isfinite(loss)


@pytest.mark.parametrize("case", ["missing", "extra-keyword", "numpy", "static-dim", "symbolic-two-sizes"])
def test_bad_input_before_the_first_step(case):
    trainer = mlp_trainer()
    args, kwargs, exc_type, pattern = _bad_calls()[case]
    with pytest.raises(exc_type, match=pattern):
        trainer.train_step(*args, **kwargs)
    assert trainer._onnx_model is None and trainer._training_session is None  # nothing was exported
    assert counters(trainer) == (0, 0)
    trainer.train_step(*batch())
    assert counters(trainer) == (1, 1)


# ========================================================================== unused inputs
class IgnoresMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D_IN, CLASSES)

    def forward(self, x, mask):
        return self.fc(x)  # mask is described but never used


def test_unused_described_input_is_accepted():
    torch.manual_seed(0)
    desc = {"inputs": [("x", ["batch", D_IN]), ("mask", ["batch", D_IN]), ("y", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", CLASSES])]}
    trainer = ORTTrainer(IgnoresMask(), desc, optim.SGDConfig(lr=0.5), loss_fn=mlp_loss,
                         options=make_options())
    x, y = batch()
    mask = torch.ones(8, D_IN)
    losses = [trainer.train_step(x, mask, y)[0].item() for _ in range(4)]
    assert losses[-1] < losses[0]
    # The unused input may take any value (and any batch it agrees with) without changing the result.
    a = trainer.eval_step(x, mask, y)
    b = trainer.eval_step(x=x, mask=torch.zeros(8, D_IN), y=y)
    assert torch.equal(a[1], b[1])
    assert counters(trainer) == (4, 4)


# ========================================================================== varying shapes
class TokenTagger(torch.nn.Module):
    def __init__(self, vocab=11, dim=8, tags=3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, tags)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def _tag_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def test_varying_batch_and_sequence_sizes_without_re_export():
    torch.manual_seed(0)
    desc = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", 3])]}
    trainer = ORTTrainer(TokenTagger(), desc, optim.SGDConfig(lr=0.1), loss_fn=_tag_loss,
                         options=make_options())
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 5), (3, 7), (1, 1), (4, 3), (2, 5)]
    onnx_model = session = None
    for i, (b, s) in enumerate(shapes):
        ids = torch.randint(0, 11, (b, s), generator=g)
        labels = torch.randint(0, 3, (b, s), generator=g)
        loss, logits = trainer.train_step(ids, labels)
        assert logits.shape == (b, s, 3) and loss.dim() == 0 and torch.isfinite(loss)
        eval_loss, eval_logits = trainer.eval_step(ids=ids, labels=labels)
        assert eval_logits.shape == (b, s, 3)
        if i == 0:
            onnx_model, session = trainer._onnx_model, trainer._training_session
        assert trainer._onnx_model is onnx_model and trainer._training_session is session
    assert counters(trainer) == (len(shapes), len(shapes))


# ========================================================================== frozen_weights
def test_frozen_weight_unknown_name_raises_naming_it():
    trainer = mlp_trainer({"utils": {"frozen_weights": ["fc1.weight", "fc9.weight"]}})
    with pytest.raises(RuntimeError, match=re.escape("fc9.weight")) as info:
        trainer.train_step(*batch())
    assert "frozen_weights" in str(info.value)
    assert "fc1.weight" not in str(info.value)  # a real weight is not reported as unknown


def test_frozen_weight_unknown_name_onnx_model(mlp_onnx, mlp_desc):
    with pytest.raises(RuntimeError, match=re.escape("not_a_weight")):
        ORTTrainer(mlp_onnx, mlp_desc, optim.SGDConfig(),
                   options=make_options({"utils": {"frozen_weights": ["not_a_weight"]}}))


@pytest.mark.parametrize("config", [optim.SGDConfig(lr=0.1), optim.AdamConfig(lr=0.05)], ids=["sgd", "adam"])
def test_frozen_weight_never_moves(config):
    torch.manual_seed(0)
    initial = {k: v.clone().numpy() for k, v in MLP().state_dict().items()}
    trainer = mlp_trainer({"utils": {"frozen_weights": ["fc1.weight"]}}, optim_config=config)
    x, y = batch()
    for _ in range(4):
        trainer.train_step(x, y)
    now = weights(trainer)
    np.testing.assert_array_equal(now["fc1.weight"], initial["fc1.weight"])  # reported, unchanged
    for name in ("fc1.bias", "fc2.weight", "fc2.bias"):
        assert not np.allclose(now[name], initial[name]), name
    assert "fc1.weight" not in trainer._training_session.graph.weights
    if config.name == "AdamOptimizer":
        assert "fc1.weight" not in trainer.state_dict()["optimizer"]
    # The frozen weight is in the pytorch-format state dict too.
    flat = trainer.state_dict(pytorch_format=True)
    assert torch.equal(flat["fc1.weight"], torch.from_numpy(initial["fc1.weight"]))


# ========================================================================== save_as_onnx
def test_save_as_onnx_before_session_warns(tmp_path):
    trainer = mlp_trainer()
    path = tmp_path / "m.onnx"
    with pytest.warns(UserWarning, match=re.escape(
            "Training session is not initialized yet. 'train_step' or 'eval_step' methods must be "
            "executed at least once before calling 'save_as_onnx()'.")):
        trainer.save_as_onnx(str(path))
    assert not path.exists()


@pytest.mark.parametrize("where", ["missing-dir", "empty-name"])
def test_save_as_onnx_invalid_path_warns(tmp_path, where):
    trainer = mlp_trainer()
    trainer.train_step(*batch())
    path = str(tmp_path / "no" / "such" / "m.onnx") if where == "missing-dir" else str(tmp_path) + os.sep
    with pytest.warns(UserWarning, match=re.escape("'path' is not valid or does not exist")):
        trainer.save_as_onnx(path)
    assert os.listdir(tmp_path) == []


def test_save_as_onnx_round_trip_continues_identically(tmp_path):
    trainer = mlp_trainer(optim_config=optim.SGDConfig(lr=0.2))
    x, y = batch()
    for _ in range(3):
        trainer.train_step(x, y)
    path = str(tmp_path / "trained.onnx")
    trainer.save_as_onnx(path)
    saved = onnx.load(path)
    trained = weights(trainer)
    for init in saved.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(init), trained[init.name])

    clone = ORTTrainer(saved, copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.2), options=make_options())
    x2, y2 = batch(5, seed=3)
    for a, b in zip(trainer.eval_step(x2, y2), clone.eval_step(x2, y2)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # SGD has no optimizer state, so both continue the same way.
    for _ in range(2):
        la, lb = trainer.train_step(x, y)[0], clone.train_step(x, y)[0]
        torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    # Saving again after more training writes the newer weights.
    trainer.save_as_onnx(path)
    again = {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}
    assert not np.array_equal(again["fc2.weight"], trained["fc2.weight"])


# ========================================================================== debug.graph_save_paths
GRAPH_PATHS = ["model_after_graph_transforms_path", "model_with_gradient_graph_path",
               "model_with_training_graph_path", "model_with_training_graph_after_optimization_path"]


def test_all_graph_save_paths_written(tmp_path):
    paths = {key: str(tmp_path / f"{key}.onnx") for key in GRAPH_PATHS}
    trainer = mlp_trainer({"debug": {"graph_save_paths": paths}}, optim_config=optim.AdamConfig(lr=0.01))
    trainer.train_step(*batch())
    assert sorted(os.listdir(tmp_path)) == sorted(f"{key}.onnx" for key in GRAPH_PATHS)
    models = {key: onnx.load(path) for key, path in paths.items()}
    training_ops = [n.op_type for n in models["model_with_training_graph_path"].graph.node]
    assert "Adam" in training_ops  # the kernel library's Adam (engine/kernels/adam.cc)
    assert any(n.op_type.endswith("Grad") for n in models["model_with_gradient_graph_path"].graph.node)
    forward_ops = [n.op_type for n in models["model_after_graph_transforms_path"].graph.node]
    assert "Gemm" in forward_ops and not any(op.endswith("Grad") for op in forward_ops)
    assert len(models["model_with_training_graph_after_optimization_path"].graph.node) > 0


@pytest.mark.parametrize("key", GRAPH_PATHS)
def test_each_graph_save_path_only_when_set(tmp_path, monkeypatch, key):
    monkeypatch.chdir(tmp_path)
    paths = {k: "" for k in GRAPH_PATHS}
    paths[key] = str(tmp_path / "out" / "graph.onnx")
    os.mkdir(tmp_path / "out")
    trainer = mlp_trainer({"debug": {"graph_save_paths": paths}})
    trainer.train_step(*batch())
    assert os.listdir(tmp_path / "out") == ["graph.onnx"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing written for the empty paths
    onnx.load(str(tmp_path / "out" / "graph.onnx"))


def test_no_graph_files_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = mlp_trainer()
    trainer.train_step(*batch())
    assert os.listdir(tmp_path) == []


# ========================================================================== other options
def test_run_symbolic_shape_infer_does_not_change_losses():
    off = mlp_trainer({"utils": {"run_symbolic_shape_infer": False}}, optim_config=optim.AdamConfig(lr=0.01))
    on = mlp_trainer({"utils": {"run_symbolic_shape_infer": True}}, optim_config=optim.AdamConfig(lr=0.01))
    losses_off, losses_on = train_losses(off, 4), train_losses(on, 4)
    np.testing.assert_allclose(losses_on, losses_off, rtol=1e-6, atol=1e-7)
    # It did run: shapes of intermediate values were inferred into the model.
    assert len(on._onnx_model.graph.value_info) > len(off._onnx_model.graph.value_info)


def test_check_model_export_passes_on_a_correct_model():
    trainer = mlp_trainer({"debug": {"check_model_export": True}}, dropout=0.3)
    losses = train_losses(trainer, 3)
    assert losses[-1] < losses[0]


def _relu_to_sigmoid(model):
    for node in model.graph.node:
        if node.op_type == "Relu":
            node.op_type = "Sigmoid"
    return model


def test_check_model_export_detects_a_wrong_export():
    trainer = mlp_trainer({"debug": {"check_model_export": True},
                           "_internal_use": {"extra_postprocess": _relu_to_sigmoid}})
    with pytest.raises(RuntimeError, match="check_model_export"):
        trainer.train_step(*batch())
    assert counters(trainer) == (0, 0)


def test_check_model_export_failure_is_not_bypassed_by_a_retry():
    trainer = mlp_trainer({"debug": {"check_model_export": True},
                           "_internal_use": {"extra_postprocess": _relu_to_sigmoid}})
    for _ in range(2):
        with pytest.raises(RuntimeError, match="check_model_export"):
            trainer.train_step(*batch())
    assert counters(trainer) == (0, 0)


def test_wrong_export_unnoticed_without_check_model_export():
    trainer = mlp_trainer({"_internal_use": {"extra_postprocess": _relu_to_sigmoid}})
    trainer.train_step(*batch())  # the corrupted graph trains silently: the check is what catches it
    assert "Sigmoid" in [n.op_type for n in trainer._onnx_model.graph.node]


def test_deterministic_compute_gives_bitwise_identical_losses():
    runs = []
    for _ in range(2):
        trainer = mlp_trainer({"debug": {"deterministic_compute": True}},
                              optim_config=optim.AdamConfig(lr=0.01))
        x, y = batch()
        runs.append(torch.stack([trainer.train_step(x, y)[0] for _ in range(4)]))
        assert trainer._training_session.session.get_session_options().use_deterministic_compute
    assert torch.equal(runs[0], runs[1])


def test_extra_postprocess_called_once_with_model_proto():
    seen = []

    def postprocess(model):
        seen.append(model)
        assert isinstance(model, onnx.ModelProto)
        # Runs after the internal postprocess: nodes are already named.
        assert all(node.name for node in model.graph.node)
        model.doc_string = "touched"
        return model

    trainer = mlp_trainer({"_internal_use": {"extra_postprocess": postprocess}})
    assert seen == []  # nothing to postprocess before the export
    x, y = batch()
    for _ in range(2):
        trainer.train_step(x, y)
    trainer.eval_step(x, y)
    assert len(seen) == 1
    assert trainer._onnx_model.doc_string == "touched"


def test_extra_postprocess_on_onnx_model_runs_at_construction(mlp_onnx, mlp_desc):
    seen = []

    def postprocess(model):
        seen.append(model)
        return model

    ORTTrainer(mlp_onnx, mlp_desc, optim.SGDConfig(),
               options=make_options({"_internal_use": {"extra_postprocess": postprocess}}))
    assert len(seen) == 1 and isinstance(seen[0], onnx.ModelProto)


@pytest.mark.parametrize("onnx_path", [False, True], ids=["torch", "onnx"])
def test_extra_postprocess_must_return_a_model_proto(onnx_path, mlp_onnx, mlp_desc):
    options = make_options({"_internal_use": {"extra_postprocess": lambda model: None}})
    with pytest.raises(AssertionError, match="extra_postprocess"):
        if onnx_path:
            ORTTrainer(mlp_onnx, mlp_desc, optim.SGDConfig(), options=options)
        else:
            trainer = ORTTrainer(MLP(), mlp_desc, optim.SGDConfig(), loss_fn=mlp_loss, options=options)
            trainer.train_step(*batch())


@pytest.mark.skipif(not NO_CUDA, reason="checks the fallback on a machine without a usable GPU")
def test_device_cuda_falls_back_to_cpu_with_one_warning():
    orttrainer_module._warn_cpu_fallback_once.cache_clear()  # the warning is once per process
    x, y = batch()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = mlp_trainer({"device": {"id": "cuda"}})
        loss, logits = trainer.train_step(x, y)
        second = trainer.train_step(x, y)[0]
        trainer.eval_step(x, y)
    fallback = [w for w in record if "training on the CPU" in str(w.message)]
    assert len(fallback) == 1 and issubclass(fallback[0].category, UserWarning)
    assert loss.device.type == "cpu" and logits.device.type == "cpu"
    assert trainer._training_session.session.get_providers() == ["CPUExecutionProvider"]
    assert second.item() < loss.item()


def test_default_device_is_cuda_with_fallback():
    assert ORTTrainerOptions().device.id == "cuda"
    if NO_CUDA:
        orttrainer_module._warn_cpu_fallback_once.cache_clear()
        torch.manual_seed(0)
        trainer = ORTTrainer(MLP(), copy.deepcopy(MLP_DESC), optim.SGDConfig(), loss_fn=mlp_loss)
        with pytest.warns(UserWarning, match="training on the CPU"):
            trainer.train_step(*batch())


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without a usable GPU")
def test_device_cuda_index_unavailable_raises():
    trainer = mlp_trainer({"device": {"id": "cuda:1"}})
    with pytest.raises(RuntimeError, match=re.escape("cuda:1")):
        trainer.train_step(*batch())


def test_device_id_not_a_device_raises():
    trainer = mlp_trainer({"device": {"id": "tpu"}})
    with pytest.raises(ValueError, match="tpu"):
        trainer.train_step(*batch())


def test_provider_options_are_used(monkeypatch):
    import orttrainer.engine.runtime.session as session_module

    calls = []
    real = session_module.ort.InferenceSession

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module.ort, "InferenceSession", recording)
    options = {"CPUExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}
    trainer = mlp_trainer({"provider_options": options})
    losses = train_losses(trainer, 3)
    assert losses[-1] < losses[0]
    assert len(calls) == 1
    providers, provider_options = calls[0]["providers"], calls[0]["provider_options"]
    assert providers[0] == "CPUExecutionProvider"
    assert provider_options[0] == {"arena_extend_strategy": "kSameAsRequested"}
    assert "CPUExecutionProvider" in trainer._training_session.session.get_providers()


def _unnamed_mlp_onnx(model_bytes):
    model = onnx.load_from_string(model_bytes)
    for node in model.graph.node:
        node.name = ""
    return model


@pytest.mark.parametrize("enabled", [True, False])
def test_enable_internal_postprocess(mlp_onnx_bytes, mlp_desc, enabled):
    options = make_options({"_internal_use": {"enable_internal_postprocess": enabled}})
    model = _unnamed_mlp_onnx(mlp_onnx_bytes)
    trainer = ORTTrainer(model, mlp_desc, optim.SGDConfig(lr=0.5), options=options)
    names = [n.name for n in trainer._onnx_model.graph.node]
    assert all(names) if enabled else not any(names)
    losses = train_losses(trainer, 3)
    assert losses[-1] < losses[0]


def test_internal_postprocess_off_keeps_logsoftmax_nll():
    seen = []

    def capture(model):
        seen.append([n.op_type for n in model.graph.node])
        return model

    weight = np.zeros((D_IN, CLASSES), np.float32)
    desc = {"inputs": [("x", ["batch", D_IN]), ("y", ["batch"])],
            "outputs": [("loss", [], True), ("log_probs", ["batch", CLASSES])]}
    options = make_options({"_internal_use": {"enable_internal_postprocess": False,
                                              "extra_postprocess": capture}})
    with pytest.raises(RuntimeError):  # onnxruntime has no gradient for NegativeLogLikelihoodLoss
        ORTTrainer(_nll_model(weight), desc, optim.SGDConfig(), options=options)
    assert seen == [["MatMul", "LogSoftmax", "NegativeLogLikelihoodLoss"]]


@pytest.mark.parametrize("opset", [13, 15])
def test_onnx_opset_version_is_used_for_export(opset):
    trainer = mlp_trainer({"_internal_use": {"onnx_opset_version": opset}})
    losses = train_losses(trainer, 2)
    assert losses[1] < losses[0]
    default_domain = [o.version for o in trainer._onnx_model.opset_import if o.domain in ("", "ai.onnx")]
    assert default_domain == [opset]


def test_default_onnx_opset_version_is_14():
    trainer = mlp_trainer()
    trainer.train_step(*batch())
    assert [o.version for o in trainer._onnx_model.opset_import if o.domain in ("", "ai.onnx")] == [14]


HIDDEN_GELU = 8


class GeluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, HIDDEN_GELU)
        self.fc2 = torch.nn.Linear(HIDDEN_GELU, CLASSES)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_enable_onnx_contrib_ops():
    results = {}
    for enabled in (True, False):
        torch.manual_seed(0)
        trainer = ORTTrainer(GeluMLP(), copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.1), loss_fn=mlp_loss,
                             options=make_options({"_internal_use": {"enable_onnx_contrib_ops": enabled}}))
        losses = train_losses(trainer, 3)
        ops = {(n.domain or "", n.op_type) for n in trainer._onnx_model.graph.node}
        results[enabled] = losses
        if enabled:
            assert ("com.microsoft", "Gelu") in ops and ("", "Erf") not in ops
        else:
            assert ("", "Erf") in ops and not any(domain == "com.microsoft" for domain, _ in ops)
    np.testing.assert_allclose(results[True], results[False], rtol=1e-5)
    # The contrib symbolic is registered only for the export: a later plain export is unaffected.
    torch.manual_seed(0)
    plain = ORTTrainer(GeluMLP(), copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.1), loss_fn=mlp_loss,
                       options=make_options({"_internal_use": {"enable_onnx_contrib_ops": False}}))
    plain.train_step(*batch())
    assert "Gelu" not in [n.op_type for n in plain._onnx_model.graph.node]


def test_session_options_are_honoured():
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    reference = train_losses(mlp_trainer(), 3)
    trainer = mlp_trainer({"session_options": so})
    losses = train_losses(trainer, 3)
    assert trainer._training_session.session.get_session_options().intra_op_num_threads == 1
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert losses[-1] < losses[0]


# ========================================================================== export
class ReturnsString(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D_IN, CLASSES)

    def forward(self, x):
        return "not a tensor"


class UsesSvd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D_IN, D_IN)

    def forward(self, x):
        return torch.linalg.svd(self.fc(x))[1].sum()  # no ONNX symbolic for linalg_svd


SCALAR_LOSS_DESC = {"inputs": [("x", ["batch", D_IN])], "outputs": [("loss", [], True)]}


def test_export_failure_unexportable_op():
    trainer = ORTTrainer(UsesSvd(), copy.deepcopy(SCALAR_LOSS_DESC), optim.SGDConfig(),
                         options=make_options())
    with pytest.raises(RuntimeError, match="Exporting the model to ONNX failed") as info:
        trainer.train_step(batch()[0])
    assert "linalg_svd" in str(info.value)
    assert trainer._training_session is None and counters(trainer) == (0, 0)


def test_export_failure_model_returns_a_string():
    trainer = ORTTrainer(ReturnsString(), copy.deepcopy(SCALAR_LOSS_DESC), optim.SGDConfig(),
                         options=make_options())
    with pytest.raises(RuntimeError, match="Exporting the model to ONNX failed"):
        trainer.train_step(batch()[0])


def test_model_output_count_must_match_model_desc():
    desc = {"inputs": [("x", ["batch", D_IN]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(MLP(), desc, optim.SGDConfig(), loss_fn=mlp_loss, options=make_options())
    with pytest.raises(ValueError, match=r"2 tensors.*\['loss'\]"):
        trainer.train_step(*batch())


def test_export_preserves_user_rng_state_and_model():
    torch.manual_seed(123)
    model = MLP(dropout=0.5)
    trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.1), loss_fn=mlp_loss,
                         options=make_options())
    x, y = batch()
    state = torch.get_rng_state()
    trainer.train_step(x, y)
    assert torch.equal(torch.get_rng_state(), state)
    trainer.train_step(x, y)
    trainer.eval_step(x, y)
    assert torch.equal(torch.get_rng_state(), state)
    # The user's model object is still usable and still in training mode.
    assert model.training and model.drop.training
    assert model(x).shape == (8, CLASSES)


# ========================================================================== postprocess: LogSoftmax+NLL
IGNORE = 2


def _nll_model(weight, ignore_index=IGNORE, reduction="sum", axis=1):
    """Hand-built forward graph: loss = NLL(LogSoftmax(x @ W), y) with the given NLL attributes."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["logits"]),
        helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=axis),
        helper.make_node("NegativeLogLikelihoodLoss", ["log_probs", "y"], ["loss"],
                         reduction=reduction, ignore_index=ignore_index),
    ]
    graph = helper.make_graph(
        nodes, "nll",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D_IN]),
         helper.make_tensor_value_info("y", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["batch", CLASSES])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_postprocess_fuses_logsoftmax_nll_keeping_attributes():
    weight = np.random.default_rng(0).standard_normal((D_IN, CLASSES)).astype(np.float32)
    model = run_postprocess(_nll_model(weight))
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["MatMul", "SoftmaxCrossEntropyLoss"]
    fused = model.graph.node[1]
    assert _attrs(fused) == {"ignore_index": IGNORE, "reduction": b"sum"}
    assert list(fused.input) == ["logits", "y"] and list(fused.output) == ["loss", "log_probs"]
    assert all(n.name for n in model.graph.node)
    onnx.checker.check_model(model)


def test_postprocess_leaves_other_logsoftmax_axes_alone():
    weight = np.zeros((D_IN, CLASSES), np.float32)
    model = run_postprocess(_nll_model(weight, axis=0))
    assert [n.op_type for n in model.graph.node] == ["MatMul", "LogSoftmax", "NegativeLogLikelihoodLoss"]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_fused_loss_trains_like_torch(reduction):
    weight = np.random.default_rng(0).standard_normal((D_IN, CLASSES)).astype(np.float32)
    desc = {"inputs": [("x", ["batch", D_IN]), ("y", ["batch"])],
            "outputs": [("loss", [], True), ("log_probs", ["batch", CLASSES])]}
    lr = 0.05
    trainer = ORTTrainer(_nll_model(weight, reduction=reduction), desc, optim.SGDConfig(lr=lr),
                         options=make_options())
    node = [n for n in trainer._onnx_model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss"]
    assert len(node) == 1 and _attrs(node[0]) == {"ignore_index": IGNORE, "reduction": reduction.encode()}
    ops = {n.op_type for n in trainer._onnx_model.graph.node}
    assert not {"LogSoftmax", "NegativeLogLikelihoodLoss"} & ops

    x, y = batch()
    y[:3] = IGNORE  # some ignored targets
    w = torch.tensor(weight, requires_grad=True)
    log_probs = F.log_softmax(x @ w, 1)
    ref = F.nll_loss(log_probs, y, ignore_index=IGNORE, reduction=reduction)
    ref.backward()

    loss, lp = trainer.eval_step(x, y)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, log_probs.detach(), rtol=1e-5, atol=1e-5)
    loss, _ = trainer.train_step(x, y)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    # One SGD step with the gradient that honours ignore_index and reduction.
    expected = (w - lr * w.grad).detach().numpy()
    np.testing.assert_allclose(weights(trainer)["W"], expected, rtol=1e-5, atol=1e-6)


def test_exported_nll_loss_keeps_ignore_index():
    """The torch path: nll_loss(log_softmax) trains to torch's loss value with ignore_index/sum."""

    class NLL(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(D_IN, CLASSES)

        def forward(self, x, y):
            return F.nll_loss(F.log_softmax(self.fc(x), 1), y, ignore_index=IGNORE, reduction="sum")

    torch.manual_seed(0)
    model = NLL()
    desc = {"inputs": [("x", ["batch", D_IN]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.01), options=make_options())
    x, y = batch()
    y[:3] = IGNORE
    with torch.no_grad():
        ref = model(x, y)
    loss = trainer.train_step(x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    sce = [n for n in trainer._onnx_model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss"]
    assert len(sce) == 1 and _attrs(sce[0]) == {"ignore_index": IGNORE, "reduction": b"sum"}


def test_compute_dtype_and_training_model_are_what_the_session_runs(make_mlp, mlp_desc, make_batch):
    trainer = ORTTrainer(make_mlp(), mlp_desc, optim.AdamConfig(lr=1e-3), loss_fn=mlp_loss, options=make_options())
    assert trainer.compute_dtype == torch.float32
    assert trainer.training_model is None  # built by the first step
    trainer.train_step(*make_batch())
    model = trainer.training_model
    assert model is trainer._training_session.graph.model
    ops = {node.op_type for node in model.graph.node}
    assert "Adam" in ops and ops & {"MatMul", "Gemm", "FusedMatMul"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp16 = ORTTrainer(make_mlp(), mlp_desc, optim.AdamConfig(lr=1e-3), loss_fn=mlp_loss,
                          options=make_options({"mixed_precision": {"enabled": True, "compute_dtype": "float16"}}))
    assert fp16.compute_dtype == torch.float16
