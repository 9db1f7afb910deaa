"""Start-up cost (issue 20): the export checks the model's outputs against model_desc on the trace's
own outputs, so the first step runs the torch forward once (the trace), not twice, and the checks
leave the exported graph and the errors as they were."""

import copy

import onnx
import pytest
import torch
import torch.nn.functional as F

from orttrainer import ORTTrainer, optim
from orttrainer.engine import checks
from orttrainer.engine import export as _export
from conftest import MLP_DESC, TinyMLP, make_options, mlp_loss


def counted(model):
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(module.training))
    return calls


def test_the_first_step_runs_the_torch_forward_once():
    torch.manual_seed(0)
    model = TinyMLP()
    calls = counted(model)
    trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.1), loss_fn=mlp_loss,
                         options=make_options({"utils": {"export_cache": False}}))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    trainer.train_step(x, y)
    assert calls == [True]  # the trace, in training mode; no separate eval forward for the checks
    trainer.train_step(x, y)
    assert calls == [True]


def test_an_output_check_inside_the_trace_changes_nothing_in_the_graph():
    torch.manual_seed(0)
    wrapper = _export.ModelWithLoss(TinyMLP(), mlp_loss, ["x", "y"])
    sample = [torch.randn(8, 6), torch.randint(0, 4, (8,))]
    args = (wrapper, sample, ["x", "y"], ["loss", "logits"], {"x": {0: "batch"}, "y": {0: "batch"},
                                                              "logits": {0: "batch"}}, 17)
    seen = []

    def check(outputs):  # reads what checks.check_outputs reads
        seen.append([(list(t.shape), t.numel(), t.dtype) for t in outputs])

    plain = _export.export(*args).SerializeToString()
    checked = _export.export(*args, check_outputs=check).SerializeToString()
    assert checked == plain
    assert seen == [[([], 1, torch.float32), ([8, 4], 32, torch.float32)]]
    assert wrapper.on_outputs is None


def test_a_refused_output_is_the_plain_valueerror_and_the_next_call_can_export():
    torch.manual_seed(0)
    model = TinyMLP()
    weights = copy.deepcopy(model.state_dict())
    trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.1),
                         loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"),
                         options=make_options({"utils": {"export_cache": False}}))
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="a loss must be one number") as info:
        trainer.train_step(x, y)
    assert type(info.value) is ValueError and info.value.__cause__ is None
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="a loss must be one number"):  # refused again, not half-built
        trainer.train_step(x, y)


def test_class_counts_are_inferred_without_copying_the_weights():
    torch.manual_seed(0)
    wrapper = _export.ModelWithLoss(TinyMLP(), mlp_loss, ["x", "y"])
    model = _export.export(wrapper, [torch.randn(8, 6), torch.randint(0, 4, (8,))], ["x", "y"],
                           ["loss", "logits"], {"x": {0: "batch"}, "y": {0: "batch"}}, 17)
    light = checks._without_large_values(model, limit=0)
    assert not any(i.raw_data or i.float_data for i in light.graph.initializer)
    full, part = onnx.shape_inference.infer_shapes(model), onnx.shape_inference.infer_shapes(light)
    types = [{v.name: v.type for v in list(m.graph.value_info) + list(m.graph.output)} for m in (full, part)]
    assert types[0] == types[1] and types[0]
    assert checks.index_ranges(model)["y"].high == 4  # the class count comes from the inference
    assert len(model.graph.initializer) == 4  # the model itself is untouched
