"""Matrix products on torch's kernels inside the one session (engine/kernels/, engine/graph/torch_matmul.py)
and bf16 mixed precision on CPUs with bf16 units.

References: the same trainer with every product on MLAS (fp32: the same arithmetic, another summation
order), torch.autocast("cpu", bfloat16) with torch.optim (bf16), and the legacy contract for options,
loss scaler and checkpoints. CPUs without bf16 units still run bf16 products (oneDNN emulates them):
the bf16 tests fake the CPU's flags, so they run on every host kind.
"""

import copy
import json
import warnings

import numpy as np
import onnx
import pytest
import torch
from helpers.models import (CLASSES, D_IN, GPT_DESC, MLP_DESC, TinyGPT, cross_entropy, export_mlp_with_loss,
                            gpt_batches)
from helpers.training import make_trainer, train
from onnx import TensorProto, helper

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.engine.graph import precision, torch_matmul
from orttrainer.engine.kernels import choice, library
from orttrainer.placement import cpu

PRODUCT_OPS = {"MatMul", "Gemm", "FusedMatMul"}
STEPS = 10


def mlp_batches(n, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, D_IN, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(n)]


def gpt_trainer(optim_config, seed=0, model=TinyGPT, **options):
    return make_trainer(model, GPT_DESC, optim_config, loss_fn=cross_entropy, seed=seed, **options)


def counts(trainer):
    ops = [n.op_type for n in trainer.training_model.graph.node]
    return {op: ops.count(op) for op in PRODUCT_OPS | {torch_matmul.OP}}


def torch_products(trainer, compute):
    return [n for n in trainer.training_model.graph.node if n.op_type == torch_matmul.OP
            and helper.get_attribute_value(next(a for a in n.attribute if a.name == "compute")) == compute]


@pytest.fixture
def fp32_kernels(monkeypatch):
    def use(kernel):
        monkeypatch.setenv(choice.FP32_ENV, kernel)
    return use


@pytest.fixture
def bf16_cpu(monkeypatch):
    """A CPU whose flags name avx512_bf16."""
    fake = cpu.CpuFacts(model="Test CPU with bf16 units", vendor="Test",
                        flags=frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.setattr(cpu, "facts", lambda path=None: fake)
    monkeypatch.setenv(choice.FP32_ENV, "mlas")
    return fake


@pytest.fixture
def plain_cpu(monkeypatch):
    """A CPU with AVX-512 but no bf16 units."""
    fake = cpu.CpuFacts(model="Test AVX-512 CPU", vendor="Test", flags=frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(cpu, "facts", lambda path=None: fake)
    return fake


def mixed(dtype="auto", **extra):
    return {"mixed_precision": {"enabled": True, "compute_dtype": dtype}, **extra}


# ------------------------------------------------------------------ the library


def test_the_library_builds_here_and_passes_its_self_test():
    assert library.problem() == ""
    assert library.kernel_dir().exists()


def test_the_op_computes_gemm_forms_through_a_session():
    """Gemm with bias and transposes, and a MatMul of a Transpose read through, in one session of the
    rewritten graph, against numpy."""
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((6, 4), (5, 6), (5,)))
    x, w = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["g"], transA=1, transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["m"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, v.shape) for n, v in
              (("a", a), ("b", b), ("c", c), ("x", x), ("w", w))]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("g", "m")]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    assert torch_matmul.matmuls_on_torch(model, "float32") == 2
    # the Transpose is read through (transB), and goes
    assert [n.op_type for n in model.graph.node] == ["TorchMatMul", "TorchMatMul"]
    assert helper.get_attribute_value(model.graph.node[1].attribute[1]) == 1  # transB
    import onnxruntime as ort
    options = ort.SessionOptions()
    library.register(options)
    g, m = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"a": a, "b": b, "c": c, "x": x, "w": w})
    np.testing.assert_allclose(g, 0.5 * a.T @ b.T + 2.0 * c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, x @ w.T, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ fp32 on torch's kernels


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "lamb"])
def test_products_on_torch_train_like_mlas_over_ten_steps(fp32_kernels, optimizer):
    """Every product of the training graph (forward and backward) on torch's fp32 kernel trains as the
    MLAS graph does, with gradient accumulation and clipping. Two fp32 GEMMs differ only in summation
    order (each product within ~k·2^-24 relative): 10 steps agree to the 1e-4 the engine's other
    reference checks use."""
    configs = {"sgd": lambda: optim.SGDConfig(lr=0.05),
               "adam": lambda: optim.AdamConfig(lr=1e-2, max_norm_clip=0.5),
               "lamb": lambda: optim.LambConfig(lr=1e-2, max_norm_clip=0.5)}
    batches = gpt_batches(2 * STEPS)
    runs = {}
    for kernel in ("mlas", "torch"):
        fp32_kernels(kernel)
        trainer = gpt_trainer(configs[optimizer](), batch={"gradient_accumulation_steps": 2})
        runs[kernel] = (train(trainer, batches), trainer)
    mlas, on_torch = counts(runs["mlas"][1]), counts(runs["torch"][1])
    products = sum(mlas[op] for op in PRODUCT_OPS)
    assert mlas[torch_matmul.OP] == 0 and products >= 30  # forward and backward products of 2 blocks + head
    assert on_torch[torch_matmul.OP] == products and all(on_torch[op] == 0 for op in PRODUCT_OPS)
    backward = [n for n in torch_products(runs["torch"][1], 0) if "grad" in n.output[0].lower()]
    assert len(backward) >= products // 2
    np.testing.assert_allclose(runs["torch"][0], runs["mlas"][0], rtol=1e-4)
    w_mlas = runs["mlas"][1].state_dict(pytorch_format=True)
    for name, value in runs["torch"][1].state_dict(pytorch_format=True).items():
        np.testing.assert_allclose(value.numpy(), w_mlas[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_odd_shapes_on_torch_kernels(fp32_kernels):
    """Batch 1, a one-token sequence, and batches of other sizes after the first, on torch's kernels
    and on MLAS: the same losses."""
    batches = [(ids[:1, :1], labels[:1, :1]) for ids, labels in gpt_batches(2)]
    batches += gpt_batches(2, batch=3, seq=5)
    losses = {}
    for kernel in ("mlas", "torch"):
        fp32_kernels(kernel)
        trainer = gpt_trainer(optim.AdamConfig(lr=1e-2), seed=0)
        losses[kernel] = train(trainer, batches)
    np.testing.assert_allclose(losses["torch"], losses["mlas"], rtol=1e-5)


def test_the_fastest_kernel_is_chosen_per_class_and_kept(fp32_kernels, monkeypatch, tmp_path):
    """'fastest': each class large enough to matter is timed once per host and kept in the host's
    choices file; torch's kernel is chosen only where it measured MARGIN faster."""
    assert library.problem() == ""  # built where it is kept; the choices go to tmp_path
    monkeypatch.setenv(library.KERNEL_DIR_ENV, str(tmp_path))
    measured = []

    def fake_measure(node, shapes):  # torch wins, by 2x, the products with the MLP's 256-wide side
        measured.append(json.dumps(shapes))
        wide = 256 in shapes[0] or 256 in shapes[1]
        return {"mlas": 2.0 if wide else 1.0, "torch": 1.0}

    monkeypatch.setattr(choice, "_measure", fake_measure)
    fp32_kernels("fastest")
    model = lambda: TinyGPT(dim=64)  # noqa: E731
    trainer = gpt_trainer(optim.AdamConfig(lr=1e-2), model=model)
    train(trainer, gpt_batches(1))
    chosen = counts(trainer)[torch_matmul.OP]
    assert 0 < chosen < sum(counts(trainer)[op] for op in PRODUCT_OPS) + chosen
    host_file = tmp_path / f"choices-{cpu.identity()}-{library.digest()}.json"
    assert len(json.loads(host_file.read_text())) == len(set(measured)) > 0
    first = len(measured)
    again = gpt_trainer(optim.AdamConfig(lr=1e-2), seed=1, model=model)
    train(again, gpt_batches(1))
    assert len(measured) == first  # read from the file, not measured again
    assert counts(again)[torch_matmul.OP] == chosen


def test_a_failed_self_test_keeps_mlas_with_one_warning(fp32_kernels, bf16_cpu, monkeypatch):
    monkeypatch.setattr(library, "_problem", "the self-test's y0 differs (forced by the test)")
    choice._warn_once.cache_clear()
    precision._warn_bf16_fallback_once.cache_clear()
    fp32_kernels("torch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = gpt_trainer(optim.AdamConfig(lr=1e-2), seed=0)
        losses = train(trainer, gpt_batches(2))
        fp32_mixed = gpt_trainer(optim.AdamConfig(lr=1e-2), seed=0, **mixed("auto"))
        train(fp32_mixed, gpt_batches(2))
    forced = [str(w.message) for w in caught if "forced by the test" in str(w.message)]
    assert len(forced) == 2, forced  # one for the fp32 products, one for mixed precision's bf16
    assert "stay on onnxruntime's fp32 kernels" in forced[0] and "computes in float32" in forced[1]
    assert counts(trainer)[torch_matmul.OP] == 0 and counts(fp32_mixed)[torch_matmul.OP] == 0
    assert fp32_mixed.compute_dtype == torch.float32 and np.isfinite(losses).all()


# ------------------------------------------------------------------ bf16 mixed precision


def autocast_reference(batches, lr):
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = cross_entropy(logits.float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_bf16_mixed_precision_trains_like_torch_autocast(bf16_cpu):
    """mixed_precision.enabled with compute_dtype 'auto' on a CPU with bf16 units: every product in
    bf16 (fp32 master weights, gradients and Adam), loss scale fixed at 1, losses within bf16's
    rounding of torch.autocast's over 10 steps (bf16 keeps 8 bits: 2^-8 per rounding)."""
    batches = gpt_batches(STEPS)
    trainer = gpt_trainer(optim.AdamConfig(lr=1e-3), seed=0, **mixed())
    losses = train(trainer, batches)
    fp32 = train(gpt_trainer(optim.AdamConfig(lr=1e-3), seed=0), batches)
    assert trainer.compute_dtype == torch.bfloat16
    products = counts(trainer)
    assert all(products[op] == 0 for op in PRODUCT_OPS)
    assert len(torch_products(trainer, 1)) == products[torch_matmul.OP] >= 30
    assert trainer.loss_scaler.loss_scale == 1.0 and trainer.loss_scaler.state_dict()["loss_scale"] == 1.0
    np.testing.assert_allclose(losses, autocast_reference(batches, 1e-3), rtol=4 * 2.0 ** -8)
    first_change = abs(losses[0] - fp32[0]) / fp32[0]
    assert 0 < first_change < 4 * 2.0 ** -8  # bf16 changed the very first loss, by a rounding's worth
    weights = trainer.state_dict()["model"]["full_precision"]
    assert all(np.asarray(v).dtype == np.float32 for v in weights.values())


def test_bfloat16_is_a_clear_error_on_a_cpu_without_bf16_units(plain_cpu):
    message = r"Test AVX-512 CPU has no bfloat16 matrix units.*amx_bf16 nor avx512_bf16"
    with pytest.raises(ValueError, match=message):
        gpt_trainer(optim.SGDConfig(lr=0.1), seed=0, **mixed("bfloat16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = gpt_trainer(optim.SGDConfig(lr=0.1), seed=0, **mixed())
    assert trainer.compute_dtype == torch.float32  # 'auto' stays fp32 there


def test_bfloat16_runs_on_an_onnx_model_too(bf16_cpu):
    """The CPU's bf16 is a rewrite of the training graph, not an autocast export: a given ONNX model
    computes its products in bf16 as well."""
    trainer = ORTTrainer(onnx.load_from_string(export_mlp_with_loss()), copy.deepcopy(MLP_DESC),
                         optim.SGDConfig(lr=0.1),
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, **mixed("bfloat16")}))
    x, y = mlp_batches(1)[0]
    trainer.train_step(x, y)
    assert trainer.compute_dtype == torch.bfloat16 and len(torch_products(trainer, 1)) > 0


def test_checkpoints_cross_between_bf16_and_fp32(bf16_cpu, tmp_path):
    """State written under bf16 compute loads into an fp32 trainer and the other way round: master
    weights and moments are fp32 in both."""
    batches = gpt_batches(4)
    bf16 = gpt_trainer(optim.AdamConfig(lr=1e-2), seed=0, **mixed())
    train(bf16, batches[:2])
    fp32 = gpt_trainer(optim.AdamConfig(lr=1e-2), seed=1)
    train(fp32, batches[:1])
    saved = bf16.state_dict()
    fp32.load_state_dict(copy.deepcopy(saved), strict=False)
    loaded = fp32.state_dict()
    for name, value in saved["model"]["full_precision"].items():
        assert np.array_equal(loaded["model"]["full_precision"][name], value), name
    for name, moments in saved["optimizer"].items():
        for key, value in moments.items():
            assert np.array_equal(np.asarray(loaded["optimizer"][name][key]), np.asarray(value)), (name, key)
    back = gpt_trainer(optim.AdamConfig(lr=1e-2), seed=2, **mixed())
    train(back, batches[:1])
    back.load_state_dict(copy.deepcopy(fp32.state_dict()), strict=False)
    for name, value in fp32.state_dict()["model"]["full_precision"].items():
        assert np.array_equal(back.state_dict()["model"]["full_precision"][name], value), name
    assert np.isfinite(train(back, batches[2:])).all()


def test_bf16_with_zero_stage_1(bf16_cpu):
    """ZeRO-1 on one process (the distributed graph form) under bf16: the same losses as without."""
    batches = gpt_batches(4)
    plain = train(gpt_trainer(optim.AdamConfig(lr=1e-2), **mixed()), batches)
    zero = gpt_trainer(optim.AdamConfig(lr=1e-2), distributed={"deepspeed_zero_optimization": {"stage": 1}},
                       **mixed())
    np.testing.assert_allclose(train(zero, batches), plain, rtol=1e-5)
    assert len(torch_products(zero, 1)) > 0


def test_a_bf16_graph_from_the_export_cache_is_used_without_a_rebuild(bf16_cpu, tmp_path):
    """The cache's check runs the eager forward under bf16 autocast for a bf16 graph (as for an fp16
    export): the cached graph is used, with no 'did not match' warning and the same losses."""
    import logging
    cache = {"utils": {"export_cache_dir": str(tmp_path)}}
    batches = gpt_batches(3)
    first = gpt_trainer(optim.AdamConfig(lr=1e-2), **mixed(), **cache)
    losses = train(first, batches)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("orttrainer").addHandler(handler)
    try:
        again = gpt_trainer(optim.AdamConfig(lr=1e-2), **mixed(), **cache)
        assert train(again, batches) == losses
    finally:
        logging.getLogger("orttrainer").removeHandler(handler)
    assert not [r for r in records if "did not match" in r.getMessage()]
    assert again._g.build.source == "export cache"


def test_a_class_whose_nominal_shapes_do_not_fit_stays_on_mlas(monkeypatch, tmp_path):
    """Symbolic sizes taken as NOMINAL_SYMBOL_SIZE can make operands that do not fit together (a
    pipeline stage's graph had one): such a class is not measured, stays on MLAS, and is kept as
    such; the graph builds."""
    assert library.problem() == ""
    monkeypatch.setenv(library.KERNEL_DIR_ENV, str(tmp_path))
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    choices = choice._Choices(cpu.identity())
    assert choices.torch_wins(node, {"a": [1024, 512], "b": [256, 64]}) is False
    kept = json.loads(next(tmp_path.glob("choices-*.json")).read_text())
    assert list(kept.values()) == [{"mlas": 0.0, "torch": float("inf"), "unmeasurable": True}]
