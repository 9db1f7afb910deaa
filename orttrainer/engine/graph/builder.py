"""A tiny helper for appending nodes to an ONNX graph, in the spirit of onnxruntime's onnxblock.

Blocks (optimizers, clipping, accumulation) call `builder.op(...)` and get output names back, so
building a sub-graph reads like the formula it computes.
"""

import heapq
import itertools

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS_DOMAIN = "com.microsoft"
# Ops whose output onnxruntime's CPU kernels place in their first input's buffer (no copy).
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


class GraphBuilder:
    def __init__(self, graph: onnx.GraphProto, prefix: str = ""):
        self.graph = graph
        self._prefix = prefix
        self._names = {n for node in graph.node for n in node.output}
        self._names |= {i.name for i in graph.input} | {i.name for i in graph.initializer}
        self._counter = itertools.count()
        self._constants = {}

    def fresh(self, hint: str) -> str:
        """A tensor name not used anywhere in the graph yet."""
        while True:
            name = f"{self._prefix}{hint}_{next(self._counter)}"
            if name not in self._names:
                self._names.add(name)
                return name

    def op(self, op_type, inputs, n_outputs=1, outputs=None, domain="", **attrs):
        """Append one node; returns its output name (or the list of names when n_outputs > 1)."""
        if outputs is None:
            outputs = [self.fresh(op_type) for _ in range(n_outputs)]
        self._names.update(outputs)
        node = helper.make_node(
            op_type, list(inputs), list(outputs), name=self.fresh(f"{op_type}_node"), domain=domain, **attrs
        )
        self.graph.node.append(node)
        return outputs[0] if len(outputs) == 1 else list(outputs)

    def const(self, value, dtype=np.float32) -> str:
        """A scalar or array initializer, shared between callers asking for the same value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            name = self.fresh("const")
            self.graph.initializer.append(numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def add_input(self, name, elem_type, shape):
        self.graph.input.append(helper.make_tensor_value_info(name, elem_type, shape))
        self._names.add(name)
        return name

    def add_output(self, name, elem_type, shape):
        self.graph.output.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name


def sort_topologically(graph: onnx.GraphProto):
    """Reorder nodes so that every input is produced before it is read (ONNX's rule; onnxruntime
    sorts for itself, but saved graphs and other tools expect it). Stable: among ready nodes the one
    that came first stays first, so an already sorted graph is unchanged."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    producer = {out: index for index, node in enumerate(graph.node) for out in node.output}
    waiting = {}   # node index -> number of inputs not yet produced
    readers = {}   # tensor -> indices of nodes waiting for it
    ready = []
    for index, node in enumerate(graph.node):
        missing = {name for name in node.input if name not in available and name in producer}
        waiting[index] = len(missing)
        for name in missing:
            readers.setdefault(name, []).append(index)
        if not missing:
            heapq.heappush(ready, index)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for name in graph.node[index].output:
            for reader in readers.pop(name, []):
                waiting[reader] -= 1
                if waiting[reader] == 0:
                    heapq.heappush(ready, reader)
    if len(order) != len(graph.node):
        raise RuntimeError("the graph has a cycle; cannot order its nodes")
    nodes = [graph.node[index] for index in order]
    del graph.node[:]
    graph.node.extend(nodes)
