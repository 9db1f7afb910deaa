"""PyTorch model (+ loss_fn) -> forward ONNX model, as the legacy ORTTrainer exported it.

The wrapper takes the described inputs positionally, passes them to `model.forward` by parameter
name, and with a `loss_fn` returns `(loss_fn(output, label), output)` where the label is the last
described input. Initializer names equal the torch `state_dict` names.
"""

import contextlib
import inspect
import io
import warnings

import onnx
import torch

from orttrainer.engine.export import trace_heap
from orttrainer.engine.pyop import python_op, runner_check

_WRAPPER_PREFIX = "model."


def dropped_inputs(model, loss_fn, input_names):
    """The described inputs that ModelWithLoss passes neither to model.forward() nor to loss_fn: those
    that name no forward() parameter when some do (inputs go by name then), except the loss_fn's label
    (the last input). As in the original, they are silently unused; callers warn."""
    params = inspect.signature(model.forward).parameters
    names = list(input_names)
    if not any(name in params for name in names):
        return []  # passed in order: none is dropped
    label = names[-1] if loss_fn is not None else None
    return [name for name in names if name not in params and name != label]


class ModelWithLoss(torch.nn.Module):
    def __init__(self, model, loss_fn, input_names):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.input_names = list(input_names)
        params = inspect.signature(model.forward).parameters
        self._by_name = [name for name in params if name in self.input_names]
        self._variadic = any(p.kind == p.VAR_POSITIONAL for p in params.values())
        self.dropped = dropped_inputs(model, loss_fn, self.input_names)
        self.on_outputs = None  # export(): called with the traced forward's flattened outputs

    def forward(self, *inputs):
        if self._by_name:
            kwargs = {name: inputs[self.input_names.index(name)] for name in self._by_name}
            output = self.model(**kwargs)
        else:
            # No described name matches a forward() parameter: pass the inputs in order
            # (all but the label when a loss_fn takes it).
            model_inputs = inputs[:-1] if self.loss_fn is not None else inputs
            output = self.model(*model_inputs)
        if self.loss_fn is not None:
            output = (self.loss_fn(output, inputs[-1]), output)
        if self.on_outputs is not None:
            with _not_traced():
                self.on_outputs(flatten_outputs(output))
        return output


def flatten_outputs(output):
    """Tensors of a (possibly nested) model output in the order the exporter flattens them."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):  # includes transformers' ModelOutput
        output = [v for v in output.values() if v is not None]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in flatten_outputs(item)]
    if output is None:
        return []
    raise TypeError(f"Model returned an unsupported output type {type(output).__name__}; "
                    "return tensors, or tuples/lists/dicts of tensors.")


@contextlib.contextmanager
def _not_traced():
    """Reading output shapes inside a trace would record size nodes; pause the tracer for it."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


@contextlib.contextmanager
def _eval_mode(module):
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def sample_outputs(wrapper, inputs):
    """Run the wrapper once (eval mode, no grad) to learn output dtypes; model state is untouched."""
    with torch.no_grad(), _eval_mode(wrapper), torch.random.fork_rng(devices=[]):
        return flatten_outputs(wrapper(*inputs))


def export(wrapper, inputs, input_names, output_names, dynamic_axes, opset_version, compute_dtype=None,
           check_outputs=None, by_reference=frozenset()):
    """torch.onnx.export in training mode; returns the ModelProto with `model.` stripped from names.

    The initializers named in `by_reference` (state_dict names of the wrapped model) come out as
    data-less stubs -- dims and type only -- whose values the caller takes from the module itself;
    every other initializer holds its tensor's data. The exporter writes no weight data at all
    (`export_params=False`): serialising it, parsing it back and copying it out again was ~2-3 s
    and a weights-sized peak at GPT-2 small (docs/notes/start-up.md, "Export without the weights' data").

    `compute_dtype` (torch.float16 / torch.bfloat16) traces under `torch.autocast`: weights stay fp32
    initializers followed by Casts, and torch's autocast policy picks the ops that run in low
    precision (matmuls do; softmax and losses stay fp32). The CPU policy is used whatever the
    session's device, so a CUDA session runs the same graph as a CPU one.
    The caller's RNG state is preserved (tracing runs dropout); the trace runs without autograd. A
    torch.autograd.Function becomes a com.microsoft PythonOp that runs the Function's own forward and
    backward (engine/pyop/python_op.py).
    `check_outputs(tensors)` sees the trace's own outputs (flattened) before they are converted, so
    checking them costs no extra forward; an exception it raises ends the export.
    """
    autocast = (torch.autocast("cpu", dtype=compute_dtype) if compute_dtype not in (None, torch.float32)
                else contextlib.nullcontext())
    arguments = (wrapper, tuple(inputs), list(input_names), list(output_names), dynamic_axes, opset_version)
    model = _trace(*arguments, autocast, check_outputs, export_params=False)
    try:
        _inputs_to_initializers(model, wrapper.state_dict(keep_vars=True), set(input_names),
                                {_WRAPPER_PREFIX + name for name in by_reference})
    except _UnexpectedInput as exc:  # an exporter that names its inputs otherwise: the exporter's own weights
        warnings.warn(f"orttrainer: {exc}; exporting again with the weights' data written by the exporter "
                      "(slower start-up, same graph)", RuntimeWarning, stacklevel=2)
        model = _trace(*arguments, autocast, check_outputs, export_params=True)
    python_op.finish_export(model)
    _strip_prefix(model, _WRAPPER_PREFIX)
    return model


def _trace(wrapper, inputs, input_names, output_names, dynamic_axes, opset_version, autocast, check_outputs,
           export_params):
    buffer = io.BytesIO()
    # no_grad: the tracer records the same graph, but autograd would keep every activation of the
    # traced forward for a backward that never runs -- the export's memory peak (docs/notes/recompute.md).
    # The heap the forward frees goes back to the OS module by module (engine/export/trace_heap.py).
    wrapper.on_outputs = check_outputs
    with _shape_inference_without_weight_values() as slow, torch.random.fork_rng(devices=[]), \
            warnings.catch_warnings(), python_op.exporting(runner_check.require), autocast, torch.no_grad(), _hook_cleared(wrapper), \
            trace_heap.returned_after_each_module():
        if slow and not _warned:  # before the exporter's warnings are silenced: this one must be seen
            _warned.append(True)
            warnings.warn(_NO_FAST_SHAPE_INFERENCE, RuntimeWarning, stacklevel=3)
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(
            wrapper, inputs, buffer, input_names=input_names, output_names=output_names,
            dynamic_axes=dynamic_axes, opset_version=opset_version,
            do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
            export_params=export_params, keep_initializers_as_inputs=False, dynamo=False,
            autograd_inlining=False,  # keep Functions whole: their backward is the user's
        )
    return onnx.load_from_string(buffer.getvalue())


class _UnexpectedInput(RuntimeError):
    """A graph input of an export without parameters that is no tensor of the module."""


def _inputs_to_initializers(model, tensors, described, by_reference):
    """Without its parameters the exporter leaves every module tensor it reads as a graph input after
    the described ones (same names, same order as its initializers would have); make each an
    initializer again: a stub for the names in `by_reference`, else the tensor's data as the exporter
    writes it (raw little-endian bytes)."""
    graph = model.graph
    kept = []
    for value in graph.input:
        if value.name in described:
            kept.append(value)
            continue
        tensor = tensors.get(value.name)
        tensor_type = value.type.tensor_type
        dims = [d.dim_value for d in tensor_type.shape.dim]
        if tensor is None or list(tensor.shape) != dims or any(d.HasField("dim_param") for d in tensor_type.shape.dim):
            raise _UnexpectedInput(f"the exporter left graph input {value.name!r} (dims {dims}) that is "
                                   "neither a described input nor a tensor of the module of that shape")
        init = graph.initializer.add(name=value.name, dims=dims, data_type=tensor_type.elem_type)
        if value.name not in by_reference:
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            init.raw_data = flat.view(torch.uint8).numpy().tobytes()
    del graph.input[:]
    graph.input.extend(kept)


# Values of floating-point parameters above this many elements are left out of the exporter's shape
# inference. Shape-defining ONNX inputs are integers (Reshape/Expand/Slice/...), or one entry per
# axis (Resize scales); a float weight only needs its type and shape, which its graph input carries.
LARGE_VALUE_ELEMENTS = 1024
_PASS = "_jit_pass_onnx_graph_shape_type_inference"
_NO_FAST_SHAPE_INFERENCE = (
    "orttrainer: this torch has no torch._C._jit_pass_onnx_graph_shape_type_inference; the export runs its "
    "shape inference with every weight's values (slower start-up at large sizes, same graph).")
_warned = []  # the fallback's warning, once per process


@contextlib.contextmanager
def _shape_inference_without_weight_values():
    """During the export, give the exporter's shape inference only the values it can use.

    torch's TorchScript exporter runs `_jit_pass_onnx_graph_shape_type_inference(graph, params, opset)`
    twice; for every node it copies and serialises the values of the parameters the node reads into a
    one-node ONNX model: at GPT-2 small ~2 x 500 MB, most of the export's time
    (docs/notes/start-up.md, "Export without the weights' values in the exporter's shape inference").
    Large float weights cannot define a shape, so their values are left out; the graph
    comes out byte for byte the same (tests/unit/test_startup_cost.py). Yields True (and changes nothing)
    where this torch lacks the pass: the caller warns once and exports the slow way."""
    original = getattr(torch._C, _PASS, None)
    if original is None:
        yield True
        return

    def shape_inference(graph, params, opset):
        kept = {name: value for name, value in params.items()
                if not (isinstance(value, torch.Tensor) and value.is_floating_point()
                        and value.numel() > LARGE_VALUE_ELEMENTS)}
        return original(graph, kept, opset)

    setattr(torch._C, _PASS, shape_inference)  # torch's exporter looks it up on torch._C at each call
    try:
        yield False
    finally:
        setattr(torch._C, _PASS, original)


@contextlib.contextmanager
def _hook_cleared(wrapper):
    try:
        yield
    finally:
        wrapper.on_outputs = None


def _strip_prefix(model, prefix):
    renames = {i.name: i.name[len(prefix):] for i in model.graph.initializer if i.name.startswith(prefix)}
    if not renames:
        return
    for init in model.graph.initializer:
        init.name = renames.get(init.name, init.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    for value in list(model.graph.input) + list(model.graph.value_info):
        value.name = renames.get(value.name, value.name)


def tied_aliases(model: torch.nn.Module, exported_names):
    """{state_dict name: exported initializer name} for tensors shared under several names.

    The exporter keeps one initializer per shared tensor (e.g. a tied embedding/output head);
    the pytorch-format state_dict needs every name the torch model has.
    """
    groups = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        groups.setdefault((tensor.data_ptr(), tuple(tensor.shape), tensor.dtype), []).append(name)
    aliases = {}
    for names in groups.values():
        kept = [n for n in names if n in exported_names]
        if len(names) > 1 and kept:
            aliases.update({n: kept[0] for n in names if n != kept[0]})
    return aliases


def _gelu_symbolic(g, self, approximate="none"):
    # onnxruntime's fused Gelu/FastGelu have fused gradient kernels: faster than the erf/tanh
    # decomposition the exporter writes for opsets < 20.
    op = "com.microsoft::FastGelu" if approximate == "tanh" else "com.microsoft::Gelu"
    return g.op(op, self).setType(self.type())


@contextlib.contextmanager
def contrib_ops(enabled, opset_version):
    """Export with onnxruntime contrib symbolics (options._internal_use.enable_onnx_contrib_ops)."""
    if not enabled:
        yield
        return
    from torch.onnx import symbolic_helper

    symbolic = symbolic_helper.parse_args("v", "s")(_gelu_symbolic)
    torch.onnx.register_custom_op_symbolic("::gelu", symbolic, opset_version)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic("::gelu", opset_version)
