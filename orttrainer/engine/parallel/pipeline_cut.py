"""Pipeline parallel, the graph side: where the forward graph is cut into stages, and each stage's own
forward sub-model.

The cut string has the legacy syntax (`pipeline_cut_info_string`): cuts separated by `,`, the edges of
one cut by `:`, an edge a tensor name, optionally with the nodes that read it through the cut
(`producer-consumer1/consumer2`; without a list every reader does). Cut k separates stage k from stage
k + 1. An empty string with P > 1 asks for an automatic cut (`auto_cut`).

Each node runs on the earliest stage its inputs allow: a node after an edge of cut k runs on stage
k + 1 or later. Nodes that read only model inputs, constants and other such nodes (shapes, position
ids, masks, label reshapes) are copied to every stage that needs them instead of being sent. Any other
tensor read on a later stage than where it is made must be an edge of the cut between the two.
"""

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper


class PipelineCutError(ValueError):
    """A pipeline_cut_info_string that does not describe a valid cut of this model."""


@dataclass(frozen=True)
class Edge:
    tensor: str
    consumers: tuple = ()  # node names reading it through the cut; () = every reader


@dataclass
class Stage:
    index: int
    nodes: list = field(default_factory=list)      # node indices into the forward graph, in order
    received: list = field(default_factory=list)   # tensors received from stage index - 1
    sent: list = field(default_factory=list)       # tensors sent to stage index + 1
    weights: list = field(default_factory=list)    # initializers this stage reads (sorted)


def parse_cut_string(text: str, stages: int):
    """[[Edge, ...] per cut]; raises PipelineCutError naming the bad piece."""
    cuts = []
    for k, cut in enumerate(text.split(",")):
        edges = []
        for piece in cut.split(":"):
            piece = piece.strip()
            tensor, _, consumers = piece.partition("-")
            names = tuple(c.strip() for c in consumers.split("/")) if consumers else ()
            if not tensor or (consumers == "" and "-" in piece) or any(not c for c in names):
                raise PipelineCutError(
                    f"pipeline_cut_info_string {text!r}: cut {k} has an empty or malformed edge {piece!r}; "
                    "write edges as 'tensor' or 'tensor-consumer1/consumer2', ':' between the edges of one "
                    "cut, ',' between cuts")
            edges.append(Edge(tensor, names))
        cuts.append(edges)
    if len(cuts) != stages - 1:
        raise PipelineCutError(
            f"pipeline_cut_info_string {text!r} has {len(cuts)} cut(s) but pipeline_parallel_size={stages} "
            f"needs {stages - 1} (one ',' between consecutive cuts); or leave it empty for an automatic cut")
    return cuts


def _producers(graph):
    return {t: i for i, node in enumerate(graph.node) for t in node.output if t}


def _replicable(graph, producers):
    """Indices of nodes that read no float initializer with more than one element (no weight) and only
    model inputs, constants or other such nodes: cheap to compute again on any stage."""
    big = {i.name for i in graph.initializer
           if i.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
           and int(np.prod(i.dims)) > 1}
    found = set()
    for i, node in enumerate(graph.node):
        if any(t in big for t in node.input):
            continue
        if all(not t or t not in producers or producers[t] in found for t in node.input):
            found.add(i)
    return found


def split(model: onnx.ModelProto, cuts, loss: str, outputs):
    """The stages of `model` for these cuts (a list of Stage); raises PipelineCutError naming the edge
    that is not a tensor of the graph, or the tensor that crosses a cut without being one of its edges."""
    graph = model.graph
    producers = _producers(graph)
    node_names = {node.name: i for i, node in enumerate(graph.node)}
    edge_cut = {}  # (tensor, consumer node index or None) -> cut index
    for k, edges in enumerate(cuts):
        for edge in edges:
            if edge.tensor not in producers:
                known = "a model input or initializer" if edge.tensor in {i.name for i in graph.input} | {
                    i.name for i in graph.initializer} else "not a tensor of the forward graph"
                raise PipelineCutError(f"pipeline cut {k}: edge {edge.tensor!r} is {known}; an edge must be "
                                       "the output of a node of the exported forward model")
            for consumer in edge.consumers:
                index = node_names.get(consumer)
                if index is None or edge.tensor not in graph.node[index].input:
                    raise PipelineCutError(f"pipeline cut {k}: edge {edge.tensor!r} names consumer {consumer!r}, "
                                           "which is not a node reading that tensor")
                edge_cut[(edge.tensor, index)] = k
            if not edge.consumers:
                edge_cut[(edge.tensor, None)] = k
    replicable = _replicable(graph, producers)
    count = len(cuts) + 1

    def cut_of(t, i):
        return edge_cut.get((t, i), edge_cut.get((t, None)))

    # After a cut edge: the earliest stage the inputs allow. Before any (weights' transposes, the
    # embedding): the latest stage that still feeds every reader, so a weight's own node goes where it
    # is used.
    after_cut = set()
    stage_of = {}
    for i, node in enumerate(graph.node):
        if i in replicable:
            continue
        stage = None
        for t in node.input:
            p = producers.get(t)
            if p is None or p in replicable:
                continue
            k = cut_of(t, i)
            if k is not None:
                stage = max(stage or 0, k + 1)
            elif p in after_cut:
                stage = max(stage or 0, stage_of[p])
        if stage is not None:
            after_cut.add(i)
            stage_of[i] = stage
    readers = {}
    for i, node in enumerate(graph.node):
        for t in node.input:
            readers.setdefault(t, []).append(i)
    for i in reversed(range(len(graph.node))):
        if i in replicable or i in after_cut:
            continue
        stage = count - 1
        for t in graph.node[i].output:
            for c in readers.get(t, []):
                if c in replicable:
                    continue
                k = cut_of(t, c)
                stage = min(stage, k if k is not None else stage_of[c])
        stage_of[i] = stage
    stages = [Stage(s) for s in range(count)]
    # Every tensor crossing stages must be an edge of the cut right after its producer's stage.
    for i, node in enumerate(graph.node):
        if i in replicable:
            continue
        for t in node.input:
            p = producers.get(t)
            if p is None or p in replicable or stage_of[p] == stage_of[i]:
                continue
            k = edge_cut.get((t, i), edge_cut.get((t, None)))
            if k is None or stage_of[p] != k or stage_of[i] != k + 1:
                raise PipelineCutError(
                    f"the pipeline cut does not separate the graph: tensor {t!r} (made by node "
                    f"{graph.node[p].name!r} on stage {stage_of[p]}) is read by node {node.name!r} on stage "
                    f"{stage_of[i]}, but it is not an edge of cut {stage_of[p]}. Add it to that cut "
                    "(edges of one cut are separated by ':') or cut elsewhere")
            if t not in stages[k].sent:
                stages[k].sent.append(t)
                stages[k + 1].received.append(t)
    for name in [loss] + list(outputs):
        p = producers.get(name)
        if p is not None and p not in replicable and stage_of[p] != count - 1:
            raise PipelineCutError(f"model output {name!r} is computed on stage {stage_of[p]}, not on the last "
                                   f"stage {count - 1}: every output must come after the last cut")
    needed = [set() for _ in range(count)]
    for i, s in stage_of.items():
        needed[s].add(i)
    for s in range(count):
        if not needed[s]:
            raise PipelineCutError(f"pipeline stage {s} has no node: two cuts are at the same place, or a cut "
                                   "is before the first or after the last node")
        stages[s].nodes = _with_replicated_inputs(graph, producers, replicable, needed[s],
                                                  extra=[loss] + list(outputs) if s == count - 1 else [])
        initializers = {i.name for i in graph.initializer}
        stages[s].weights = sorted({t for i in stages[s].nodes for t in graph.node[i].input if t in initializers})
    return stages


def _with_replicated_inputs(graph, producers, replicable, nodes, extra):
    """`nodes` plus the replicable nodes they (and the tensors `extra`) depend on, in graph order."""
    chosen = set(nodes)
    todo = [t for i in nodes for t in graph.node[i].input] + list(extra)
    while todo:
        p = producers.get(todo.pop())
        if p is not None and p in replicable and p not in chosen:
            chosen.add(p)
            todo.extend(graph.node[p].input)
    return sorted(chosen)


def stage_model(model: onnx.ModelProto, stage: Stage, last: bool, loss: str, outputs):
    """The forward sub-model of one stage: its nodes, the model inputs and initializers they read, the
    received tensors as inputs; outputs are the sent tensors (the last stage: loss and model outputs)."""
    graph = model.graph
    infos = {v.name: v for v in list(graph.value_info) + list(graph.input) + list(graph.output)}
    nodes = [graph.node[i] for i in stage.nodes]
    read = {t for node in nodes for t in node.input}
    made = {t for node in nodes for t in node.output}
    inputs = [i for i in graph.input if i.name in read | set(outputs if last else ())]
    for t in stage.received:
        if t not in infos:
            raise PipelineCutError(f"edge {t!r}: its type is unknown (no shape inference result); "
                                   "cut at another tensor")
        inputs.append(infos[t])
    names = ([loss] + list(outputs)) if last else list(stage.sent)
    outs = []
    for name in dict.fromkeys(names):
        if name not in made and name not in {i.name for i in inputs}:
            raise PipelineCutError(f"stage {stage.index} must output {name!r} but does not compute it")
        outs.append(infos[name])
    sub = helper.make_graph(nodes, f"{graph.name}_stage{stage.index}", inputs, outs,
                            initializer=[i for i in graph.initializer if i.name in read],
                            value_info=[v for v in graph.value_info if v.name in made | read])
    result = helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return result


def infer_types(model: onnx.ModelProto):
    """The model with value_info for every tensor the exporter left untyped (cut tensors need one)."""
    return onnx.shape_inference.infer_shapes(model)


def auto_cut(model: onnx.ModelProto, stages: int, loss: str, outputs):
    """A cut string splitting the model into `stages` stages of about equal parameter count (a weight
    counted at every node reading it: compute, not memory), each cut at a single float tensor that
    separates the graph (the residual stream between transformer blocks)."""
    graph = model.graph
    producers = _producers(graph)
    replicable = _replicable(graph, producers)
    sizes = {i.name: int(np.prod(i.dims)) for i in graph.initializer}
    order = [i for i in range(len(graph.node)) if i not in replicable]
    cost = np.cumsum([sum(sizes.get(t, 0) for t in graph.node[i].input if sizes.get(t, 0) > 1) for i in order])
    floats = {v.name for v in list(graph.value_info) + list(graph.output)
              if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    last_reader = {}
    for position, i in enumerate(order):
        for t in graph.node[i].input:
            p = producers.get(t)
            if p is not None and p not in replicable:
                last_reader[t] = position
    candidates = []  # (position after which to cut, tensor): exactly one live non-replicable tensor
    live = set()
    for position, i in enumerate(order[:-1]):
        live |= {t for t in graph.node[i].output if t in last_reader}
        live = {t for t in live if last_reader[t] > position}
        if len(live) == 1:
            (t,) = live
            if t in floats and t not in [loss] + list(outputs):
                candidates.append((position, t))
    total = float(cost[-1]) if len(cost) else 0.0
    chosen, after = [], -1
    for k in range(1, stages):
        target = total * k / stages
        options = [(abs(float(cost[p]) - target), p, t) for p, t in candidates if p > after]
        if len(options) < stages - k:
            raise PipelineCutError(
                f"no automatic cut into {stages} stages: the forward graph has only {len(candidates)} places "
                "where a single tensor separates it; give distributed.pipeline_parallel.pipeline_cut_info_string")
        _, after, tensor = min(options[:len(options) - (stages - k - 1)])
        chosen.append(tensor)
    return ",".join(chosen)
