"""Start-up cost (issue 20): the export checks the model's outputs against model_desc on the trace's
own outputs, so the first step runs the torch forward once (the trace), not twice, and the checks
leave the exported graph and the errors as they were."""

import copy
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from orttrainer import ORTTrainer, optim
from orttrainer.engine.runtime import input_checks as checks
from orttrainer.engine.export import torch_export as _export
from helpers.models import MLP, MLP_DESC, mlp_loss
from helpers.training import make_options


def counted(model):
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(module.training))
    return calls


def test_the_first_step_runs_the_torch_forward_once():
    torch.manual_seed(0)
    model = MLP()
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
    wrapper = _export.ModelWithLoss(MLP(), mlp_loss, ["x", "y"])
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
    model = MLP()
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
    wrapper = _export.ModelWithLoss(MLP(), mlp_loss, ["x", "y"])
    model = _export.export(wrapper, [torch.randn(8, 6), torch.randint(0, 4, (8,))], ["x", "y"],
                           ["loss", "logits"], {"x": {0: "batch"}, "y": {0: "batch"}}, 17)
    light = checks._without_large_values(model, limit=0)
    assert not any(i.raw_data or i.float_data for i in light.graph.initializer)
    full, part = onnx.shape_inference.infer_shapes(model), onnx.shape_inference.infer_shapes(light)
    types = [{v.name: v.type for v in list(m.graph.value_info) + list(m.graph.output)} for m in (full, part)]
    assert types[0] == types[1] and types[0]
    assert checks.index_ranges(model)["y"].high == 4  # the class count comes from the inference
    assert len(model.graph.initializer) == 4  # the model itself is untouched


class _ShapedNet(torch.nn.Module):
    """Float weights above and below the size limit, an int64 buffer, and shapes computed from tensors."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)  # 2048 elements: its values are left out
        self.proj = torch.nn.Linear(32, 64)
        self.small = torch.nn.Parameter(torch.randn(4, 8))  # 32 elements: kept
        self.register_buffer("positions", torch.arange(16))

    def forward(self, ids, y):
        h = self.embed(ids) + self.embed(self.positions[: ids.shape[1]])
        h = h.reshape(ids.shape[0], ids.shape[1], 4, 8) * self.small
        logits = self.proj(h.reshape(ids.shape[0] * ids.shape[1], -1))
        return F.cross_entropy(logits, y.reshape(-1))


def _shaped_export(**kwargs):
    torch.manual_seed(0)
    wrapper = _export.ModelWithLoss(_ShapedNet(), None, ["ids", "y"])
    g = torch.Generator().manual_seed(1)
    sample = [torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)]
    return _export.export(wrapper, sample, ["ids", "y"], ["loss"], {"ids": {0: "batch"}, "y": {0: "batch"}}, 17,
                          **kwargs)


def _recorded_shape_inference(monkeypatch):
    """What torch's exporter hands its shape inference: elements of the values per call."""
    original = torch._C._jit_pass_onnx_graph_shape_type_inference
    given = []

    def recorder(graph, params, opset):
        given.append({name: value.numel() for name, value in params.items()})
        return original(graph, params, opset)

    monkeypatch.setattr(torch._C, "_jit_pass_onnx_graph_shape_type_inference", recorder)
    return given


def test_the_exporters_shape_inference_gets_no_large_weight_values(monkeypatch):
    given = _recorded_shape_inference(monkeypatch)
    _shaped_export()
    assert len(given) == 2  # the exporter's two passes
    for values in given:
        assert "model.embed.weight" not in values and "model.proj.weight" not in values  # 2048 elements each
        assert "model.small" in values and "model.positions" in values  # small float / integer values stay
        assert max(values.values()) <= _export.LARGE_VALUE_ELEMENTS


def test_the_graph_is_byte_for_byte_the_one_shape_inference_with_every_value_gives(monkeypatch):
    fast = _shaped_export().SerializeToString()
    monkeypatch.setattr(_export, "LARGE_VALUE_ELEMENTS", 1 << 62)  # every value given, as torch does
    given = _recorded_shape_inference(monkeypatch)
    full = _shaped_export().SerializeToString()
    assert "model.embed.weight" in given[0]  # the comparison really ran the slow way
    assert fast == full


def test_without_the_pass_the_export_warns_once_and_gives_the_same_graph(monkeypatch):
    fast = _shaped_export().SerializeToString()
    monkeypatch.setattr(_export, "_warned", [])
    monkeypatch.setattr(_export, "_PASS", "_a_pass_this_torch_lacks")  # as a torch without the pass
    given = _recorded_shape_inference(monkeypatch)
    with pytest.warns(RuntimeWarning, match="shape inference with every weight's values") as first:
        slow = _shaped_export().SerializeToString()
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        _shaped_export()
    assert len([w for w in first if "every weight's values" in str(w.message)]) == 1
    assert not [w for w in second if "every weight's values" in str(w.message)]  # once per process
    assert "model.embed.weight" in given[0]  # the slow way: every value
    assert slow == fast


# ---------------------------------------------------------------- the export without weight data
class _TiedNet(torch.nn.Module):
    """A tied embedding/head, a frozen parameter, an fp16 parameter, and float, bf16 and int buffers."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.head = torch.nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight  # tied: one initializer under the first name
        self.norm = torch.nn.LayerNorm(16)
        self.frozen = torch.nn.Parameter(torch.randn(16), requires_grad=False)
        self.low = torch.nn.Parameter(torch.randn(16).half())
        self.register_buffer("scale", torch.tensor([0.5]))
        self.register_buffer("shift", torch.tensor([0.25], dtype=torch.bfloat16))
        self.register_buffer("positions", torch.arange(12))

    def forward(self, ids, y):
        h = self.embed(ids) + self.embed(self.positions[: ids.shape[1]])
        h = self.norm(h) * self.scale + self.shift.float() + self.frozen + self.low.float()
        return F.cross_entropy(self.head(h).reshape(-1, 40), y.reshape(-1))


TRAINABLE = {"embed.weight", "head.weight", "norm.weight", "norm.bias"}  # float32, requiring grad


def _tied_export(compute_dtype=None, **kwargs):
    torch.manual_seed(0)
    wrapper = _export.ModelWithLoss(_TiedNet(), None, ["ids", "y"])
    g = torch.Generator().manual_seed(1)
    sample = [torch.randint(0, 40, (2, 12), generator=g), torch.randint(0, 40, (2, 12), generator=g)]
    model = _export.export(wrapper, sample, ["ids", "y"], ["loss"], {"ids": {0: "batch"}, "y": {0: "batch"}}, 17,
                           compute_dtype=compute_dtype, **kwargs)
    return model, wrapper.model


def _exporters_own_weights(monkeypatch, compute_dtype=None):
    """The export as torch writes it with every weight (`export_params=True`): the fallback path."""
    params = []
    original = torch.onnx.export

    def recording(*args, **kwargs):
        params.append(kwargs["export_params"])
        return original(*args, **kwargs)

    def refuse(*args):
        raise _export._UnexpectedInput("graph input 'x' is unexpected (test)")

    with monkeypatch.context() as patch:
        patch.setattr(torch.onnx, "export", recording)
        patch.setattr(_export, "_inputs_to_initializers", refuse)
        with pytest.warns(RuntimeWarning, match="exporting again with the weights' data written by the exporter"):
            model, _ = _tied_export(compute_dtype)
    assert params == [False, True]  # the fast trace, then the exporter's own weights
    return model


@pytest.mark.parametrize("compute_dtype", [None, torch.float16], ids=["fp32", "autocast-fp16"])
def test_weights_written_from_the_module_equal_the_exporters_byte_for_byte(monkeypatch, compute_dtype):
    ours, _ = _tied_export(compute_dtype)
    theirs = _exporters_own_weights(monkeypatch, compute_dtype)
    assert not any(checks_stub(i) for i in ours.graph.initializer)
    names = {i.name for i in ours.graph.initializer}
    assert {"embed.weight", "frozen", "low", "scale", "shift", "positions"} <= names and "head.weight" not in names
    assert ours.SerializeToString() == theirs.SerializeToString()


def test_weights_by_reference_are_stubs_that_the_modules_values_complete(monkeypatch):
    stubbed, module = _tied_export(by_reference=TRAINABLE)
    full = _exporters_own_weights(monkeypatch)
    stubs = {i.name for i in stubbed.graph.initializer if checks_stub(i)}
    assert stubs == {"embed.weight", "norm.weight", "norm.bias"}  # the tied head is the embedding's initializer
    tensors = module.state_dict()
    for init in stubbed.graph.initializer:
        if init.name in stubs:
            assert not init.raw_data and list(init.dims) == list(tensors[init.name].shape)
            init.CopyFrom(onnx.numpy_helper.from_array(tensors[init.name].numpy(), init.name))
    assert stubbed.SerializeToString() == full.SerializeToString()


def checks_stub(init):
    from orttrainer.engine.graph.training_graph import is_stub
    return is_stub(init)


def _tied_trainer(extra=None, frozen=()):
    torch.manual_seed(0)
    model = _TiedNet()
    desc = {"inputs": [("ids", ["batch", 12]), ("y", ["batch", 12])], "outputs": [("loss", [], True)]}
    options = {"utils": {"export_cache": False, "frozen_weights": list(frozen), "grad_norm_clip": False}}
    options.update(extra or {})
    return model, ORTTrainer(model, desc, optim.AdamConfig(lr=1e-2), options=make_options(options))


def _tied_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 40, (2, 12), generator=g), torch.randint(0, 40, (2, 12), generator=g)


def test_the_trainer_reads_trained_weights_from_the_module_and_trains_like_torch(monkeypatch):
    exported = []
    original = _export.export
    monkeypatch.setattr(_export, "export", lambda *a, **k: exported.append(original(*a, **k)) or exported[-1])
    model, trainer = _tied_trainer(frozen=["norm.bias"])
    reference = copy.deepcopy(model)
    trained = [p for n, p in reference.named_parameters() if n in ("embed.weight", "norm.weight")]
    reference_optim = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        ids, y = _tied_batch()
        loss = trainer.train_step(ids, y)
        expected = reference(ids, y)
        reference_optim.zero_grad()
        expected.backward()
        reference_optim.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    # Stubs: exactly the weights that train (not the frozen one, the fp16 one, or any buffer).
    assert {i.name for i in exported[0].graph.initializer if checks_stub(i)} == {"embed.weight", "norm.weight"}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), p.detach(), rtol=1e-5, atol=1e-6)


def test_a_users_extra_postprocess_sees_every_weights_value():
    seen = {}

    def postprocess(model):
        seen.update({i.name: onnx.numpy_helper.to_array(i).copy() for i in model.graph.initializer})
        return model

    model, trainer = _tied_trainer({"_internal_use": {"extra_postprocess": postprocess}})
    trainer.train_step(*_tied_batch())
    torch.manual_seed(0)
    initial = _TiedNet()
    for name in ("embed.weight", "norm.weight", "norm.bias", "frozen"):
        np.testing.assert_array_equal(seen[name], initial.state_dict()[name].numpy())


# ============================================================================ the trace's freed heap
def test_the_export_trims_the_heap_after_each_module_and_leaves_no_hook(monkeypatch):
    """engine/export/trace_heap.py: after every module's forward in the trace, malloc_trim; the global hook is gone
    after the export, even one that failed."""
    from orttrainer.engine.export import trace_heap as heap

    if heap._malloc_trim is None:
        pytest.skip("this C library has no malloc_trim: the export trims nothing (by design)")
    calls = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda pad: calls.append(pad) or 1)
    hooks = dict(torch.nn.modules.module._global_forward_hooks)
    _shaped_export()
    # one trim after each forward: the wrapper, the net, its two Embedding calls and its Linear (and the
    # module torch's tracer wraps them in)
    assert len(calls) >= 5 and set(calls) == {0}
    assert dict(torch.nn.modules.module._global_forward_hooks) == hooks
    with pytest.raises(Exception):
        _export.export(_export.ModelWithLoss(_ShapedNet(), None, ["ids", "y"]), [torch.zeros(2, 3)], ["ids", "y"],
                       ["loss"], {}, 17)
    assert dict(torch.nn.modules.module._global_forward_hooks) == hooks


def test_the_trimmed_export_writes_the_same_graph(monkeypatch):
    from orttrainer.engine.export import trace_heap as heap

    trimmed = _shaped_export().SerializeToString()
    monkeypatch.setattr(heap, "_malloc_trim", None)
    assert _shaped_export().SerializeToString() == trimmed
