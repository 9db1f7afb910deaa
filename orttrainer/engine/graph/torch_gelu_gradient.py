"""GELU's gradient computed by torch instead of onnxruntime's `GeluGrad` CPU kernel.

onnxruntime's CPU `GeluGrad` evaluates erf and exp one element at a time on one thread: 3.3 ms per
[8, 128, 1024] tensor here, where torch's `gelu_backward` (vectorised), called on one thread from inside
the session, takes 0.8 ms (docs/notes/optimisation-log.md). Each fp32 `GeluGrad(dy, x)` of
the training graph becomes a pair of torch-interop nodes (engine/pyop/python_op.py runs them):

    PythonOp(dy, x)          -> ctx, (empty), (empty)   registers the context; computes nothing
    PythonOpGrad(ctx, dy, x) -> dx                      dx = torch gelu_backward(dy, x), written into dy

dx is written into dy's own buffer, and the PythonOpGrad says so (`tensor_reuse_map`): onnxruntime's
memory plan then treats dx as an alias of dy and keeps that arena buffer until dx's last reader, then
reuses it. A dx in memory of torch's own would be held until the run ends (onnxruntime keeps every
PythonOpGrad output that long: at BERT-base, twelve 12.6 MB buffers above eager's peak). Writing into
dy is safe only where nothing else reads dy or the buffer it shares (`_owns_its_buffer`); elsewhere
GeluGrad stays the kernel.

Why a pair: onnxruntime registers every PythonOp's context in a process-wide pool that only its
PythonOpGrad removes; a PythonOp alone would grow that pool by one entry per node and step. Both run
in the same backward pass, so each step's contexts are freed.

The export cache stores training graphs with these nodes; a process that loads one registers the
Function first (`register_if_used`, called by export_cache.load). Its key holds `enabled()`.

The runners reach into onnxruntime's internals, so the rewrite is applied only where
engine/pyop/runner_check.py passed (version, bindings, a PythonOp self-test, once per process); elsewhere
GeluGrad stays onnxruntime's kernel, with one warning.

torch runs single-threaded inside the call: onnxruntime's two intra-op threads are still spinning
then, and torch's own OpenMP threads on the same two cores made a step slower, not faster.
"""

import warnings

import onnx
import torch
from onnx import TensorProto, helper

from orttrainer.engine.pyop import python_op
from orttrainer.engine.pyop import runner_check
from orttrainer.engine.graph.builder import VIEW_OPS
from orttrainer.placement.process_state import PROCESS, keep_module_names

# PROCESS.runners_platform: python_op's runners can run here; PROCESS.gelu_fallback_warned: the fallback to
# GeluGrad was reported (once per process).
keep_module_names(__name__, _RUNNERS_WORK="runners_platform", _warned="gelu_fallback_warned")


class TorchGeluGradient(torch.autograd.Function):
    """dx = GELU'(x)·dy (erf form), as torch's own backward computes it, written into dy's memory; see
    the module docstring. Its PythonOp only registers the context; the PythonOpGrad gets dy and x."""

    gradients_written_into = {0: 0}  # gradient 0 (dx) is incoming gradient 0 (dy)'s memory: python_op.py

    @staticmethod
    def forward(ctx, dy, x):
        return dy.new_empty([0]), dy.new_empty([0])

    @staticmethod
    def backward(ctx, dy, x):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.ops.aten.gelu_backward.grad_input(dy, x, grad_input=dy)  # elementwise: in place is exact
        finally:
            torch.set_num_threads(threads)
        return dy, None


def register_if_used(model: onnx.ModelProto):
    """Make a training graph built by another process runnable here (the export cache): its PythonOps
    name TorchGeluGradient, which this process must register and serve with its runners."""
    name = python_op.function_name(TorchGeluGradient)
    for node in model.graph.node:
        if node.op_type == python_op.PYTHON_OP and node.domain == python_op.MS_DOMAIN \
                and python_op._func_name(node) == name:
            runner_check.require("the cached training graph (its GELU gradient runs in torch)")
            python_op._install_runners()
            python_op._register_function(TorchGeluGradient)
            return


def _fp32_ranks(graph):
    """Rank of every fp32 tensor whose type the graph records (inputs, value_info, outputs)."""
    ranks = {}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor_type = info.type.tensor_type
        if tensor_type.elem_type == TensorProto.FLOAT and tensor_type.HasField("shape"):
            ranks[info.name] = len(tensor_type.shape.dim)
    return ranks


def enabled():
    """Whether gelu_gradient_in_torch rewrites anything in this process (part of the export cache key)."""
    return PROCESS.runners_platform and not torch.cuda.is_available() and not runner_check.problem()


def _owns_its_buffer(name, reader, consumers, producers, outside):
    """Whether `reader` may overwrite tensor `name`: it is its only reader, and so on up through any chain
    of view ops (onnxruntime gives a Reshape's output its input's buffer) to a tensor that a computing
    node wrote; never one of `outside` (graph inputs, initializers, outputs)."""
    while True:
        if name in outside or consumers.get(name, []) != [reader]:
            return False
        producer = producers.get(name)
        if producer is None:
            return False
        if producer.op_type not in VIEW_OPS:
            return True
        name, reader = producer.input[0], producer


def gelu_gradient_in_torch(model: onnx.ModelProto):
    """Replace each com.microsoft GeluGrad whose incoming gradient is a known fp32 tensor that only it
    reads; returns how many. Others (fp16, unknown type, a dy something else reads, a dx the graph
    returns, a platform without the interop runners) keep the kernel, and so does a machine with CUDA
    (the session may run there, where GeluGrad is a fast kernel and torch would need onnxruntime's
    stream) and a process where runner_check failed (then with one warning)."""
    if not PROCESS.runners_platform or torch.cuda.is_available():
        return 0
    graph = model.graph
    ranks = _fp32_ranks(graph)
    consumers, producers = {}, {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
        for name in node.output:
            producers[name] = node
    outputs = {o.name for o in graph.output}
    outside = outputs | {i.name for i in graph.input} | {i.name for i in graph.initializer}
    # GeluGrad's two inputs and its output share one type and shape; the gradient builder records dy's.
    targets = [n for n in graph.node if n.op_type == "GeluGrad" and n.domain == python_op.MS_DOMAIN
               and n.input[0] in ranks and n.output[0] not in outputs
               and _owns_its_buffer(n.input[0], n, consumers, producers, outside)]
    if not targets:
        return 0
    reason = runner_check.problem()
    if reason:
        if not PROCESS.gelu_fallback_warned:
            PROCESS.gelu_fallback_warned = True
            warnings.warn(f"GELU's gradient stays on onnxruntime's GeluGrad kernel (slower on the CPU): {reason}",
                          RuntimeWarning, stacklevel=2)
        return 0
    python_op._install_runners()
    func_name = python_op._register_function(TorchGeluGradient)
    replaced = {id(n) for n in targets}
    nodes = []
    for node in graph.node:
        if id(node) not in replaced:
            nodes.append(node)
            continue
        (dx,) = node.output
        rank = ranks[node.input[0]]
        ctx = f"{dx}.torch_ctx"
        two_floats = [TensorProto.FLOAT] * 2
        nodes.append(helper.make_node(
            python_op.PYTHON_OP, list(node.input), [ctx, f"{dx}.torch_empty0", f"{dx}.torch_empty1"],
            name=f"{node.name}_torch", domain=python_op.MS_DOMAIN, func_name=func_name, input_convention="dd",
            input_tensor_types=two_floats, input_tensor_ranks=[rank, rank], input_requires_grads=[1, 0],
            output_tensor_types=two_floats, output_tensor_ranks=[1, 1], training_mode=1, safe_run_mode=0))
        nodes.append(helper.make_node(
            python_op.PYTHON_OP_GRAD, [ctx] + list(node.input), [dx, f"{dx}.torch_unused"],
            name=f"{node.name}_torch_grad", domain=python_op.MS_DOMAIN, func_name=func_name,
            input_tensor_types=two_floats, input_tensor_ranks=[rank, rank], output_convention="dd",
            output_tensor_types=two_floats, output_tensor_ranks=[rank, rank],
            output_tensor_requires_grads=[1, 0], safe_run_mode=0,
            tensor_reuse_map=[1, -1]))  # dx is node input 1 (dy)'s buffer: see the module docstring
    del graph.node[:]
    graph.node.extend(nodes)
    return len(targets)
