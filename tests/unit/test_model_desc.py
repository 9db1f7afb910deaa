"""_ORTTrainerModelDesc: normalized descriptions, typed descriptions, exact legacy error messages."""

import pytest
import torch

from orttrainer import model_desc_validation as md_val
from orttrainer.model_desc_validation import _ORTTrainerModelDesc


@pytest.mark.parametrize(
    "input_dict,input_dtype,output_dtype",
    [
        (
            {"inputs": [("in0", [])], "outputs": [("out0", []), ("out1", [])]},
            (torch.int,),
            (torch.float, torch.int32),
        ),
        (
            {"inputs": [("in0", ["batch", 2, 3])], "outputs": [("out0", [], True)]},
            (torch.int8,),
            (torch.int16,),
        ),
        (
            {
                "inputs": [
                    ("in0", []),
                    ("in1", [1]),
                    ("in2", [1, 2]),
                    ("in3", [1000, "dyn_ax1"]),
                    ("in4", ["dyn_ax1", "dyn_ax2", "dyn_ax3"]),
                ],
                "outputs": [("out0", [], True), ("out1", [1], False), ("out2", [1, "dyn_ax1", 3])],
            },
            (torch.float, torch.uint8, torch.bool, torch.double, torch.half),
            (torch.float, torch.float, torch.int64),
        ),
    ],
)
def test_valid_schemas(input_dict, input_dtype, output_dtype):
    desc = _ORTTrainerModelDesc(input_dict)

    assert desc.learning_rate == ("__learning_rate", [1], torch.float32)
    assert isinstance(desc.learning_rate, desc._InputDescriptionTyped)
    assert desc.learning_rate.name == md_val.LEARNING_RATE_IO_DESCRIPTION_NAME

    for idx, i_desc in enumerate(desc.inputs):
        assert isinstance(i_desc, desc._InputDescription) and len(i_desc) == 2
        assert (i_desc.name, i_desc.shape) == input_dict["inputs"][idx]
    for idx, o_desc in enumerate(desc.outputs):
        assert isinstance(o_desc, desc._OutputDescription) and len(o_desc) == 3
        given = input_dict["outputs"][idx]
        assert (o_desc.name, o_desc.shape, o_desc.is_loss) == (
            given[0],
            given[1],
            given[2] if len(given) == 3 else False,
        )

    for idx, dtype in enumerate(input_dtype):
        desc.add_type_to_input_description(idx, dtype)
    for idx, dtype in enumerate(output_dtype):
        desc.add_type_to_output_description(idx, dtype)
    for idx, i_desc in enumerate(desc.inputs):
        assert isinstance(i_desc, desc._InputDescriptionTyped) and len(i_desc) == 3
        assert i_desc.dtype == input_dtype[idx]
    for idx, o_desc in enumerate(desc.outputs):
        assert isinstance(o_desc, desc._OutputDescriptionTyped) and len(o_desc) == 5
        assert (o_desc.dtype, o_desc.dtype_amp) == (output_dtype[idx], None)


def test_retyping_replaces_the_previous_type():
    desc = _ORTTrainerModelDesc({"inputs": [("x", [2])], "outputs": [("loss", [], True)]})
    desc.add_type_to_input_description(0, torch.float32)
    desc.add_type_to_input_description(0, torch.int64)
    assert desc.inputs[0] == md_val.InputDescriptionTyped("x", [2], torch.int64)
    desc.add_type_to_output_description(0, torch.float32, torch.float16)
    desc.add_type_to_output_description(0, torch.float32)
    assert desc.outputs[0] == md_val.OutputDescriptionTyped("loss", [], True, torch.float32, None)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: d.add_type_to_input_description(-1, torch.float), "input 'index' must be a positive int"),
        (lambda d: d.add_type_to_input_description(0, "float"), "input 'dtype' must be a torch.dtype type"),
        (
            lambda d: d.add_type_to_output_description(0.0, torch.float),
            "output 'index' must be a positive int",
        ),
        (lambda d: d.add_type_to_output_description(0, None), "output 'dtype' must be a torch.dtype type"),
        (
            lambda d: d.add_type_to_output_description(0, torch.float, "half"),
            "output 'dtype_amp' must be either None or torch.dtype type",
        ),
    ],
)
def test_add_type_asserts(call, message):
    desc = _ORTTrainerModelDesc({"inputs": [("x", [2])], "outputs": [("loss", [], True)]})
    with pytest.raises(AssertionError) as info:
        call(desc)
    assert str(info.value) == message


def test_extra_io_descriptions():
    desc = _ORTTrainerModelDesc({"inputs": [("x", [2])], "outputs": [("loss", [], True)]})
    assert desc.all_finite is None and desc.loss_scale_input is None and desc.gradient_accumulation is None

    desc.all_finite = "all_gradients_finite"
    desc.loss_scale_input = "loss_scale"
    desc.gradient_accumulation = "Group_Accumulated_Gradients"
    assert desc.all_finite == md_val.OutputDescriptionTyped(
        "all_gradients_finite", [1], False, torch.bool, None
    )
    assert desc.loss_scale_input == md_val.InputDescriptionTyped("loss_scale", [], torch.float32)
    assert desc.gradient_accumulation == md_val.OutputDescriptionTyped(
        "Group_Accumulated_Gradients", [1], False, torch.bool, None
    )
    desc.all_finite = "other_name"  # setting again replaces
    assert desc.all_finite.name == "other_name"
    assert desc.outputs == [("loss", [], True)]  # extras are not model outputs

    for attr, kind in (
        ("all_finite", "output"),
        ("gradient_accumulation", "output"),
        ("loss_scale_input", "input"),
    ):
        with pytest.raises(AssertionError, match=f"'name' is an invalid {kind} name"):
            setattr(desc, attr, "")


def test_repr():
    desc = _ORTTrainerModelDesc(
        {"inputs": [("x", ["batch", 2])], "outputs": [("loss", [], True), ("y", ["batch"])]}
    )
    desc.add_type_to_input_description(0, torch.float32)
    desc.all_finite = "finite"
    desc.loss_scale_input = "scale"
    desc.gradient_accumulation = "acc"
    text = repr(desc)
    assert text.startswith("Model description:")
    assert "0: (name=x, shape=['batch', 2], dtype=torch.float32)" in text
    assert "1: (name=y, shape=['batch'])" in text
    assert "Learning rate: (name=__learning_rate, shape=[1], dtype=torch.float32)" in text
    assert "is gradients finite: (name=finite, shape=[1], dtype=torch.bool)" in text
    assert "loss scale input name: (name=scale, shape=[], dtype=torch.float32)" in text
    assert "Gradient Accumulation: (name=acc, shape=[1], dtype=torch.bool)" in text


def test_loss_index():
    assert (
        _ORTTrainerModelDesc(
            {"inputs": [("x", [])], "outputs": [("y", []), ("loss", [], True)]}
        )._loss_index()
        == 1
    )
    assert _ORTTrainerModelDesc({"inputs": [("x", [])], "outputs": [("y", [])]})._loss_index() is None


def test_user_description_is_not_aliased_or_mutated():
    shape = ["batch", 3]
    given = {"inputs": [("x", shape)], "outputs": [("loss", [], True)]}
    desc = _ORTTrainerModelDesc(given)
    desc.inputs[0].shape.append(7)
    desc.add_type_to_input_description(0, torch.float32)
    assert shape == ["batch", 3]
    assert given == {"inputs": [("x", ["batch", 3])], "outputs": [("loss", [], True)]}


def test_tuple_lists_are_accepted():
    desc = _ORTTrainerModelDesc({"inputs": (("x", [2]),), "outputs": (("loss", [], True),)})
    desc.add_type_to_input_description(0, torch.float32)
    assert desc.inputs == [("x", [2], torch.float32)]


@pytest.mark.parametrize(
    "input_dict,error_msg",
    [
        (
            {"inputs": [(True, [])], "outputs": [(True, [])]},
            "Invalid model_desc: {'inputs': [{0: "
            "['the first element of the tuple (aka name) must be a string']}], "
            "'outputs': [{0: ['the first element of the tuple (aka name) must be a string']}]}",
        ),
        (
            {"inputs": [("in1", None)], "outputs": [("out1", None)]},
            "Invalid model_desc: {'inputs': [{0: "
            "['the second element of the tuple (aka shape) must be a list']}], "
            "'outputs': [{0: ['the second element of the tuple (aka shape) must be a list']}]}",
        ),
        (
            {"inputs": [("in1", [])], "outputs": [("out1", [], None)]},
            "Invalid model_desc: {'outputs': [{0: "
            "['the third element of the tuple (aka is_loss) must be a boolean']}]}",
        ),
        (
            {"inputs": [("in1", [True])], "outputs": [("out1", [True])]},
            "Invalid model_desc: {'inputs': [{0: ['each shape must be either a string or integer']}], "
            "'outputs': [{0: ['each shape must be either a string or integer']}]}",
        ),
        (
            {"inputs": [("in1", [1.0])], "outputs": [("out1", [None])]},
            "Invalid model_desc: {'inputs': [{0: ['each shape must be either a string or integer']}], "
            "'outputs': [{0: ['each shape must be either a string or integer']}]}",
        ),
        (
            {"inputs": [("in1", [])], "outputs": [("out1", [], True), ("out2", [], True)]},
            "Invalid model_desc: {'outputs': [{1: ['only one is_loss can bet set to True']}]}",
        ),
        (
            {
                "inputs": [("in1", [])],
                "outputs": [("out1", [], True), ("out2", [], False), ("out3", [], True)],
            },
            "Invalid model_desc: {'outputs': [{2: ['only one is_loss can bet set to True']}]}",
        ),
        (
            {"inputz": [("in1", [])], "outputs": [("out1", [], True)]},
            "Invalid model_desc: {'inputs': ['required field'], 'inputz': ['unknown field']}",
        ),
        (
            {"inputs": [("in1", [])], "outputz": [("out1", [], True)]},
            "Invalid model_desc: {'outputs': ['required field'], 'outputz': ['unknown field']}",
        ),
        (
            {"inputs": [], "outputs": [("out1", [], True)]},
            "Invalid model_desc: {'inputs': ['min length is 1']}",
        ),
        (
            {"inputs": [("in1", [], True)], "outputs": [("out1", [], True, 1)]},
            "Invalid model_desc: {'inputs': [{0: ['must be a tuple with size 2']}], "
            "'outputs': [{0: ['must be a tuple with size 2 or 3']}]}",
        ),
        (
            {"inputs": [["in1", []]], "outputs": [("out1",)]},
            "Invalid model_desc: {'inputs': [{0: ['must be a tuple with size 2']}], "
            "'outputs': [{0: ['must be a tuple with size 2 or 3']}]}",
        ),
        (
            {"inputs": [None], "outputs": [3]},
            "Invalid model_desc: {'inputs': [{0: "
            "['must be a tuple with size 2', 'null value not allowed']}], "
            "'outputs': [{0: ['must be a tuple with size 2 or 3']}]}",
        ),
        # Several problems with one tuple: cerberus orders them (the same order as the legacy class).
        (
            {"inputs": [(1, None, 2)], "outputs": [(None, 3, "yes")]},
            "Invalid model_desc: {'inputs': [{0: "
            "['the second element of the tuple (aka shape) must be a list', "
            "'must be a tuple with size 2', 'the first element of the tuple (aka name) must be a string']}], "
            "'outputs': [{0: ['the second element of the tuple (aka shape) must be a list', "
            "'the third element of the tuple (aka is_loss) must be a boolean', "
            "'the first element of the tuple (aka name) must be a string']}]}",
        ),
        (
            {"inputs": "x", "outputs": [("out1", [])]},
            "Invalid model_desc: {'inputs': ['must be of list type']}",
        ),
    ],
)
def test_invalid_schemas(input_dict, error_msg):
    with pytest.raises(ValueError) as info:
        _ORTTrainerModelDesc(input_dict)
    assert str(info.value) == error_msg


def test_invalid_schema_notes():
    with pytest.raises(ValueError) as info:
        _ORTTrainerModelDesc(
            {"inputs": [("in1", [])], "outputs": [("out1", [], True), ("out2", [], True)], "input": 1}
        )
    assert info.value.__notes__ == [
        "input: got 1; unknown key, did you mean 'inputs'?",
        "outputs[1]: got ('out2', [], True); only one is_loss can bet set to True",
    ]


def test_notes_merge_problems_of_one_value():
    with pytest.raises(ValueError) as info:
        _ORTTrainerModelDesc({"inputs": [(1, None)], "outputs": [("y", [])]})
    assert info.value.__notes__ == [
        "inputs[0]: got (1, None); the second element of the tuple (aka shape) must be a list; "
        "the first element of the tuple (aka name) must be a string",
    ]


def test_not_a_dict():
    with pytest.raises(TypeError, match="'model_desc' must be a dict, got list"):
        _ORTTrainerModelDesc([("inputs", [])])
