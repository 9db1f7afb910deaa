"""Compute precision under mixed precision: which dtype the exported model computes in, and the
graph edits that keep a low-precision training graph correct on onnxruntime.

    mixed_precision.compute_dtype ──resolve_compute_dtype──> torch dtype the matrix products compute in
                                  ──export_dtype──> the dtype the export traces under (fp32 for the
                                                    CPU's bf16, whose products run on torch's kernels)
    forward model ──loss_in_fp32──> the loss (and so the backward's seed) is fp32
                  ──fence_low_precision_ops──> ops the CPU provider cannot run in fp16 run in fp32

Master weights, gradients (a Cast's gradient is a Cast back), accumulation buffers, the global
norm, unscaling, clipping and the optimizer stay fp32: only the forward ops that torch's autocast
policy lowers, and their gradients, compute in fp16 / bf16.
"""

import functools
import warnings

import onnx
import torch
from onnx import TensorProto

from orttrainer.engine.graph.builder import GraphBuilder
from orttrainer.engine.kernels import library
from orttrainer.placement import cpu

COMPUTE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOW_PRECISION = (TensorProto.FLOAT16, TensorProto.BFLOAT16)

# Forward ops whose fp16 gradient the CPU provider accepts at session creation and then fails on at
# run time: Slice -> SliceGrad ("Type for T or Tind not supported yet in SliceGrad") as soon as two
# gradients meet at the sliced tensor (two slices of it, or a slice of a Concat). They only move
# data, so running them in fp32 costs two Casts and changes no value. (SplitTraining, Concat's
# gradient, fails as a one-node graph but ran in every model form tried: not fenced.) The graph is
# the same on every provider (a CUDA session runs this graph too).
FENCED_OPS = ("Slice",)


def resolve_compute_dtype(option, *, enabled, device_type, torch_model):
    """The dtype the model's matrix products compute in: torch.float32, torch.float16 or torch.bfloat16.

    `option` is mixed_precision.compute_dtype ('auto', 'float16', 'bfloat16', 'float32'). 'auto' is
    float16 on a CUDA session; on the CPU it is bfloat16 where the CPU has bf16 matrix units
    (amx_bf16 / avx512_bf16) and torch's kernels run inside the session (engine/kernels/library.py),
    else float32. Raises ValueError for what cannot run; warns (once) that fp16 on the CPU is slower
    than fp32, and when bf16 falls back to fp32 because the kernel library failed its check.
    """
    if not enabled:
        return torch.float32
    on_cpu = device_type != "cuda"
    if option == "auto":
        if not on_cpu:
            return torch.float16 if torch_model else torch.float32
        return torch.bfloat16 if cpu.bf16_units() and _bf16_kernels_work() else torch.float32
    dtype = COMPUTE_DTYPES[option]
    if dtype == torch.float32:
        return dtype
    if dtype == torch.bfloat16 and on_cpu:
        if not cpu.bf16_units():
            model = cpu.facts().model or "this CPU"
            raise ValueError(
                f"mixed_precision.compute_dtype is 'bfloat16' but {model} has no bfloat16 matrix units: its "
                f"/proc/cpuinfo flags name neither {' nor '.join(cpu.BF16_FLAGS)}, and onnxruntime has no "
                "bfloat16 kernels of its own on the CPU. Use 'auto' (float32 on this CPU) or 'float32', or "
                "train on a CPU with those flags or a CUDA device.")
        return torch.bfloat16 if _bf16_kernels_work() else torch.float32
    if not torch_model:
        raise ValueError(
            f"mixed_precision.compute_dtype is {option!r} but the model is an ONNX model: the trainer "
            "sets the compute precision when it exports a PyTorch model. Pass the torch.nn.Module, or an "
            "ONNX model that already computes in low precision with compute_dtype 'auto'.")
    if dtype == torch.float16 and on_cpu:
        _warn_fp16_on_cpu_once()
    return dtype


def export_dtype(compute_dtype, device_type):
    """What the export traces under torch.autocast: the compute dtype, except bfloat16 on the CPU,
    where the graph stays fp32 and its matrix products compute in bf16 on torch's kernels
    (engine/graph/torch_matmul.py) -- onnxruntime's CPU provider has no bf16 kernels to run an
    autocast graph's ops."""
    if compute_dtype == torch.bfloat16 and device_type != "cuda":
        return torch.float32
    return compute_dtype


def _bf16_kernels_work():
    reason = library.problem()
    if reason:
        _warn_bf16_fallback_once(reason)
    return not reason


@functools.lru_cache(maxsize=None)
def _warn_bf16_fallback_once(reason):
    warnings.warn(f"Mixed precision computes in float32 on this CPU, not bfloat16: {reason}", RuntimeWarning)


@functools.lru_cache(maxsize=None)
def _warn_fp16_on_cpu_once():
    warnings.warn(
        "mixed_precision.compute_dtype is 'float16' on the CPU: onnxruntime's CPU provider has no fp16 "
        "kernels and runs those ops through Casts, so a step is slower than in float32 (about 1.2-1.4x). "
        "It is useful to check fp16 numerics before a GPU run; use 'auto' or 'float32' to train fast here.",
        UserWarning)


def elem_types(model: onnx.ModelProto):
    """{tensor name: ONNX element type} of a forward model, from onnx's type inference completed by
    propagation where it stops (onnxruntime contrib ops such as Gelu are unknown to onnx): an output
    onnx could not type takes its Cast's target type, else the type of the node's first typed input
    (true of the elementwise and data-movement ops this is needed for)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(inferred.value_info) + list(inferred.input) + list(inferred.output)
             if v.type.tensor_type.elem_type}
    types.update({init.name: init.data_type for init in model.graph.initializer})
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == "Constant" and attr.name == "value":
                types.setdefault(node.output[0], attr.t.data_type)
        fallback = None
        if node.op_type == "Cast":
            fallback = next(a.i for a in node.attribute if a.name == "to")
        else:
            fallback = next((types[i] for i in node.input if i in types), None)
        for out in node.output:
            if out and out not in types and fallback is not None:
                types[out] = fallback
    return types


def loss_in_fp32(model: onnx.ModelProto, loss):
    """Make the loss output fp32 (a Cast after a low-precision loss): the loss is returned in fp32,
    as the legacy trainer did, and its gradient seed (the loss scale) is an fp32 scalar."""
    output = next(o for o in model.graph.output if o.name == loss)
    elem_type = output.type.tensor_type.elem_type
    if elem_type not in LOW_PRECISION:
        return False
    b = GraphBuilder(model.graph, prefix="fp32_loss_")
    low = b.fresh(f"{loss}_low_precision")
    for node in model.graph.node:
        for i, name in enumerate(node.output):
            if name == loss:
                node.output[i] = low
        for i, name in enumerate(node.input):
            if name == loss:
                node.input[i] = low
    b.op("Cast", [low], outputs=[loss], to=TensorProto.FLOAT)
    output.type.tensor_type.elem_type = TensorProto.FLOAT
    return True


def fence_low_precision_ops(model: onnx.ModelProto, ops=FENCED_OPS):
    """Run in fp32 the nodes that cannot run in fp16/bf16 here: the `ops` nodes whose data input
    (input 0) is fp16/bf16, and LayerNormalization nodes whose input is fp16/bf16 but whose scale is
    fp32 (torch's CPU autocast lets layer_norm take an fp16 input with fp32 weights; ONNX requires
    one type, and the gradient builder rejects the node). Every low-precision input is cast to fp32
    and output 0 back to the input's type. Returns the names of the fenced nodes."""
    graph = model.graph
    types = elem_types(model)
    b = GraphBuilder(graph, prefix="fp32_fence_")
    fenced = []
    rewritten = []
    for node in list(graph.node):
        low = types.get(node.input[0]) if node.input else None
        mixed_layer_norm = (node.op_type == "LayerNormalization" and len(node.input) > 1
                            and types.get(node.input[1]) == TensorProto.FLOAT)
        if low not in LOW_PRECISION or not (node.op_type in ops or mixed_layer_norm):
            rewritten.append(node)
            continue
        before = len(graph.node)
        for i, name in enumerate(node.input):
            if name and types.get(name) in LOW_PRECISION:
                node.input[i] = b.op("Cast", [name], to=TensorProto.FLOAT)
        output = node.output[0]
        node.output[0] = b.fresh(f"{output}_fp32")
        rewritten.extend(graph.node[before:])
        rewritten.append(node)
        before = len(graph.node)
        b.op("Cast", [node.output[0]], outputs=[output], to=low)
        rewritten.extend(graph.node[before:])
        fenced.append(node.name or output)
    del graph.node[:]
    graph.node.extend(rewritten)
    return fenced


def has_low_precision_compute(model: onnx.ModelProto):
    """Whether some node casts to fp16/bf16 (an autocast export does, before its matmuls)."""
    return any(node.op_type == "Cast" and any(a.name == "to" and a.i in LOW_PRECISION for a in node.attribute)
               for node in model.graph.node)
