"""Execution-order hints that lower the step's peak memory without changing any value.

onnxruntime's default order is a depth-first walk back from the graph's last nodes. A weight
gradient that only a late `Sum` reads (a tied LM head: the decoder's partial gradient summed with
the embedding's at the very end) is then computed at the end of the backward pass, and the
`[tokens, vocab]` logits gradient it reads stays alive through the whole backward pass (119 MB at
BERT-base). PyTorch's autograd computes it as soon as that gradient exists and frees it.
"""

import numpy as np

from .graph_builder import GraphBuilder


def head_weight_gradient_first(model, weight_shapes, min_rows=16384):
    """For `y = x · Wᵀ` with a tall W (an LM head, at least `min_rows` rows): make x's gradient wait
    for W's, so that W's gradient runs right after `dy` exists and `dy` is freed early.

    The wait is on data (onnxruntime folds a dependency on shapes away): x's gradient becomes
    `Where(IsNaN(e), dx, dx)` with `e` one element of W's gradient, which is `dx` bit for bit
    whatever `e` is (NaN included). Costs one copy of `dx` ([tokens, hidden]). Returns the number of
    heads rewritten; the caller sorts the graph afterwards."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    b = GraphBuilder(graph, prefix="early_head_grad_")
    count = 0
    for forward in list(graph.node):
        if forward.op_type != "MatMul" or len(forward.input) != 2:
            continue
        x, transposed = forward.input
        weight = producers.get(transposed)
        if weight is None or weight.op_type != "Transpose" or weight.input[0] not in weight_shapes:
            continue
        shape = weight_shapes[weight.input[0]]
        if len(shape) != 2 or shape[0] < min_rows:
            continue
        # W's partial gradient: the Transpose back of dWᵀ (the last node on its path to the Sum).
        users = consumers.get(f"{transposed}_grad", [])
        gate = users[0].output[0] if len(users) == 1 and users[0].op_type == "Transpose" else f"{transposed}_grad"
        dx = producers.get(f"{x}_grad")
        if gate not in producers or dx is None:
            continue
        early = f"{x}_grad_before_head_weight"
        dx.output[list(dx.output).index(f"{x}_grad")] = early
        element = b.op("Slice", [b.op("Reshape", [gate, b.const([-1], np.int64)]),
                                 b.const([0], np.int64), b.const([1], np.int64)])
        b.op("Where", [b.op("IsNaN", [element]), early, early], outputs=[f"{x}_grad"])
        count += 1
    return count

