"""Rewrites applied to every forward model before training (`_internal_use.enable_internal_postprocess`).

Unlike the legacy passes, the fused loss keeps the NLL node's attributes (`reduction`, `ignore_index`).
"""

import onnx
from onnx import helper


def run_postprocess(model: onnx.ModelProto) -> onnx.ModelProto:
    add_name(model)
    fuse_softmaxNLL_to_softmaxCE(model)
    return model


def add_name(model):
    """Give every unnamed node a unique `<OpType>_<index>` name (onnxruntime messages cite node names)."""
    taken = {node.name for node in model.graph.node if node.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{index}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def _rank(model, name):
    for value in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        if value.name == name and value.type.tensor_type.HasField("shape"):
            return len(value.type.tensor_type.shape.dim)
    return None


def fuse_softmaxNLL_to_softmaxCE(model):
    """LogSoftmax(x, class axis) -> NegativeLogLikelihoodLoss  ==>  SoftmaxCrossEntropyLoss(x).

    The fused node's second output (log_prob) takes the LogSoftmax output's name, so other readers of
    the log-probabilities keep working; it has a fused gradient kernel.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    for nll in [n for n in graph.node if n.op_type == "NegativeLogLikelihoodLoss"]:
        log_softmax = producers.get(nll.input[0])
        if log_softmax is None or log_softmax.op_type != "LogSoftmax":
            continue
        axis = next((a.i for a in log_softmax.attribute if a.name == "axis"), -1)
        if axis != 1 and not (axis == -1 and _rank(model, log_softmax.input[0]) == 2):
            continue  # the loss's class axis is 1; other axes are not the same computation
        fused = helper.make_node(
            "SoftmaxCrossEntropyLoss",
            [log_softmax.input[0], *nll.input[1:]],
            [nll.output[0], log_softmax.output[0]],
            name=f"{nll.name or 'NegativeLogLikelihoodLoss'}_fused",
        )
        fused.attribute.extend(a for a in nll.attribute if a.name in ("reduction", "ignore_index"))
        position = list(graph.node).index(nll)
        graph.node.remove(nll)
        graph.node.insert(position, fused)
        graph.node.remove(log_softmax)
    return model
