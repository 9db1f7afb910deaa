"""Adam's update on the kernel library's Adam (engine/kernels/adam.cc): AdamOptimizer's arithmetic,
skipping a discarded step itself, so that mixed precision updates weights and moments in place.

References: the same trainer with onnxruntime's AdamOptimizer ($ORTTRAINER_ADAM=onnxruntime, the
kernel the library repeats operation for operation; itself checked against torch.optim in
test_engine_numerics.py), and the legacy contract for the state_dict and the loss scaler.
"""

import warnings

import numpy as np
import pytest
import torch
from helpers.models import GPT_DESC, TinyGPT, cross_entropy, gpt_batches
from helpers.training import make_trainer, train

from orttrainer import amp, optim
from orttrainer.engine.graph import optimizer_graph
from orttrainer.engine.kernels import choice, library

STEPS = 10
AFTER_UPDATE = optim.AdamConfig.DecayMode.AFTER_WEIGHT_UPDATE  # Hugging Face's AdamW


def gpt_trainer(optim_config, adam, monkeypatch, mixed=False, scale=1024.0, **options):
    monkeypatch.setenv(choice.ADAM_ENV, adam)
    if mixed:
        options["mixed_precision"] = {"enabled": True, "compute_dtype": "float32",
                                      "loss_scaler": amp.DynamicLossScaler(loss_scale=scale)}
    return make_trainer(TinyGPT, GPT_DESC, optim_config, loss_fn=cross_entropy, seed=0, **options)


def adam_nodes(trainer):
    nodes = trainer.training_model.graph.node
    op = (optimizer_graph.LIBRARY_DOMAIN, optimizer_graph.LIBRARY_ADAM)
    library = [n for n in nodes if (n.domain, n.op_type) == op]
    return {"library": len(library),
            "onnxruntime": sum(n.op_type == "AdamOptimizer" for n in nodes)}


def state(trainer):
    sd = trainer.state_dict()
    return sd["model"]["full_precision"], sd["optimizer"]


def assert_close_states(a, b, lr):
    """Weights and moments close to the reference's after the steps. The kernels differ only in the
    last bits of a square root (the library's is exact, Eigen's approximates it); over steps, the
    weights' rounding differences change the gradients, and Adam turns a changed gradient of an
    element whose gradient is ~0 into a changed update of up to a whole step (lr). So the weights
    agree to a thousandth of one step, the moments to fp32 rounding of the gradients they average."""
    (wa, oa), (wb, ob) = a, b
    assert wa.keys() == wb.keys() and oa.keys() == ob.keys()
    for name in wa:
        np.testing.assert_allclose(wa[name], wb[name], rtol=0, atol=1e-3 * lr, err_msg=name)
    for weight in oa:
        assert oa[weight].keys() == ob[weight].keys()
        for key in oa[weight]:
            np.testing.assert_allclose(oa[weight][key], ob[weight][key], rtol=1e-4, atol=1e-7,
                                       err_msg=f"{weight} {key}")


def test_the_library_adam_passes_its_self_test_here():
    assert library.adam_problem() == ""


CASES = {
    "adam": (dict(lr=1e-2), {}),
    "adamw-hugging-face": (dict(lr=1e-2, lambda_coef=0.01, weight_decay_mode=AFTER_UPDATE), {}),
    "no-bias-correction-decay": (dict(lr=1e-2, lambda_coef=0.02, do_bias_correction=False), {}),
    "accumulation-clip": (dict(lr=1e-2), {"batch": {"gradient_accumulation_steps": 2},
                                          "utils": {"grad_norm_clip": True}}),
}


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "mixed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_library_adam_trains_like_adam_optimizer(case, mixed, monkeypatch):
    hyper, options = CASES[case]
    batches = gpt_batches(STEPS)
    reference = gpt_trainer(optim.AdamConfig(**hyper), "onnxruntime", monkeypatch, mixed, **options)
    expected = train(reference, batches)
    trainer = gpt_trainer(optim.AdamConfig(**hyper), "orttrainer", monkeypatch, mixed, **options)
    losses = train(trainer, batches)
    assert adam_nodes(reference)["library"] == 0 and adam_nodes(trainer)["onnxruntime"] == 0
    assert adam_nodes(trainer)["library"] == adam_nodes(reference)["onnxruntime"] > 0  # one per weight
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_close_states(state(trainer), state(reference), hyper["lr"])
    updates = STEPS // options.get("batch", {}).get("gradient_accumulation_steps", 1)
    counts = {int(np.asarray(v["Update_Count"]).item()) for v in state(trainer)[1].values()}
    assert counts == {updates + 1}  # the number of the next update


def test_mixed_precision_updates_in_place_and_skips_a_non_finite_step(monkeypatch):
    """With the library's Adam the mixed-precision graph updates every weight and moment in place
    (one buffer each, the module's own parameters as its weights), and a non-finite step leaves all
    of them, bit for bit, and the update counts as they were."""
    trainer = gpt_trainer(optim.AdamConfig(lr=1e-2), "orttrainer", monkeypatch, mixed=True)
    model = trainer._torch_model
    batches = gpt_batches(3)
    train(trainer, batches[:2])
    specs = trainer._training_session.graph.states
    in_place = {name for name, spec in specs.items() if spec.in_place}
    assert {n for n in specs if not n.startswith("Update_Count_")} <= in_place
    pairs = trainer._training_session.state.pairs
    assert all(pairs[name][0] is pairs[name][1] for name in in_place)
    parameters = {p.data_ptr() for p in model.parameters()}
    assert {pairs[n][0].data_ptr() for n in in_place if n in dict(model.named_parameters())} <= parameters

    before = state(trainer)
    scale = trainer.loss_scaler.loss_scale
    trainer.loss_scaler.loss_scale = float("inf")  # every gradient becomes non-finite
    trainer.train_step(*batches[2])
    assert not bool(trainer._train_step_info.all_finite)
    after = state(trainer)
    for name, value in before[0].items():
        assert np.array_equal(after[0][name], value), name
    for weight, states in before[1].items():
        for key, value in states.items():
            assert np.array_equal(after[1][weight][key], value), (weight, key)
    trainer.loss_scaler.loss_scale = scale
    train(trainer, batches[2:])
    assert bool(trainer._train_step_info.all_finite) and trainer._train_step_info.optimization_step == 3


def test_mixed_precision_with_adam_optimizer_keeps_second_buffers(monkeypatch):
    """The fallback's form: onnxruntime's AdamOptimizer cannot skip, so the states ping-pong."""
    trainer = gpt_trainer(optim.AdamConfig(lr=1e-2), "onnxruntime", monkeypatch, mixed=True)
    train(trainer, gpt_batches(1))
    assert not any(spec.in_place for spec in trainer._training_session.graph.states.values())


def test_a_failed_self_test_keeps_adam_optimizer_with_one_warning(monkeypatch):
    monkeypatch.setattr(library, "_adam_problem", "Adam's self-test case 1: w differs (forced by the test)")
    choice._warn_once.cache_clear()
    batches = gpt_batches(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = gpt_trainer(optim.AdamConfig(lr=1e-2), "orttrainer", monkeypatch, mixed=True)
        losses = train(trainer, batches)
        again = gpt_trainer(optim.AdamConfig(lr=1e-2), "orttrainer", monkeypatch)
        train(again, batches)
    forced = [str(w.message) for w in caught if "forced by the test" in str(w.message)]
    assert len(forced) == 1 and "stay on onnxruntime's AdamOptimizer" in forced[0], forced
    assert adam_nodes(trainer) == {"library": 0, "onnxruntime": adam_nodes(trainer)["onnxruntime"]}
    assert adam_nodes(again)["library"] == 0 and np.isfinite(losses).all()
    reference = gpt_trainer(optim.AdamConfig(lr=1e-2), "onnxruntime", monkeypatch, mixed=True)
    assert train(reference, batches) == losses


def test_a_bad_adam_choice_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(choice.ADAM_ENV, "torch")
    with pytest.raises(ValueError, match=r"\$ORTTRAINER_ADAM is 'torch'; use one of orttrainer, onnxruntime"):
        choice.Kernels.of(torch.float32, "cpu")


def test_checkpoints_move_between_the_kernels(tmp_path, monkeypatch):
    """A checkpoint written with one Adam kernel loads into a trainer on the other and continues as
    the writer would have (same state_dict layout: Moment_1/Moment_2/Update_Count per weight)."""
    batches = gpt_batches(6)
    writer = gpt_trainer(optim.AdamConfig(lr=1e-2), "orttrainer", monkeypatch, mixed=True)
    train(writer, batches[:3])
    path = str(tmp_path / "library.ortcp")
    writer.save_checkpoint(path)
    expected = train(writer, batches[3:])
    reader = gpt_trainer(optim.AdamConfig(lr=1e-2), "onnxruntime", monkeypatch, mixed=True)
    reader.load_checkpoint(path)
    np.testing.assert_allclose(train(reader, batches[3:]), expected, rtol=1e-5)


def test_graphs_name_the_kernel_in_the_training_spec(monkeypatch):
    """The choice is part of the export cache key (a cached graph holds one kernel's nodes)."""
    monkeypatch.setenv(choice.ADAM_ENV, "onnxruntime")
    onnxruntime = choice.Kernels.of(torch.float32, "cpu")
    monkeypatch.setenv(choice.ADAM_ENV, "orttrainer")
    assert choice.Kernels.of(torch.float32, "cpu") != onnxruntime
    assert choice.Kernels.of(torch.float32, "cuda").adam == "onnxruntime"  # the CUDA provider's own
