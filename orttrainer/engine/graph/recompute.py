"""Recompute (activation checkpointing) as a rewrite of the training graph.

Normally every forward tensor that a backward node reads stays alive from the forward pass until that
backward node ran. A recompute rewrite gives the backward nodes a *copy* of the forward sub-graph that
produced those tensors instead: the originals then die as soon as the forward is done with them, and
the copies run late in the backward pass, when their consumers are about to need them.

    forward:   x ──► [region] ──► y ──► ... ──► loss
    backward:                  dL/dy ──► gate ─┐
               x ──gated──► [region copy] ──► y' ──► backward nodes (instead of y)

The copies compute exactly what the originals computed (same ops, same inputs, same attributes), so
losses and weights are bitwise unchanged. Dropout is not re-run (it would draw a new mask): its copy
applies the forward's saved mask with `DropoutGrad`, which computes x · mask / (1 - ratio) as Dropout does.
Every other random node (onnxruntime's CUDA fusions BitmaskDropout, BiasDropout, BiasSoftmaxDropout, the
Random* ops, any op with a seed) is never copied: its outputs stay stashed and the copies read them.

Ordering: onnxruntime has no control edges and orders nodes itself, so a copy could run right after
its inputs exist -- in the forward pass, saving nothing. Every input the copies take from the
forward is therefore read through a *gate*: `Reshape(t, Where(IsNaN(p), Shape(t), Shape(t)))`, where
p is one element of the gradient that reaches the region (dL/d of the region's output). The Reshape
is an alias on onnxruntime's CPU provider (no copy); the Where makes it wait for p. So the copies
cannot start before the backward pass has reached the region.

onnxruntime-training's own MemoryOptimizer (session config `optimization.memory_optimizer_config`)
runs on an InferenceSession too, but it only acts on ORTModule graphs: it finds the forward/backward
boundary by a `YieldOp`, and our single-graph training step has none (docs/ort-notes.md).

Regions:
  * gelu: each Gelu / FastGelu / BiasGelu node (its input stays: GeluGrad reads it anyway);
  * attn_dropout: each Dropout fed by a Softmax (the softmax output stays: SoftmaxGrad reads it);
  * transformer layers: layer k = the forward nodes between the layer's input tensor x_k and the next
    layer's input x_{k+1}. The boundaries are found from the graph's structure (below), not from
    node names, so models given as ONNX work too.
"""

import heapq
import logging
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from orttrainer.engine.kernels import library as kernels
from orttrainer.engine.graph.builder import MS_DOMAIN, GraphBuilder

logger = logging.getLogger(__name__)

GELU_OPS = {"Gelu", "FastGelu", "BiasGelu"}
# Ops that draw random numbers: a copy would draw new ones. Besides ONNX's, onnxruntime's CUDA dropout
# fusions (com.microsoft), which the optimized graph that recompute rewrites holds on a CUDA session.
# Any other op with a `seed` attribute counts as random too (`is_random`).
RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial",
              "BitmaskDropout", "BiasDropout", "BitmaskBiasDropout", "BiasSoftmaxDropout"}
SHAPE_OPS = {"Shape", "Size"}  # their outputs describe a tensor, they do not carry its data


@dataclass(frozen=True)
class RecomputeOptions:
    """Which sub-graphs to recompute (options.graph_transformer)."""

    attn_dropout: bool = False
    gelu: bool = False
    layers: int | None = None  # None: no layer recompute; 0: every layer but the last; N: the first N

    @classmethod
    def from_graph_transformer(cls, gt):
        layers = gt.number_recompute_layers if gt.transformer_layer_recompute else None
        return cls(attn_dropout=gt.attn_dropout_recompute, gelu=gt.gelu_recompute, layers=layers)

    @property
    def enabled(self):
        return self.attn_dropout or self.gelu or self.layers is not None


@dataclass(frozen=True)
class RecomputePlan:
    """What the session needs to apply the rewrite: the options, and how to tell the forward nodes."""

    options: RecomputeOptions
    forward_tensors: frozenset  # every forward node's outputs, before the gradient was built
    loss: str
    weights: tuple


def create_session_with_recompute(model: onnx.ModelProto, plan: RecomputePlan, options: ort.SessionOptions, *,
                                  providers, provider_options=None, disabled_optimizers=None):
    """The training session, with the plan's sub-graphs recomputed.

    The rewrite is applied to the graph as onnxruntime optimized it, and the session then loads that
    graph with optimizations off. Applied before, it would change what onnxruntime fuses: fusions
    such as MatMul+Div -> FusedMatMul(alpha) only apply to a tensor with one reader, and moving the
    backward readers to a copy changes the readers. After, each copy is a clone of the very kernel the
    forward ran, on the same values, so losses and weights are bitwise those of the plain session.
    """
    level = options.graph_optimization_level
    with tempfile.TemporaryDirectory() as folder:
        first = ort.SessionOptions()
        first.log_severity_level = 3
        first.graph_optimization_level = level
        first.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        first.enable_cpu_mem_arena = options.enable_cpu_mem_arena  # the process's first session may be this one
        if _uses_env_allocators(options):
            first.add_session_config_entry("session.use_env_allocators", "1")
        if kernels.uses(model):
            kernels.register(first)
        ort.InferenceSession(model.SerializeToString(), first, providers=providers, provider_options=provider_options,
                             disabled_optimizers=disabled_optimizers)
        optimized = onnx.load(first.optimized_model_filepath)
    apply_recompute(optimized, plan.forward_tensors, plan.loss, plan.weights, plan.options)
    order_to_free_early(optimized.graph)
    order = options.execution_order
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED  # = the node order given, see below
    try:
        return ort.InferenceSession(optimized.SerializeToString(), options, providers=providers,
                                    provider_options=provider_options)
    finally:
        options.graph_optimization_level = level
        options.execution_order = order


def order_to_free_early(graph: onnx.GraphProto):
    """Reorder the nodes (topologically) so that a node that is the last reader of some tensor runs as
    soon as it can, and otherwise keep the given order.

    With `ExecutionOrder.PRIORITY_BASED` and no priorities set, onnxruntime runs the ready node of
    lowest index first, i.e. exactly this order. Its default order (a depth-first walk from the graph's
    outputs) runs the backward pass's data gradients through every layer before the weight gradients
    that also read them, so each layer's output gradient stays alive to the end of the backward
    pass: once recompute has removed the stashed activations, that is the peak.
    """
    produced = {o for node in graph.node for o in node.output if o}
    pinned = {o.name for o in graph.output}
    readers = defaultdict(set)
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name in produced:
                readers[name].add(index)
    waiting = {i: len({x for x in n.input if x in produced}) for i, n in enumerate(graph.node)}
    done = set()

    def key(index):
        frees = any(len(readers[x]) == 1 and x not in pinned for x in graph.node[index].input if x in produced)
        return (0 if frees else 1, index)

    ready = [key(i) for i, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, index = heapq.heappop(ready)
        if index in done:
            continue
        done.add(index)
        order.append(graph.node[index])
        for name in set(graph.node[index].input):
            if name in produced:
                readers[name].discard(index)
                if len(readers[name]) == 1:  # its last reader now frees it: may move up
                    (last,) = readers[name]
                    if waiting[last] == 0 and last not in done:
                        heapq.heappush(ready, key(last))
        for name in graph.node[index].output:
            for reader in readers.get(name, ()):
                waiting[reader] -= 1
                if waiting[reader] == 0:
                    heapq.heappush(ready, key(reader))
    assert len(order) == len(graph.node), "the graph has a cycle"
    del graph.node[:]
    graph.node.extend(order)


def is_random(node):
    """Whether a copy of `node` would draw different random numbers (Dropout aside: `_copy` reuses its mask)."""
    if node.op_type == "Dropout":
        return False
    return node.op_type in RANDOM_OPS or any(a.name == "seed" for a in node.attribute)


def recompute_name(name):
    return f"{name}_recompute"


def apply_recompute(model: onnx.ModelProto, forward_tensors, loss, weights, options: RecomputeOptions):
    """Rewrite `model` (forward + gradient nodes, not yet the optimizer) in place.

    `forward_tensors`: the names every forward node produced before the gradient was built (what
    tells forward from backward nodes). Returns {region kind: number of regions recomputed}.
    """
    graph = _Graph(model.graph, forward_tensors)
    done = {"layers": 0, "gelu": 0, "attn_dropout": 0}
    if options.layers is not None:
        count, layers = graph.transformer_layers(loss, set(weights))
        if not layers:
            logger.warning("transformer_layer_recompute: found %d transformer layer(s) (one attention Softmax "
                           "each) with boundaries; the last layer is never recomputed, so nothing is.", count)
        wanted = len(layers) if options.layers == 0 else options.layers
        if wanted > len(layers):
            logger.warning("number_recompute_layers=%d but only the first %d of the model's %d layers can be "
                           "recomputed (the last layer's activations are used at once: recomputing it saves "
                           "nothing).", options.layers, len(layers), count)
        for region, end in layers[:wanted]:
            done["layers"] += graph.recompute(region, graph.gradients_of([end]))
    if options.gelu:
        for node in graph.forward_nodes_of(GELU_OPS):
            done["gelu"] += graph.recompute([node], graph.gradients_of(graph.forward_readers(node)))
    if options.attn_dropout:
        for node in graph.forward_nodes_of({"Dropout"}):
            source = graph.producer.get(node.input[0])
            if source is not None and source.op_type == "Softmax":
                done["attn_dropout"] += graph.recompute([node], graph.gradients_of(graph.forward_readers(node)))
    logger.info("recompute: %s", done)
    return done


class _Graph:
    """Producer/consumer index of the graph, kept up to date as copies are added."""

    def __init__(self, graph: onnx.GraphProto, forward_tensors):
        self.graph = graph
        self.b = GraphBuilder(graph, prefix="recompute_")
        self.producer = {}
        self.readers = defaultdict(list)
        self.forward = set()  # id() of forward nodes
        for node in graph.node:
            self._index(node)
            if any(o in forward_tensors for o in node.output):  # backward nodes only make new names
                self.forward.add(id(node))
        self.outputs = {o.name for o in graph.output}
        self.tensors = set(self.producer)
        self._indexed = len(graph.node)

    def _index(self, node):
        for name in node.output:
            if name:
                self.producer[name] = node
        for name in node.input:
            if name:
                self.readers[name].append(node)

    def is_forward(self, node):
        return id(node) in self.forward

    def forward_nodes_of(self, op_types):
        return [n for n in self.graph.node if self.is_forward(n) and n.op_type in op_types]

    def forward_readers(self, node):
        return [r for o in node.output for r in self.readers[o] if self.is_forward(r)]

    def gradients_of(self, nodes, max_depth=8):
        """The gradients the backward pass computes first among the nodes' outputs and, when
        onnxruntime's fusions removed those (an Identity eliminated, say), their forward descendants'.
        `<t>_grad` is the gradient builder's name for dL/dt, summed over t's readers."""
        level = {o for n in nodes for o in n.output if o}
        for _ in range(max_depth):
            found = sorted(f"{t}_grad" for t in level if f"{t}_grad" in self.producer)
            if found or not level:
                return found
            level = {o for t in level for r in self.readers[t] if self.is_forward(r) for o in r.output if o}
        return []

    def _ancestors(self, names):
        """Every node some tensor in `names` depends on (by id)."""
        seen, stack = set(), [self.producer[n] for n in names if n in self.producer]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.extend(self.producer[i] for i in node.input if i in self.producer)
        return seen

    # ------------------------------------------------------------------ the rewrite
    def recompute(self, region, gate_tensors):
        """Give backward readers of `region`'s outputs a gated copy of the region. Returns 1 if some
        reader was moved to the copy, 0 if the region had none (or no gradient to wait for)."""
        # A random node is never copied: it stays in the forward and its outputs (values, mask) stay
        # stashed; the copies read them gated like any other forward tensor. (Dropout is the exception:
        # its copy re-applies the forward's own mask, see `_copy`.)
        region = [n for n in region if not is_random(n)]
        if not gate_tensors or not region:
            return 0
        before_gate = self._ancestors(gate_tensors)  # readers the copy cannot serve: they come before it
        in_region = {id(n) for n in region}
        moved = []  # (reader, input index, tensor)
        for node in region:
            for k, name in enumerate(node.output):
                if not name or name in self.outputs or (node.op_type == "Dropout" and k > 0):
                    continue  # a Dropout's mask is kept: the copy reuses it
                for reader in self.readers[name]:
                    if self.is_forward(reader) or id(reader) in before_gate or id(reader) in in_region:
                        continue
                    moved.extend((reader, i, name) for i, x in enumerate(reader.input) if x == name)
        if not moved:
            return 0
        needed = {name for _, _, name in moved}
        to_copy = []
        for node in reversed(region):  # region is in topological order: readers before producers here
            if any(o in needed for o in node.output):
                to_copy.append(node)
                needed.update(i for i in node.input if i in self.producer and id(self.producer[i]) in in_region)
        to_copy.reverse()

        gate = self._gate_condition(gate_tensors)
        copied, gated = {}, {}
        for node in to_copy:
            inputs = []
            for name in node.input:
                if name in copied:
                    inputs.append(copied[name])
                elif name in self.producer:  # a forward tensor from outside the copy: read it gated
                    if name not in gated:
                        gated[name] = self._gated(name, gate)
                    inputs.append(gated[name])
                else:
                    inputs.append(name)  # graph input, weight, initializer or absent optional input
            copy = self._copy(node, inputs)
            for old, new in zip(node.output, copy.output):
                if old:
                    copied[old] = new
        for reader, i, name in moved:
            reader.input[i] = copied[name]
            self.readers[copied[name]].append(reader)
            self.readers[name].remove(reader)
        return 1

    def _copy(self, node, inputs):
        if node.op_type == "Dropout":
            # x · mask / (1 - ratio) from the forward's own mask: DropoutGrad computes exactly that.
            args = [inputs[0], node.output[1]] + inputs[1:]
            copy = helper.make_node("DropoutGrad", args, [self._fresh(node.output[0])], domain=MS_DOMAIN,
                                    name=recompute_name(node.name or node.output[0]))
        else:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = recompute_name(node.name or node.output[0])
            del copy.input[:]
            copy.input.extend(inputs)
            del copy.output[:]
            copy.output.extend(self._fresh(o) if o else "" for o in node.output)
        self.graph.node.append(copy)
        self._index_new()
        return copy

    def _fresh(self, name):
        candidate, n = recompute_name(name), 0
        while candidate in self.tensors:
            n += 1
            candidate = recompute_name(f"{name}_{n}")
        self.tensors.add(candidate)
        return candidate

    def _gate_condition(self, tensors):
        """A bool scalar that exists only once every tensor in `tensors` does (its value is irrelevant)."""
        b = self.b
        flat, first, last = b.const([-1], np.int64), b.const([0], np.int64), b.const([1], np.int64)
        elements = [b.op("Slice", [b.op("Reshape", [t, flat]), first, last]) for t in tensors]
        probe = elements[0] if len(elements) == 1 else b.op("Concat", elements, axis=0)
        condition = b.op("IsNaN", [b.op("ReduceMax", [probe], keepdims=0)])
        self._index_new()
        return condition

    def _gated(self, name, condition):
        """`name`, made to wait for `condition`: an aliasing Reshape to its own shape, computed after it."""
        b = self.b
        shape = b.op("Shape", [name])
        gated = b.op("Reshape", [name, b.op("Where", [condition, shape, shape])])
        self._index_new()
        return gated

    def _index_new(self):
        """Index the nodes appended since the last call (by the builder or `_copy`)."""
        for node in self.graph.node[self._indexed:]:
            self._index(node)
        self._indexed = len(self.graph.node)

    # ------------------------------------------------------------------ transformer layers
    def transformer_layers(self, loss, weights):
        """(number of layers, [(region, end node)] for every layer but the last).

        A layer is counted by its attention Softmax. Its boundaries come from post-dominators of the
        forward graph (node d post-dominates n when every path from n to the loss passes through d):
        the input of layer k+1 is the last post-dominator of layer k's Softmax that layer k+1's Softmax
        still depends on (in a pre-LN block the residual sum, in a post-LN block the LayerNorm). The
        input of layer 0 is found the same way from the nodes that read the model's inputs. Layer k's
        region: the nodes that depend on its input through data (not only through a Shape) and that
        its output depends on.
        """
        order = self._forward_order(loss)
        position = {id(n): i for i, n in enumerate(order)}
        ipdom, depth = {}, {}
        for node in reversed(order):
            succ = [r for o in node.output for r in self.readers[o] if id(r) in position]
            if not succ:  # the loss node: root of the post-dominator tree
                ipdom[id(node)], depth[id(node)] = None, 0
                continue
            d = succ[0]
            for other in succ[1:]:
                d = self._meet(d, other, ipdom, depth)
            ipdom[id(node)], depth[id(node)] = d, depth[id(d)] + 1

        def chain(node):  # node, then every node that post-dominates it, in forward order
            while node is not None:
                yield node
                node = ipdom[id(node)]

        def last_ancestor_on_chain(node, ancestors):
            last = None
            for c in chain(node):
                if id(c) not in ancestors:
                    break
                last = c
            return last

        softmaxes = [n for n in order if n.op_type == "Softmax"]
        if len(softmaxes) < 2:
            return len(softmaxes), []
        ancestors = [self._ancestors(list(s.input)) for s in softmaxes]
        inputs = {i.name for i in self.graph.input} - set(weights)
        sources = [n for n in order if id(n) in ancestors[0] and any(i in inputs for i in n.input)]
        firsts = [c for c in (last_ancestor_on_chain(n, ancestors[0]) for n in sources) if c is not None]
        if not firsts:
            return len(softmaxes), []
        starts = [max(firsts, key=lambda n: position[id(n)])]
        for k in range(1, len(softmaxes)):
            end = last_ancestor_on_chain(ipdom[id(softmaxes[k - 1])], ancestors[k])
            if end is None:
                break
            starts.append(end)
        layers = []
        for start, end in zip(starts, starts[1:]):
            inside = self._ancestors(list(end.input))
            region = [n for n in self._data_descendants(start, position) if id(n) in inside]
            layers.append((sorted(region, key=lambda n: position[id(n)]), end))
        return len(softmaxes), layers

    @staticmethod
    def _meet(a, b, ipdom, depth):
        """The nearest common post-dominator of a and b."""
        while a is not b:
            if depth[id(a)] >= depth[id(b)]:
                a = ipdom[id(a)]
            else:
                b = ipdom[id(b)]
        return a

    def _forward_order(self, loss):
        """The forward nodes the loss depends on, in topological order."""
        wanted = self._ancestors([loss])
        done, order = set(), []
        for node in self.graph.node:
            stack = [(node, False)]
            while stack:
                current, expanded = stack.pop()
                if id(current) in done or id(current) not in wanted:
                    continue
                if expanded:
                    done.add(id(current))
                    order.append(current)
                    continue
                stack.append((current, True))
                stack.extend((self.producer[i], False) for i in current.input if i in self.producer)
        return order

    def _data_descendants(self, start, position):
        """Forward nodes that read `start`'s outputs, or such nodes' outputs, as data (Shape/Size cut)."""
        seen, found, stack = set(), [], list(start.output)
        while stack:
            name = stack.pop()
            for reader in self.readers[name]:
                if id(reader) in seen or id(reader) not in position or reader.op_type in SHAPE_OPS:
                    continue
                seen.add(id(reader))
                found.append(reader)
                stack.extend(o for o in reader.output if o)
        return found


def _uses_env_allocators(options):
    try:
        return options.get_session_config_entry("session.use_env_allocators") == "1"
    except RuntimeError:  # not set
        return False
