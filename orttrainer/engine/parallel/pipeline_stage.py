"""Pipeline parallel, the run side: one stage per process, its own onnxruntime session, a 1F1B schedule
with torch.distributed point-to-point between neighbouring stages (docs/distributed.md, "Pipeline
parallel").

A stage's training graph is the ordinary one (training_graph.build_training_graph) of its forward
sub-model (pipeline_cut.stage_model). A non-last stage's loss is sum(y · dy) over the tensors y it sends,
dy fed from the next stage: its gradient is exactly dy back-propagated. The graph also outputs the
gradients of the received tensors, which go back to the stage before.

Built in the distributed form with each weight one whole "segment": micro runs accumulate gradients in
place; the apply run reads them (tied weights first summed over the stages that read them), with the
global gradient norm summed over stages in torch and fed, so clipping sees every stage's gradients.
"""

import datetime
import functools
import time

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from orttrainer.placement import process_group as _process_group
from orttrainer.engine.parallel import pipeline_cut as cut
from orttrainer.engine.graph import training_graph as tg
from orttrainer.engine.parallel.data_parallel import Segment
from orttrainer.engine.graph.optimizer_graph import direction_square_sum
from orttrainer.placement.process_group import DistributedError
from orttrainer.engine.runtime.session import Runtime
from orttrainer.placement.dims import ParallelDims

PIPELINE_LOSS = "__pipeline_stage_loss"
_HEADER = 9  # ndim + up to 8 dims
_DTYPES = {TensorProto.FLOAT: torch.float32, TensorProto.INT64: torch.int64, TensorProto.INT32: torch.int32,
           TensorProto.BOOL: torch.bool, TensorProto.FLOAT16: torch.float16, TensorProto.DOUBLE: torch.float64}


def dy_name(tensor):
    """The input of a non-last stage that receives d(loss)/d(tensor) from the next stage."""
    return f"{tensor}__pipeline_dy"


# ---------------------------------------------------------------------- point-to-point
class Links:
    """Sends (kept until `flush`) and receives to and from other stages, every wait with the timeout."""

    def __init__(self, rank, world_of=lambda stage: stage):
        self.rank = rank
        self.world_of = world_of  # stage index -> world rank of that stage in this pipeline
        self.timeout = datetime.timedelta(seconds=_process_group.timeout_seconds())
        self._pending = []
        self.waited = 0.0  # seconds blocked on peers: the bubble, plus transfer time

    def _wait(self, work, what):
        started = time.perf_counter()
        try:
            work.wait(self.timeout)
            self.waited += time.perf_counter() - started
        except RuntimeError as exc:
            raise DistributedError(
                f"pipeline stage {self.rank}: {what} failed: {exc}\nThe other stage has probably exited or "
                f"stopped answering; its own log says why ({_process_group.TIMEOUT_ENV} sets the timeout).") from exc

    def send(self, tensor, peer, with_shape=True):
        tensor = tensor.contiguous()
        if with_shape:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0] = tensor.dim()
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            self._pending.append((torch.distributed.isend(header, self.world_of(peer)), header, peer))
        self._pending.append((torch.distributed.isend(tensor, self.world_of(peer)), tensor, peer))

    def recv(self, peer, dtype, shape=None):
        if shape is None:
            header = torch.empty(_HEADER, dtype=torch.int64)
            self._wait(torch.distributed.irecv(header, self.world_of(peer)), f"receiving a shape from stage {peer}")
            shape = header[1:1 + int(header[0])].tolist()
        tensor = torch.empty(shape, dtype=dtype)
        self._wait(torch.distributed.irecv(tensor, self.world_of(peer)), f"receiving a tensor from stage {peer}")
        return tensor

    def flush(self):
        pending, self._pending = self._pending, []
        for work, _, peer in pending:
            self._wait(work, f"sending to stage {peer}")


def broadcast_outputs(tensors, source, dtypes, group=None):
    """`tensors` (on world rank `source`) on every rank of `group`: shapes first, then the data."""
    out = []
    for index, dtype in enumerate(dtypes):
        header = torch.zeros(_HEADER, dtype=torch.int64)
        if tensors is not None:
            t = tensors[index]
            header[0] = t.dim()
            header[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        torch.distributed.broadcast(header, source, group=group)
        value = tensors[index].contiguous() if tensors is not None else \
            torch.empty(header[1:1 + int(header[0])].tolist(), dtype=dtype)
        torch.distributed.broadcast(value, source, group=group)
        out.append(value)
    return out


# ---------------------------------------------------------------------- one stage's session
class StageRuntime(Runtime):
    """A Runtime whose optimizer step reads the accumulated gradients after the stages agreed on the
    global norm and summed the tied weights' gradients (module docstring)."""

    def __init__(self, graph, *, shared, norm_owner, data_group=None, pipeline_group=None, **runtime_options):
        super().__init__(graph, **runtime_options)
        opts = self._run_options["micro"].__class__()
        opts.only_execute_path_to_fetches = True
        opts.training_mode = True
        self._run_options["forward"] = opts  # a 1F1B forward slot: training-mode forward only
        self.shared = shared  # [(weight, process group of the stages reading it)]
        self.norm_owner = norm_owner  # weights whose square norm this stage adds (a tied one once)
        self.data_group = data_group  # the ranks of this stage in the other pipelines (None: no data parallel)
        self.pipeline_group = pipeline_group  # the stages of this pipeline
        self.has_gradient_norm = tg.GLOBAL_NORM in self.input_names
        self._global_norm = torch.zeros([], dtype=torch.float32)
        self._direction_norms = torch.zeros([len(graph.weights)], dtype=torch.float32)
        self._direction_square_sums = torch.zeros_like(self._direction_norms)

    def _flat(self, tensor):
        return tensor.view(-1)

    def _make_binding(self, kind, output_names):
        if kind not in ("apply", "lamb_norms"):
            return super()._make_binding(kind, output_names)
        binding = self._optimizer_binding()
        for w in self.graph.weights:
            gradient = self._accumulators[tg.accumulation_buffer(w)]
            self._bind_tensor(binding, tg.reduced_gradient(w), self._flat(gradient))
            self._bind_tensor(binding, tg.weight_shard(w), self._flat(self._pairs[w][0]))
        for name, tensor in ((tg.GLOBAL_NORM, self._global_norm), (tg.LAMB_DIRECTION_NORMS, self._direction_norms)):
            if name in self.input_names:
                self._bind_tensor(binding, name, tensor)
        if kind == "lamb_norms":
            for index, w in enumerate(self.graph.weights):
                self._bind_tensor(binding, direction_square_sum(w), self._direction_square_sums[index], output=True)
            return binding
        for name, pair in self._pairs.items():
            if name in self.graph.weights:  # in place: the update overwrites the weight itself
                self._bind_tensor(binding, tg.updated_name(tg.weight_shard(name)), self._flat(pair[0]), output=True)
            else:
                self._bind_tensor(binding, self.graph.states[name].updated, pair[1 - self._parity], output=True)
        return binding

    def _execute(self, kind):
        self.session.run_with_iobinding(self._binding(kind, (), ()), self._run_options[kind])

    def apply(self, lr, gradient_scale):
        """The optimizer step on the window's accumulated gradients (every stage calls it together)."""
        if self.data_group is not None:  # summed over the data-parallel replicas of this stage first
            for w in self.graph.weights:
                _collective(torch.distributed.all_reduce, self._accumulators[tg.accumulation_buffer(w)],
                            group=self.data_group, what=f"data-parallel all_reduce of {w}'s gradient")
        for w, group in self.shared:
            buffer = self._accumulators[tg.accumulation_buffer(w)]
            _collective(torch.distributed.all_reduce, buffer, group=group, what=f"all_reduce of tied {w}'s gradient")
        square = torch.zeros([], dtype=torch.float32)
        for w in self.norm_owner:
            square += torch.linalg.vector_norm(self._accumulators[tg.accumulation_buffer(w)]).square()
        _collective(torch.distributed.all_reduce, square, group=self.pipeline_group,
                    what="all_reduce of the gradient norm")
        norm = square.sqrt() * gradient_scale
        self._global_norm.copy_(norm)
        self.gradient_norm.copy_(norm)
        self.set_scalars(lr=lr, gradient_scale=gradient_scale)
        # A stage whose weights are all frozen (say, a frozen embedding cut off alone) has nothing to
        # update: its apply run would have no output, which onnxruntime refuses to run.
        if self.graph.weights:
            if tg.LAMB_DIRECTION_NORMS in self.input_names:  # whole weights: this stage's norms are complete
                self._direction_square_sums.zero_()
                self._execute("lamb_norms")
                torch.sqrt(self._direction_square_sums, out=self._direction_norms)
            self._execute("apply")
            self._parity = 1 - self._parity
        self._scalars[tg.LAZY_RESET].fill_(True)


def _collective(operation, tensor, what, **kwargs):
    try:
        operation(tensor, **kwargs)
    except RuntimeError as exc:
        raise DistributedError(f"pipeline: {what} failed: {exc}") from exc


# ---------------------------------------------------------------------- the pipeline
class Pipeline:
    """This process's stage: built on the first step from the exported forward model; runs the
    schedule. `factory` is a GraphFactory (export and postprocess only)."""

    def __init__(self, factory, options, rank, dims=None):
        dims = dims or ParallelDims.of(options.distributed)
        self.factory, self.options, self.world_rank, self.dims = factory, options, rank, dims
        self.stages, self.data_size = dims.pipeline, dims.data
        coords = dims.coords(rank)  # stage-major ranks, as the original (placement/dims.py)
        self.rank, self.data_index = coords.pipeline, coords.data  # self.rank: this stage's index
        self.micro_batches = options.distributed.pipeline_parallel.num_pipeline_micro_batches
        self.last = self.rank == self.stages - 1
        self.runtime = None
        self.pending_load = None
        # Wall seconds of train steps, and how much of them this stage waited on its neighbours
        # (bench/pipeline.py reports the ratio as the bubble share).
        # "forward": the forward-only runs of the 1F1B forward slots, which the backward slot recomputes.
        self.seconds = {"step": 0.0, "wait": 0.0, "forward": 0.0}
        if options.mixed_precision.enabled:
            raise NotImplementedError("mixed_precision.enabled with distributed.pipeline_parallel."
                                      "pipeline_parallel_size > 1 is not built: train in fp32, or without pipeline")

    @classmethod
    def of(cls, trainer_graphs, rank, dims):
        """This rank's stage of a trainer (its TrainerGraphs give the export's GraphFactory); None
        without pipeline parallel."""
        if not dims.pipeline_parallel:
            return None
        return cls(trainer_graphs.pipeline_factory(), trainer_graphs.options, rank, dims)

    def step(self, kind, inputs, fetches, steps=None):
        """train_step (`steps`: the trainer's StepAccounting) or eval_step: the outputs on every rank."""
        from orttrainer.engine.runtime.input_checks import check_fetches, check_ranges

        fetches = check_fetches(fetches, self.factory.model_desc.outputs)
        inputs = {n: t.detach().cpu().contiguous() for n, t in inputs.items()}
        if self.runtime is None:
            self.build(inputs)
        # Every stage of a pipeline has the whole batch: a bad token id fails them all here, before
        # anything is sent (not stage 0 alone, with the others waiting out the timeout).
        check_ranges(self.index_ranges, inputs)
        if kind == "eval":
            return self.eval(inputs, fetches)[0]
        step = steps.next_step()
        return steps.run_counted(lambda: self.train(inputs, fetches, **step), step, fetches)

    # ------------------------------------------------------------------ checkpoints (state/pipeline.py)
    def state_dict(self, steps, group, optimizer_name, pytorch_format=False):
        """This stage's state_dict (legacy layout); None before the first step."""
        from orttrainer.state import pipeline as pipeline_state

        if self.runtime is None:
            return None
        state = pipeline_state.state_dict(self, steps, optimizer_name)
        if pytorch_format:
            return {n: torch.from_numpy(np.asarray(v)) for n, v in state["model"]["full_precision"].items()}
        steps.check_window_boundary(group)
        return state

    def load_state_dict(self, state_dict, strict, steps, optimizer_name):
        """This stage's part of a whole-model state_dict; before the first step, at the end of build."""
        from orttrainer.state import pipeline as pipeline_state

        load = functools.partial(pipeline_state.load, self, state_dict, strict, steps, optimizer_name)
        if self.runtime is None:
            self.pending_load = load
        else:
            load()

    # ------------------------------------------------------------------ building
    def build(self, inputs):
        spec = self.factory.spec
        from orttrainer.engine.runtime.input_checks import index_ranges

        forward = cut.infer_types(self.factory.prepare_forward(self.factory.export(inputs)))
        self.index_ranges = index_ranges(forward)
        loss = next(name for name, _, is_loss in spec.outputs if is_loss)
        outputs = [name for name, _, _ in spec.outputs]
        text = self.options.distributed.pipeline_parallel.pipeline_cut_info_string
        if not text:
            text = cut.auto_cut(forward, self.stages, loss, outputs)
        self.cut_string = text
        plan = cut.split(forward, cut.parse_cut_string(text, self.stages), loss, outputs)
        self.plan, self.stage = plan, plan[self.rank]
        self.model_inputs = [i.name for i in forward.graph.input]
        typed = list(forward.graph.value_info) + list(forward.graph.input) + list(forward.graph.output)
        types = {v.name: v.type.tensor_type.elem_type for v in typed}
        self.recv_dtypes = {t: _DTYPES[types[t]] for t in self.stage.received}
        self.output_dtypes = {name: _DTYPES[types[name]] for name in outputs}
        sub = cut.stage_model(forward, self.stage, self.last, loss, outputs)
        if not self.last:
            sub = _with_dot_loss(sub, self.stage.sent)
        candidates = None
        if self.factory.torch_model is not None:
            candidates = {n for n, p in self.factory.torch_model.named_parameters() if p.requires_grad}
        weights = tg.trainable_weights(sub, frozen=set(spec.frozen_weights), candidates=candidates)
        self.grad_inputs = [t for t in self.stage.received if self.recv_dtypes[t] == torch.float32]
        sizes = {i.name: int(np.prod(i.dims)) for i in sub.graph.initializer}
        segments = {w: Segment(w, 0, sizes[w], 0) for w in weights}  # each weight one whole segment
        graph = tg.build_training_graph(
            sub, loss=loss if self.last else PIPELINE_LOSS, outputs=outputs if self.last else list(self.stage.sent),
            weights=weights, optim_config=spec.optim_config, grad_norm_clip=spec.grad_norm_clip,
            partition=tg.Partition(segments), deterministic=spec.deterministic_compute,
            input_gradients=self.grad_inputs, kernels=spec.kernels)
        trainable = set(tg.trainable_weights(forward, frozen=set(spec.frozen_weights), candidates=candidates))
        # What the stage checkpoints read (state/pipeline.py).
        self.forward, self.trainable = forward, trainable
        self.shapes = {i.name: tuple(i.dims) for i in forward.graph.initializer}
        self.aliases = {}
        if self.factory.torch_model is not None:
            from orttrainer.engine.export.torch_export import tied_aliases
            self.aliases = tied_aliases(self.factory.torch_model, set(self.shapes))
        shared, norm_owner, data_group, pipeline_group = self._groups(trainable, weights)
        providers, provider_options, device = self.factory.placement
        with self.factory.session_options() as session_options:
            self.runtime = StageRuntime(graph, shared=shared, norm_owner=norm_owner, data_group=data_group,
                                        pipeline_group=pipeline_group, providers=providers,
                                        provider_options=provider_options, session_options=session_options,
                                        device=device)
        self._start_from_rank0(forward, weights)
        if self.pending_load is not None:  # a load_state_dict before the first step (legacy: deferred)
            pending, self.pending_load = self.pending_load, None
            pending()

    def world_of(self, stage):
        """The world rank of stage `stage` in this rank's pipeline."""
        return self.dims.rank_of(data=self.data_index, pipeline=stage)

    def _groups(self, trainable, weights):
        """([(weight, group)] for weights several stages train, the weights whose norm this stage counts
        (a tied one on its first stage only), this stage's data-parallel group, this pipeline's group).
        `trainable`: the whole model's trained weights, the same on every rank, so every rank makes the
        same groups in the same order (new_group is collective: every rank calls it for every group)."""
        dims, me = self.dims, self.world_rank
        data_group = pipeline_group = None
        if dims.data > 1:
            for ranks in dims.data_groups():
                group = torch.distributed.new_group(ranks)
                if me in ranks:
                    data_group = group
            for ranks in dims.pipeline_groups():
                group = torch.distributed.new_group(ranks)
                if me in ranks:
                    pipeline_group = group
        readers = {}
        for stage in self.plan:
            for w in stage.weights:
                if w in trainable:
                    readers.setdefault(w, []).append(stage.index)
        groups, shared, owner = {}, [], []
        for w in sorted(readers):
            ranks = tuple(readers[w])
            if len(ranks) > 1 and ranks not in groups:
                for d in range(dims.data):  # one group per pipeline; this rank keeps its own
                    group = torch.distributed.new_group([dims.rank_of(data=d, pipeline=s) for s in ranks])
                    if d == self.data_index:
                        groups[ranks] = group
            if w in weights:
                if len(ranks) > 1:
                    shared.append((w, groups[ranks]))
                if ranks[0] == self.rank:
                    owner.append(w)
        return shared, owner, data_group, pipeline_group

    def _start_from_rank0(self, forward, weights):
        """Every stage's weights from rank 0's model (ranks may have built theirs from other seeds)."""
        values = {i.name: i for i in forward.graph.initializer}
        for name in sorted(values):
            init = values[name]
            if init.data_type != TensorProto.FLOAT:
                continue
            mine = self.runtime.current(name) if name in weights else \
                torch.from_numpy(onnx.numpy_helper.to_array(init).copy())
            _collective(torch.distributed.broadcast, mine, src=0, what=f"broadcast of rank 0's {name}")

    # ------------------------------------------------------------------ micro-batches
    def slice(self, inputs):
        """The batch as `num_pipeline_micro_batches` feeds (legacy sliced_* options)."""
        pipe = self.options.distributed.pipeline_parallel
        m = self.micro_batches
        names = list(pipe.sliced_tensor_names) or [n for n, t in inputs.items() if t.dim() > 0]
        pieces = [dict() for _ in range(m)]
        for name, tensor in inputs.items():
            if name not in names:
                for p in pieces:
                    p[name] = tensor
                continue
            axis = _lookup(pipe.sliced_axes, name, 0)
            if tensor.shape[axis] % m:
                raise ValueError(f"input {name!r} has {tensor.shape[axis]} rows on axis {axis}, not a multiple of "
                                 f"distributed.pipeline_parallel.num_pipeline_micro_batches={m}: give a batch "
                                 "that divides into equal micro-batches")
            for p, part in zip(pieces, torch.tensor_split(tensor, m, dim=axis)):
                expected = _lookup(pipe.sliced_schema, name, None)
                if expected is not None and list(part.shape) != list(expected):
                    raise ValueError(f"input {name!r}: a micro-batch has shape {list(part.shape)} but "
                                     f"distributed.pipeline_parallel.sliced_schema says {list(expected)}")
                p[name] = part.contiguous()
        return pieces

    def _feed(self, piece):
        return {n: t for n, t in piece.items() if n in self.runtime.input_names}

    # ------------------------------------------------------------------ steps
    def train(self, inputs, fetches, *, update, lr, gradient_scale, loss_scale):
        """One train_step over all micro-batches (1F1B); returns (outputs on every rank, None)."""
        started = time.perf_counter()
        pieces = self.slice(inputs)
        names = list(fetches or self.output_dtypes)
        links, s, count = Links(self.rank, self.world_of), self.rank, len(pieces)
        kept, shapes, results = {}, {}, []
        runtime = self.runtime

        def forward(m):
            feed = self._feed(pieces[m])
            for t in self.stage.received:
                feed[t] = links.recv(s - 1, self.recv_dtypes[t])
            kept[m] = feed
            if not self.last:  # the last stage runs forward and backward together
                started_forward = time.perf_counter()
                ys, _ = runtime.run("forward", feed, list(self.stage.sent))
                self.seconds["forward"] += time.perf_counter() - started_forward
                shapes[m] = [y.shape for y in ys]
                for y in ys:
                    links.send(y, s + 1)

        def backward(m):
            feed = kept.pop(m)
            if not self.last:
                for t, shape in zip(self.stage.sent, shapes.pop(m)):
                    feed[dy_name(t)] = links.recv(s + 1, torch.float32, shape)
            wanted = (names if self.last else list(self.stage.sent)) + [f"{t}_grad" for t in self.grad_inputs]
            out, _ = runtime.run("micro", feed, wanted)
            if self.last:
                results.append([o.clone() for o in out[:len(names)]])
            for g in out[len(wanted) - len(self.grad_inputs):]:
                links.send(g, s - 1, with_shape=False)

        done_f = done_b = 0
        for _ in range(min(self.stages - 1 - s, count)):  # warm-up: fill the pipeline
            forward(done_f)
            done_f += 1
        while done_b < count:  # steady state: one forward, one backward; then drain
            if done_f < count:
                forward(done_f)
                done_f += 1
            backward(done_b)
            done_b += 1
        links.flush()
        if update:
            runtime.apply(lr, gradient_scale / count)
        gathered = self._gather(results, names)
        self.seconds["step"] += time.perf_counter() - started
        self.seconds["wait"] += links.waited
        return gathered, None

    def eval(self, inputs, fetches):
        """Forward through the stages on the whole batch, dropout off; outputs on every rank."""
        names = list(fetches or self.output_dtypes)
        links, s = Links(self.rank, self.world_of), self.rank
        feed = self._feed(inputs)
        for t in self.stage.received:
            feed[t] = links.recv(s - 1, self.recv_dtypes[t])
        out, _ = self.runtime.run("eval", feed, names if self.last else list(self.stage.sent))
        results = [[o.clone() for o in out]] if self.last else []
        if not self.last:
            for y in out:
                links.send(y, s + 1)
        links.flush()
        return self._gather(results, names), None

    def _gather(self, results, names):
        """The micro-batches' outputs combined (0-d: mean; else concatenated on axis 0), on every rank."""
        merged = None
        if self.last:
            merged = [torch.stack(parts).mean(0) if parts[0].dim() == 0 else torch.cat(parts, 0)
                      for parts in zip(*results)]
        return broadcast_outputs(merged, self.world_of(self.stages - 1), [self.output_dtypes[n] for n in names],
                                 group=self.runtime.pipeline_group)


def _lookup(options_dict, name, default):
    """An entry of a dict-valued option (the options wrap dicts in attribute objects)."""
    if isinstance(options_dict, dict):
        return options_dict.get(name, default)
    return getattr(options_dict, name, default)


def _with_dot_loss(model, sent):
    """A non-last stage's forward with the loss sum(y · dy) over its sent tensors y (dy: inputs)."""
    graph = model.graph
    infos = {o.name: o for o in graph.output}
    terms = []
    for y in sent:
        info = infos[y]
        if info.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        dy = helper.make_tensor_value_info(dy_name(y), TensorProto.FLOAT, None)
        dy.type.tensor_type.shape.CopyFrom(info.type.tensor_type.shape)
        graph.input.append(dy)
        product = f"{y}__pipeline_prod"
        graph.node.append(helper.make_node("Mul", [y, dy_name(y)], [product], name=f"{product}_node"))
        graph.node.append(helper.make_node("ReduceSum", [product], [f"{product}_sum"], name=f"{product}_sum_node",
                                           keepdims=0))
        terms.append(f"{product}_sum")
    if not terms:
        raise cut.PipelineCutError(f"the cut after a stage sends only non-float tensors {list(sent)}: no "
                                   "gradient can flow back through it; cut at a float activation")
    total = terms[0]  # Add, not Sum: onnxruntime-training has no gradient for Sum
    for index, term in enumerate(terms[1:]):
        total_next = f"{PIPELINE_LOSS}_{index}"
        graph.node.append(helper.make_node("Add", [total, term], [total_next], name=f"{total_next}_node"))
        total = total_next
    graph.node.append(helper.make_node("Identity", [total], [PIPELINE_LOSS], name=f"{PIPELINE_LOSS}_node"))
    graph.output.insert(0, helper.make_tensor_value_info(PIPELINE_LOSS, TensorProto.FLOAT, []))
    return model

