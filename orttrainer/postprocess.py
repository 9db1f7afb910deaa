"""Rewrites applied to every forward model before training (`_internal_use.enable_internal_postprocess`).

Unlike the legacy passes, the fused loss keeps the NLL node's attributes (`reduction`, `ignore_index`).
The original's other helpers are kept for scripts that call them (find_input_node, fix_expand_shape,
...); run_postprocess does not need the Expand shape passes: today's exporter records those shapes.
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


def fuse_softmaxNLL_to_softmaxCE(onnx_model):
    """LogSoftmax(x, class axis) -> NegativeLogLikelihoodLoss  ==>  SoftmaxCrossEntropyLoss(x).

    The fused node's second output (log_prob) takes the LogSoftmax output's name, so other readers of
    the log-probabilities keep working; it has a fused gradient kernel.
    """
    model = onnx_model
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


# ---------------------------------------------------------------------- the original's graph helpers
def find_input_node(model, arg):
    """The node that produces `arg`, or None unless exactly one does."""
    found = [node for node in model.graph.node if arg in node.output]
    return found[0] if len(found) == 1 else None


def find_output_node(model, arg):
    """The node that reads `arg` when exactly one does, else the list of those that do."""
    found = [node for node in model.graph.node if arg in node.input]
    return found[0] if len(found) == 1 else found


def find_nodes(graph, op_type):
    return [node for node in graph.node if node.op_type == op_type]


def is_type(node, op_type):
    """Whether `node` (a node, None, or a list as find_output_node returns) is one node of `op_type`."""
    return node is not None and not isinstance(node, list) and node.op_type == op_type


def add_const(model, name, output, t_value=None, f_value=None):
    """Append a Constant node `name` producing `output`: the tensor `t_value`, else the float `f_value`."""
    value = helper.make_attribute("value", t_value if t_value is not None else f_value)
    node = model.graph.node.add()
    node.op_type, node.name = "Constant", name
    node.output.append(output)
    node.attribute.append(value)
    return node


def _copy_input_type(model, expand, input_name):
    inputs = [i.name for i in model.graph.input]
    if input_name in inputs:
        info = model.graph.value_info.add()
        info.name = expand.output[0]
        info.type.CopyFrom(model.graph.input[inputs.index(input_name)].type)


def fix_expand_shape(model):
    """Expand(x, Shape(model input)): record the input's type as the Expand output's value_info."""
    for expand in find_nodes(model.graph, "Expand"):
        shape = find_input_node(model, expand.input[1])
        if is_type(shape, "Shape"):
            _copy_input_type(model, expand, shape.input[0])
    return model


def fix_expand_shape_pt_1_5(model):
    """The same for PyTorch 1.5's form of the target shape: Where(Equal(Reshape(Concat(Unsqueeze(Gather(
    Shape(input))) ...)), Mul(ConstantOfShape, Constant)), ConstantOfShape, Reshape), every Gather reading
    the Shape of one and the same model input (the Concat inputs up to the first other form decide)."""
    def producer(name, op_type):
        node = find_input_node(model, name)
        return node if is_type(node, op_type) else None

    for expand in find_nodes(model.graph, "Expand"):
        where = producer(expand.input[1], "Where")
        if where is None:
            continue
        equal, fill = producer(where.input[0], "Equal"), producer(where.input[1], "ConstantOfShape")
        reshape = producer(where.input[2], "Reshape")
        if None in (equal, fill, reshape) or find_input_node(model, equal.input[0]) is not reshape:
            continue
        mul = producer(equal.input[1], "Mul")
        if mul is None or find_input_node(model, mul.input[0]) is not fill or not producer(mul.input[1], "Constant"):
            continue
        concat = producer(reshape.input[0], "Concat")
        if concat is None or not producer(reshape.input[1], "Constant"):
            continue
        sources = set()
        for name in concat.input:
            unsqueeze = producer(name, "Unsqueeze")
            gather = unsqueeze and producer(unsqueeze.input[0], "Gather")
            shape = gather and producer(gather.input[0], "Shape")
            if not shape or not producer(gather.input[1], "Constant"):
                break  # as in the original: the inputs matched so far decide
            sources.add(shape.input[0])
        if len(sources) == 1:
            _copy_input_type(model, expand, sources.pop())
    return model
