"""The original frontend's clients, one call each through the path they used: the old class's loss
scalers (the original transformers / ToyBERT tests), a model_desc input forward() does not take, the
restored module-level helpers of the old module and of postprocess/_utils/model_desc_validation, and
the file semantics of _checkpoint_storage.save and the torch.save checkpoint functions."""

import warnings

import cerberus
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from test_old_class import LR_DESC, batches, cross_entropy, model, old_desc, old_trainer

from orttrainer import ORTTrainer, ORTTrainerOptions, _utils, model_desc_validation, optim
from orttrainer import ort_trainer as old
from orttrainer import postprocess


# ---------------------------------------------------------------------- the old class's loss scalers
class DuckScaler:
    """Not an ort_trainer.LossScaler: only what the original read (loss_scale_, update_loss_scale)."""

    def __init__(self, loss_scale):
        self.loss_scale_ = loss_scale
        self.seen = []

    def update_loss_scale(self, is_all_finite):
        self.seen.append(bool(is_all_finite))
        self.loss_scale_ *= 2.0


class SubclassScaler(old.LossScaler):
    """A subclass that does not call LossScaler.__init__ (no loss_scale_input_name_)."""

    def __init__(self, loss_scale):
        self.loss_scale_ = loss_scale
        self.updates = 0

    def update_loss_scale(self, is_all_finite):
        self.updates += 1


def _losses(trainer, steps=3):
    return [float(trainer.train_step(x, y)[0]) for x, y in batches(steps)]


def test_a_loss_scaler_of_another_class_is_used_like_the_old_one():
    reference = old.LossScaler("loss_scale", True, loss_scale=1024.0, up_scale_window=1)  # doubles every step
    expected = _losses(old_trainer(use_mixed_precision=True, loss_scaler=reference))
    duck = DuckScaler(1024.0)
    np.testing.assert_allclose(_losses(old_trainer(use_mixed_precision=True, loss_scaler=duck)), expected, rtol=1e-6)
    assert duck.seen == [True] * 3 and duck.loss_scale_ == reference.loss_scale_ == 1024.0 * 8


def test_a_loss_scaler_subclass_without_the_base_init_trains():
    scaler = SubclassScaler(512.0)
    trainer = old_trainer(use_mixed_precision=True, loss_scaler=scaler)
    assert all(np.isfinite(_losses(trainer, 2)))
    assert scaler.updates == 2 and trainer.loss_scale_input_name == "loss_scale"


def test_something_without_a_loss_scale_is_still_refused():
    with pytest.raises(TypeError, match="'loss_scale_' attribute and an update_loss_scale"):
        old_trainer(use_mixed_precision=True, loss_scaler=object())


def test_a_loss_scaler_without_mixed_precision_is_ignored_as_the_original_did():
    scaler = old.LossScaler("ls", True, loss_scale=8.0)
    with pytest.warns(UserWarning, match="'loss_scaler' is ignored"):
        trainer = old_trainer(loss_scaler=scaler)
    np.testing.assert_allclose(_losses(trainer), _losses(old_trainer()), rtol=1e-6)
    assert scaler.loss_scale_ == 8.0  # never read nor updated


# ---------------------------------------------------------------------- a model_desc input forward() lacks
class LabelledMLP(torch.nn.Module):
    """forward(x, labels=None): (loss, logits, hidden) with labels, else (logits, hidden)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 4)

    def forward(self, x, labels=None):
        hidden = torch.relu(self.fc1(x))
        logits = self.fc2(hidden)
        if labels is None:
            return logits, hidden
        return F.cross_entropy(logits, labels), logits, hidden


# transformers <= 3 called the labels masked_lm_labels; model_desc still does here.
OLD_NAME_DESC = {"inputs": [("x", ["batch", 6]), ("masked_lm_labels", ["batch"])],
                 "outputs": [("loss", [], True), ("logits", ["batch", 4]), ("hidden", ["batch", 16])]}


def test_an_input_forward_does_not_take_is_named_at_construction_and_in_the_error():
    options = ORTTrainerOptions({"device": {"id": "cpu"}})
    with pytest.warns(UserWarning, match=r"model_desc inputs \['masked_lm_labels'\] name no parameter of "
                                         r"LabelledMLP.forward\(x, labels\)"):
        trainer = ORTTrainer(LabelledMLP(), OLD_NAME_DESC, optim.SGDConfig(lr=0.1), options=options)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match=r"gave 2 tensors but model_desc describes 3 outputs .*"
                                         r"\['masked_lm_labels'\] name no parameter of forward\(\)"):
        trainer.train_step(x, y)


def test_no_warning_when_every_input_reaches_the_model_or_the_loss():
    desc = {"inputs": [("x", ["batch", 6]), ("labels", ["batch"])], "outputs": OLD_NAME_DESC["outputs"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ORTTrainer(LabelledMLP(), desc, optim.SGDConfig(lr=0.1), options=ORTTrainerOptions({"device": {"id": "cpu"}}))
        old_trainer()  # label 'y' goes to loss_fn


# ---------------------------------------------------------------------- the old module's helpers
def test_old_module_checkpoint_functions_round_trip(tmp_path):
    trainer = old_trainer()
    _losses(trainer, 2)
    old.save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict={"epoch": 3})
    assert (tmp_path / "ORT_checkpoint.ort.pt").exists()
    with pytest.warns(UserWarning, match="ORT_checkpoint.ort.pt already exists, overwriting."):
        old.save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict={"epoch": 4})
    fresh = old_trainer()
    fresh.train_step(*batches(1)[0])  # a session, so that the load applies now
    assert old.load_checkpoint(fresh, str(tmp_path)) == {"epoch": 4}
    saved, loaded = trainer.state_dict(), fresh.state_dict()
    assert saved.keys() == loaded.keys()
    for name in saved:
        np.testing.assert_array_equal(loaded[name].numpy(), saved[name].numpy(), err_msg=name)


def test_old_module_wrappers_and_dtypes():
    net, names = model(), ["x", "y"]
    plain = old.wrap_for_input_match(net, cross_entropy, names)  # x, y in forward()+label order
    assert isinstance(plain, old.model_loss_cls)
    x, y = batches(1)[0]
    loss, logits = plain(x, y)
    torch.testing.assert_close(loss, cross_entropy(net(x), y))

    class TwoInputs(torch.nn.Module):
        def forward(self, a, b=None, c=None):
            return a * 2 + (0 if c is None else c)

    wrapped = old.wrap_for_input_match(TwoInputs(), None, ["c", "a"])  # a re-ordered subset: by name
    assert isinstance(wrapped, old.WrapModel)
    torch.testing.assert_close(wrapped(torch.ones(2), torch.full((2,), 3.0)), torch.full((2,), 7.0))
    assert old.dtype_torch_to_numpy(torch.bool) is bool and old.dtype_torch_to_numpy(torch.int64) is np.longlong
    with pytest.raises(Exception, match="unavailable for: torch.uint8"):
        old.dtype_torch_to_numpy(torch.uint8)
    assert old.get_device_index("cuda:1") == 1 and old.input_get_device_index([torch.ones(1)]) == 0


def _add_model(outputs=("sum",)):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    nodes = [helper.make_node("Add", ["x", "x"], [name]) for name in outputs]
    outs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n"]) for name in outputs]
    return helper.make_model(helper.make_graph(nodes, "g", [x], outs), opset_imports=[helper.make_opsetid("", 14)],
                             ir_version=8)


def test_io_binding_run_helper_and_session_output_names():
    session = ort.InferenceSession(_add_model(("sum", "all_gradients_finite_0")).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    descs = [old.IODescription("x", ["n"], torch.float32)]
    outputs = [old.IODescription("sum", ["n"], torch.float32)]
    x = torch.arange(3, dtype=torch.float32)
    result = old.ort_training_session_run_helper(session, session.io_binding(), [x], descs, outputs, "cpu")
    torch.testing.assert_close(result["sum"], 2 * x)
    assert _utils.get_all_gradients_finite_name_from_session(session) == "all_gradients_finite_0"
    assert old.get_all_gradients_finite_arg_name(session) == "all_gradients_finite_0"
    with pytest.raises(RuntimeError, match="'Group_Accumulated_Gradients' node not found"):
        _utils.get_gradient_accumulation_name_from_session(session)


def test_postprocess_graph_helpers():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Shape", ["y"], ["s"]), helper.make_node("Expand", ["x", "s"], ["out"])]
    graph = helper.make_graph(nodes, "g", [x, y], [out])
    model_proto = helper.make_model(graph)
    assert postprocess.find_input_node(model_proto, "s").op_type == "Shape"
    assert postprocess.is_type(postprocess.find_output_node(model_proto, "s"), "Expand")
    assert postprocess.find_output_node(model_proto, "nothing") == []
    postprocess.fix_expand_shape(model_proto)
    (info,) = model_proto.graph.value_info
    assert info.name == "out" and info.type == y.type  # the Expand output takes y's type
    const = postprocess.add_const(model_proto, "c", "c_out", f_value=0.5)
    assert const.op_type == "Constant" and onnx.helper.get_attribute_value(const.attribute[0]) == 0.5
    fused = old.FuseSofmaxNLLToSoftmaxCE(model_proto)
    assert fused is model_proto


def test_model_desc_check_functions_work_as_cerberus_rules():
    inputs = model_desc_validation._model_desc_inputs_validation
    outputs = model_desc_validation._model_desc_outputs_validation
    schema = {"inputs": {"type": "list", "schema": {"check_with": inputs}},
              "outputs": {"type": "list", "schema": {"check_with": outputs}}}
    model_desc_validation._model_desc_outputs_validation.loss_counter = 0
    validator = cerberus.Validator(schema)
    assert not validator.validate({"inputs": [("x", [True])], "outputs": [("a", [], True), ("b", [], True)]})
    assert validator.errors == {"inputs": [{0: ["each shape must be either a string or integer"]}],
                                "outputs": [{1: ["only one is_loss can bet set to True"]}]}


def test_experimental_save_checkpoint_overwrites_with_the_original_warning(tmp_path, recwarn):
    from orttrainer import checkpoint

    options = ORTTrainerOptions({"device": {"id": "cpu"}})
    trainer = ORTTrainer(model(), {"inputs": [("x", ["batch", 6]), ("y", ["batch"])],
                                   "outputs": [("loss", [], True), ("logits", ["batch", 4])]},
                         optim.SGDConfig(lr=0.1), loss_fn=cross_entropy, options=options)
    trainer.train_step(*batches(1)[0])
    checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict={"epoch": 1})
    trainer.train_step(*batches(2)[1])
    with pytest.warns(UserWarning, match=r"ORT_checkpoint\.ort\.pt already exists, overwriting\."):
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict={"epoch": 2})
    saved = torch.load(tmp_path / "ORT_checkpoint.ort.pt", weights_only=True)
    assert saved["epoch"] == 2
    torch.testing.assert_close(saved["model"]["fc1.weight"], trainer.state_dict(pytorch_format=True)["fc1.weight"])
