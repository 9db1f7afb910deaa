"""Mixed precision with fp16 compute (mixed_precision.compute_dtype), against fp32 and PyTorch.

The CPU provider runs fp16 ops through Casts (slow, correct): these tests check the numerics and the
graph a GPU would run, on the CPU. Reference: the same model trained in fp32 (orttrainer, itself
checked against torch.optim in test_engine_numerics.py) and torch's fp32 autograd gradients.
"""

import copy
import warnings

import numpy as np
import onnx
import pytest
import torch
from helpers import training
from helpers.models import GPT_DESC, MLP, MLP_DESC, TinyGPT, cross_entropy, gpt_batches
from onnx import TensorProto

from orttrainer import amp, optim
from orttrainer.engine.graph import precision
from orttrainer.engine.graph import training_graph as tg

STEPS = 12


@pytest.fixture(autouse=True)
def _quiet_fp16_cpu_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixed_precision.compute_dtype is 'float16' on the CPU")
        yield


def gpt(vocab=50, max_len=32):
    torch.manual_seed(0)
    desc = {"inputs": GPT_DESC["inputs"], "outputs": [("loss", [], True), ("logits", ["batch", "seq", vocab])]}
    return TinyGPT(vocab=vocab, max_len=max_len), desc


def mixed_precision(dtype="float16", scaler=None, enabled=True):
    """The mixed_precision options: enabled, fp16 compute and a 1024 loss scale unless told otherwise."""
    mixed = {"enabled": enabled}
    if enabled:
        mixed["loss_scaler"] = scaler or amp.DynamicLossScaler(loss_scale=1024.0)
    if dtype is not None:
        mixed["compute_dtype"] = dtype
    return mixed


def options(dtype="float16", scaler=None, enabled=True, **extra):
    return training.make_options({"mixed_precision": mixed_precision(dtype, scaler, enabled), **extra})


def trainer_for(model, desc, optim_config, dtype="float16", scaler=None, enabled=True, **extra):
    return training.make_trainer(model, desc, optim_config, loss_fn=cross_entropy,
                                 mixed_precision=mixed_precision(dtype, scaler, enabled), **extra)


def weights(trainer):
    return {k: v.copy() for k, v in trainer.state_dict()["model"]["full_precision"].items()}


# ------------------------------------------------------------------ the graph


def _cast_targets(model):
    """{tensor: element type} for every Cast output."""
    return {n.output[0]: next(a.i for a in n.attribute if a.name == "to") for n in model.graph.node
            if n.op_type == "Cast"}


def _fed_by_fp16_cast(model, name):
    """Whether `name` is a Cast to FLOAT16, possibly behind data movement (Transpose, Reshape...)."""
    producers = {out: n for n in model.graph.node for out in n.output}
    casts = _cast_targets(model)
    while name in producers and producers[name].op_type in ("Transpose", "Reshape", "Unsqueeze", "Identity"):
        name = producers[name].input[0]
    return casts.get(name) == TensorProto.FLOAT16


def test_float16_graph_computes_matmuls_in_fp16_with_fp32_master_weights(tmp_path):
    model, desc = gpt()
    path = str(tmp_path / "training.onnx")
    trainer = trainer_for(model, desc, optim.AdamConfig(lr=1e-2),
                          debug={"graph_save_paths": {"model_with_training_graph_path": path}})
    x, y = gpt_batches(1)[0]
    trainer.train_step(x, y)
    graph = onnx.load(path)
    forward_matmuls = [n for n in graph.graph.node if n.op_type == "MatMul" and n.name.startswith("/model/")]
    fp16_matmuls = [n.name for n in forward_matmuls if any(_fed_by_fp16_cast(graph, i) for i in n.input)]
    # Every Linear (4 per block × 2 blocks) and the LM head read an fp16 Cast of its fp32 weight.
    assert len(fp16_matmuls) == 4 * 2 + 1, fp16_matmuls
    # Master weights, optimizer state and gradients stay fp32.
    inputs = {i.name: i.type.tensor_type.elem_type for i in graph.graph.input}
    for w in trainer._training_session.graph.weights:
        assert inputs[w] == TensorProto.FLOAT
        assert inputs[f"Moment_1_{w}"] == TensorProto.FLOAT
    assert trainer._training_session.graph.low_precision


def test_auto_on_the_cpu_is_float32_compute(tmp_path):
    model, desc = gpt()
    path = str(tmp_path / "training.onnx")
    trainer = trainer_for(model, desc, optim.AdamConfig(lr=1e-2), dtype=None,
                          debug={"graph_save_paths": {"model_with_training_graph_path": path}})
    assert trainer.options.mixed_precision.compute_dtype == "auto"
    trainer.train_step(*gpt_batches(1)[0])
    assert TensorProto.FLOAT16 not in _cast_targets(onnx.load(path)).values()
    assert not trainer._training_session.graph.low_precision


# ------------------------------------------------------------------ numerics


@pytest.mark.parametrize("vocab,max_len", [(50, 32), (100, 80)])  # one-hot MatMul / Gather embeddings
def test_float16_trains_like_float32(vocab, max_len):
    """Adam with clipping on TinyGPT: fp16 compute follows the fp32 run within rtol 2e-2 (measured:
    5e-4), and ends with weights within 3e-2 (relative L2 norm per tensor; measured 5e-3 / 1.3e-2)
    of the fp32 ones."""
    batches = gpt_batches(STEPS, vocab=vocab)
    runs = {}
    for dtype in ("float32", "float16"):
        model, desc = gpt(vocab, max_len)
        trainer = trainer_for(model, desc, optim.AdamConfig(lr=1e-2, max_norm_clip=0.5), dtype=dtype)
        runs[dtype] = (training.train(trainer, batches), weights(trainer))
    (loss32, w32), (loss16, w16) = runs["float32"], runs["float16"]
    assert loss32[-1] < loss32[0] - 1.0  # it trains
    np.testing.assert_allclose(loss16, loss32, rtol=2e-2)
    assert loss16 != loss32  # really computed differently
    for name, value in w32.items():  # Adam turns tiny gradient differences into ±lr steps: compare norms
        assert np.linalg.norm(w16[name] - value) <= 3e-2 * np.linalg.norm(value), name


def test_float16_gradients_match_torch_float32():
    """One SGD step with lr 1 writes w - g: the fp16-compute gradient, unscaled, against torch's fp32
    autograd. Tolerance: 1e-2 of the tensor's largest gradient (measured: 1.1e-3)."""
    model, desc = gpt()
    reference = copy.deepcopy(model)
    x, y = gpt_batches(1)[0]
    trainer = trainer_for(model, desc, optim.SGDConfig(lr=1.0))
    before = {k: v.detach().numpy().copy() for k, v in reference.state_dict().items()}
    trainer.train_step(x, y)
    after = weights(trainer)
    cross_entropy(reference(x), y).backward()
    for name, param in reference.named_parameters():
        expected = param.grad.numpy()
        got = before[name] - after[name]
        np.testing.assert_allclose(got, expected, atol=1e-2 * np.abs(expected).max(), err_msg=name)


def test_outputs_keep_legacy_dtypes_and_state_stays_fp32():
    model, desc = gpt()
    trainer = trainer_for(model, desc, optim.AdamConfig(lr=1e-2))
    x, y = gpt_batches(1)[0]
    loss, logits = trainer.train_step(x, y)
    assert loss.dtype == torch.float32 and logits.dtype == torch.float16
    loss, logits = trainer.eval_step(x, y)
    assert loss.dtype == torch.float32 and logits.dtype == torch.float16
    out = trainer.model_desc.outputs[1]
    assert (out.dtype, out.dtype_amp) == (torch.float32, torch.float16)
    state = trainer.state_dict()
    assert set(state["model"]) == {"full_precision"}
    assert all(v.dtype == np.float32 for v in state["model"]["full_precision"].values())
    assert all(v.dtype == torch.float32 for v in trainer.state_dict(pytorch_format=True).values())


# ------------------------------------------------------------------ overflow and non-finite steps


def test_forced_overflow_skips_the_step_and_halves_the_scale():
    """A loss scale of 2**40 overflows fp16 in the backward (fp32 compute would not overflow):
    nothing is updated, bit for bit, the scale halves and optimization_step stays."""
    model, desc = gpt()
    scaler = amp.DynamicLossScaler(loss_scale=float(2**40))
    trainer = trainer_for(model, desc, optim.AdamConfig(lr=1e-2), scaler=scaler)
    x, y = gpt_batches(1)[0]
    trainer.eval_step(x, y)  # creates the session
    before = trainer.state_dict()
    loss, _ = trainer.train_step(x, y)
    after = trainer.state_dict()
    assert np.isfinite(float(loss))  # the forward is fine; the scaled backward overflowed
    assert not bool(trainer._train_step_info.all_finite)
    assert trainer.loss_scaler.loss_scale == float(2**39)
    assert trainer._train_step_info.optimization_step == 0 and trainer._train_step_info.step == 1
    for name, value in before["model"]["full_precision"].items():
        assert np.array_equal(after["model"]["full_precision"][name], value), name
    for weight, states in before["optimizer"].items():
        for key, value in states.items():
            assert np.array_equal(after["optimizer"][weight][key], value), (weight, key)
    assert trainer.mixed_precision_counters.state_dict() == {"skipped_steps": 1, "nan_steps": 0}

    # The same scale with fp32 compute stays finite: the overflow above is fp16's.
    model, desc = gpt()
    fp32 = trainer_for(model, desc, optim.AdamConfig(lr=1e-2), dtype="float32",
                       scaler=amp.DynamicLossScaler(loss_scale=float(2**40)))
    fp32.train_step(x, y)
    assert bool(fp32._train_step_info.all_finite) and fp32._train_step_info.optimization_step == 1


def test_nan_loss_is_counted_and_skipped():
    torch.manual_seed(0)
    trainer = trainer_for(MLP(), MLP_DESC, optim.SGDConfig(lr=0.1))
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    trainer.train_step(x, y)
    x[0, 0] = float("nan")
    loss, _ = trainer.train_step(x, y)
    assert np.isnan(float(loss))
    assert trainer.mixed_precision_counters.state_dict() == {"skipped_steps": 1, "nan_steps": 1}
    assert trainer._train_step_info.optimization_step == 1


# ------------------------------------------------------------------ resume


def _fp16_run(trainer, batches):
    return [(float(trainer.train_step(x, y)[0]), trainer.loss_scaler.loss_scale) for x, y in batches]


@pytest.mark.slow
@pytest.mark.parametrize("immediate", [False, True])  # load before / after the session exists
def test_resume_of_an_fp16_run_is_exact(tmp_path, immediate):
    """Starting at 2**30 the first steps overflow (skipped, counted); the scale then grows every 2
    steps. A run saved after 5 steps and resumed in a new trainer continues exactly like the
    uninterrupted one: losses, scale, its stable-step count, the counters and the weights."""
    batches = gpt_batches(10)

    def make():
        model, desc = gpt()
        scaler = amp.DynamicLossScaler(loss_scale=float(2**30), up_scale_window=2)
        return trainer_for(model, desc, optim.AdamConfig(lr=1e-2), scaler=scaler)

    reference = make()
    expected = _fp16_run(reference, batches)
    assert reference.mixed_precision_counters.skipped_steps >= 2
    assert len({scale for _, scale in expected}) > 3

    saver = make()
    _fp16_run(saver, batches[:5])
    path = str(tmp_path / "fp16.ortcp")
    saver.save_checkpoint(path)
    saved_counters = saver.mixed_precision_counters.state_dict()
    assert saved_counters["skipped_steps"] >= 2

    resumed = make()
    if immediate:
        resumed.eval_step(*batches[0])
    resumed.load_checkpoint(path)
    if immediate:
        assert resumed.mixed_precision_counters.state_dict() == saved_counters
    trajectory = _fp16_run(resumed, batches[5:])
    assert trajectory == expected[5:]
    assert resumed.loss_scaler.state_dict() == reference.loss_scaler.state_dict()
    assert resumed.mixed_precision_counters.state_dict() == reference.mixed_precision_counters.state_dict()
    assert resumed._train_step_info.optimization_step == reference._train_step_info.optimization_step
    for name, value in weights(reference).items():
        assert np.array_equal(weights(resumed)[name], value), name


# ------------------------------------------------------------------ errors and the CPU fence


def test_low_precision_needs_mixed_precision_and_a_torch_model():
    with pytest.raises(ValueError, match="compute_dtype is 'float16' but mixed_precision.enabled is False"):
        options(enabled=False)
    with pytest.raises(ValueError, match="ONNX model"):
        precision.resolve_compute_dtype("float16", enabled=True, device_type="cpu", torch_model=False)


def test_float16_on_the_cpu_warns_once():
    precision._warn_fp16_on_cpu_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            precision.resolve_compute_dtype("float16", enabled=True, device_type="cpu", torch_model=True)
        assert precision.resolve_compute_dtype("auto", enabled=True, device_type="cuda",
                                               torch_model=True) == torch.float16
    assert len([w for w in caught if "slower than in float32" in str(w.message)]) == 1


class SliceModel(torch.nn.Module):
    """Two slices of one fp16 activation: their SliceGrads' gradients meet (the form that fails)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.relu(torch.cat([h[:, :8] + h[:, 8:], h[:, 8:]], dim=-1)))


def test_cpu_fence_runs_fp16_slices_in_fp32(monkeypatch):
    """Without the fence the CPU provider fails at run time on this fp16 SliceGrad; with it the fp16
    model trains like the fp32 one. (A guard: if onnxruntime gains the kernel, the second half fails
    and the fence can go.)"""
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3] * 2)

    def losses(dtype):
        torch.manual_seed(0)
        trainer = trainer_for(SliceModel(), MLP_DESC, optim.SGDConfig(lr=0.1), dtype=dtype)
        return [float(trainer.train_step(x, y)[0]) for _ in range(3)]

    np.testing.assert_allclose(losses("float16"), losses("float32"), rtol=2e-2)
    monkeypatch.setattr(tg, "fence_low_precision_ops", lambda model: [])
    with pytest.raises(RuntimeError, match="SliceGrad"):
        losses("float16")


@pytest.mark.slow
def test_float16_in_the_distributed_form():
    """ZeRO stage 1 builds the distributed runtime's graph even in one process (finiteness decided in
    torch before its apply run): fp16 compute shares the graph's front half, trains like the
    single-process form, and a forced overflow skips the step there too."""
    batches = gpt_batches(6)
    runs = []
    for zero in (0, 1):
        model, desc = gpt()
        trainer = trainer_for(model, desc, optim.AdamConfig(lr=1e-2),
                              distributed={"deepspeed_zero_optimization": {"stage": zero}})
        runs.append(training.train(trainer, batches))
        assert trainer._training_session.graph.low_precision
    assert type(trainer._training_session.runtime).__name__ == "DistributedRuntime"
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-4)

    model, desc = gpt()
    trainer = trainer_for(model, desc, optim.AdamConfig(lr=1e-2), scaler=amp.DynamicLossScaler(loss_scale=2.0**40),
                          distributed={"deepspeed_zero_optimization": {"stage": 1}})
    trainer.eval_step(*batches[0])
    before = weights(trainer)
    trainer.train_step(*batches[0])
    assert trainer.loss_scaler.loss_scale == 2.0**39 and trainer._train_step_info.optimization_step == 0
    assert trainer.mixed_precision_counters.skipped_steps == 1
    for name, value in before.items():
        assert np.array_equal(weights(trainer)[name], value), name


def test_float16_with_recompute():
    """Recompute builds its session through a first optimized session: it must get the same
    PreShapeNodeElimination fix, and recomputing changes no fp16 value."""
    batches = gpt_batches(3)
    runs = []
    for recompute in (False, True):
        model, desc = gpt()
        trainer = trainer_for(model, desc, optim.AdamConfig(lr=1e-2),
                              graph_transformer={"gelu_recompute": recompute, "attn_dropout_recompute": recompute})
        runs.append(training.train(trainer, batches))
        assert (trainer._training_session.graph.recompute is not None) == recompute
    assert runs[0] == runs[1]
