"""Model description: names and shapes of a model's inputs and outputs (docs/legacy-api.md §1.8, §2.2).

User schema: `{'inputs': [(name, shape)], 'outputs': [(name, shape) or (name, shape, is_loss)]}` where
shape is a list of int (static) or str (symbolic) dimensions, `[]` being a scalar. Invalid input
raises ValueError with the exact legacy `Invalid model_desc: {...}` text (scripts match on it).
"""

from collections import namedtuple
from collections.abc import Mapping

import cerberus
import torch

from orttrainer._config import validation as _validation

LEARNING_RATE_IO_DESCRIPTION_NAME = "__learning_rate"
ALL_FINITE_IO_DESCRIPTION_NAME = "__all_finite"
LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME = "__loss_scale_input_name"
GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME = "__gradient_accumulation_name"

InputDescription = namedtuple("InputDescription", ["name", "shape"])
InputDescriptionTyped = namedtuple("InputDescriptionTyped", ["name", "shape", "dtype"])
OutputDescription = namedtuple("OutputDescription", ["name", "shape", "is_loss"])
OutputDescriptionTyped = namedtuple(
    "OutputDescriptionTyped", ["name", "shape", "is_loss", "dtype", "dtype_amp"]
)


def _is_loss_entry(entry):
    return isinstance(entry, (tuple, list)) and len(entry) == 3 and entry[2] is True


def _check_elements(field, value, error):
    if not isinstance(value, (tuple, list)):
        return  # nothing to look into; the size error says it all
    if len(value) >= 1 and not isinstance(value[0], str):
        error(field, "the first element of the tuple (aka name) must be a string")
    if len(value) >= 2:
        if not isinstance(value[1], list):
            error(field, "the second element of the tuple (aka shape) must be a list")
        elif any(isinstance(dim, bool) or not isinstance(dim, (str, int)) for dim in value[1]):
            error(field, "each shape must be either a string or integer")


def _model_desc_inputs_validation(field, value, error):
    """cerberus check of one model_desc['inputs'] entry, (name, shape); problems go to error(field, msg)."""
    if not isinstance(value, tuple) or len(value) != 2:
        error(field, "must be a tuple with size 2")
    _check_elements(field, value, error)


def _check_output(field, value, error, second_loss):
    if not isinstance(value, tuple) or not 2 <= len(value) <= 3:
        error(field, "must be a tuple with size 2 or 3")
    if isinstance(value, (tuple, list)) and len(value) == 3:
        if not isinstance(value[2], bool):
            error(field, "the third element of the tuple (aka is_loss) must be a boolean")
        elif value[2] and second_loss():
            error(field, "only one is_loss can bet set to True")
    _check_elements(field, value, error)


def _model_desc_outputs_validation(field, value, error):
    """cerberus check of one model_desc['outputs'] entry, (name, shape[, is_loss]). As in the original,
    the is_loss=True entries seen are counted in `_model_desc_outputs_validation.loss_counter` (set it
    to 0 before checking a new list)."""
    def second_loss():
        _model_desc_outputs_validation.loss_counter += 1
        return _model_desc_outputs_validation.loss_counter > 1

    _check_output(field, value, error, second_loss)


_model_desc_outputs_validation.loss_counter = 0


class _ModelDescValidator(cerberus.Validator):
    """Checks each (name, shape[, is_loss]) tuple; messages are the legacy ones, word for word."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("error_handler", _validation.SafeErrorHandler)
        super().__init__(*args, **kwargs)

    def _check_with_input_description(self, field, value):
        _model_desc_inputs_validation(field, value, self._error)

    def _check_with_output_description(self, field, value):
        # The earlier entries of this document, not a counter: a validator may be reused.
        _check_output(field, value, self._error,
                      lambda: any(_is_loss_entry(o) for o in self.root_document["outputs"][:field]))


MODEL_DESC_SCHEMA = {
    "inputs": {
        "type": "list",
        "required": True,
        "minlength": 1,
        "schema": {"check_with": "input_description"},
    },
    "outputs": {
        "type": "list",
        "required": True,
        "minlength": 1,
        "schema": {"check_with": "output_description"},
    },
}


class _ORTTrainerModelDesc:
    r"""Validated model description.

    Attributes:
        inputs (list): `InputDescription(name, shape)`, or `InputDescriptionTyped(name, shape, dtype)`
            once the trainer knows the dtype.
        outputs (list): `OutputDescription(name, shape, is_loss)` or
            `OutputDescriptionTyped(name, shape, is_loss, dtype, dtype_amp)`.
        learning_rate: `InputDescriptionTyped('__learning_rate', [1], torch.float32)`.
        all_finite, loss_scale_input, gradient_accumulation: descriptions of the extra graph
            inputs/outputs the trainer adds (None until it sets them by name).
    """

    _InputDescription = InputDescription
    _InputDescriptionTyped = InputDescriptionTyped
    _OutputDescription = OutputDescription
    _OutputDescriptionTyped = OutputDescriptionTyped

    def __init__(self, model_desc):
        if not isinstance(model_desc, Mapping):
            raise TypeError(f"'model_desc' must be a dict, got {type(model_desc).__name__}")
        self._original = dict(model_desc)
        self._main_class_name = self.__class__.__name__
        validated = _validation.validate(_ModelDescValidator(MODEL_DESC_SCHEMA), self._original, "model_desc")
        self.inputs = [InputDescription(name, list(shape)) for name, shape in validated["inputs"]]
        self.outputs = [
            OutputDescription(desc[0], list(desc[1]), desc[2] if len(desc) == 3 else False)
            for desc in validated["outputs"]
        ]
        self.learning_rate = InputDescriptionTyped(LEARNING_RATE_IO_DESCRIPTION_NAME, [1], torch.float32)

    def __repr__(self):
        lines = ["Model description:", "", "Inputs:"]
        for idx, desc in enumerate(self.inputs):
            dtype = f", dtype={desc.dtype}" if isinstance(desc, InputDescriptionTyped) else ""
            lines.append(f"\t{idx}: (name={desc.name}, shape={desc.shape}{dtype})")
        lines.append("Outputs:")
        for idx, desc in enumerate(self.outputs):
            dtype = (
                f", dtype={desc.dtype}, dtype_amp={desc.dtype_amp}"
                if isinstance(desc, OutputDescriptionTyped)
                else ""
            )
            lines.append(f"\t{idx}: (name={desc.name}, shape={desc.shape}{dtype})")
        lines.append(f"Learning rate: {self._describe(self.learning_rate)}")
        if self.all_finite or self.loss_scale_input:
            lines.append("Mixed Precision:")
            if self.all_finite:
                lines.append(f"\tis gradients finite: {self._describe(self.all_finite)}")
            if self.loss_scale_input:
                lines.append(f"\tloss scale input name: {self._describe(self.loss_scale_input)}")
        if self.gradient_accumulation:
            lines.append(f"Gradient Accumulation: {self._describe(self.gradient_accumulation)}")
        return "\n".join(lines)

    @staticmethod
    def _describe(desc):
        return f"(name={desc.name}, shape={desc.shape}, dtype={desc.dtype})"

    def add_type_to_input_description(self, index, dtype):
        r"""Replaces input `index` by its typed description (`dtype`: torch.dtype)."""
        assert isinstance(index, int) and index >= 0, "input 'index' must be a positive int"
        assert isinstance(dtype, torch.dtype), "input 'dtype' must be a torch.dtype type"
        desc = self.inputs[index]
        self.inputs[index] = InputDescriptionTyped(desc.name, desc.shape, dtype)

    def add_type_to_output_description(self, index, dtype, dtype_amp=None):
        r"""Replaces output `index` by its typed description (`dtype_amp`: dtype under mixed precision)."""
        assert isinstance(index, int) and index >= 0, "output 'index' must be a positive int"
        assert isinstance(dtype, torch.dtype), "output 'dtype' must be a torch.dtype type"
        assert dtype_amp is None or isinstance(
            dtype_amp, torch.dtype
        ), "output 'dtype_amp' must be either None or torch.dtype type"
        desc = self.outputs[index]
        self.outputs[index] = OutputDescriptionTyped(desc.name, desc.shape, desc.is_loss, dtype, dtype_amp)

    def _loss_index(self):
        r"""Index of the output flagged `is_loss`, or None."""
        return next((idx for idx, desc in enumerate(self.outputs) if desc.is_loss), None)

    @property
    def gradient_accumulation(self):
        return getattr(self, GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME, None)

    @gradient_accumulation.setter
    def gradient_accumulation(self, name):
        _assert_name(name, "output")
        setattr(
            self,
            GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME,
            OutputDescriptionTyped(name, [1], False, torch.bool, None),
        )

    @property
    def all_finite(self):
        return getattr(self, ALL_FINITE_IO_DESCRIPTION_NAME, None)

    @all_finite.setter
    def all_finite(self, name):
        _assert_name(name, "output")
        setattr(
            self, ALL_FINITE_IO_DESCRIPTION_NAME, OutputDescriptionTyped(name, [1], False, torch.bool, None)
        )

    @property
    def loss_scale_input(self):
        return getattr(self, LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME, None)

    @loss_scale_input.setter
    def loss_scale_input(self, name):
        _assert_name(name, "input")
        setattr(self, LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME, InputDescriptionTyped(name, [], torch.float32))


def _assert_name(name, kind):
    assert isinstance(name, str) and len(name) > 0, f"'name' is an invalid {kind} name"


class _ORTTrainerModelDescInternal(_ORTTrainerModelDesc):
    r"""Attribute view of a nested dict of a model description (the original's internal class)."""

    def __init__(self, main_class_name, model_desc):
        self._main_class_name = main_class_name
        for key, value in dict(model_desc).items():
            setattr(self, key, value)
