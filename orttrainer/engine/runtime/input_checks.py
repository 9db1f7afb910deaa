"""Checks of what the user passes that model_desc's shapes and dtypes do not cover, each failing with
an error that names the output or input, what it holds and what was expected:

- `check_outputs`: at export, the tensors the model (and loss_fn) return against model_desc: the
  loss must be one number (a per-example loss would be trained on as its sum), fixed sizes must match.
- `match_inputs` / `check_fetches`: every step, the inputs against model_desc, the fetches against
  its outputs.
- `index_ranges` / `check_ranges`: every step, integer inputs used as row indices of a weight (token
  ids of an embedding) or as class labels of a cross-entropy loss must be in range. torch raises for
  them; onnxruntime does not always: a small embedding runs as a one-hot product (engine/graph/rewrites.py),
  where an id past the table gives a zero vector, and a negative label is silently accepted.
"""

import math
from dataclasses import dataclass

import onnx
import torch

# Nodes an index may pass through unchanged on its way from a graph input to its use.
_PASS_THROUGH = {"Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose"}
_LOSSES = {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}


def check_outputs(descs, outputs, with_loss_fn):
    """ValueError when a returned tensor does not fit its model_desc output (name, shape)."""
    for desc, tensor in zip(descs, outputs):
        shape = list(tensor.shape)
        source = "loss_fn" if with_loss_fn and desc.is_loss else "the model"
        if desc.is_loss:
            if tensor.numel() != 1:
                raise ValueError(f"Output {desc.name!r} (the loss) from {source} has shape {shape}; a loss must be "
                                 "one number: reduce it (e.g. reduction='mean'), or the trainer would train on "
                                 "its sum")
            continue
        if len(shape) != len(desc.shape):
            raise ValueError(f"Output {desc.name!r} from {source} has shape {shape} ({len(shape)} dims) but "
                             f"model_desc describes {list(desc.shape)} ({len(desc.shape)} dims)")
        for axis, (size, described) in enumerate(zip(shape, desc.shape)):
            if isinstance(described, int) and size != described:
                raise ValueError(f"Output {desc.name!r} from {source} has size {size} on axis {axis} (shape "
                                 f"{shape}) but model_desc fixes it to {described} (shape {list(desc.shape)})")


@dataclass
class IndexRange:
    high: int | None          # exclusive upper bound; None when the exported graph does not fix it
    what: str                 # "row index of weight 'e.weight'" / "class label of the loss"
    ignored: int | None = None  # a label value the loss skips (ignore_index)


def index_ranges(model: onnx.ModelProto):
    """{graph input name: IndexRange} for inputs used as indices, from the exported forward model."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    producers = {out: node for node in graph.node for out in node.output}
    tables = {init.name: list(init.dims) for init in graph.initializer}
    classes = _class_counts(model)

    def source_input(name):
        while name not in inputs:
            node = producers.get(name)
            if node is None or node.op_type not in _PASS_THROUGH:
                return None
            name = node.input[0]
        return name

    ranges = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2 and node.input[0] in tables:
            axis = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
            name = source_input(node.input[1])
            if name is not None and axis == 0 and tables[node.input[0]]:
                ranges[name] = IndexRange(tables[node.input[0]][0], f"a row index of weight {node.input[0]!r}")
        elif node.op_type in _LOSSES and len(node.input) >= 2:
            name = source_input(node.input[1])
            if name is not None:
                ignored = next((onnx.helper.get_attribute_value(a) for a in node.attribute
                                if a.name == "ignore_index"), None)
                ranges.setdefault(name, IndexRange(classes.get(node.input[0]), "a class label of the loss", ignored))
    return ranges


def _class_counts(model):
    """{scores tensor of a loss node: its number of classes (axis 1)} where shape inference fixes it."""
    try:
        inferred = onnx.shape_inference.infer_shapes(_without_large_values(model))
    except Exception:  # noqa: BLE001 - inference is a convenience here; without it labels get a lower bound only
        return {}
    wanted = {node.input[0] for node in model.graph.node if node.op_type in _LOSSES}
    counts = {}
    for value in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        if value.name in wanted:
            dims = value.type.tensor_type.shape.dim
            if len(dims) >= 2 and dims[1].HasField("dim_value"):
                counts[value.name] = dims[1].dim_value
    return counts


def _without_large_values(model, limit=1024):
    """`model` with the data of initializers of more than `limit` elements left out (dims and type kept).

    Shape inference serializes the model, parses it, serializes its result and parses that again: on
    the full forward model that held ~3x the weights at once (+1.3 GB at BERT-base, the process peak,
    docs/notes/real-size-investigations.md, round 5). Types and shapes need no weight values; the small constants
    that shape computations read (Reshape targets, axes) stay."""
    from orttrainer.engine.runtime.lifecycle import without_data  # lifecycle imports nothing of the checks: no cycle
    large = {init.name for init in model.graph.initializer if math.prod(init.dims) > limit}
    return without_data(model, large) if large else model


def check_ranges(ranges, inputs):
    """ValueError naming the input when one of `inputs` ({name: tensor}) holds an out-of-range index."""
    for name, bounds in ranges.items():
        tensor = inputs.get(name)
        if tensor is None or tensor.numel() == 0 or tensor.dtype.is_floating_point:
            continue
        values = tensor
        if bounds.ignored is not None:
            values = tensor[tensor != bounds.ignored]
            if values.numel() == 0:
                continue
        low, high = int(torch.min(values)), int(torch.max(values))
        if low < 0 or (bounds.high is not None and high >= bounds.high):
            bad = low if low < 0 else high
            allowed = f"[0, {bounds.high})" if bounds.high is not None else "0 or more"
            skip = f" (or {bounds.ignored}, which the loss ignores)" if bounds.ignored is not None else ""
            raise ValueError(f"Input {name!r} holds {bad}; it is {bounds.what}, so its values must be in "
                             f"{allowed}{skip}")


def match_inputs(descs, input_dtypes, args, kwargs, allow_missing=False):
    """{name: tensor} of a step's positional and keyword inputs matched to model_desc `descs`, with
    their types, ranks, fixed sizes, symbolic sizes (equal within the call) and, once known, dtypes
    (`input_dtypes`) checked. Changes nothing. `allow_missing`: fetches may need fewer inputs."""
    if len(args) == 1 and isinstance(args[0], (list, tuple)) and not kwargs:
        args = tuple(args[0])
    names = [d.name for d in descs]
    given = bind_inputs(args, kwargs, names)
    missing = [n for n in names if n not in given]
    if missing and not allow_missing:
        raise ValueError(f"Missing inputs {missing}: model_desc inputs are {names} "
                         "(positional arguments fill them in this order)")
    symbols = {}
    inputs = {}
    for desc in descs:
        if desc.name not in given:
            continue
        tensor = given[desc.name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Input {desc.name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != len(desc.shape):
            raise ValueError(f"Input {desc.name!r} has shape {list(tensor.shape)} ({tensor.dim()} dims) but "
                             f"model_desc describes {desc.shape} ({len(desc.shape)} dims)")
        for axis, (dim, size) in enumerate(zip(desc.shape, tensor.shape)):
            if isinstance(dim, int) and dim != size:
                raise ValueError(f"Input {desc.name!r} has size {size} on axis {axis} but model_desc fixes it "
                                 f"to {dim} (shape {desc.shape}); use a symbolic name for a varying size")
            if isinstance(dim, str):
                first = symbols.setdefault(dim, (size, desc.name, axis))
                if first[0] != size:
                    raise ValueError(f"Dimension {dim!r} is {first[0]} in input {first[1]!r} (axis {first[2]}) "
                                     f"but {size} in input {desc.name!r} (axis {axis}) in the same call")
        expected = input_dtypes.get(desc.name)
        if expected is not None and tensor.dtype != expected:
            raise TypeError(f"Input {desc.name!r} has dtype {tensor.dtype} but the model expects {expected}; "
                            f"convert it with .to({expected})")
        inputs[desc.name] = tensor
    return inputs


def bind_inputs(args, kwargs, names, takes="model_desc describes", listed="model_desc inputs are"):
    """{name: value} of positional (in `names` order) and keyword inputs; ValueError for too many,
    unknown or doubly given ones (`takes`, `listed`: how the messages name the expected inputs)."""
    if len(args) > len(names):
        raise ValueError(f"Got {len(args)} positional inputs but {takes} {len(names)}: {names}")
    given = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names:
            raise ValueError(f"Unexpected input {name!r}: {listed} {names}")
        if name in given:
            raise ValueError(f"Input {name!r} was given both positionally and by keyword")
        given[name] = value
    return given


def check_fetches(fetches, output_descs):
    """`fetches` (TrainStepInfo.fetches), or RuntimeError naming the ones model_desc has no output for."""
    if fetches:
        known = {o.name for o in output_descs}
        unknown = [name for name in fetches if name not in known]
        if unknown:
            raise RuntimeError(f"The specified fetches list contains invalid output names: {unknown} "
                               f"(outputs are {sorted(known)})")
    return fetches
