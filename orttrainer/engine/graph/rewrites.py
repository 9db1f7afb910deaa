"""Rewrites of the forward graph that make the *training* graph faster on onnxruntime.

They are applied to the copy that becomes the training graph only: the forward model that
`save_as_onnx` writes keeps the exporter's standard ops. Each rewrite computes the same values;
docs/notes/optimisation-log.md and docs/ort-notes.md hold the measurements behind them.
"""

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from orttrainer.engine.graph.builder import GraphBuilder


def _opset(model):
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def is_stub(init: TensorProto):
    """Whether an initializer is a data-less stand-in (dims and type only) for a value held elsewhere."""
    if init.HasField("raw_data") or init.data_location == TensorProto.EXTERNAL or math.prod(init.dims) == 0:
        return False
    return not (init.float_data or init.int32_data or init.int64_data or init.double_data
                or init.uint64_data or init.string_data)


def constant_value(graph, name):
    """The value of `name` if a Constant node or an initializer with data defines it, else None."""
    for init in graph.initializer:
        if init.name == name:
            return None if is_stub(init) else numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
                if attr.name in ("value_float", "value_int"):
                    return np.asarray(helper.get_attribute_value(attr))
    return None


def _replace_nodes(graph, prefix, replace):
    """Rewrite node by node: `replace(b, node)` appends the replacement nodes through the builder `b`
    and returns True, or returns False to keep the node. Replacements take the node's place."""
    b = GraphBuilder(graph, prefix=prefix)
    rewritten = []
    for node in list(graph.node):  # b.op appends to graph.node
        before = len(graph.node)
        if replace(b, node):
            rewritten.extend(graph.node[before:])
        else:
            rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)


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
        exponent = constant_value(graph, pow_node.input[1])
        if exponent is None or exponent.size != 1 or float(exponent) != 2.0:
            continue
        var = only_consumer(pow_node.output[0], "ReduceMean")
        if var is None or not last_axis_mean(var):
            continue
        add_eps = only_consumer(var.output[0], "Add")
        eps = constant_value(graph, add_eps.input[1]) if add_eps is not None else None
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


@dataclass(frozen=True)
class CrossEntropyTensors:
    """Names inside one decomposed cross-entropy that `fuse_cross_entropy_gradient` rewires."""

    scores: str          # x, [N, C]
    shifted: str         # s = x − m
    exp: str             # e = exp(s)
    exp_sum: str         # Σ_c e, [N, 1]
    labels: str          # safe labels, [N, 1]
    log_prob: str        # s[y] − log Σ e, [N, 1]


def decompose_softmax_cross_entropy(model: onnx.ModelProto):
    """SoftmaxCrossEntropyLoss -> log-sum-exp written with elementwise ops (same value, faster).

    onnxruntime's CPU SoftmaxCrossEntropyLoss kernel is slow, and so is LogSoftmaxGrad; the loss
    head dominated small language-model steps. Per row:

        m = float(int(max(x)))          # an integer shift: stable, and no gradient flows through it
        log_prob[y] = (x − m)[y] − log Σ exp(x − m)

    differentiates into Exp/Mul/Sum kernels. Honours `reduction` (mean/sum/none), `ignore_index` and
    the optional class-weight input; the log_prob output is computed only if something reads it.
    Needs opset >= 13 (ReduceSum with an axes input); older graphs are left as they are.

    Returns the tensors of each loss whose gradient `fuse_cross_entropy_gradient` may fuse (those
    whose log_prob output nobody reads).
    """
    opset = _opset(model)
    if opset < 13:
        return []
    graph = model.graph
    consumed = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    fusable = []

    def decompose(b, node):
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
            return False
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        reduction = attrs.get("reduction", b"mean")
        reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
        scores, labels = node.input[0], node.input[1]
        class_weight = node.input[2] if len(node.input) > 2 and node.input[2] else None
        class_axis = b.const([1], np.int64)
        row_max = (b.op("ReduceMax", [scores, class_axis], keepdims=1) if opset >= 18
                   else b.op("ReduceMax", [scores], axes=[1], keepdims=1))
        shift = b.op("Cast", [b.op("Cast", [row_max], to=TensorProto.INT64)], to=TensorProto.FLOAT)
        shifted = b.op("Sub", [scores, shift])
        exp = b.op("Exp", [shifted])
        exp_sum = b.op("ReduceSum", [exp, class_axis], keepdims=1)
        log_sum = b.op("Log", [exp_sum])
        log_prob_read = len(node.output) > 1 and node.output[1] in consumed
        if log_prob_read:
            b.op("Sub", [shifted, log_sum], outputs=[node.output[1]])
        if "ignore_index" in attrs:
            keep = b.op("Not", [b.op("Equal", [labels, b.const(attrs["ignore_index"], np.int64)])])
            safe_labels = b.op("Where", [keep, labels, b.const(0, np.int64)])
        else:
            keep, safe_labels = None, labels
        labels_2d = b.op("Unsqueeze", [safe_labels, class_axis])
        log_prob = b.op("Sub", [b.op("GatherElements", [shifted, labels_2d], axis=1), log_sum])
        picked = b.op("Squeeze", [log_prob, class_axis])
        if not log_prob_read:
            fusable.append(CrossEntropyTensors(scores, shifted, exp, exp_sum, labels_2d, log_prob))
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
        return True

    _replace_nodes(graph, "sce_", decompose)
    return fusable


def fuse_cross_entropy_gradient(model: onnx.ModelProto, losses):
    """Replace the autodiff gradient of each decomposed cross-entropy by its closed form.

    With d = ∂L/∂log_prob (one value per row), ∂L/∂s = d · (onehot(y) − e / Σe). The gradient builder
    writes this as Expand + Mul (exp path), GatherElementsGrad (label path), their Sum and a ReduceSum
    copy for x − m: five passes over [N, C] with a buffer each. Here: one broadcast Mul, then the
    label entries patched by ScatterElements, which onnxruntime runs in the Mul's buffer. Same values,
    to rounding.

    `losses` comes from `decompose_softmax_cross_entropy` on the forward graph; a loss whose tensors
    the gradient graph does not have (e.g. no gradient reached it) is left alone.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    b = GraphBuilder(graph, prefix="sce_fused_")
    renames = {}
    for t in losses:
        shifted_grad, log_prob_grad = f"{t.shifted}_grad", f"{t.log_prob}_grad"
        if shifted_grad not in producers or log_prob_grad not in producers:
            continue
        # p = e · (−d / Σe); then p[y] += d
        p = b.op("Mul", [t.exp, b.op("Neg", [b.op("Div", [log_prob_grad, t.exp_sum])])])
        at_label = b.op("Add", [b.op("GatherElements", [p, t.labels], axis=1), log_prob_grad])
        fused = b.op("ScatterElements", [p, t.labels, at_label], axis=1)
        # onnxruntime writes the scatter into p's buffer only if it can prove both have one shape;
        # after the Reshape to [N, C] the row count is unknown, so name the dims.
        dims = [b.fresh("rows"), b.fresh("classes")]
        for name in (p, fused):
            graph.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
        renames[shifted_grad] = fused
        # x's gradient is s's gradient passed through a no-op ReduceSum + Reshape (x and s have the
        # same shape): when that is the only path, read the fused tensor directly.
        scores_grad = producers.get(f"{t.scores}_grad")
        if scores_grad is not None and scores_grad.op_type == "Reshape":
            reduce = producers.get(scores_grad.input[0])
            if reduce is not None and reduce.op_type == "ReduceSum" and reduce.input[0] == shifted_grad:
                renames[f"{t.scores}_grad"] = fused
    if not renames:
        return
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    remove_dead_nodes(graph)


def remove_dead_nodes(graph: onnx.GraphProto):
    """Drop nodes no graph output depends on (keeps the order of the others)."""
    producers = {out: node for node in graph.node for out in node.output if out}
    live, stack = set(), [o.name for o in graph.output]
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in live:
            continue
        live.add(id(node))
        stack.extend(name for name in node.input if name)
    kept = [n for n in graph.node if id(n) in live]
    del graph.node[:]
    graph.node.extend(kept)


def tall_weight_product_as_gemm(model: onnx.ModelProto, weight_shapes, min_rows=16384):
    """`MatMul(x, Transpose(W))` of a tall trainable W ([vocab, hidden]: a tied LM head) as
    `Gemm(x, W, transB=1)`, x flattened to 2-D and the product given x's leading dims back.

    The exporter writes a tied head as a Transpose of the embedding table and a MatMul. onnxruntime
    folds such Transposes into the product for the layers' weights, but BERT-base's head (its bias
    add made the product a Gemm with the Transpose still feeding it) wrote the transposed table
    ([hidden, vocab], 89 MB) every step, right before the product, where the step's live memory
    peaks (`bench/liveness.py`). Gemm reads W as it is stored, and its gradient needs no transposed
    copy either.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    folded = set()  # outputs of the Transposes whose only reader became a Gemm

    def replace(b, node):
        transpose = producers.get(node.input[1]) if node.op_type == "MatMul" else None
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in weight_shapes:
            return False
        shape = weight_shapes[transpose.input[0]]
        perm = [list(helper.get_attribute_value(a)) for a in transpose.attribute if a.name == "perm"]
        if len(shape) != 2 or shape[0] < min_rows or perm not in ([[1, 0]], []) \
                or len(readers[transpose.output[0]]) != 1:
            return False
        x, weight = node.input[0], transpose.input[0]
        flat = b.op("Reshape", [x, b.const([-1, shape[1]], np.int64)])
        product = b.op("Gemm", [flat, weight], transB=1)
        leading = b.op("Slice", [b.op("Shape", [x]), b.const([0], np.int64), b.const([-1], np.int64)])
        b.op("Reshape", [product, b.op("Concat", [leading, b.const([shape[0]], np.int64)], axis=0)],
             outputs=list(node.output))
        folded.add(transpose.output[0])
        return True

    _replace_nodes(graph, "tall_gemm_", replace)
    kept = [node for node in graph.node if not (node.op_type == "Transpose" and node.output[0] in folded)]
    del graph.node[:]
    graph.node.extend(kept)


def small_embedding_as_matmul(model: onnx.ModelProto, weight_shapes, max_rows=64):
    """Gather from a trainable table of at most `max_rows` rows -> MatMul(OneHot(ids), table).

    onnxruntime's CPU GatherGrad (the embedding gradient) takes ~6 ms for 1024 ids into a 2-row
    table — BERT's token-type embeddings — because every id lands on the same two rows; the one-hot
    product's gradient is a [rows, ids] × [ids, hidden] Gemm of 0.07 ms (docs/ort-notes.md). Large
    tables keep Gather: a one-hot over 30522 rows costs ~200 ms.
    """
    def as_matmul(b, node):
        shape = weight_shapes.get(node.input[0]) if node.op_type == "Gather" and node.input else None
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        if shape is None or len(shape) != 2 or shape[0] > max_rows or axis != 0:
            return False
        table, ids = node.input
        one_hot = b.op("OneHot", [ids, b.const(shape[0], np.int64), b.const([0.0, 1.0])], axis=-1)
        b.op("MatMul", [one_hot, table], outputs=[node.output[0]])
        return True

    _replace_nodes(model.graph, "onehot_", as_matmul)


def large_bias_gradient_as_matmul(model: onnx.ModelProto, weight_shapes, min_size=4096):
    """The gradient of a long 1-D bias (an LM head's, [vocab]) as ones[1, N] · dy[N, vocab].

    The builder sums dy over every leading axis with ReduceSum (an Add's bias, or a Gemm's C through
    an Identity), which onnxruntime's CPU kernel does at ~13 GB/s (9.4 ms for BERT's [8, 128, 30522]);
    the same sum as a MLAS product takes 3.8 ms (docs/ort-notes.md). Same values to rounding. Only for
    biases of at least `min_size` entries: for layer-sized ones the two take the same time.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    b = GraphBuilder(graph, prefix="bias_grad_")
    for bias, shape in weight_shapes.items():
        if len(shape) != 1 or shape[0] < min_size:
            continue
        node = producers.get(f"{bias}_grad")
        if node is not None and node.op_type == "Identity":
            node = producers.get(node.input[0])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute} if node is not None else {}
        if node is None or node.op_type != "ReduceSum" or attrs.get("keepdims", 1) != 0:
            continue
        rows = b.op("Reshape", [node.input[0], b.const([-1, shape[0]], np.int64)])
        count = b.op("Slice", [b.op("Shape", [rows]), b.const([0], np.int64), b.const([1], np.int64)])
        ones = b.op("Expand", [b.const([[1.0]]), b.op("Concat", [b.const([1], np.int64), count], axis=0)])
        summed = b.op("MatMul", [ones, rows])
        # The ReduceSum becomes the Reshape of the product to [size], under the same output name.
        node.CopyFrom(helper.make_node("Reshape", [summed, b.const([shape[0]], np.int64)], list(node.output),
                                       name=f"{node.name}_as_matmul"))


DETERMINISTIC_OPSET = 16  # ScatterElements' reduction attribute


def deterministic_gather_grad(model: onnx.ModelProto):
    """Every GatherGrad (axis 0: an embedding's gradient) -> ScatterElements(reduction='add') into zeros.

    onnxruntime's CPU GatherGrad adds the rows of repeated ids from several threads under a mutex, so
    the order of the additions -- and the last bits of the sum -- change from run to run. The CPU
    ScatterElements adds them in index order (measured bitwise equal over repeated runs, and faster:
    88 vs 246 ms for 4096 ids into [30522, 768]; docs/performance.md, "Deterministic compute"). Needs default-domain opset
    16, which the model is raised to (no op this trainer exports changes meaning between 14 and 16).
    Returns the number of nodes rewritten.
    """
    count = 0

    def as_scatter(b, node):
        nonlocal count
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "GatherGrad" or axis != 0:
            return False
        shape, ids, grad = node.input
        table = b.op("Reshape", [b.op("CastLike", [b.op("ConstantOfShape", [shape]), grad]),
                                 b.const([0, -1], np.int64)])                                  # [rows, R]
        width = b.op("Slice", [b.op("Shape", [table]), b.const([1], np.int64), b.const([2], np.int64)])
        rows = b.op("Reshape", [grad, b.op("Concat", [b.const([-1], np.int64), width], axis=0)])  # [n, R]
        index = b.op("Expand", [b.op("Reshape", [ids, b.const([-1, 1], np.int64)]), b.op("Shape", [rows])])
        summed = b.op("ScatterElements", [table, index, rows], axis=0, reduction="add")
        b.op("Reshape", [summed, shape], outputs=[node.output[0]])
        count += 1
        return True

    _replace_nodes(model.graph, "detgather_", as_scatter)
    if count:
        for opset in model.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version < DETERMINISTIC_OPSET:
                opset.version = DETERMINISTIC_OPSET
    return count
