"""The engine against independent references: torch.optim for SGD/Adam, a LAMB written here.

Each test trains the same initial weights on the same batches with orttrainer and with the reference,
step by step, and compares losses and final weights.
"""

import copy

import numpy as np
import pytest
import torch
from helpers.models import GPT_DESC, MLP, MLP_DESC, TinyGPT, cross_entropy, gpt_batches
from helpers import training

from orttrainer import optim
from orttrainer.optim import lr_scheduler
from orttrainer.engine.kernels import choice

STEPS = 20


def mlp_batches(n, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def make(kind):
    """mlp; gpt (50-row tables: its embeddings become one-hot products, small_embedding_as_matmul);
    gpt-gather (a 100-row vocabulary and 80 positions: the tables stay Gather / GatherGrad)."""
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(), MLP_DESC, mlp_batches(STEPS)
    if kind == "gpt-gather":
        desc = {"inputs": GPT_DESC["inputs"], "outputs": [("loss", [], True), ("logits", ["batch", "seq", 100])]}
        return TinyGPT(vocab=100, max_len=80), desc, gpt_batches(STEPS)
    return TinyGPT(), GPT_DESC, gpt_batches(STEPS)


def run_reference(model, batches, make_optimizer, clip=None, loss_fn=cross_entropy):
    optimizer = make_optimizer(model.parameters())
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses


def run_orttrainer(model, desc, batches, optim_config, **options):
    """orttrainer's (losses, trainer) of `batches` (helpers.training: CPU options merged with `options`)."""
    trainer = training.make_trainer(model, desc, optim_config, loss_fn=cross_entropy, **options)
    return training.train(trainer, batches), trainer


def assert_same_training(ref_model, ref_losses, trainer, losses, rtol=1e-4, atol=1e-5):
    """rtol 1e-4; the atol only matters for weights near 0 (|w| < 0.1), where Adam's normalised update
    turns float-rounding differences of two implementations into relative errors above 1e-4."""
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in ref_model.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=rtol, atol=atol, err_msg=name)


def assert_trains_like_torch_sgd(model, desc, batches, lr):
    """Train `model` with orttrainer's SGD and a deepcopy with torch.optim.SGD; they must agree step by
    step. Returns orttrainer's (losses, trainer)."""
    ref = copy.deepcopy(model)
    ref_losses = run_reference(ref, batches, lambda p: torch.optim.SGD(p, lr=lr))
    losses, trainer = run_orttrainer(model, desc, batches, optim.SGDConfig(lr=lr))
    assert_same_training(ref, ref_losses, trainer, losses)
    return losses, trainer


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlp", "gpt", "gpt-gather"])
def test_sgd_matches_torch(kind):
    model, desc, batches = make(kind)
    losses, _ = assert_trains_like_torch_sgd(model, desc, batches, lr=0.1)
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlp", "gpt", "gpt-gather"])
@pytest.mark.parametrize("clip", [True, False])
def test_adam_matches_torch(kind, clip):
    model, desc, batches = make(kind)
    ref = copy.deepcopy(model)
    # max_norm_clip 0.5 so that clipping really acts on these models' gradients.
    ref_losses = run_reference(ref, batches, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
                               clip=0.5 if clip else None)
    losses, trainer = run_orttrainer(model, desc, batches, optim.AdamConfig(lr=1e-2, max_norm_clip=0.5),
                                     utils={"grad_norm_clip": clip})
    assert_same_training(ref, ref_losses, trainer, losses)


def test_clipping_changes_training():
    """Guards the test above: with these settings the clipped and unclipped runs differ."""
    model, desc, batches = make("mlp")
    clipped, _ = run_orttrainer(copy.deepcopy(model), desc, batches, optim.AdamConfig(lr=1e-2, max_norm_clip=0.05))
    free, _ = run_orttrainer(model, desc, batches, optim.AdamConfig(lr=1e-2, max_norm_clip=0.05),
                             utils={"grad_norm_clip": False})
    assert not np.allclose(clipped, free)


def test_adam_weight_decay_modes():
    """Mode 0 (BEFORE_WEIGHT_UPDATE) is torch's AdamW; mode 1 applies lr·λ·w after the Adam step."""
    model, desc, batches = make("mlp")
    ref = copy.deepcopy(model)
    ref_losses = run_reference(ref, batches, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    losses, trainer = run_orttrainer(copy.deepcopy(model), desc, batches,
                                     optim.AdamConfig(lr=1e-2, lambda_coef=0.1), utils={"grad_norm_clip": False})
    assert_same_training(ref, ref_losses, trainer, losses)

    ref = copy.deepcopy(model)
    adam = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, y in batches:
        adam.zero_grad()
        loss = cross_entropy(ref(x), y)
        loss.backward()
        adam.step()
        with torch.no_grad():
            for p in ref.parameters():
                p.sub_(1e-2 * 0.1 * p)
        ref_losses.append(loss.item())
    mode = optim.AdamConfig.DecayMode.AFTER_WEIGHT_UPDATE
    losses, trainer = run_orttrainer(model, desc, batches,
                                     optim.AdamConfig(lr=1e-2, lambda_coef=0.1, weight_decay_mode=mode),
                                     utils={"grad_norm_clip": False})
    assert_same_training(ref, ref_losses, trainer, losses)


def lamb_reference(model, batches, lr, alpha=0.9, beta=0.999, lambda_coef=0.0, epsilon=1e-6, max_norm=1.0,
                   ratio_min=float("-inf"), ratio_max=float("inf"), bias_correction=False):
    """LAMB (You et al.) as onnxruntime's kernel computes it, clipping by the global gradient norm."""
    params = list(model.parameters())
    m1 = [torch.zeros_like(p) for p in params]
    m2 = [torch.zeros_like(p) for p in params]
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        model.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
        scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
        with torch.no_grad():
            for p, a, b in zip(params, m1, m2):
                g = p.grad * scale
                a.mul_(alpha).add_((1 - alpha) * g)
                b.mul_(beta).add_((1 - beta) * g * g)
                a_hat = a / (1 - alpha ** step) if bias_correction else a
                b_hat = b / (1 - beta ** step) if bias_correction else b
                d = a_hat / (b_hat.sqrt() + epsilon) + lambda_coef * p
                w_norm, d_norm = p.norm().item(), d.norm().item()
                ratio = min(max(w_norm / d_norm, ratio_min), ratio_max) if w_norm > 0 and d_norm > 0 else 1.0
                p.sub_(lr * ratio * d)
    return losses


@pytest.mark.parametrize("kind", ["mlp", "gpt", "gpt-gather"])
@pytest.mark.parametrize("settings", [
    {},
    {"lambda_coef": 0.01, "do_bias_correction": True, "max_norm_clip": 0.5, "ratio_max": 5.0, "ratio_min": 0.01},
])
@pytest.mark.slow
def test_lamb_matches_reference(kind, settings):
    model, desc, batches = make(kind)
    ref = copy.deepcopy(model)
    ref_settings = {("max_norm" if k == "max_norm_clip" else "bias_correction" if k == "do_bias_correction"
                     else k): v for k, v in settings.items()}
    ref_losses = lamb_reference(ref, batches, lr=1e-3, **ref_settings)
    losses, trainer = run_orttrainer(model, desc, batches, optim.LambConfig(lr=1e-3, **settings))
    assert_same_training(ref, ref_losses, trainer, losses)
    assert int(trainer.state_dict()["optimizer"]["shared_optimizer_state"]["Step"][0]) == STEPS + 1


def test_param_groups_apply_per_weight():
    """A group with its own weight decay acts on its weights only (torch param groups as reference)."""
    model, desc, batches = make("mlp")
    ref = copy.deepcopy(model)
    decayed = ["fc1.weight"]
    ref_losses = run_reference(ref, batches, lambda p: torch.optim.AdamW(
        [{"params": [ref.fc1.weight], "weight_decay": 0.5},
         {"params": [ref.fc1.bias, ref.fc2.weight, ref.fc2.bias], "weight_decay": 0.0}], lr=1e-2))
    config = optim.AdamConfig(params=[{"params": decayed, "lambda_coef": 0.5}], lr=1e-2)
    losses, trainer = run_orttrainer(model, desc, batches, config, utils={"grad_norm_clip": False})
    assert_same_training(ref, ref_losses, trainer, losses)


@pytest.mark.slow
@pytest.mark.parametrize("optim_config", [optim.SGDConfig(lr=0.1), optim.AdamConfig(lr=1e-2)],
                         ids=["sgd", "adam"])
def test_gradient_accumulation_equals_big_batch(optim_config):
    """k micro-batches of size b with accumulation == one batch of k·b (mean-reduced loss)."""
    k = 4
    model, desc, _ = make("gpt")
    big = gpt_batches(5, batch=8)
    big_losses, big_trainer = run_orttrainer(copy.deepcopy(model), desc, big, optim_config)

    trainer = training.make_trainer(model, desc, optim_config, loss_fn=cross_entropy,
                                    batch={"gradient_accumulation_steps": k})
    for x, y in big:
        before = trainer.state_dict(pytorch_format=True) if trainer._training_session else None
        for i, (xs, ys) in enumerate(zip(x.chunk(k), y.chunk(k))):
            trainer.train_step(xs, ys)
            if before is not None and i < k - 1:  # no weight moves on a micro-step
                now = trainer.state_dict(pytorch_format=True)
                assert all(torch.equal(now[n], before[n]) for n in now)
    assert trainer._train_step_info.optimization_step == 5
    assert trainer._train_step_info.step == 5 * k
    mine = trainer.state_dict(pytorch_format=True)
    for name, value in big_trainer.state_dict(pytorch_format=True).items():
        np.testing.assert_allclose(mine[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_frozen_weights_never_move():
    model, desc, batches = make("mlp")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    _, trainer = run_orttrainer(model, desc, batches, optim.AdamConfig(lr=1e-2),
                                utils={"frozen_weights": ["fc1.weight", "fc2.bias"]})
    trained = trainer.state_dict(pytorch_format=True)
    assert torch.equal(trained["fc1.weight"], initial["fc1.weight"])
    assert torch.equal(trained["fc2.bias"], initial["fc2.bias"])
    assert not torch.equal(trained["fc2.weight"], initial["fc2.weight"])
    assert "fc1.weight" not in trainer.state_dict()["optimizer"]


def test_eval_step_changes_nothing():
    model, desc, batches = make("gpt")
    _, trainer = run_orttrainer(model, desc, batches[:3], optim.AdamConfig(lr=1e-2))
    before = trainer.state_dict()
    first = trainer.eval_step(*batches[3])
    second = trainer.eval_step(*batches[3])
    after = trainer.state_dict()
    assert torch.equal(first[0], second[0])
    assert after["train_step_info"] == before["train_step_info"]
    for name, value in before["model"]["full_precision"].items():
        assert np.array_equal(after["model"]["full_precision"][name], value)
    for name, states in before["optimizer"].items():
        for key, value in states.items():
            assert np.array_equal(after["optimizer"][name][key], value)


def test_eval_matches_torch_forward():
    model, desc, batches = make("gpt")
    trainer = training.make_trainer(copy.deepcopy(model), desc, optim.SGDConfig(lr=0.0),
                                    loss_fn=cross_entropy)
    loss, logits = trainer.eval_step(*batches[0])
    with torch.no_grad():
        expected = model(batches[0][0])
    np.testing.assert_allclose(logits.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(loss.item(), cross_entropy(expected, batches[0][1]).item(), rtol=1e-5)


class RecordingScheduler(lr_scheduler.LinearWarmupLRScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def get_lr(self, train_step_info):
        lr = super().get_lr(train_step_info)
        self.seen.append(lr[0])
        return lr


def test_lr_schedule_reaches_the_optimizer():
    """SGD moves weights by exactly lr·grad: the lr the graph used equals the scheduler's value."""
    model, desc, batches = make("mlp")
    scheduler = RecordingScheduler(total_steps=6, warmup=0.5)
    trainer = training.make_trainer(model, desc, optim.SGDConfig(lr=0.5), loss_fn=cross_entropy,
                                    lr_scheduler=scheduler)
    ref = copy.deepcopy(model)
    for step, (x, y) in enumerate(batches[:6]):
        trainer.train_step(x, y)
        lr = scheduler.seen[step]
        ref.zero_grad()
        cross_entropy(ref(x), y).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p.sub_(lr * p.grad)
        trained = trainer.state_dict(pytorch_format=True)
        for name, value in ref.state_dict().items():
            np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-7)
    # Warm-up: step 0 applies lr 0, then linear growth to the peak, then linear decay.
    expected = [0.0, 0.5 / 3, 1.0 / 3, 0.5, 0.5 * 2 / 3, 0.5 / 3]
    np.testing.assert_allclose(scheduler.seen, expected, rtol=1e-6)
    assert initial_weights_unchanged_at_lr0(batches)


def initial_weights_unchanged_at_lr0(batches):
    model, desc, _ = make("mlp")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = training.make_trainer(model, desc, optim.AdamConfig(lr=1.0), loss_fn=cross_entropy,
                                    lr_scheduler=lr_scheduler.ConstantWarmupLRScheduler(10, warmup=0.5))
    trainer.train_step(*batches[0])
    trained = trainer.state_dict(pytorch_format=True)
    return all(torch.equal(trained[k], v) for k, v in initial.items())


@pytest.mark.slow
def test_varying_batch_and_sequence_sizes():
    model, desc, _ = make("gpt")
    ref = copy.deepcopy(model)
    trainer = training.make_trainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy)
    shapes = [(2, 8), (3, 16), (1, 5), (4, 12)]
    g = torch.Generator().manual_seed(1)
    batches = []
    for b, t in shapes:
        ids = torch.randint(0, 50, (b, t), generator=g)
        batches.append((ids, torch.roll(ids, -1, dims=1)))
    losses = training.train(trainer, batches)
    exported = trainer._onnx_model
    ref_losses = run_reference(ref, batches, lambda p: torch.optim.SGD(p, lr=0.1))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert trainer._onnx_model is exported  # no re-export
    logits = trainer.eval_step(*batches[1])[1]
    assert list(logits.shape) == [3, 16, 50]


def test_mixed_precision_loss_scaling_matches_fp32_and_skips_overflow():
    """Dynamic loss scaling: same training as without it; a non-finite step updates nothing and
    halves the scale; optimization_step counts only real updates. fp32 compute: on a CPU with bf16
    units 'auto' would compute in bf16, whose rounding is not what this test is about."""
    from orttrainer import amp

    model, desc, batches = make("mlp")
    plain_losses, plain = run_orttrainer(copy.deepcopy(model), desc, batches[:5], optim.AdamConfig(lr=1e-2))
    scaler = amp.DynamicLossScaler(loss_scale=float(1 << 16), up_scale_window=2)
    scaled_losses, trainer = run_orttrainer(model, desc, batches[:5], optim.AdamConfig(lr=1e-2),
                                            mixed_precision={"enabled": True, "loss_scaler": scaler,
                                                             "compute_dtype": "float32"})
    np.testing.assert_allclose(scaled_losses, plain_losses, rtol=1e-5)
    assert trainer.loss_scaler.loss_scale == float(1 << 18)  # doubled after steps 2 and 4
    assert bool(trainer._train_step_info.all_finite.item()) is True

    before = trainer.state_dict()
    x, y = batches[5]
    poisoned = x.clone()
    poisoned[0, 0] = float("inf")
    trainer.train_step(poisoned, y)
    after = trainer.state_dict()
    assert bool(trainer._train_step_info.all_finite.item()) is False
    assert trainer.loss_scaler.loss_scale == float(1 << 17)
    assert after["train_step_info"] == {"optimization_step": 5, "step": 6}
    for name, value in before["model"]["full_precision"].items():
        assert np.array_equal(after["model"]["full_precision"][name], value), name
    assert np.array_equal(after["optimizer"]["fc1.weight"]["Moment_1"], before["optimizer"]["fc1.weight"]["Moment_1"])

    # The skipped step left no trace: the next step equals the plain trainer's next step.
    np.testing.assert_allclose(trainer.train_step(x, y)[0].item(), plain.train_step(x, y)[0].item(), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_attributes_survive(reduction, weighted):
    """ignore_index, reduction and class weights keep torch's meaning through the loss rewrite and the
    fused loss gradient (SGD steps compare weights, so the gradient is checked, not just the loss)."""
    class_weight = torch.tensor([1.0, 2.0, 0.5, 3.0]) if weighted else None

    def loss_fn(logits, label):
        loss = torch.nn.functional.cross_entropy(logits, label, weight=class_weight, ignore_index=-100,
                                                 reduction=reduction)
        return loss.mean() * 3.0 if reduction == "none" else loss

    model, desc, batches = make("mlp")
    batches = [(x, torch.where(torch.arange(len(y)) % 3 == 0, torch.tensor(-100), y)) for x, y in batches[:6]]
    ref = copy.deepcopy(model)
    ref_losses = run_reference(ref, batches, lambda p: torch.optim.SGD(p, lr=0.05), loss_fn=loss_fn)
    trainer = training.make_trainer(model, desc, optim.SGDConfig(lr=0.05), loss_fn=loss_fn)
    losses = training.train(trainer, batches)
    assert_same_training(ref, ref_losses, trainer, losses)


def test_operator_without_gradient_is_named():
    class WithBatchNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 4)
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.fc(x))

    trainer = training.make_trainer(WithBatchNorm(), MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy)
    with pytest.raises(NotImplementedError, match="no gradient for BatchNormalization"):
        trainer.train_step(*mlp_batches(1)[0])


def test_training_graph_rewrites_apply():
    """The exporter's opset-14 LayerNorm becomes LayerNormalization, the loss becomes the exp-sum
    form with a fused gradient in the training graph (the numerics tests above prove the values are unchanged); the forward
    model that save_as_onnx writes keeps the exporter's ops."""
    model, desc, batches = make("gpt")
    _, trainer = run_orttrainer(model, desc, batches[:1], optim.SGDConfig(lr=0.1))
    training_ops = {n.op_type for n in trainer._training_session.graph.model.graph.node}
    forward_ops = {n.op_type for n in trainer._onnx_model.graph.node}
    assert {"LayerNormalization", "LayerNormalizationGrad"} <= training_ops
    assert "Pow" not in training_ops and "SoftmaxCrossEntropyLoss" not in training_ops
    # Nodes are in topological order (the rewrites append nodes that earlier ones read).
    graph = trainer._training_session.graph.model.graph
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in graph.node:
        assert set(node.input) <= defined, (node.name, set(node.input) - defined)
        defined.update(node.output)
    # The 50-row tables are one-hot products (no GatherGrad); larger ones stay Gather (below).
    assert "OneHot" in training_ops and "GatherGrad" not in training_ops
    # The loss gradient is the fused closed form, not the autodiff of the exp-sum form.
    assert "ScatterElements" in training_ops and "GatherElementsGrad" not in training_ops
    assert {"Pow", "SoftmaxCrossEntropyLoss"} <= forward_ops and "LayerNormalization" not in forward_ops
    model, desc, batches = make("gpt-gather")
    _, trainer = run_orttrainer(model, desc, batches[:1], optim.SGDConfig(lr=0.1))
    training_ops = {n.op_type for n in trainer._training_session.graph.model.graph.node}
    assert "GatherGrad" in training_ops and "OneHot" not in training_ops


@pytest.mark.parametrize("adam", ["orttrainer", "onnxruntime"])
@pytest.mark.parametrize("mixed_precision", [False, True])
def test_state_buffers_in_place_but_mixed_precision_on_adam_optimizer(mixed_precision, adam, monkeypatch):
    """Weights and moments live in one buffer each (the update writes over its input; the numerics
    tests above prove the ordering keeps that exact) -- under mixed precision too with the library's
    Adam, which skips a discarded step itself. Mixed precision on onnxruntime's AdamOptimizer: two
    buffers, so a skipped step keeps the old values. Counters always have two (a few bytes)."""
    monkeypatch.setenv(choice.ADAM_ENV, adam)
    model, desc, batches = make("gpt")
    options = {"mixed_precision": {"enabled": True}} if mixed_precision else {}
    _, trainer = run_orttrainer(model, desc, batches[:2], optim.AdamConfig(lr=1e-3), **options)
    runtime = trainer._training_session
    in_place = not mixed_precision or adam == "orttrainer"
    for name, (first, second) in runtime._pairs.items():
        shared = first.data_ptr() == second.data_ptr()
        assert shared == (in_place and not name.startswith("Update_Count_")), name


def test_tall_lm_head_reads_its_table_untransposed_and_matches_torch():
    """A vocabulary-sized tied head (>= 16384 rows) is a Gemm(x, W, transB=1) on the table as stored
    (tall_weight_product_as_gemm): no step writes the transposed table; training still equals
    torch's, step by step, through the flattened 3-D input."""
    vocab = 16384
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab, dim=8, heads=2, layers=1)
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", vocab])]}
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(5):
        ids = torch.randint(0, vocab, (2, 8), generator=g)
        batches.append((ids, torch.roll(ids, -1, dims=1)))
    _, trainer = assert_trains_like_torch_sgd(model, desc, batches, lr=0.5)
    nodes = trainer._training_session.graph.model.graph.node
    table = next(n for n, p in model.named_parameters() if tuple(p.shape) == (vocab, 8))
    readers = [n for n in nodes if table in n.input]
    assert not any(n.op_type == "Transpose" for n in readers)
    assert any(n.op_type == "Gemm" and n.name.startswith("tall_gemm_") for n in readers)


def test_in_place_updates_wait_for_every_output():
    """A model output that no gradient needs (an int64 argmax from a second use of fc2, whose node is
    an ancestor of no gradient) must still read the weights before their in-place update: outputs
    equal torch's forward with the weights of that step, and training equals torch's."""

    class WithHiddenArgmax(MLP):
        def forward(self, x):
            hidden = torch.relu(self.fc1(x))
            return self.fc2(hidden), self.fc2(hidden * 2.0).argmax(-1)

    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 4]), ("unit", ["batch"])]}
    torch.manual_seed(0)
    model = WithHiddenArgmax()
    ref = copy.deepcopy(model)
    trainer = training.make_trainer(model, desc, optim.SGDConfig(lr=0.5),
                                    loss_fn=lambda out, y: cross_entropy(out[0], y))
    sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in mlp_batches(4):
        loss, logits, unit = trainer.train_step(x, y)
        with torch.no_grad():
            ref_logits, ref_unit = ref(x)
        assert unit.dtype == torch.int64 and torch.equal(unit, ref_unit)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
        sgd.zero_grad()
        cross_entropy(ref(x)[0], y).backward()
        sgd.step()
    trained = trainer.state_dict(pytorch_format=True)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6)


def test_long_bias_gradient_matches_torch():
    """A bias of >= 4096 entries gets its gradient as a ones-vector MatMul
    (large_bias_gradient_as_matmul); training still equals torch's, step by step."""
    classes = 4096
    torch.manual_seed(0)
    model = MLP(hidden=8, classes=classes)
    desc = {"inputs": MLP_DESC["inputs"], "outputs": [("loss", [], True), ("logits", ["batch", classes])]}
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(16, 6, generator=g), torch.randint(0, classes, (16,), generator=g)) for _ in range(5)]
    _, trainer = assert_trains_like_torch_sgd(model, desc, batches, lr=0.5)
    nodes = trainer._training_session.graph.model.graph.node
    assert any(n.op_type == "MatMul" and n.name.startswith("bias_grad_") for n in nodes)
