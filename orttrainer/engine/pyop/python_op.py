"""Custom torch.autograd.Function in the training graph: exported as onnxruntime's PythonOp, run by our runners.

    Function.apply in forward()  ──export (symbolic for prim::PythonOp)──>  com.microsoft::PythonOp
    GradientGraphBuilder         ──────────────────────────────────────>  com.microsoft::PythonOpGrad
    session run: PythonOp kernel ──forward runner──> Function.forward(ctx, *args)   (torch, no autograd)
                 PythonOpGrad    ──backward runner─> Function.backward(ctx, *grads) (the user's backward)

onnxruntime's kernels call a *runner* through a C++ function pointer with the signature

    std::vector<PyObject*> runner(const char* func_name, PyObject* callback,
        const std::vector<int64_t>& requires_grads, const std::vector<int64_t>& tensor_flags,
        bool is_training_mode, const std::vector<int64_t>& inplace_map, const char* invoke_id,
        bool safe_run_mode, const std::vector<PyObject*>& args)

ORTModule's runners are a compiled torch extension that does not build against torch 2.13; ours are
Python functions behind a ctypes trampoline (x86-64 System V / libstdc++: the returned vector comes
through a hidden pointer, a vector is three pointers). Tensors cross as DLPack capsules, non-tensor
arguments as the Python objects themselves. The forward runner returns [ctx, *outputs] (ctx owned by
onnxruntime until PythonOpGrad hands it back); the backward runner returns one gradient per forward
argument. Both run with `safe_run_mode=0`: the Function's own `forward` is called with our
`FunctionContext` and no autograd graph, which is what the user's backward expects to receive.

Tensors onnxruntime passes in are views of its buffers, which its memory plan reuses once their last
graph reader ran (PythonOpGrad does not read the forward inputs). So anything kept past the call --
saved tensors, tensor attributes of ctx, outputs that alias an argument -- is copied first. The one
exception is the engine's own: a Function whose `gradients_written_into` names a gradient it writes
into an incoming gradient's memory, on a PythonOpGrad whose `tensor_reuse_map` declares that alias
(`_written_in_place`).
"""

import atexit
import contextlib
import ctypes
import logging
import platform
import sys
import weakref

import onnx
import torch
from onnx import helper
from torch.utils import dlpack

from orttrainer.placement.process_state import PROCESS, keep_module_names

_LOG = logging.getLogger(__name__)

PYTHON_OP = "PythonOp"
PYTHON_OP_GRAD = "PythonOpGrad"
MS_DOMAIN = "com.microsoft"
CONTEXT_SUFFIX = "_ctx"  # PythonOp's first output: the context id PythonOpGrad reads

_ONNX_TYPES = {
    torch.float32: onnx.TensorProto.FLOAT, torch.float64: onnx.TensorProto.DOUBLE,
    torch.float16: onnx.TensorProto.FLOAT16, torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.int64: onnx.TensorProto.INT64, torch.int32: onnx.TensorProto.INT32,
    torch.int16: onnx.TensorProto.INT16, torch.int8: onnx.TensorProto.INT8, torch.uint8: onnx.TensorProto.UINT8,
}


class UnsupportedFunctionError(RuntimeError):
    """A torch.autograd.Function that cannot become a PythonOp (the message names it and says why)."""


# --------------------------------------------------------------------------- registry (process-wide)
# PROCESS.functions, .kept_alive, .runners, .pending_error, .live_contexts: see placement/process_state.py.
keep_module_names(__name__, _functions="functions", _kept_alive="kept_alive", _runners="runners",
                  _pending_error="pending_error", _live_contexts="live_contexts")


def function_name(cls):
    """The PythonOp func_name of a Function class: its qualified name, made unique per class object."""
    base = f"{cls.__module__}.{cls.__qualname__}"
    name, n = base, 1
    while name in PROCESS.functions and PROCESS.functions[name] is not cls:
        n += 1
        name = f"{base}#{n}"
    return name


class _Registered(torch.autograd.Function):
    """What onnxruntime's registry holds for every name. Its kernels only look the name up and pass the
    entry to our runners, which ignore it and call the user's class from `PROCESS.functions`; the
    registry accepts direct subclasses of Function only, the user's may derive from another Function."""

    @staticmethod
    def forward(ctx, *args):
        raise AssertionError("called through engine/pyop/python_op runners only")


def _register_function(cls):
    from onnxruntime.capi import _pybind_state as C

    name = function_name(cls)
    if name not in PROCESS.functions:
        PROCESS.functions[name] = cls
        C.register_torch_autograd_function(name, _Registered)
        if hasattr(cls, "infer_shape"):
            C.register_shape_inference_function(name, cls.infer_shape)
    return name


def _keep_alive(obj):
    from onnxruntime.capi import _pybind_state as C

    if not any(kept is obj for kept in PROCESS.kept_alive):
        PROCESS.kept_alive.append(obj)
        C.register_miscellaneous_const_input(obj)


# --------------------------------------------------------------------------- export
def _onnx_type(dtype, what):
    if dtype not in _ONNX_TYPES:
        raise UnsupportedFunctionError(f"{what} has dtype {dtype}, which PythonOp cannot carry "
                                       f"(supported: {', '.join(str(t) for t in _ONNX_TYPES)})")
    return _ONNX_TYPES[dtype]


def _has_tensor(obj):
    if isinstance(obj, (torch.Tensor, torch._C.Value)):
        return True
    if isinstance(obj, (list, tuple, set)):
        return any(_has_tensor(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_tensor(o) for o in obj.values())
    return False


def _encode_constant(position, arg, attrs):
    """Add non-tensor argument `arg` at `position` to the PythonOp attributes (onnxruntime's layout)."""
    def add(kind, value):
        attrs.setdefault(f"input_{kind}s", []).append(value)
        attrs.setdefault(f"input_{kind}_positions", []).append(position)

    def add_tuple(kind, values):
        begins = attrs.setdefault(f"input_{kind}_tuple_begins", [])
        items = attrs.setdefault(f"input_{kind}_tuples", [])
        begins.append(len(items))
        items.extend(values)
        attrs.setdefault(f"input_{kind}_tuple_positions", []).append(position)

    if isinstance(arg, bool):  # before int: bool is an int
        add("bool_scalar", int(arg))
    elif isinstance(arg, int):
        add("int_scalar", arg)
    elif isinstance(arg, tuple) and arg and all(isinstance(v, bool) for v in arg):
        add_tuple("bool", [int(v) for v in arg])
    elif isinstance(arg, tuple) and arg and all(isinstance(v, int) and not isinstance(v, bool) for v in arg):
        add_tuple("int", list(arg))
    else:
        # Any other object goes by address; the registry keeps it alive as long as the process. Floats
        # too: float attributes are float32, and the Function must see the double eager would pass.
        _keep_alive(arg)
        add("pointer_scalar", id(arg))


def _check_exportable(cls, cconv, args):
    if cls is _checkpoint_function():
        raise UnsupportedFunctionError(
            "torch.utils.checkpoint with use_reentrant=True runs the wrapped layers in PyTorch, whose "
            "weights the training session would never update; remove the checkpointing (or use "
            "use_reentrant=False, which is traced like ordinary code)")
    for position, (kind, arg) in enumerate(zip(cconv, args)):
        if kind == "d":
            continue
        if _has_tensor(arg):
            raise UnsupportedFunctionError(
                f"argument {position} is a {type(arg).__name__} holding tensors; pass each tensor as its own "
                "argument of apply() (tensors inside containers would be frozen at their export-time values)")
        if isinstance(arg, torch.nn.Module):
            raise UnsupportedFunctionError(
                f"argument {position} is a torch.nn.Module ({type(arg).__name__}); its parameters would stay "
                "in PyTorch and never be trained; pass its weights as tensor arguments instead")


def _checkpoint_function():
    import torch.utils.checkpoint

    return getattr(torch.utils.checkpoint, "CheckpointFunction", None)


def _symbolic(g, *args, **_attrs):
    """prim::PythonOp -> com.microsoft::PythonOp, for Functions without their own `symbolic`."""
    node = g.original_node
    cls = node.pyobj().__self__
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    _export_requires[-1](f"torch.autograd.Function {qualified}")  # the hook checked once per process
    try:
        cconv = node.cconv()
        _check_exportable(cls, cconv, args)
        tensors = [a for kind, a in zip(cconv, args) if kind == "d"]
        attrs = {
            "input_convention": cconv,
            "input_tensor_types": [_onnx_type(t.type().dtype(), f"tensor argument {i}") for i, t in enumerate(tensors)],
            "input_tensor_ranks": [t.type().dim() for t in tensors],
            "output_tensor_types": [], "output_tensor_ranks": [],
            "training_mode": 1, "safe_run_mode": 0,
        }
        for i, out in enumerate(node.outputs()):
            out_type = out.type()
            if not isinstance(out_type, torch._C.TensorType) or out_type.dtype() is None:
                raise UnsupportedFunctionError(f"output {i} is not a tensor ({out_type}); return tensors only")
            attrs["output_tensor_types"].append(_onnx_type(out_type.dtype(), f"output {i}"))
            attrs["output_tensor_ranks"].append(out_type.dim())
        for position, (kind, arg) in enumerate(zip(cconv, args)):
            if kind != "d":
                _encode_constant(position, arg, attrs)
    except UnsupportedFunctionError as exc:
        raise UnsupportedFunctionError(f"torch.autograd.Function {qualified} cannot be exported: {exc}") from None
    attrs["func_name"] = _register_function(cls)
    suffixed = {f"{k}_{_attr_kind(v)}": v for k, v in attrs.items()}
    outputs = g.op(f"{MS_DOMAIN}::{PYTHON_OP}", *tensors, outputs=node.outputsSize(), **suffixed)
    # dtype and rank as traced; every dim unknown (the sample's sizes are not the graph's): the exporter
    # names them, and finish_export replaces them when the Function has a shape hook.
    for out, traced in zip(outputs if isinstance(outputs, (list, tuple)) else [outputs], node.outputs()):
        out.setType(traced.type().with_sizes([None] * traced.type().dim()))
    return outputs


def _attr_kind(value):
    return "s" if isinstance(value, str) else "i"  # strings, ints and int lists (floats go by reference)


_export_requires = []  # the `require` of each active `exporting` context, innermost last


class exporting:
    """Context for torch.onnx.export: Functions become PythonOps (pass autograd_inlining=False too).

    `require(what)` raises when this process cannot run PythonOps (runner_check.require); the caller
    passes it, since the checker's self-test builds on this module."""

    def __init__(self, require):
        self.require = require

    def __enter__(self):
        _export_requires.append(self.require)
        torch.onnx.register_custom_op_symbolic("prim::PythonOp", _symbolic, 1)
        return self

    def __exit__(self, *exc):
        torch.onnx.unregister_custom_op_symbolic("prim::PythonOp", 1)
        _export_requires.pop()
        return False


def finish_export(model: onnx.ModelProto):
    """Give every PythonOp its context output (first) and apply the Functions' shape hooks."""
    nodes = [n for n in model.graph.node if n.op_type == PYTHON_OP and n.domain == MS_DOMAIN]
    for node in nodes:
        outputs = list(node.output)
        del node.output[:]
        node.output.extend([outputs[0] + CONTEXT_SUFFIX] + outputs)
    if any(hasattr(PROCESS.functions.get(_func_name(n)), "infer_shape") for n in nodes):
        _apply_shape_hooks(model, nodes)


def _func_name(node):
    return next(a.s.decode() for a in node.attribute if a.name == "func_name")


def _apply_shape_hooks(model, nodes):
    """Output shapes from `Function.infer_shape(node, input_shapes, input_dtypes)` (onnxruntime's hook
    convention; dims are ints or dim_param strings), written as value_info so that the symbolic dims of
    the inputs carry on through the rest of the graph instead of fresh per-output symbols."""
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in list(inferred.graph.input) + list(inferred.graph.value_info)
             + list(inferred.graph.output)}
    known.update({i.name: helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                  for i in model.graph.initializer})
    replaced = {}
    for node in nodes:
        cls = PROCESS.functions[_func_name(node)]
        if not hasattr(cls, "infer_shape"):
            continue
        shapes, dtypes = [], []
        for name in node.input:
            tensor_type = known[name].type.tensor_type if name in known else None
            if tensor_type is None or not tensor_type.HasField("shape"):
                shapes.append(None)
            else:
                shapes.append([d.dim_param if d.HasField("dim_param") else
                               (d.dim_value if d.HasField("dim_value") else None) for d in tensor_type.shape.dim])
            dtypes.append(tensor_type.elem_type if tensor_type is not None else 0)
        out_shapes, out_dtypes = cls.infer_shape(node, shapes, dtypes)
        if len(out_shapes) != len(node.output) - 1 or len(out_dtypes) != len(node.output) - 1:
            raise UnsupportedFunctionError(
                f"{_func_name(node)}.infer_shape returned {len(out_shapes)} shapes and {len(out_dtypes)} dtypes "
                f"for {len(node.output) - 1} outputs")
        for name, shape, dtype in zip(node.output[1:], out_shapes, out_dtypes):
            replaced[name] = helper.make_tensor_value_info(name, int(dtype), shape)
    kept = [v for v in model.graph.value_info if v.name not in replaced]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept + list(replaced.values()))


def mark_required_gradients(model: onnx.ModelProto):
    """After the gradient graph is built: tell each PythonOp which inputs its PythonOpGrad computes
    gradients for (the Function sees them as ctx.needs_input_grad). PythonOpGrad's first input is the
    context output of its PythonOp."""
    forward_by_context = {n.output[0]: n for n in model.graph.node
                          if n.op_type == PYTHON_OP and n.domain == MS_DOMAIN}
    for grad in model.graph.node:
        if grad.op_type != PYTHON_OP_GRAD or grad.domain != MS_DOMAIN:
            continue
        forward = forward_by_context[grad.input[0]]
        wanted = iter(next(a.ints for a in grad.attribute if a.name == "output_tensor_requires_grads"))
        cconv = next(a.s.decode() for a in forward.attribute if a.name == "input_convention")
        flags = [int(next(wanted)) if kind == "d" else 0 for kind in cconv]
        for attr in list(forward.attribute):
            if attr.name == "input_requires_grads":
                forward.attribute.remove(attr)
        forward.attribute.append(helper.make_attribute("input_requires_grads", flags))


# --------------------------------------------------------------------------- run time
class FunctionContext:
    """The `ctx` a Function's forward and backward see inside the training session."""

    def __init__(self, function, needs_input_grad):
        self._function = function
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self._saved = ()

    def save_for_backward(self, *tensors):
        self._saved = tensors

    @property
    def saved_tensors(self):
        return self._saved

    def mark_non_differentiable(self, *outputs):
        pass  # the gradient graph already gives such outputs no gradient edge when nothing reads one

    def set_materialize_grads(self, value):
        self.materialize_grads = bool(value)

    def mark_dirty(self, *tensors):
        raise UnsupportedFunctionError(
            f"torch.autograd.Function {self._function} modifies its inputs in place (ctx.mark_dirty); inside "
            "onnxruntime that would overwrite the session's own buffers. Return a new tensor instead.")

    def save_for_forward(self, *tensors):
        pass  # forward-mode AD is not used by training

    def _release(self):
        self.__dict__.clear()


class _Vector(ctypes.Structure):
    """libstdc++ std::vector<T> for 8-byte T: begin, end, end of storage."""
    _fields_ = [("begin", ctypes.c_void_p), ("end", ctypes.c_void_p), ("capacity", ctypes.c_void_p)]


def _read_int64s(address):
    vector = _Vector.from_address(address)
    count = (vector.end - vector.begin) // 8 if vector.begin else 0
    return list((ctypes.c_int64 * count).from_address(vector.begin)) if count else []


def _read_objects(address):
    vector = _Vector.from_address(address)
    count = (vector.end - vector.begin) // 8 if vector.begin else 0
    pointers = list((ctypes.c_void_p * count).from_address(vector.begin)) if count else []
    return [ctypes.cast(p, ctypes.py_object).value for p in pointers]


_RUNNER_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_void_p,  # returns the hidden result pointer
    ctypes.c_void_p,  # hidden pointer: the std::vector<PyObject*> to construct
    ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_bool,
    ctypes.c_void_p, ctypes.c_char_p, ctypes.c_bool, ctypes.c_void_p)


def _install_runners():
    if PROCESS.runners is not None:
        return
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise UnsupportedFunctionError(
            f"custom torch.autograd.Function needs x86-64 Linux here (the runners' calling convention); "
            f"this is {sys.platform}/{platform.machine()}")
    from onnxruntime.capi import _pybind_state as C

    libstdcxx = ctypes.CDLL("libstdc++.so.6")
    operator_new = libstdcxx._Znwm  # the caller frees the vector's storage with operator delete
    operator_new.restype, operator_new.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    incref = ctypes.pythonapi.Py_IncRef
    incref.argtypes = [ctypes.py_object]

    def construct(result_address, objects):
        """Build the returned vector in place; each element carries a reference the caller releases."""
        result = _Vector.from_address(result_address)
        if not objects:
            result.begin = result.end = result.capacity = None
            return result_address
        storage = operator_new(8 * len(objects))
        slots = (ctypes.c_void_p * len(objects)).from_address(storage)
        for i, obj in enumerate(objects):
            incref(obj)
            slots[i] = id(obj)
        result.begin, result.end = storage, storage + 8 * len(objects)
        result.capacity = result.end
        return result_address

    def make_runner(body):
        def runner(result_address, func_name, _callback, requires_grads, tensor_flags, _training,
                   _inplace, invoke_id, _safe_run, args):
            name = func_name.decode()
            try:
                objects = body(name, _read_int64s(requires_grads), _read_int64s(tensor_flags),
                               invoke_id.decode(), _read_objects(args))
            except BaseException as exc:  # noqa: BLE001 -- nothing may unwind into C++
                # An empty result makes the kernel fail; function_errors re-raises this error.
                if PROCESS.pending_error is None:  # later ones are consequences of the first
                    PROCESS.pending_error = exc
                _LOG.debug("torch.autograd.Function %s failed inside the training session: %r", name, exc)
                objects = []
            return construct(result_address, objects)
        return _RUNNER_TYPE(runner)

    runners = PROCESS.runners = (make_runner(_run_forward), make_runner(_run_backward))
    C.register_forward_runner(ctypes.cast(runners[0], ctypes.c_void_p).value)
    C.register_backward_runner(ctypes.cast(runners[1], ctypes.c_void_p).value)
    # The registries hold Python references in C++ statics: drop them before the interpreter finalizes.
    atexit.register(C.unregister_python_functions)


@contextlib.contextmanager
def function_errors():
    """Around a session run: a Function's own exception that made the run fail is raised as the error
    (from onnxruntime's). The slot is emptied before and after, so an error of one run is never
    reported as the cause of another's failure."""
    PROCESS.pending_error = None
    try:
        yield
    except Exception as session_error:
        error, PROCESS.pending_error = PROCESS.pending_error, None
        if error is not None:
            raise error from session_error
        raise
    finally:
        PROCESS.pending_error = None


def _storage(tensor):
    return tensor.untyped_storage().data_ptr()


def _detach_from(value, borrowed):
    """`value` (tensor, or tuple/list of them) with copies of tensors whose storage is in `borrowed`."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.numel() and _storage(value) in borrowed else value
    if isinstance(value, (tuple, list)):
        return type(value)(_detach_from(v, borrowed) for v in value)
    return value


def _release_stale_context(invoke_id, ctx):
    """A forward whose backward never ran (an eval run) leaves its ctx in onnxruntime's registry; free
    its saved tensors when the same node runs again. Weak: onnxruntime requires sole ownership."""
    stale = PROCESS.live_contexts.get(invoke_id)
    stale = stale() if stale is not None else None
    if stale is not None:
        stale._release()
    PROCESS.live_contexts[invoke_id] = weakref.ref(ctx)


def _uses_setup_context(cls):
    return getattr(cls, "setup_context", None) is not getattr(torch.autograd.Function, "setup_context", None)


def _run_forward(name, requires_grads, tensor_flags, invoke_id, args):
    cls = PROCESS.functions[name]
    args = [torch.from_dlpack(a) if flag else a for a, flag in zip(args, tensor_flags)]
    ctx = FunctionContext(name, tuple(bool(r) for r in requires_grads))
    with torch.no_grad():
        if _uses_setup_context(cls):
            outputs = cls.forward(*args)
            cls.setup_context(ctx, tuple(args), outputs)
        else:
            outputs = cls.forward(ctx, *args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    borrowed = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
    ctx._saved = _detach_from(tuple(ctx._saved), borrowed)
    for key, value in list(vars(ctx).items()):
        if not key.startswith("_"):
            setattr(ctx, key, _detach_from(value, borrowed))
    # An output that is (a view of) an input or a saved tensor would be shared with a buffer that
    # onnxruntime reuses or overwrites: hand onnxruntime its own copy.
    borrowed |= {_storage(t) for t in ctx._saved if isinstance(t, torch.Tensor)}
    results = []
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            raise UnsupportedFunctionError(f"{name}.forward returned {type(out).__name__} as output {i}; "
                                           "return tensors only")
        results.append(out.clone(memory_format=torch.contiguous_format) if out.numel() and _storage(out) in borrowed
                       else out.contiguous())
    # (shape, dtype, device): a missing gradient is made as zeros like these, on the tensor's own device
    ctx._inputs = [_meta(a) if isinstance(a, torch.Tensor) else None for a in args]
    ctx._outputs = [_meta(o) for o in results]
    _release_stale_context(invoke_id, ctx)
    return [ctx] + [dlpack.to_dlpack(o) for o in results]


def _meta(tensor):
    return tuple(tensor.shape), tensor.dtype, tensor.device


def _zeros(meta):
    """Zeros for a missing gradient, on the device of the tensor it belongs to (a CUDA session's
    gradients are CUDA tensors: CPU zeros there would be read by onnxruntime as device memory)."""
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _run_backward(name, _requires_grads, tensor_flags, _invoke_id, args):
    cls = PROCESS.functions[name]
    ctx = args[0]
    grads = [torch.from_dlpack(a) if flag and a is not None else None for a, flag in zip(args[1:], tensor_flags[1:])]
    if ctx.materialize_grads:  # as torch does: outputs without a gradient (e.g. integer ones) get zeros
        grads = [_zeros(meta) if g is None else g for g, meta in zip(grads, ctx._outputs)]
    with torch.no_grad():
        result = cls.backward(ctx, *grads)
    result = result if isinstance(result, tuple) else (result,)
    inputs = ctx._inputs
    if len(result) != len(inputs):
        raise UnsupportedFunctionError(f"{name}.backward returned {len(result)} gradients; forward takes "
                                       f"{len(inputs)} arguments (return None for those without one)")
    borrowed = {_storage(g) for g in grads if g is not None}
    written_into = getattr(cls, "gradients_written_into", {})  # engine-internal Functions only, see below
    results = []
    for i, (grad, meta, needed) in enumerate(zip(result, inputs, ctx.needs_input_grad)):
        if meta is None:  # a non-tensor argument has no gradient
            results.append(None)
            continue
        if i in written_into:
            results.append(_written_in_place(name, grad, grads[written_into[i]]))
            continue
        shape, dtype = meta[:2]
        if grad is None:
            grad = _zeros(meta) if needed else None
        elif tuple(grad.shape) != tuple(shape) or grad.dtype != dtype or grad.device != meta[2]:
            raise UnsupportedFunctionError(
                f"{name}.backward returned a gradient of shape {tuple(grad.shape)}, dtype {grad.dtype} on "
                f"{grad.device} for argument {i} of shape {tuple(shape)}, dtype {dtype} on {meta[2]}")
        if grad is not None:
            grad = _detach_from(grad, borrowed).contiguous()
        results.append(grad)
    ctx._release()  # saved tensors are not needed any more
    return [dlpack.to_dlpack(g) if g is not None else None for g in results]


def _written_in_place(name, grad, incoming):
    """A gradient the Function wrote into the memory of an incoming gradient, for a PythonOpGrad whose
    `tensor_reuse_map` declares that alias (engine/graph/torch_gelu_gradient.py). onnxruntime's memory plan
    then keeps that buffer until the gradient's last reader, and its kernel checks the two addresses.
    What goes back is a view the session does not own: onnxruntime keeps every PythonOpGrad output
    until the run ends (docs/ort-notes.md), and a view that held the buffer would keep the arena from
    reusing it for the rest of the backward pass."""
    if grad is None or grad.data_ptr() != incoming.data_ptr() or not grad.is_contiguous() \
            or grad.shape != incoming.shape or grad.dtype != incoming.dtype:
        raise UnsupportedFunctionError(f"{name}.backward must return its gradient written into the incoming "
                                       "gradient's own memory (the graph declares that alias)")
    if grad.numel() == 0:
        return grad
    memory = (ctypes.c_byte * (grad.numel() * grad.element_size())).from_address(grad.data_ptr())
    return torch.frombuffer(memory, dtype=grad.dtype).view(grad.shape)


def has_python_ops(model: onnx.ModelProto):
    return any(n.op_type == PYTHON_OP and n.domain == MS_DOMAIN for n in model.graph.node)

