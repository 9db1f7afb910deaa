"""Masked-LM head on the labelled rows only ("sparse predictions").

In masked-LM pretraining ~15% of the positions carry a label; the others hold `ignore_index` and add
neither loss nor gradient. When the vocabulary logits feed nothing but such a loss, the unlabelled
rows can be dropped before the vocabulary projection: the same loss (the mean over labelled rows)
and the same gradients (an ignored row's logit gradient is exactly 0), with the decoder's matmuls
and the loss head run on [K, vocab] instead of [rows, vocab].

Matched pattern (forward graph, before `decompose_softmax_cross_entropy`):

    h ─ MatMul(h, W) ─ [row-wise ops] ─ Reshape(·, [-1, C]) ─ [Cast] ─ SoftmaxCrossEntropyLoss(·, y)
                                                                     ignore_index set, reduction mean

    W       a 2-D weight of known shape [H, C]: an initializer seen through Casts and Transposes
            (perm [1, 0]: a decoder tied to the word embeddings; Casts: an autocast export)
    row-wise Add/Sub/Mul/Div with a (maybe cast) constant or initializer of shape [], [1] or [C]
            (the decoder bias), Cast
    y       the loss's [N] labels, of a known int64 type

and every tensor from the MatMul's output to the loss's scores has one reader and is no graph
output. Rewritten as

    labelled = Reshape(NonZero(y != ignore_index), [-1])                 # [K]
    rows = Concat(labelled, [0])                                          # + one ignored row
    MatMul(Gather(Reshape(h, [-1, H]), rows), W) ─ [row-wise ops] ─
        SoftmaxCrossEntropyLoss(·, Concat(Gather(y, labelled), [ignore_index]))

The extra row (row 0 again, labelled ignore_index) contributes exactly 0 and keeps the decoder's
row count above 0: with no labelled row the loss is 0/0 = NaN, as without the rewrite (and in torch).

Anything else (logits described as a model output, other readers, no ignore_index, another
reduction, class weights, a read log_prob output, unknown shapes) leaves the graph as it is: nothing
is wrong then, it is only slower.
"""

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from orttrainer.engine.graph.builder import GraphBuilder, sort_topologically
from orttrainer.engine.graph.rewrites import constant_value, _opset

ROW_WISE_BINARY = ("Add", "Sub", "Mul", "Div")


def sparse_masked_lm_head(model: onnx.ModelProto):
    """Apply the rewrite to every matching loss; returns the number of losses rewritten."""
    if _opset(model) < 13:
        # The loss must then stay an onnxruntime SoftmaxCrossEntropyLoss kernel (no decomposition),
        # which fails on zero rows (K = 0).
        return 0
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output if out}
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}

    def only_reader(name):
        users = readers.get(name, [])
        return users[0] if len(users) == 1 and name not in outputs else None

    b = GraphBuilder(graph, prefix="sparse_mlm_")
    rewritten = 0
    for loss in [n for n in graph.node if n.op_type == "SoftmaxCrossEntropyLoss"]:
        match = _match(graph, loss, producers, only_reader, outputs)
        if match is None:
            continue
        matmul, hidden_size, ignore_index = match.matmul, match.hidden_size, match.ignore_index
        reshape, reader, chain, classes = match.reshape, match.reader, match.chain, match.classes
        labels = loss.input[1]
        keep = b.op("Not", [b.op("Equal", [labels, b.const(ignore_index, np.int64)])])
        labelled = b.op("Reshape", [b.op("NonZero", [keep]), b.const([-1], np.int64)])
        # One more row, row 0 with the ignored label: it adds exactly 0 to the loss and to every
        # gradient, and keeps K >= 1 (onnxruntime's Gemm rejects the weight gradient's inner size 0).
        rows = b.op("Concat", [labelled, b.const([0], np.int64)], axis=0)
        hidden = b.op("Reshape", [matmul.input[0], b.const([-1, hidden_size], np.int64)])
        hidden_type = list(chain.values())[-1]  # the MatMul's output type: its inputs share it
        matmul.input[0] = b.op("Gather", [hidden, rows], axis=0)
        loss.input[1] = b.op("Concat", [b.op("Gather", [labels, labelled], axis=0),
                                        b.const([ignore_index], np.int64)], axis=0)
        # The chain's output is already [K, C]; the Reshape to [-1, C] would have to infer -1 from
        # zero elements when K = 0, so the loss reads the chain directly.
        reader.input[0] = reshape.input[0]
        graph.node.remove(reshape)
        # The exporter's [batch, seq, C] shapes of the chain are stale now, and the gradient builder
        # derives the bias gradient's reduction axes from them: record [K, C].
        stale = set(chain) | {reshape.output[0]}
        kept = [v for v in graph.value_info if v.name not in stale]
        del graph.value_info[:]
        graph.value_info.extend(kept)
        rows_dim = b.fresh("labelled_rows")
        for name, elem_type in chain.items():
            graph.value_info.append(helper.make_tensor_value_info(name, elem_type, [rows_dim, classes]))
        # Named [K, H]: with the rank known the gradient builder writes MatMul's input gradient
        # without a broadcast reduction (which fails at K = 0).
        graph.value_info.append(helper.make_tensor_value_info(matmul.input[0], hidden_type, [rows_dim, hidden_size]))
        rewritten += 1
    if rewritten:
        sort_topologically(graph)  # the new nodes were appended after their readers
    return rewritten


def _match(graph, loss, producers, only_reader, outputs):
    """The `_Match` of `loss` when it has the documented pattern; else None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in loss.attribute}
    reduction = attrs.get("reduction", b"mean")
    if loss.domain not in ("", "ai.onnx") or "ignore_index" not in attrs or reduction not in (b"mean", "mean"):
        return None
    if len(loss.input) > 2 and loss.input[2]:
        return None  # class weights
    log_prob = loss.output[1] if len(loss.output) > 1 else ""
    if log_prob and (log_prob in outputs or any(log_prob in node.input for node in graph.node)):
        return None  # the [N, C] log_prob is read (prepare_forward adds it unread, for the gradient builder)
    if _elem_type(graph, loss.input[1], producers) != TensorProto.INT64:
        return None
    scores_cast = producers.get(loss.input[0])  # an autocast export casts the scores back to fp32
    if scores_cast is None or scores_cast.op_type != "Cast" or only_reader(loss.input[0]) is not loss:
        scores_cast = None
    reshape = producers.get(scores_cast.input[0] if scores_cast else loss.input[0])
    if reshape is None or reshape.op_type != "Reshape" or only_reader(reshape.output[0]) is not (scores_cast or loss):
        return None
    target = constant_value(graph, reshape.input[1])
    if target is None or target.shape != (2,) or int(target[0]) != -1 or int(target[1]) <= 0:
        return None
    classes = int(target[1])
    # Walk back over row-wise ops to the decoder MatMul; each link must be read by the next only.
    name = reshape.input[0]
    chain = {}  # tensor -> element type, from the scores back to the MatMul's output
    while True:
        node = producers.get(name)
        if node is None or only_reader(name) is None:
            return None
        if node.op_type == "MatMul":
            chain[name] = None
            break
        if node.op_type == "Cast":
            chain[name] = helper.get_attribute_value(next(a for a in node.attribute if a.name == "to"))
            name = node.input[0]
            continue
        if node.op_type not in ROW_WISE_BINARY or len(node.input) != 2:
            return None
        # Sub and Div are row-wise only with the row tensor first.
        sides = [0, 1] if node.op_type in ("Add", "Mul") else [0]
        side = next((i for i in sides if _small_constant(graph, node.input[1 - i], classes, producers)), None)
        if side is None:
            return None
        chain[name] = None
        name = node.input[side]
    weight = _weight(graph, node.input[1], producers)
    if weight is None or len(weight.dims) != 2 or weight.dims[1] != classes:
        return None
    # Element types: a Cast sets its own, the others keep their input's (the weight's at the MatMul).
    current = weight.data_type
    for tensor in reversed(list(chain)):
        current = chain[tensor] or current
        chain[tensor] = current
    return _Match(node, weight.dims[0], int(attrs["ignore_index"]), reshape, scores_cast or loss, chain, classes)


def _small_constant(graph, name, classes, producers):
    """A constant or initializer (maybe cast) that broadcasts along rows: a scalar, [1] or [classes].
    An initializer's dims decide (a trained weight's may be a data-less stub)."""
    while name in producers and producers[name].op_type == "Cast":
        name = producers[name].input[0]
    init = next((i for i in graph.initializer if i.name == name), None)
    if init is not None:
        shape = list(init.dims)
    else:
        value = constant_value(graph, name)
        shape = None if value is None else list(value.shape)
    return shape is not None and len(shape) <= 1 and math.prod(shape) in (1, classes)


@dataclass(frozen=True)
class _Match:
    matmul: onnx.NodeProto  # the decoder MatMul(h, W)
    hidden_size: int  # H: W's rows
    ignore_index: int
    reshape: onnx.NodeProto  # the scores' Reshape(·, [-1, C]), removed by the rewrite
    reader: onnx.NodeProto  # what reads the Reshape's output: the loss, or the autocast's Cast before it
    chain: dict  # tensor -> element type, from the scores back to the MatMul's output
    classes: int  # C


@dataclass(frozen=True)
class _Weight:
    dims: list
    data_type: int


def _weight(graph, name, producers):
    """Shape and type of an initializer seen through Casts and 2-D Transposes; else None."""
    inits = {i.name: i for i in graph.initializer}
    data_type, transposed = None, False
    while name not in inits:
        node = producers.get(name)
        if node is None or node.op_type not in ("Cast", "Transpose"):
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Cast":
            data_type = data_type or attrs["to"]
        elif list(attrs.get("perm", [1, 0])) == [1, 0]:
            transposed = not transposed
        else:
            return None
        name = node.input[0]
    dims = list(inits[name].dims)
    if len(dims) != 2:
        return None
    return _Weight(dims[::-1] if transposed else dims, data_type or inits[name].data_type)


def _elem_type(graph, name, producers):
    """Element type of `name`, followed back through shape-only ops to a typed input or a Cast."""
    typed = {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.value_info)}
    while True:
        if name in typed:
            return typed[name]
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type == "Cast":
            return next(helper.get_attribute_value(a) for a in node.attribute if a.name == "to")
        if node.op_type not in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"):
            return None
        name = node.input[0]
