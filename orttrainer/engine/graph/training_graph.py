"""Turn a forward ONNX model into ONE training graph: forward, gradients, accumulation, clipping, update.

    forward model ──prepare──> weights as inputs, training-form loss/dropout
                  ──GradientGraphBuilder──> + `<w>_grad`
                  ──gradient blocks──> accumulate (InPlaceAccumulatorV2) | sum, scale, clip
                  ──optimizer blocks──> `<state>.updated` outputs

Which part of the graph runs is chosen per call by the fetched outputs (the runtime sets
`only_execute_path_to_fetches`): model outputs alone = eval; + accumulator flags = micro-step;
+ `.updated` states = optimizer step.
"""

import re
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from orttrainer.engine.pyop import python_op
from orttrainer.engine.graph.builder import MS_DOMAIN, GraphBuilder, sort_topologically
from orttrainer.engine.graph.rewrites import (
    constant_value, decompose_softmax_cross_entropy, deterministic_gather_grad, is_stub,
    fuse_cross_entropy_gradient, fuse_layer_norm, large_bias_gradient_as_matmul, small_embedding_as_matmul,
    tall_weight_product_as_gemm,
)
from orttrainer.engine.graph.optimizer_graph import (
    AdamKernel, StateSpec, Target, build_optimizer, direction_square_sum, hyper_parameters, optimizer_state,
    updated_name,
)
from orttrainer.engine.graph.precision import fence_low_precision_ops, has_low_precision_compute, loss_in_fp32
from orttrainer.engine.graph.recompute import RecomputeOptions, RecomputePlan
from orttrainer.engine.export.shape_annotation import annotate as annotate_symbolic_shapes
from orttrainer.engine.graph.sparse_prediction import sparse_masked_lm_head
from orttrainer.engine.graph.torch_gelu_gradient import gelu_gradient_in_torch
from orttrainer.engine.kernels import choice as kernel_choice
from orttrainer.engine.kernels.choice import Kernels

LEARNING_RATE = "__learning_rate"          # float [1], fed every train step
TRAINING_MODE = "__training_mode"          # bool [], replaces every Dropout's training_mode input
LAZY_RESET = "__lazy_reset_grad"           # bool [1], True on the first micro-step of a window
GRADIENT_SCALE = "__gradient_scale"        # float [], 1 / (accumulation steps · loss scale)
LOSS_SCALE = "__loss_scale"                # float [], seeds the backward pass (mixed precision)
ALL_FINITE = "__all_gradients_finite"      # bool [1] output (mixed precision)
GLOBAL_NORM = "__global_gradient_norm"     # float [] output when computed here; fed under ZeRO-1
LAMB_DIRECTION_NORMS = "__lamb_direction_norms"  # float [weights], fed under ZeRO-1 with LAMB

MAX_IR_VERSION = 10  # onnxruntime 1.19.2 reads IR <= 10; onnx 1.23 writes 14 by default


@dataclass
class TrainingGraph:
    model: onnx.ModelProto
    outputs: list                  # described model outputs, in order
    weights: list                  # trainable weights (sorted): graph inputs, updated every step
    states: dict                   # every ping-pong tensor (weights included): name -> StateSpec
    accumulated: list = field(default_factory=list)  # weights with a gradient accumulation buffer
    uses_training_mode: bool = False
    mixed_precision: bool = False  # the graph decides finiteness (ALL_FINITE output, ping-pong states)
    partition: "Partition | None" = None  # set for the distributed form
    recompute: RecomputePlan | None = None  # applied when the session is created (engine/graph/recompute.py)
    low_precision: bool = False    # some forward ops compute in fp16/bf16 (engine/graph/precision.py)


@dataclass
class Partition:
    """The distributed form's apply run: `segments` None updates every weight whole (data parallel);
    {weight: distributed.Segment} updates only this rank's ZeRO-1 segments."""

    segments: dict | None = None


def accumulation_buffer(weight):
    return f"{weight}_grad.accumulation.buffer"


def accumulation_flag(weight):
    return f"{weight}_grad.accumulation.out"


def reduced_gradient(weight):
    """Distributed form: the gradient (sum over ranks) the apply run reads."""
    return f"{weight}_grad.reduced"


def weight_shard(weight):
    """ZeRO-1: this rank's flat segment of a weight (a view of the flat weight buffer)."""
    return f"{weight}.shard"


def prepare_forward(model: onnx.ModelProto):
    """Put loss and dropout nodes into the training form the gradient builder needs.

    SoftmaxCrossEntropyLoss gets its log_prob output, LayerNormalization its saved statistics, Dropout
    its mask output; every Dropout reads its
    training_mode from one graph input so eval can switch dropout off. Attributes are left as they are
    (`ignore_index`, `reduction` survive). Returns True when some Dropout now reads TRAINING_MODE.

    A Dropout whose ratio is the constant 0 becomes an Identity, as torch's dropout returns its input
    when p is 0: onnxruntime's would write a copy and an all-true mask that its gradient keeps until
    the backward pass (240 MB per attention layer at GPT-2 small, batch 4 × seq 1024).
    """
    graph = model.graph
    b = GraphBuilder(graph, prefix="prep_")
    uses_training_mode = False
    _dropout_of_zero_as_identity(graph)
    for node in graph.node:
        if node.op_type in ("SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossInternal") and len(node.output) < 2:
            node.output.append(b.fresh(f"{node.output[0]}_log_prob"))
        elif node.op_type == "LayerNormalization":
            # The gradient reuses the forward's saved mean and inverse std-dev (outputs 1 and 2).
            while len(node.output) < 3:
                node.output.append(b.fresh(f"{node.output[0]}_saved_{len(node.output)}"))
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            while len(node.output) < 2:
                node.output.append(b.fresh(f"{node.output[0]}_mask"))
            inputs = list(node.input) + [""] * (3 - len(node.input))
            if not inputs[1]:
                inputs[1] = b.const(0.5)  # ONNX default ratio
            inputs[2] = TRAINING_MODE
            del node.input[:]
            node.input.extend(inputs)
            uses_training_mode = True
    if uses_training_mode:
        b.add_input(TRAINING_MODE, TensorProto.BOOL, [])
    return uses_training_mode


def _dropout_of_zero_as_identity(graph):
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or len(node.input) < 2 \
                or not node.input[1] or (len(node.output) > 1 and node.output[1] in read):
            continue
        ratio = constant_value(graph, node.input[1])
        if ratio is not None and ratio.size == 1 and float(ratio) == 0.0:
            data, out = node.input[0], node.output[0]
            node.Clear()
            node.CopyFrom(helper.make_node("Identity", [data], [out], name=f"{out}_dropout_of_zero"))


def save_debug_graph(model: onnx.ModelProto, path):
    """Write a model for debugging (options.debug.graph_save_paths) when `path` is set; a path that
    cannot be written warns and training goes on, as the original's failed debug dumps did."""
    if not path:
        return
    try:
        onnx.save(model, path)
    except (OSError, ValueError) as exc:
        warnings.warn(f"Could not save the debug graph to {path!r} ({exc}); training continues without it.")


def _initializers_to_inputs(graph, names, values=None):
    """Move the given initializers to graph inputs; returns {name: initial numpy value} -- a copy of
    the initializer's data, or `values(name)` for a stub."""
    keep, initial = [], {}
    for init in graph.initializer:
        if init.name in names:
            initial[init.name] = _stub_value(init, values) if is_stub(init) else numpy_helper.to_array(init).copy()
            graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        elif is_stub(init):
            raise ValueError(f"initializer {init.name!r} has no data and is not a trained weight: a session "
                             "cannot run it (fill it before building the training graph)")
        else:
            keep.append(init)
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return initial


def _stub_value(init, values):
    value = values(init.name) if values is not None else None
    if value is None or tuple(value.shape) != tuple(init.dims) or \
            helper.np_dtype_to_tensor_dtype(value.dtype) != init.data_type:
        raise ValueError(f"weight {init.name!r} is a data-less stub {list(init.dims)} and no value of that "
                         f"shape and type was given ({None if value is None else (value.shape, value.dtype)})")
    return value


def trainable_weights(model: onnx.ModelProto, frozen=(), candidates=None):
    """Float32 initializers that some node reads, minus the frozen ones (sorted by name)."""
    used = {name for node in model.graph.node for name in node.input}
    names = []
    for init in model.graph.initializer:
        if init.data_type != TensorProto.FLOAT or init.name in frozen or init.name not in used:
            continue
        if candidates is not None and init.name not in candidates:
            continue
        names.append(init.name)
    return sorted(names)


def _build_gradient(model: onnx.ModelProto, loss: str, weights):
    import onnxruntime as ort
    from onnxruntime.capi._pybind_state import GradientGraphBuilder

    options = ort.SessionOptions()
    options.log_severity_level = 3  # its graph transformers log at INFO otherwise
    builder = GradientGraphBuilder(model.SerializeToString(), {loss}, set(weights), loss, options)
    try:
        builder.build()
    except RuntimeError as exc:
        missing = re.search(r"has not been registered: (\S+) for node (\S+)", str(exc))
        if missing:
            op, node = missing.groups()
            raise NotImplementedError(
                f"onnxruntime-training has no gradient for {op} (node {node}), so this model cannot be "
                f"trained here. Replace that layer (BatchNormalization: use LayerNorm or GroupNorm), or "
                f"freeze its weights and every weight before it (options.utils.frozen_weights).") from exc
        raise RuntimeError(f"Building the gradient graph failed: {exc}") from exc
    result = builder.get_model()
    return onnx.load_from_string(result) if isinstance(result, bytes) else result


def build_training_graph(forward: onnx.ModelProto, *, loss, outputs, weights, optim_config,
                         gradient_accumulation_steps=1, grad_norm_clip=True, mixed_precision=False,
                         gradient_graph_path=None, partition=None, recompute=RecomputeOptions(),
                         deterministic=False, input_gradients=(), sharded=frozenset(), values=None,
                         kernels=Kernels()):
    """The whole training step as one ModelProto (see the module docstring for its shape).

    `values(name)`: the initial value (a numpy array, used as it is: a view of the module's tensor is
    fine, it is never written) of a weight whose initializer in `forward` is a data-less stub
    (`is_stub`; the export leaves the module's parameters so). Every other initializer must hold data.

    `deterministic` (options.debug.deterministic_compute) replaces kernels whose results depend on
    thread timing by ones that do not (graph_rewrites.deterministic_gather_grad).

    `partition` (a `Partition`) builds the distributed form instead: gradients accumulate into
    buffers that torch.distributed reduces between runs, and the optimizer reads the reduced ones.

    `input_gradients`: graph inputs whose gradients `<x>_grad` become graph outputs (a pipeline stage
    sends them back to the stage before it).

    `sharded` (tensor parallel, engine/parallel/megatron.py): the weights this rank holds a shard of. Their
    square sums are summed over the horizontal group (in-graph PythonOps) for the global norm and
    LAMB's trust ratio; the replicated weights count once.

    `kernels` (engine/kernels/choice.py): which matrix products run on torch's kernels, and whether Adam
    runs as the kernel library's Adam (in place, skippable).
    """
    low_precision = has_low_precision_compute(forward)
    model, initial, uses_training_mode, forward_tensors = _forward_and_gradients(forward, loss, weights,
                                                                                 gradient_graph_path,
                                                                                 low_precision, deterministic,
                                                                                 input_gradients, values,
                                                                                 kernels)
    graph = model.graph
    b = GraphBuilder(graph, prefix="train_")
    if mixed_precision:
        _seed_backward_with_loss_scale(graph, b, loss)
    per_weight_hp = hyper_parameters(optim_config, weights)
    library_adam = optim_config.name == "AdamOptimizer" and kernel_choice.adam_on_library(kernels)
    clip = grad_norm_clip and optim_config.name in ("AdamOptimizer", "LambOptimizer")
    if partition is None:
        states, accumulated = _single_process_step(b, graph, initial, weights, outputs, optim_config.name,
                                                   per_weight_hp, gradient_accumulation_steps, clip,
                                                   mixed_precision, sharded, library_adam)
    else:
        states, accumulated = _distributed_step(b, initial, weights, optim_config.name, per_weight_hp, clip,
                                                partition, sharded, library_adam)
    segments = partition.segments if partition is not None else None
    for name, shape, elem_type in _updated_outputs(states, weights, segments):
        b.add_output(name, elem_type, shape)

    if not any(op.domain == MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    sort_topologically(graph)  # the rewrites append nodes that earlier nodes now read
    return TrainingGraph(model=model, outputs=list(outputs), weights=list(weights), states=states,
                         accumulated=accumulated, uses_training_mode=uses_training_mode,
                         mixed_precision=mixed_precision and partition is None, partition=partition,
                         recompute=RecomputePlan(recompute, frozenset(forward_tensors), loss, tuple(weights))
                         if recompute.enabled else None,
                         low_precision=low_precision)


def _forward_and_gradients(forward, loss, weights, gradient_graph_path, low_precision=False, deterministic=False,
                           input_gradients=(), values=None, kernels=Kernels()):
    """Forward in training form + `<w>_grad` for every weight (not graph outputs); weights become inputs.
    Returns (model, {weight: initial value}, uses_training_mode, names of the forward nodes' outputs)."""
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    uses_training_mode = prepare_forward(model)
    loss_in_fp32(model, loss)
    fuse_layer_norm(model)
    if low_precision:  # an autocast export (mixed_precision.compute_dtype)
        fence_low_precision_ops(model)
    sparse_masked_lm_head(model)
    cross_entropies = decompose_softmax_cross_entropy(model)
    initial = _initializers_to_inputs(model.graph, set(weights), values)
    small_embedding_as_matmul(model, {w: initial[w].shape for w in weights})
    tall_weight_product_as_gemm(model, {w: initial[w].shape for w in weights})

    forward_tensors = {name for node in model.graph.node for name in node.output if name}
    annotate_symbolic_shapes(model)  # so the builder reduces broadcast gradients only where it must
    model = _build_gradient(model, loss, list(weights) + list(input_gradients))
    python_op.mark_required_gradients(model)
    fuse_cross_entropy_gradient(model, cross_entropies)
    shapes = {w: initial[w].shape for w in weights}
    large_bias_gradient_as_matmul(model, shapes)
    gelu_gradient_in_torch(model)
    kernel_choice.apply(model, kernels)
    if deterministic:
        deterministic_gather_grad(model)
    save_debug_graph(model, gradient_graph_path)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    graph = model.graph
    grad_outputs = {f"{w}_grad" for w in weights}
    kept = [o for o in graph.output if o.name not in grad_outputs]
    del graph.output[:]
    graph.output.extend(kept)
    return model, initial, uses_training_mode, forward_tensors


def _single_process_step(b, graph, initial, weights, outputs, optim_name, per_weight_hp,
                         gradient_accumulation_steps, clip, mixed_precision, sharded=frozenset(),
                         library_adam=False):
    """Accumulate, scale, clip and update in the same run as forward and backward.

    Mixed precision discards a non-finite step after it ran: its states are then updated into second
    buffers (kept only when the step was finite), except with the library's Adam, which reads the
    step's finiteness and skips the update itself, so every state is updated in place."""
    in_place = not mixed_precision or library_adam
    states = {w: StateSpec(w, initial[w], in_place=in_place) for w in weights}
    states.update(_add_optimizer_state(b, optim_name, initial, in_place))

    grads = {w: f"{w}_grad" for w in weights}
    accumulated = []
    if gradient_accumulation_steps > 1:
        accumulated = _accumulate(b, initial, weights)
        # The optimizer step adds its own micro-batch to what the window accumulated.
        grads = {w: b.op("Add", [accumulation_buffer(w), g]) for w, g in grads.items()}
    if gradient_accumulation_steps > 1 or mixed_precision:
        scale = b.add_input(GRADIENT_SCALE, TensorProto.FLOAT, [])
        grads = {w: b.op("Mul", [g, scale]) for w, g in grads.items()}

    if weights and (clip or mixed_precision):
        if sharded:
            norm = _tensor_parallel_norm(b, grads, sharded)
        else:
            norm = b.op("ReduceAllL2", list(grads.values()), domain=MS_DOMAIN, outputs=[GLOBAL_NORM])
        b.add_output(norm, TensorProto.FLOAT, [])
        if mixed_precision:
            finite = b.op("Not", [b.op("Or", [b.op("IsInf", [norm]), b.op("IsNaN", [norm])])])
            b.op("Reshape", [finite, b.const([1], np.int64)], outputs=[ALL_FINITE])
            b.add_output(ALL_FINITE, TensorProto.BOOL, [1])
        if clip:
            grads = _clip_by_global_norm(b, grads, norm, per_weight_hp)

    lr = LEARNING_RATE
    if in_place and weights:
        output_types = {o.name: o.type.tensor_type.elem_type for o in graph.output}
        readers = {g: TensorProto.FLOAT for g in grads.values()}
        readers.update({name: output_types[name] for name in outputs})
        lr = _after_every_reader(b, lr, readers)
    targets = None
    if sharded:
        from orttrainer.engine.parallel.megatron import all_reduce_sum

        targets = {w: Target(w, w, group_sum=all_reduce_sum if w in sharded else None) for w in weights}
    adam = AdamKernel(library_adam, ALL_FINITE if mixed_precision and weights else "")
    build_optimizer(b, optim_name, lr, grads, per_weight_hp, targets, adam)
    b.add_input(LEARNING_RATE, TensorProto.FLOAT, [1])
    return states, accumulated


def _tensor_parallel_norm(b, grads, sharded):
    """‖g‖ over the whole model: replicated gradients (equal on every horizontal rank) once, plus the
    shards' square sums summed over the horizontal group."""
    from orttrainer.engine.parallel.megatron import all_reduce_sum

    def square_sum(names):
        if not names:
            return b.const(0.0)
        norm = b.op("ReduceAllL2", names, domain=MS_DOMAIN)
        # Typed here: inference cannot type it when its first gradient comes from a PythonOpGrad.
        b.graph.value_info.append(helper.make_tensor_value_info(norm, TensorProto.FLOAT, []))
        return b.op("Mul", [norm, norm])

    replicated = square_sum([g for w, g in grads.items() if w not in sharded])
    shards = all_reduce_sum(b, square_sum([g for w, g in grads.items() if w in sharded]))
    return b.op("Sqrt", [b.op("Add", [replicated, shards])], outputs=[GLOBAL_NORM])


def _distributed_step(b, initial, weights, optim_name, per_weight_hp, clip, partition, sharded=frozenset(),
                      library_adam=False):
    """Micro runs accumulate every gradient into its buffer (a view of the flat buffer that
    torch.distributed reduces); the apply run reads the reduced gradients and runs only the update.

    Data parallel: every weight is updated whole from `<w>_grad.reduced`, the global norm computed
    here as in one process. ZeRO-1: this rank updates only its segments (`<w>.shard`, a view of the
    flat weight buffer that torch all-gathers afterwards); the global norm (over every rank's
    segments) and, for LAMB, each weight's direction norm are fed. Every state is updated in place:
    the apply run executes no forward or backward node (nothing else reads a weight), and a
    non-finite step is skipped before the apply run instead of discarded after it.

    Tensor parallel (`sharded`): the norms of the shards are summed over the horizontal group, in the
    graph (data parallel) or in torch (ZeRO-1, DistributedRuntime._apply).
    """
    accumulated = _accumulate(b, initial, weights)
    segments = partition.segments
    if segments is None:
        updated = {w: initial[w] for w in weights}
        targets = {w: Target.whole(w) for w in weights}
        if sharded:
            from orttrainer.engine.parallel.megatron import all_reduce_sum

            targets = {w: Target(w, w, group_sum=all_reduce_sum if w in sharded else None) for w in weights}
    else:
        updated = {w: np.zeros([segments[w].size], np.float32) for w in weights if w in segments}
        norms = None
        if optim_name == "LambOptimizer":
            norms = b.add_input(LAMB_DIRECTION_NORMS, TensorProto.FLOAT, [len(weights)])
        targets = {}
        for w in updated:
            b.add_input(weight_shard(w), TensorProto.FLOAT, [segments[w].size])
            direction_norm = None
            if norms:
                direction_norm = b.op("Gather", [norms, b.const(weights.index(w), np.int64)], axis=0)
            group_sum = None
            if w in sharded:
                from orttrainer.engine.parallel.megatron import all_reduce_sum as group_sum
            targets[w] = Target(w, weight_shard(w), direction_norm, group_sum)
    states = {w: StateSpec(w, initial[w], in_place=True) for w in weights}
    states.update(_add_optimizer_state(b, optim_name, updated, in_place=True))

    scale = b.add_input(GRADIENT_SCALE, TensorProto.FLOAT, [])
    grads = {w: b.op("Mul", [b.add_input(reduced_gradient(w), TensorProto.FLOAT, list(value.shape)), scale])
             for w, value in updated.items()}
    if clip and weights:
        if segments is None:
            norm = _tensor_parallel_norm(b, grads, sharded) if sharded else \
                b.op("ReduceAllL2", list(grads.values()), domain=MS_DOMAIN, outputs=[GLOBAL_NORM])
            b.add_output(norm, TensorProto.FLOAT, [])
        else:
            norm = b.add_input(GLOBAL_NORM, TensorProto.FLOAT, [])
        grads = _clip_by_global_norm(b, grads, norm, per_weight_hp)
    b.add_input(LEARNING_RATE, TensorProto.FLOAT, [1])
    build_optimizer(b, optim_name, LEARNING_RATE, grads, per_weight_hp, targets, AdamKernel(library_adam))
    for target in targets.values():
        if target.direction_norm is not None:  # fetched by the run before the apply run
            b.add_output(direction_square_sum(target.weight), TensorProto.FLOAT, [])
    return states, accumulated


def _add_optimizer_state(b, optim_name, values, in_place):
    """Graph inputs for the optimizer state of `values` ({weight: array of the updated tensor})."""
    specs = optimizer_state(optim_name, values, in_place_moments=in_place)
    for spec in specs.values():
        b.add_input(spec.name, helper.np_dtype_to_tensor_dtype(spec.initial.dtype), list(spec.initial.shape))
    return specs


def _accumulate(b, initial, weights):
    """InPlaceAccumulatorV2 of every `<w>_grad` into its buffer (overwritten when LAZY_RESET is set)."""
    b.add_input(LAZY_RESET, TensorProto.BOOL, [1])
    for w in weights:
        buffer = b.add_input(accumulation_buffer(w), TensorProto.FLOAT, list(initial[w].shape))
        flag = b.op("InPlaceAccumulatorV2", [buffer, f"{w}_grad", LAZY_RESET], domain=MS_DOMAIN,
                    outputs=[accumulation_flag(w)])
        b.add_output(flag, TensorProto.BOOL, [1])
    return list(weights)


def _updated_outputs(states, weights, segments):
    """(output name, shape, element type) of every state's next value."""
    for spec in states.values():
        elem_type = helper.np_dtype_to_tensor_dtype(spec.initial.dtype)
        if segments is not None and spec.name in weights:
            if spec.name in segments:
                yield updated_name(weight_shard(spec.name)), [segments[spec.name].size], elem_type
            continue  # a weight outside this rank's chunk: all-gathered, not updated here
        yield spec.updated, list(spec.initial.shape), elem_type


def _after_every_reader(b, lr, tensors):
    """The learning rate, made to depend on `tensors` ({name: element type}: every final gradient and
    model output).

    Weights are updated in place, so no node may read a weight after its update ran. Every node that
    reads a weight is an ancestor of some gradient or model output (other nodes never run: the
    session executes only the path to the fetched outputs), and every update reads the learning rate.
    Routing the learning rate through all of them orders the updates last. The dependency must be on
    data (onnxruntime folds `Shape` of a static shape into a constant): one element of each tensor,
    into `Where(c, lr, lr)`, which is lr whatever the elements are (NaN included).
    """
    flat, first, last = b.const([-1], np.int64), b.const([0], np.int64), b.const([1], np.int64)
    elements = []
    for t, elem_type in tensors.items():
        element = b.op("Slice", [b.op("Reshape", [t, flat]), first, last])
        elements.append(element if elem_type == TensorProto.FLOAT else b.op("Cast", [element], to=TensorProto.FLOAT))
    probe = b.op("ReduceMax", [b.op("Concat", elements + [b.const([0.0])], axis=0)], keepdims=1)
    return b.op("Where", [b.op("IsNaN", [probe]), lr, lr])


def _clip_by_global_norm(b, grads, norm, per_weight_hp):
    """g ← g · min(1, max_norm / ‖g‖) with the global norm over all gradients (legacy max_norm_clip).

    A zero norm gives max_norm/0 = inf, and min(1, inf) = 1: no clipping, no NaN.
    """
    factors = {}
    clipped = {}
    for w, g in grads.items():
        max_norm = float(per_weight_hp[w]["max_norm_clip"])
        if max_norm not in factors:
            factors[max_norm] = b.op("Min", [b.const(1.0), b.op("Div", [b.const(max_norm), norm])])
        clipped[w] = b.op("Mul", [g, factors[max_norm]])
    return clipped


def _seed_backward_with_loss_scale(graph, b, loss):
    """Replace the constant d(loss)/d(loss) = 1 by the fed loss scale: gradients come out scaled."""
    seed_name = f"{loss}_grad"
    seeds = [init for init in graph.initializer if init.name == seed_name]
    if not seeds:
        raise RuntimeError(f"Gradient graph has no seed initializer {seed_name!r}; cannot apply loss scaling.")
    seed = seeds[0]
    graph.initializer.remove(seed)
    b.add_input(LOSS_SCALE, TensorProto.FLOAT, [])
    b.op("Reshape", [LOSS_SCALE, b.const(list(seed.dims), np.int64)], outputs=[seed_name])
