"""The old class (`orttrainer.ort_trainer`, onnxruntime.capi.ort_trainer's seed API) against the new class.

Reference: the new `orttrainer.ORTTrainer` (itself checked against torch.optim in test_engine_numerics.py)
on the same model, the same batches and the same learning-rate schedule: the old class feeds the LR as an
input each step, the new one computes it with an LR scheduler. Losses and weights must agree to 1e-6.
"""

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.models import MLP, MLP_DESC, cross_entropy

from orttrainer import ORTTrainer, ORTTrainerOptions, amp, optim
from orttrainer import ort_trainer as old
from orttrainer.engine.graph import precision
from orttrainer.optim.lr_scheduler import _LRScheduler

LR0, WARMUP_STEPS, TOTAL = 0.05, 4, 10


def old_desc():
    return old.ModelDescription(
        [old.IODescription("x", ["batch", 6], torch.float32), old.IODescription("y", ["batch"], torch.int64, 4)],
        [old.IODescription("loss", [], torch.float32), old.IODescription("logits", ["batch", 4], torch.float32)])


LR_DESC = old.IODescription("Learning_Rate", [1], torch.float32)


def lr_at(global_step):
    """ConstantWarmupLRScheduler(total_steps=TOTAL, warmup=0.4) written out by hand."""
    return LR0 * (global_step / WARMUP_STEPS if global_step < WARMUP_STEPS else 1.0)


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def model():
    torch.manual_seed(0)
    return MLP()


def new_trainer(config, gas=1, mixed=None, **extra):
    opts = {"device": {"id": "cpu"}, "batch": {"gradient_accumulation_steps": gas},
            "lr_scheduler": optim.ConstantWarmupLRScheduler(total_steps=TOTAL, warmup=0.4), **extra}
    if mixed is not None:
        opts["mixed_precision"] = {"enabled": True, "loss_scaler": mixed}
    return ORTTrainer(model(), copy.deepcopy(MLP_DESC), config, loss_fn=cross_entropy,
                      options=ORTTrainerOptions(opts))


def old_trainer(name="AdamOptimizer", attrs=None, **kwargs):
    kwargs.setdefault("get_lr_this_step", lr_at)
    return old.ORTTrainer(model(), cross_entropy, old_desc(), name, attrs, LR_DESC, torch.device("cpu"), **kwargs)


def weights(trainer):
    return {k: v.numpy() for k, v in trainer.state_dict(pytorch_format=True).items()}


def old_weights(trainer):
    return {k: v.numpy() for k, v in trainer.state_dict(include_optimizer_state=False).items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7, err_msg=key)


CONFIGS = {"AdamOptimizer": optim.AdamConfig, "LambOptimizer": optim.LambConfig, "SGDOptimizer": optim.SGDConfig}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("gas", [1, 2])
def test_same_losses_and_weights_as_new_class(name, gas):
    new = new_trainer(CONFIGS[name](lr=LR0), gas=gas)
    legacy = old_trainer(name, gradient_accumulation_steps=gas)
    for i, (x, y) in enumerate(batches(4 * gas)):
        new_loss, new_logits = new.train_step(x, y)
        old_loss, old_logits = legacy.train_step(x, y)  # LR from get_lr_this_step(global_step_)
        np.testing.assert_allclose(old_loss.numpy(), new_loss.numpy(), rtol=1e-6, err_msg=f"step {i}")
        np.testing.assert_allclose(old_logits.numpy(), new_logits.numpy(), rtol=1e-6, atol=1e-7)
    assert legacy.global_step_ == 4 and legacy.current_step == 4 * gas
    assert_same(old_weights(legacy), weights(new))
    # The optimizer state too, under the session's names.
    assert_same(legacy.session.get_state(), new._training_session.get_state())


def test_learning_rate_as_positional_and_keyword_input():
    new = new_trainer(optim.AdamConfig(lr=LR0))
    by_position = old_trainer(get_lr_this_step=None)
    by_name = old_trainer(get_lr_this_step=None)
    for step, (x, y) in enumerate(batches(3)):
        expected = new.train_step(x, y)[0]
        lr = torch.tensor([lr_at(step)])
        np.testing.assert_allclose(by_position.train_step(x, y, lr)[0].numpy(), expected.numpy(), rtol=1e-6)
        np.testing.assert_allclose(by_name.train_step([x, y], Learning_Rate=lr)[0].numpy(), expected.numpy(),
                                   rtol=1e-6)
    assert_same(old_weights(by_position), weights(new))
    assert_same(old_weights(by_name), weights(new))


def hf_attributes(name):
    """The 2020 Hugging Face map: no weight decay for biases."""
    decay = 0.0 if name.endswith("bias") else 0.01
    return {"alpha": 0.9, "beta": 0.999, "lambda": decay, "epsilon": 1e-6, "do_bias_correction": 1}


@pytest.mark.parametrize("name", ["AdamOptimizer", "LambOptimizer"])
def test_map_optimizer_attributes_become_param_groups(name):
    config_cls = CONFIGS[name]
    groups = [{"params": ["fc1.weight", "fc2.weight"], "alpha": 0.9, "beta": 0.999, "lambda_coef": 0.01,
               "epsilon": 1e-6, "do_bias_correction": True},
              {"params": ["fc1.bias", "fc2.bias"], "alpha": 0.9, "beta": 0.999, "lambda_coef": 0.0,
               "epsilon": 1e-6, "do_bias_correction": True}]
    new = new_trainer(config_cls(params=groups, lr=LR0))
    legacy = old_trainer(name, hf_attributes)
    for x, y in batches(6):
        np.testing.assert_allclose(legacy.train_step(x, y)[0].numpy(), new.train_step(x, y)[0].numpy(), rtol=1e-6)
    assert_same(old_weights(legacy), weights(new))
    # The decay really acts: without the map the weights differ.
    plain = old_trainer(name)
    for x, y in batches(6):
        plain.train_step(x, y)
    assert not np.allclose(old_weights(plain)["fc1.weight"], weights(new)["fc1.weight"], rtol=1e-6)


def test_mixed_precision_with_old_loss_scaler_matches_new_scaler():
    new_scaler = amp.DynamicLossScaler(loss_scale=1024.0, up_scale_window=2)
    new = new_trainer(optim.AdamConfig(lr=LR0), mixed=new_scaler)
    scaler = old.LossScaler("loss_scale", True, loss_scale=1024.0, up_scale_window=2)
    legacy = old_trainer(use_mixed_precision=True, loss_scaler=scaler)
    for x, y in batches(5):
        np.testing.assert_allclose(legacy.train_step(x, y)[0].numpy(), new.train_step(x, y)[0].numpy(), rtol=1e-6)
        assert scaler.loss_scale_ == new_scaler.loss_scale
    assert scaler.loss_scale_ == 1024.0 * 4  # doubled after steps 2 and 4
    assert_same(old_weights(legacy), weights(new))


def test_mixed_precision_caller_feeds_scale_and_gets_all_finite():
    scaler = old.LossScaler("loss_scale", True, loss_scale=2.0 ** 20, up_scale_window=1000)
    legacy = old_trainer(use_mixed_precision=True, gradient_accumulation_steps=2, get_lr_this_step=None)
    for step, (x, y) in enumerate(batches(4)):
        outputs = legacy.train_step(x, y, torch.tensor([0.01]), torch.tensor([scaler.loss_scale_]))
        if step % 2 == 0:
            assert len(outputs) == 2  # loss, logits: no all_finite inside an accumulation window
        else:
            assert len(outputs) == 3 and outputs[2].dtype == torch.bool and bool(outputs[2])
            scaler.update_loss_scale(outputs[2])
    assert legacy.global_step_ == 2
    # An overflow: the step is skipped, the caller's scaler halves, global_step_ does not move.
    before = old_weights(legacy)
    x, y = batches(1, seed=1)[0]
    x[0, 0] = float("inf")  # non-finite gradients
    scale = torch.tensor([scaler.loss_scale_])
    legacy.train_step(x, y, torch.tensor([0.01]), default_loss_scale_input_name=scale)  # the old kwarg
    outputs = legacy.train_step(x, y, torch.tensor([0.01]), scale)
    assert not bool(outputs[2])
    scaler.update_loss_scale(outputs[2])
    assert scaler.loss_scale_ == 2.0 ** 19
    assert legacy.global_step_ == 2
    assert_same(old_weights(legacy), before)


def test_loss_scaler_update_rule_is_the_old_one():
    scaler = old.LossScaler("ls", True, loss_scale=8.0, up_scale_window=2, min_loss_scale=2.0, max_loss_scale=16.0)
    seen = []
    for finite in [True, True, True, True, False, False, False, True]:
        scaler.update_loss_scale(finite)
        seen.append(scaler.loss_scale_)
    assert seen == [8.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0]
    scaler.reset()
    assert (scaler.loss_scale_, scaler.stable_steps_) == (8.0, 0)
    static = old.LossScaler("ls", False, loss_scale=8.0)
    static.update_loss_scale(False)
    assert static.loss_scale_ == 8.0


def test_fetches_and_eval_step():
    new = new_trainer(optim.AdamConfig(lr=LR0))
    legacy = old_trainer()
    (x, y), (ex, ey) = batches(2)
    new_loss = new.train_step(x, y)[0]
    logits = legacy.train_step(x, y, fetches=["logits"])
    assert logits.shape == (8, 4)
    assert legacy.global_step_ == 1  # a fetches step still trains
    new.eval_step(ex, ey)
    expected_loss, expected_logits = new.eval_step(ex, ey)
    loss, out_logits = legacy.eval_step(ex, ey)
    np.testing.assert_allclose(loss.numpy(), expected_loss.numpy(), rtol=1e-6)
    np.testing.assert_allclose(out_logits.numpy(), expected_logits.numpy(), rtol=1e-6)
    assert legacy.eval_step(ex, fetches=["logits"]).shape == (8, 4)  # the label is not needed
    assert (legacy.global_step_, legacy.current_step) == (1, 1)
    assert new_loss is not None
    legacy.eval()
    np.testing.assert_allclose(legacy(ex, ey)[0].numpy(), loss.numpy())
    with pytest.raises(RuntimeError, match="invalid output names"):
        legacy.eval_step(ex, ey, fetches=["nope"])


@pytest.mark.parametrize("before_first_step", [True, False])
def test_state_dict_round_trip(before_first_step):
    data = batches(5)
    first = old_trainer()
    for x, y in data[:3]:
        first.train_step(x, y)
    state = first.state_dict()
    assert {"fc1.weight", "Moment_1_fc1.weight", "Moment_2_fc1.weight", "Update_Count_fc1.weight"} <= state.keys()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    second = old_trainer()
    if not before_first_step:
        second.eval_step(*data[0])
    second.load_state_dict(state)
    second.global_step_ = first.global_step_
    for x, y in data[3:]:
        np.testing.assert_allclose(second.train_step(x, y)[0].numpy(), first.train_step(x, y)[0].numpy(),
                                   rtol=1e-6)
    assert_same({k: v.numpy() for k, v in second.state_dict().items()},
                {k: v.numpy() for k, v in first.state_dict().items()})


def test_load_state_dict_strict_names_the_unknown_tensor_and_changes_nothing():
    trainer = old_trainer()
    trainer.train_step(*batches(1)[0])
    before = old_weights(trainer)
    bad = {k: v + 1 for k, v in trainer.state_dict().items()}
    bad["not_in_model"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="Checkpoint tensor: not_in_model is not present"):
        trainer.load_state_dict(bad, strict=True)
    assert_same(old_weights(trainer), before)
    trainer.load_state_dict(bad)  # strict=False (the old default) skips it
    assert_same(old_weights(trainer), {k: v + 1 for k, v in before.items()})


def test_state_dict_before_session_and_save_as_onnx(tmp_path):
    trainer = old_trainer()
    with pytest.warns(UserWarning, match="not initialized"):
        assert trainer.state_dict() == {}
    data = batches(3)
    for x, y in data[:2]:
        trainer.train_step(x, y)
    path = str(tmp_path / "model.onnx")
    trainer.save_as_onnx(path)
    saved = onnx.load(path)
    onnx.checker.check_model(saved)
    x, y = data[2]
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    loss, logits = session.run(["loss", "logits"], {"x": x.numpy(), "y": y.numpy()})
    expected_loss, expected_logits = trainer.eval_step(x, y)
    np.testing.assert_allclose(loss, expected_loss.numpy(), rtol=1e-5)
    np.testing.assert_allclose(logits, expected_logits.numpy(), rtol=1e-5, atol=1e-6)


def test_onnx_model_input_trains_like_the_torch_model():
    source = old_trainer()
    source.eval_step(*batches(1)[0])
    onnx_model = copy.deepcopy(source.onnx_model_)
    from_onnx = old.ORTTrainer(onnx_model, None, old_desc(), "AdamOptimizer", None, LR_DESC, torch.device("cpu"),
                               get_lr_this_step=lr_at)
    from_torch = old_trainer()
    for x, y in batches(3):
        np.testing.assert_allclose(from_onnx.train_step(x, y)[0].numpy(), from_torch.train_step(x, y)[0].numpy(),
                                   rtol=1e-6)
    torch_state = from_torch.state_dict()
    # include_optimizer_state=False keeps only torch state_dict keys: with an ONNX model, everything.
    assert from_onnx.state_dict(include_optimizer_state=False).keys() == torch_state.keys()
    assert_same({k: v.numpy() for k, v in from_onnx.state_dict().items()},
                {k: v.numpy() for k, v in torch_state.items()})


def test_bad_input_errors():
    trainer = old_trainer(get_lr_this_step=None)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="missing \\['Learning_Rate'\\]"):
        trainer.train_step(x, y)
    with pytest.raises(ValueError, match="must hold one value"):
        trainer.train_step(x, y, torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="finite number >= 0"):
        trainer.train_step(x, y, torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="Unexpected input 'z'"):
        trainer.train_step(x, y, torch.tensor([0.1]), z=x)
    with pytest.raises(ValueError, match="4 positional inputs"):
        trainer.train_step(x, y, torch.tensor([0.1]), x)
    assert trainer.current_step == 0 and trainer.session is None  # nothing ran
    with pytest.raises(ValueError, match="only float, int and bool"):
        old_trainer(attrs=lambda name: {"alpha": "0.9"})
    with pytest.raises(ValueError, match="does not take per weight"):
        old_trainer(attrs=lambda name: {"momentum": 0.9})
    with pytest.raises(ValueError, match="SGDOptimizer does not take"):
        old_trainer("SGDOptimizer", attrs=lambda name: {"alpha": 0.9})
    with pytest.raises(ValueError, match="not one of"):
        old_trainer("AdagradOptimizer")
    with pytest.raises(RuntimeError, match="frozen_weights"):
        old_trainer(frozen_weights=["fc9.weight"])
    with pytest.raises(NotImplementedError, match="enable_adasum=True with distributed.world_size=3"):
        old_trainer(enable_adasum=True, world_size=3)
    # The original ignored a loss scaler without mixed precision (it only read it in mixed precision).
    with pytest.warns(UserWarning, match="'loss_scaler' is ignored: use_mixed_precision is False"):
        old_trainer(loss_scaler=old.LossScaler("ls", True))


def test_frozen_weights_do_not_train():
    trainer = old_trainer(frozen_weights=["fc1.weight"])
    before = old_weights(trainer) if trainer.session else {k: v.detach().numpy().copy()
                                                           for k, v in model().state_dict().items()}
    for x, y in batches(2):
        trainer.train_step(x, y)
    after = old_weights(trainer)
    np.testing.assert_array_equal(after["fc1.weight"], before["fc1.weight"])
    assert not np.allclose(after["fc2.weight"], before["fc2.weight"])


def run_script(tmp_path, *flags):
    out = tmp_path / f"result{'_'.join(flags)}.json"
    script = Path(__file__).resolve().parents[1] / "helpers" / "old_class_bert_script.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(out), *flags], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_2020_bert_pretraining_script_runs_unchanged(tmp_path):
    """The script (tests/helpers/old_class_bert_script.py) against the new class on the same model, the same
    batches, the script's LR schedule and its optimizer-attribute map written as parameter groups."""
    from helpers import old_class_bert_script as script

    result = run_script(tmp_path)
    args = argparse.Namespace(learning_rate=0.05, warmup_proportion=0.2, max_steps=6,
                              gradient_accumulation_steps=2, vocab_size=40)

    class ScriptSchedule(_LRScheduler):
        def get_lr(self, info):
            return [script.get_lr(args, info.optimization_step)]

    torch.manual_seed(42)
    bert = script.TinyBertForPreTraining(40)
    decay = [n for n, _ in bert.named_parameters()
             if not any(k in n for k in ["bias", "gamma", "beta", "LayerNorm"])]
    rest = [n for n, _ in bert.named_parameters() if n not in decay]
    groups = [{"params": decay, "lambda_coef": 0.01}, {"params": rest, "lambda_coef": 0.0}]
    seq = ["batch", "max_seq_len_in_batch"]
    desc = {"inputs": [("input_ids", seq), ("token_type_ids", seq), ("attention_mask", seq),
                       ("masked_lm_labels", seq), ("next_sentence_label", ["batch"])],
            "outputs": [("loss", [], True)]}
    new = ORTTrainer(bert, desc, optim.LambConfig(params=groups, lr=0.05, epsilon=1e-6),
                     options=ORTTrainerOptions({"device": {"id": "cpu"}, "lr_scheduler": ScriptSchedule(),
                                                "batch": {"gradient_accumulation_steps": 2},
                                                "_internal_use": {"onnx_opset_version": 12}}))
    batches_ = script.make_batches(args)
    expected = [new.train_step(*batch).item() for batch in batches_[:-1]]
    np.testing.assert_allclose(result["losses"], expected, rtol=1e-6)
    assert result["global_step"] == 6
    assert result["eval_loss"] < result["losses"][0]  # batch 0 after training vs before: it learned
    np.testing.assert_allclose(result["eval_loss"], new.eval_step(*batches_[0]).item(), rtol=1e-6)
    assert "Moment_1_word_embeddings.weight" in result["state_keys"]

    # --fp16: the old class's mixed precision, the new class's compute_dtype 'auto' -- fp32 compute on a
    # CPU without bf16 units (loss scale 2**16 in and out: the same run), bf16 on one with them (the
    # same run within bf16's rounding, 2^-8 per product).
    fp16 = run_script(tmp_path, "--fp16")
    auto = precision.resolve_compute_dtype("auto", enabled=True, device_type="cpu", torch_model=True)
    np.testing.assert_allclose(fp16["losses"], result["losses"], rtol=1e-5 if auto == torch.float32 else 2.0 ** -6)
    assert fp16["loss_scale"] == 2.0 ** 16 and fp16["global_step"] == 6


class ThreeInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))

    def forward(self, a, b, c=None):
        return (a * self.w).sum() + 2 * (b * self.w).sum() + (0 if c is None else 3 * (c * self.w).sum())


def described(*names):
    return old.ModelDescription([old.IODescription(n, [2], torch.float32) for n in names],
                                [old.IODescription("loss", [], torch.float32)])


@pytest.mark.parametrize("names, positional", [
    (("x", "y", "z"), True),   # same count as forward(): in order, whatever the names
    (("a", "q"), True),        # a name forward() does not take: in order (the new class would match 'a')
    (("b", "a"), False),       # fewer, all named, out of order: by name
    (("a", "b"), False),       # already in order: either way
])
def test_inputs_reach_forward_as_the_old_class_passed_them(names, positional):
    assert old._needs_positional_inputs(ThreeInputs(), None, described(*names)) == (
        positional and any(n in ("a", "b", "c") for n in names) and list(names) != ["a", "b", "c"][:len(names)])
    trainer = old.ORTTrainer(ThreeInputs(), None, described(*names), "SGDOptimizer", None, LR_DESC,
                             torch.device("cpu"))
    first, second = torch.tensor([1.0, 1.0]), torch.tensor([10.0, 10.0])
    inputs = [first, second] + ([torch.zeros(2)] if len(names) == 3 else [])
    loss = trainer.eval_step(*inputs).item()
    # In order: a=first, b=second -> 2 + 40; by name ('b', 'a'): b=first, a=second -> 20 + 4.
    assert loss == (42.0 if positional or list(names) == ["a", "b"] else 24.0)


def test_load_state_dict_wrong_shape_changes_nothing():
    trainer = old_trainer()
    trainer.train_step(*batches(1)[0])
    before = {k: v.numpy().copy() for k, v in trainer.state_dict().items()}
    bad = {k: v + 1 for k, v in trainer.state_dict().items()}
    bad["Moment_1_fc2.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="Moment_1_fc2.weight"):
        trainer.load_state_dict(bad)
    assert_same({k: v.numpy() for k, v in trainer.state_dict().items()}, before)
