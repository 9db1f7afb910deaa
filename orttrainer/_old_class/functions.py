"""The module-level helpers of the old `onnxruntime.capi.ort_trainer` (2020), re-exported by
`orttrainer.ort_trainer`: device and dtype helpers, the model wrappers its export used, the
io-binding run helper, and its torch.save checkpoint functions (on the old class's flat state_dict).
"""

import inspect
import os
import warnings

import numpy as np
import torch

from orttrainer import postprocess
from orttrainer.state.experimental_checkpoint import _CombineZeroCheckpoint as CombineZeroCheckpoint
from orttrainer.state.experimental_checkpoint import _get_checkpoint_name as get_checkpoint_name
from orttrainer.state.experimental_checkpoint import _list_checkpoint_files as list_checkpoint_files

DEFAULT_OPSET_VERSION = 14


class IODescription:
    """An input or output: name, shape (ints, or strings for symbolic sizes; [] is a scalar), dtype and,
    for `generate_sample`, the number of classes of an integer input."""

    def __init__(self, name, shape, dtype=None, num_classes=None):
        self.name_ = name
        self.shape_ = shape
        self.dtype_ = dtype
        self.num_classes_ = num_classes


class ModelDescription:
    """Lists of IODescription; the first output is the loss (a float scalar)."""

    def __init__(self, inputs, outputs):
        self.inputs_ = inputs
        self.outputs_ = outputs


def resolve_symbolic_dimensions(inputs, input_descs, output_descs):
    """Output descriptions with every symbolic size that some input fixes replaced by its value."""
    sizes = {}
    for tensor, desc in zip(inputs, input_descs):
        for dim, size in zip(desc.shape_, tensor.shape):
            if isinstance(dim, str):
                sizes.setdefault(dim, size)
    return [IODescription(d.name_, [sizes.get(s, s) if isinstance(s, str) else s for s in d.shape_], d.dtype_,
                          d.num_classes_) for d in output_descs]


def get_device_index(device):
    """'cuda:1' -> 1; 'cpu', 'cuda' -> 0."""
    if isinstance(device, str):
        device = torch.device(device)
    return 0 if device.index is None else device.index


def input_get_device_index(input):
    """Device index of a tensor, or of the first tensor of a list/tuple."""
    return get_device_index((input[0] if isinstance(input, (list, tuple)) else input).device)


def _output_names(session, part):
    return [output.name for output in session._outputs_meta if part in output.name]


def get_all_gradients_finite_arg_name(session):
    """The first output of `session` (its `_outputs_meta`) whose name contains 'all_gradients_finite'."""
    names = _output_names(session, "all_gradients_finite")
    if not names:
        raise RuntimeError("Failed to find a group NodeArg with name that matches 'all_gradients_finite' "
                           "from the training session.")
    return names[0]


def get_group_accumulated_gradients_output_node_arg_name(session):
    """The one output of `session` whose name contains 'Group_Accumulated_Gradients'."""
    names = _output_names(session, "Group_Accumulated_Gradients")
    if len(names) != 1:
        raise RuntimeError("Failed to find a group NodeArg with name that matches 'Group_Accumulated_Gradients' "
                           "from the training session.")
    return names[0]


def dtype_torch_to_numpy(torch_dtype):
    """The numpy type onnxruntime binds for a torch dtype (the old class's narrower table)."""
    table = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
             torch.int64: np.longlong, torch.int32: np.int32, torch.int16: np.int16, torch.bool: bool}
    if torch_dtype not in table:
        raise Exception("Torch type to numpy type mapping unavailable for: " + str(torch_dtype))  # noqa: TRY002
    return table[torch_dtype]


def ort_training_session_run_helper(session, iobinding, inputs, input_descs, output_descs, device, run_options=None):
    """Bind `inputs` (torch tensors, by the descriptions' names) and freshly allocated outputs on
    `device`, run `session.run_with_iobinding`, and return {output name: torch tensor}."""
    for tensor, desc in zip(inputs, input_descs):
        iobinding.bind_input(desc.name_, tensor.device.type, input_get_device_index(tensor),
                             dtype_torch_to_numpy(tensor.dtype), list(tensor.size()), tensor.data_ptr())
    outputs = {}
    for desc in resolve_symbolic_dimensions(inputs, input_descs, output_descs):
        dtype = getattr(desc, "eval_dtype_", None) or desc.dtype_ or torch.float32
        tensor = torch.zeros(desc.shape_, device=device, dtype=dtype)
        iobinding.bind_output(desc.name_, tensor.device.type, get_device_index(device),
                              dtype_torch_to_numpy(tensor.dtype), list(tensor.size()), tensor.data_ptr())
        outputs[desc.name_] = tensor
    session.run_with_iobinding(iobinding, run_options)
    return outputs


def FuseSofmaxNLLToSoftmaxCE(onnx_model):  # noqa: N802 (the original's name)
    """LogSoftmax + NegativeLogLikelihoodLoss -> one cross-entropy node (postprocess's pass)."""
    return postprocess.fuse_softmaxNLL_to_softmaxCE(onnx_model)


def delete_input_with_name(input, name):
    """Remove the first entry called `name` from a repeated ValueInfo field (graph.input)."""
    for index, value in enumerate(input):
        if value.name == name:
            del input[index]
            break


class model_loss_cls(torch.nn.Module):  # noqa: N801 (the original's name)
    """model + loss_fn: the inputs with the label last -> (loss, predictions)."""

    def __init__(self, model, loss_fn):
        super().__init__()
        self.model_ = model
        self.loss_fn_ = loss_fn

    def forward(self, *inputs):
        preds = self.model_(*inputs[:-1])
        return self.loss_fn_(preds, inputs[-1]), preds


class WrapModel(torch.nn.Module):
    """Inputs in model_desc order, passed to forward() by name (+ loss_fn on the last one, the label)."""

    def __init__(self, model, loss_fn, input_names):
        super().__init__()
        self.model_ = model
        self.loss_fn_ = loss_fn
        self.input_names_ = input_names

    def forward(self, *inputs):
        params = inspect.signature(self.model_.forward).parameters
        output = self.model_(**{key: inputs[self.input_names_.index(key)] for key in params
                                if key in self.input_names_})
        if self.loss_fn_ is None:
            return output
        return self.loss_fn_(output, inputs[-1]), output


def wrap_for_input_match(model, loss_fn, input_names):
    """The module the old export traced: WrapModel when the described inputs are a re-ordered subset
    of forward()'s parameters (+ the loss_fn's label), else model_loss_cls (with a loss_fn) or the model."""
    keys = list(inspect.signature(model.forward).parameters)
    if loss_fn:
        loss_params = list(inspect.signature(loss_fn).parameters)
        if len(loss_params) != 2:
            raise RuntimeError("loss function should take two arguments - predict and label.")
        keys.append(loss_params[1])
    plain = model_loss_cls(model, loss_fn) if loss_fn else model
    if len(input_names) >= len(keys) or not all(name in keys for name in input_names):
        return plain
    if list(input_names) == keys[:len(input_names)]:
        return plain
    return WrapModel(model, loss_fn, input_names)


# ---------------------------------------------------------------------- torch.save checkpoints
def save_checkpoint(model, checkpoint_dir, checkpoint_prefix="ORT_checkpoint", checkpoint_state_dict=None,
                    include_optimizer_state=True):
    """torch.save {'model': model.state_dict(include_optimizer_state), **checkpoint_state_dict} to
    <dir>/<prefix>.ort.pt (with ZeRO: <prefix>.ZeRO.<rank>.<world_size - 1>.ort.pt); overwrites, warning."""
    from orttrainer._checkpoint_storage import atomic_write

    state = dict(checkpoint_state_dict or {})
    state["model"] = model.state_dict(include_optimizer_state)
    assert os.path.exists(checkpoint_dir), f"ERROR: Checkpoint directory doesn't exist: {checkpoint_dir}"
    path = os.path.join(checkpoint_dir, get_checkpoint_name(checkpoint_prefix, model.deepspeed_zero_stage_,
                                                            model.world_rank, model.world_size))
    if os.path.exists(path):
        warnings.warn(f"{path} already exists, overwriting.")
    atomic_write(path, lambda tmp_path: torch.save(state, tmp_path), overwrite=True)


def _torch_load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _load_single_checkpoint(model, checkpoint_dir, checkpoint_prefix, is_partitioned, strict):
    path = os.path.join(checkpoint_dir, get_checkpoint_name(checkpoint_prefix, is_partitioned, model.world_rank,
                                                            model.world_size))
    if not os.path.exists(path):
        hint = (f" Optimizer partitioning is enabled using ZeRO. Please make sure that the checkpoint file "
                f"exists for rank {model.world_rank} of {model.world_size}.") if is_partitioned else ""
        raise AssertionError(f"Couldn't find checkpoint file {path}.{hint}")
    state = _torch_load(path)
    model.load_state_dict(state.pop("model"), strict=strict)
    return state


def _load_multi_checkpoint(model, checkpoint_dir, checkpoint_prefix, strict):
    files = list_checkpoint_files(checkpoint_dir, checkpoint_prefix)
    model.load_state_dict(CombineZeroCheckpoint(files).aggregate_checkpoints(), strict=strict)
    extras = {}
    for path in files:  # later ranks win for keys saved by several ranks
        state = _torch_load(path)
        state.pop("model", None)
        extras.update(state)
    return extras


def load_checkpoint(model, checkpoint_dir, checkpoint_prefix="ORT_checkpoint", strict=False):
    """Load what save_checkpoint wrote: one file, this rank's ZeRO file, or (a trainer without ZeRO)
    every ZeRO rank file merged; returns the entries other than 'model'. Files are read with
    torch.load(weights_only=True)."""
    files = list_checkpoint_files(checkpoint_dir, checkpoint_prefix)
    is_partitioned = len(files) > 1
    if is_partitioned:
        warnings.warn(f"Found more than one file with prefix {checkpoint_prefix} in directory {checkpoint_dir}. "
                      "Attempting to load ZeRO checkpoint.")
    if is_partitioned and not model.deepspeed_zero_stage_:
        return _load_multi_checkpoint(model, checkpoint_dir, checkpoint_prefix, strict)
    return _load_single_checkpoint(model, checkpoint_dir, checkpoint_prefix, is_partitioned, strict)
