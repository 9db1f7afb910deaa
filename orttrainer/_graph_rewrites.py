"""Rewrites of the forward graph that make the *training* graph faster on onnxruntime.

They are applied to the copy that becomes the training graph only: the forward model that
`save_as_onnx` writes keeps the exporter's standard ops. Each rewrite computes the same values;
bench/loss_kernels.py and docs/ort-notes.md hold the measurements behind them.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ._graph_builder import GraphBuilder


def _opset(model):
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _constant_value(graph, name):
    """The value of `name` if a Constant node or an initializer defines it, else None."""
    for init in graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
                if attr.name in ("value_float", "value_int"):
                    return np.asarray(helper.get_attribute_value(attr))
    return None


def fuse_layer_norm(model: onnx.ModelProto):
    """The exporter's opset < 17 LayerNorm pattern -> one LayerNormalization node.

        ReduceMean(x) → Sub → Pow(2) → ReduceMean → Add(ε) → Sqrt → Div → Mul(γ) → Add(β)

    The decomposed form differentiates into a dozen elementwise and Pow kernels per LayerNorm
    (Pow alone was ~5% of a GPT step); LayerNormalization has fused forward and gradient kernels
    in onnxruntime (registered for the ONNX domain from version 1). Normalisation over the last axis
    with an affine γ/β only; any other shape of the pattern is left alone.
    """
    graph = model.graph
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}

    def only_consumer(name, op_type):
        users = consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == op_type and name not in graph_outputs:
            return users[0]
        return None

    def last_axis_mean(node):
        axes = [helper.get_attribute_value(a) for a in node.attribute if a.name == "axes"]
        return node.op_type == "ReduceMean" and len(node.input) == 1 and axes == [[-1]]

    b = GraphBuilder(graph, prefix="ln_")
    fused, removed = {}, set()
    for mean in graph.node:
        if not last_axis_mean(mean):
            continue
        x = mean.input[0]
        sub = only_consumer(mean.output[0], "Sub")
        if sub is None or list(sub.input) != [x, mean.output[0]]:
            continue
        sub_users = consumers.get(sub.output[0], [])
        pow_node = next((n for n in sub_users if n.op_type == "Pow"), None)
        div = next((n for n in sub_users if n.op_type == "Div"), None)
        if len(sub_users) != 2 or pow_node is None or div is None or div.input[0] != sub.output[0]:
            continue
        exponent = _constant_value(graph, pow_node.input[1])
        if exponent is None or exponent.size != 1 or float(exponent) != 2.0:
            continue
        var = only_consumer(pow_node.output[0], "ReduceMean")
        if var is None or not last_axis_mean(var):
            continue
        add_eps = only_consumer(var.output[0], "Add")
        eps = _constant_value(graph, add_eps.input[1]) if add_eps is not None else None
        if eps is None or eps.size != 1:
            continue
        sqrt = only_consumer(add_eps.output[0], "Sqrt")
        if sqrt is None or only_consumer(sqrt.output[0], "Div") is not div:
            continue
        mul = only_consumer(div.output[0], "Mul")
        add = only_consumer(mul.output[0], "Add") if mul is not None else None
        if add is None or mul.input[0] != div.output[0] or add.input[0] != mul.output[0]:
            continue
        gamma, beta = mul.input[1], add.input[1]
        node = helper.make_node(
            "LayerNormalization", [x, gamma, beta],
            [add.output[0], b.fresh(f"{add.output[0]}_mean"), b.fresh(f"{add.output[0]}_inv_std")],
            name=b.fresh("LayerNormalization_fused"), axis=-1, epsilon=float(eps))
        fused[id(mean)] = node
        removed.update(id(n) for n in (sub, pow_node, var, add_eps, sqrt, div, mul, add))
    if not fused:
        return
    nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(nodes)


def decompose_softmax_cross_entropy(model: onnx.ModelProto):
    """SoftmaxCrossEntropyLoss -> log-sum-exp written with elementwise ops (same value, faster).

    onnxruntime's CPU SoftmaxCrossEntropyLoss kernel is slow, and so is LogSoftmaxGrad; the loss
    head dominated small language-model steps. Per row:

        m = float(int(max(x)))          # an integer shift: stable, and no gradient flows through it
        log_prob[y] = (x − m)[y] − log Σ exp(x − m)

    differentiates into Exp/Mul/Sum kernels. Honours `reduction` (mean/sum/none), `ignore_index` and
    the optional class-weight input; the log_prob output is computed only if something reads it.
    Needs opset >= 13 (ReduceSum with an axes input); older graphs are left as they are.
    """
    opset = _opset(model)
    if opset < 13:
        return
    graph = model.graph
    consumed = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    b = GraphBuilder(graph, prefix="sce_")
    rewritten = []
    for node in list(graph.node):
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
            rewritten.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        reduction = attrs.get("reduction", b"mean")
        reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
        scores, labels = node.input[0], node.input[1]
        class_weight = node.input[2] if len(node.input) > 2 and node.input[2] else None
        before = len(graph.node)
        class_axis = b.const([1], np.int64)
        row_max = (b.op("ReduceMax", [scores, class_axis], keepdims=1) if opset >= 18
                   else b.op("ReduceMax", [scores], axes=[1], keepdims=1))
        shift = b.op("Cast", [b.op("Cast", [row_max], to=TensorProto.INT64)], to=TensorProto.FLOAT)
        shifted = b.op("Sub", [scores, shift])
        log_sum = b.op("Log", [b.op("ReduceSum", [b.op("Exp", [shifted]), class_axis], keepdims=1)])
        if len(node.output) > 1 and node.output[1] in consumed:
            b.op("Sub", [shifted, log_sum], outputs=[node.output[1]])
        if "ignore_index" in attrs:
            keep = b.op("Not", [b.op("Equal", [labels, b.const(attrs["ignore_index"], np.int64)])])
            safe_labels = b.op("Where", [keep, labels, b.const(0, np.int64)])
        else:
            keep, safe_labels = None, labels
        picked = b.op("GatherElements", [shifted, b.op("Unsqueeze", [safe_labels, class_axis])], axis=1)
        picked = b.op("Squeeze", [b.op("Sub", [picked, log_sum]), class_axis])
        weight = b.op("Gather", [class_weight, safe_labels]) if class_weight else None
        if keep is not None:
            mask = b.op("Cast", [keep], to=TensorProto.FLOAT)
            weight = b.op("Mul", [weight, mask]) if weight else mask
        per_item = b.op("Neg", [b.op("Mul", [picked, weight]) if weight else picked])
        if reduction == "none":
            b.op("Identity", [per_item], outputs=[node.output[0]])
        elif reduction == "sum":
            b.op("ReduceSum", [per_item], keepdims=0, outputs=[node.output[0]])
        else:  # mean: over the (weighted) items that count, as ONNX defines it
            total = b.op("ReduceSum", [per_item], keepdims=0)
            count = b.op("ReduceSum", [weight], keepdims=0) if weight else \
                b.op("Cast", [b.op("Size", [labels])], to=TensorProto.FLOAT)
            b.op("Div", [total, count], outputs=[node.output[0]])
        rewritten.extend(graph.node[before:])
    del graph.node[:]
    graph.node.extend(rewritten)
