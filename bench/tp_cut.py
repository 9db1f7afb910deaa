"""Tensor parallel with the step CUT at its collective points (a measurement, not the engine's path).

The engine runs a tensor-parallel rank's training graph in one onnxruntime session; the Megatron f/g
collectives run inside it as PythonOp nodes (engine/parallel/megatron.py). This module runs the SAME graph as a
chain of sessions instead, with torch.distributed.all_reduce called from Python between them:

  * f's forward and g's backward are identities: replaced by Identity nodes;
  * g's forward, f's backward (and AllReduceSum's, the global-norm sum of the shards) are collective
    points: removed from the graph; their input is fetched from the segment that computes it, summed
    over the horizontal group, and fed to the later segments that read their output;
  * node n runs in segment = the number of collective points on the longest path before it; each
    segment is one InferenceSession whose inputs are what it reads from graph inputs / earlier
    segments and whose outputs are what later segments (or the step's fetches) read.

`install()` replaces Runtime.run for the process: every "update" run (a train_step without gradient
accumulation) goes through a CutRun built from that Runtime's graph, binding the same state tensors
(weights updated in place, the same ping-pong pairs) as Runtime does.
"""

import collections

import onnx
import onnxruntime as ort
import torch
from onnx import helper

from orttrainer.engine.parallel import megatron
from orttrainer.engine.pyop import python_op
from orttrainer.engine.graph import training_graph as tg
from orttrainer.engine.runtime.session import Runtime

_ORT_TYPES = {"tensor(float)": onnx.TensorProto.FLOAT, "tensor(int64)": onnx.TensorProto.INT64,
              "tensor(bool)": onnx.TensorProto.BOOL, "tensor(float16)": onnx.TensorProto.FLOAT16,
              "tensor(int32)": onnx.TensorProto.INT32, "tensor(double)": onnx.TensorProto.DOUBLE}


def _rewrite(nodes):
    """(nodes with f-forward/g-backward as Identity and the collectives removed, [(input, output)] of
    the collectives). Other PythonOps (e.g. a torch gelu gradient) stay: they are local."""
    by_ctx = {}
    for node in nodes:
        if node.op_type == python_op.PYTHON_OP:
            by_ctx[node.output[0]] = node
    kept, collectives = [], []
    for node in nodes:
        if node.op_type not in (python_op.PYTHON_OP, python_op.PYTHON_OP_GRAD):
            kept.append(node)
            continue
        cls = python_op._functions.get(python_op._func_name(node))
        forward = node.op_type == python_op.PYTHON_OP
        if cls is megatron.MegatronF and forward or cls is megatron.MegatronG and not forward:
            # identity: PythonOp [x] -> [ctx, y]; PythonOpGrad [ctx, dy] -> [dx]
            x, y = (node.input[0], node.output[1]) if forward else (node.input[1], node.output[0])
            kept.append(helper.make_node("Identity", [x], [y], name=f"{node.name}_identity"))
        elif cls is megatron.MegatronG or cls is megatron.MegatronF:
            pair = (node.input[0], node.output[1]) if forward else (node.input[1], node.output[0])
            collectives.append(pair)
        elif cls is megatron.AllReduceSum:
            if not forward:  # the sum of the PythonOp's input, handed out by its PythonOpGrad
                collectives.append((by_ctx[node.input[0]].input[0], node.output[0]))
        else:
            kept.append(node)
    return kept, collectives


def _needed(nodes, fetches, produced_by):
    """The nodes the fetches depend on, in topological order."""
    needed, todo = set(), list(fetches)
    while todo:
        node = produced_by.get(todo.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            todo.extend(i for i in node.input if i)
    chosen = [n for n in nodes if id(n) in needed]
    ready, order = set(), []
    pending = collections.deque(chosen)
    stalled = 0
    while pending:  # Kahn, simple form: megatron appends its f/g nodes at the end of the graph
        node = pending.popleft()
        if all(not i or i not in produced_by or i in ready for i in node.input):
            order.append(node)
            ready.update(node.output)
            stalled = 0
        else:
            pending.append(node)
            stalled += 1
            if stalled > len(pending):
                raise RuntimeError(f"cycle or missing producer at {node.name}")
    return order


class CutRun:
    """One update run of `runtime`'s graph as segments joined by Python all_reduces."""

    def __init__(self, runtime, output_names):
        if runtime.graph.mixed_precision:
            raise NotImplementedError("the cut measurement covers fp32 only")
        self.rt = runtime
        graph = runtime.graph.model.graph
        self.fetches = list(output_names) + [s.updated for s in runtime.graph.states.values()]
        if runtime.has_gradient_norm:
            self.fetches.append(tg.GLOBAL_NORM)
        nodes, collectives = _rewrite(list(graph.node))
        produced_by = {o: n for n in nodes for o in n.output if o}
        # _needed walks collectives too: give them a node-like stand-in
        stand_ins = {y: helper.make_node("Identity", [x], [y], name=f"collective_{y}")
                     for x, y in collectives}
        walk = {**produced_by, **stand_ins}
        order = _needed(nodes + list(stand_ins.values()), self.fetches, walk)
        collective_nodes = {id(n) for n in stand_ins.values()}
        avail, segment_of, self.boundaries = {}, {}, collections.defaultdict(list)
        for node in order:
            seg = max((avail.get(i, 0) for i in node.input if i), default=0)
            if id(node) in collective_nodes:
                avail[node.output[0]] = seg + 1
                self.boundaries[seg].append((node.input[0], node.output[0]))
            else:
                segment_of[id(node)] = seg
                for o in node.output:
                    avail[o] = seg
        count = max(segment_of.values()) + 1
        segments = [[n for n in order if segment_of.get(id(n)) == s] for s in range(count)]
        # who reads what, across segments and collectives
        readers = collections.defaultdict(set)  # tensor -> segments (or "c") reading it
        for s, seg_nodes in enumerate(segments):
            for n in seg_nodes:
                for i in n.input:
                    readers[i].add(s)
        reduced_inputs = {x for pairs in self.boundaries.values() for x, _ in pairs}
        graph_inputs = {i.name: i for i in graph.input}
        # typed tensors: what the graph declares (ReduceAllL2's output type cannot be inferred), then
        # what onnx infers; the rest is typed by the session that produces it
        known = {v.name: v for v in graph.value_info}
        try:
            inferred = onnx.shape_inference.infer_shapes(runtime.graph.model).graph.value_info
            known = {**{v.name: v for v in inferred if v.type.tensor_type.elem_type}, **known}
        except Exception:  # noqa: BLE001 -- contrib ops: inference is a help, not a need
            pass
        known.update({o.name: o for o in graph.output})
        inits = {i.name: i for i in graph.initializer}
        options = runtime.session.get_session_options()
        providers = runtime.session.get_providers()
        self.types, self.sessions, self.seg_inputs, self.seg_outputs = {}, [], [], []
        for s, seg_nodes in enumerate(segments):
            produced = {o for n in seg_nodes for o in n.output if o}
            read = [i for n in seg_nodes for i in n.input if i and i not in produced and i not in inits]
            inputs = list(dict.fromkeys(read))
            outputs = [o for n in seg_nodes for o in n.output
                       if o and (o in self.fetches or o in reduced_inputs or readers[o] - {s})]
            used_inits = {i for n in seg_nodes for i in n.input if i in inits}
            infos = []
            for name in inputs:
                if name in graph_inputs:
                    infos.append(graph_inputs[name])
                elif name in known:
                    infos.append(known[name])
                else:
                    infos.append(helper.make_tensor_value_info(name, self.types[name], None))
            outs = [known.get(o, onnx.ValueInfoProto(name=o)) for o in outputs]
            inner = [known[o] for o in produced if o in known and o not in outputs]
            model = helper.make_model(
                helper.make_graph(seg_nodes, f"segment_{s}", infos, outs, [inits[i] for i in used_inits],
                                  value_info=inner),
                opset_imports=runtime.graph.model.opset_import, ir_version=runtime.graph.model.ir_version)
            session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
            for out in session.get_outputs():
                self.types[out.name] = _ORT_TYPES[out.type]
            for x, y in self.boundaries.get(s, ()):
                self.types[y] = self.types.get(x, onnx.TensorProto.FLOAT)
            self.sessions.append(session)
            self.seg_inputs.append(inputs)
            self.seg_outputs.append(outputs)
        # a collective's input is reduced in place unless something else reads the unreduced value
        self.clone = {x for x in reduced_inputs if readers[x] or x in graph_inputs}
        self.run_options = ort.RunOptions()
        self.run_options.training_mode = True

    def _fixed(self):
        """{graph input: tensor} and {graph output: tensor}, as Runtime._make_binding binds an update."""
        rt = self.rt
        inputs = {n: p[rt._parity] for n, p in rt._pairs.items()}
        if rt.graph.uses_training_mode:
            inputs[tg.TRAINING_MODE] = rt._train_mode
        inputs.update(rt._scalars)
        inputs.update(rt._accumulators)
        outputs = {rt.graph.states[n].updated: p[1 - rt._parity] for n, p in rt._pairs.items()}
        if rt.has_gradient_norm:
            outputs[tg.GLOBAL_NORM] = rt.gradient_norm
        return inputs, outputs

    def run(self, inputs, output_names):
        rt = self.rt
        fixed_in, fixed_out = self._fixed()
        values = {**fixed_in, **inputs}
        for s, session in enumerate(self.sessions):
            binding = session.io_binding()
            for name in self.seg_inputs[s]:
                rt._bind_tensor(binding, name, values[name])
            for name in self.seg_outputs[s]:
                if name in fixed_out:
                    rt._bind_tensor(binding, name, fixed_out[name], output=True)
                else:
                    binding.bind_output(name, rt.device.type, rt.device.index or 0)
            session.run_with_iobinding(binding, self.run_options)
            for name, value in zip(self.seg_outputs[s], binding._iobinding.get_outputs()):
                if name not in fixed_out:
                    tensor = torch.from_dlpack(value.to_dlpack())
                    # dlpack hands bool as uint8: the same bytes, viewed back
                    is_bool = self.types[name] == onnx.TensorProto.BOOL
                    values[name] = tensor.view(torch.bool) if is_bool else tensor
            for x, y in self.boundaries.get(s, ()):
                values[y] = megatron._all_reduce(values[x].clone() if x in self.clone else values[x])
        return [values[n] for n in output_names]


_original_run = Runtime.run
_cuts = {}


def _cut_run(self, kind, inputs, outputs=None, *, lr=None, gradient_scale=None, loss_scale=None):
    if kind != "update":
        return _original_run(self, kind, inputs, outputs, lr=lr, gradient_scale=gradient_scale,
                             loss_scale=loss_scale)
    output_names = tuple(outputs or self.graph.outputs)
    key = (id(self), output_names)
    if key not in _cuts:
        _cuts[key] = CutRun(self, output_names)
    self.set_scalars(lr=lr, gradient_scale=gradient_scale, loss_scale=loss_scale)
    with python_op.function_errors():
        results = _cuts[key].run(inputs, output_names)
    self._parity = 1 - self._parity
    self._scalars[tg.LAZY_RESET].fill_(True)
    return results, None


def install():
    """Route every Runtime's update run of this process through a CutRun."""
    Runtime.run = _cut_run


def segments_of(runtime):
    """[(sessions, collectives)] of the CutRuns built for `runtime` (for the report)."""
    return [(len(c.sessions), sum(len(v) for v in c.boundaries.values()))
            for (rid, _), c in _cuts.items() if rid == id(runtime)]
