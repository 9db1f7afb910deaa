"""Data parallel and ZeRO stage 1 over torch.distributed: the flat layout of the gradients (and, for
ZeRO, the weights) and the collectives between a step's runs (the group itself: process_group.py).

The wheel has no in-graph collectives (docs/ort-notes.md, "Distributed"), so a distributed step is
three phases around ONE session per process:

    micro run   forward + backward, InPlaceAccumulatorV2 into views of one flat gradient buffer
    torch       all_reduce (data parallel) or reduce-scatter (ZeRO-1) of that buffer, in place
    apply run   only the optimizer nodes, reading the reduced gradients     (+ all_gather, ZeRO-1)

Rank r of N owns the r-th of N equal chunks of the flat buffer (padded to a multiple of N); under
ZeRO-1 it keeps optimizer state only for the weight segments inside its chunk.
"""

import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from orttrainer.placement import device as placement
from orttrainer.engine.graph import training_graph as tg
from orttrainer.engine.graph.optimizer_graph import direction_square_sum
from orttrainer.placement.process_group import ProcessGroup
from orttrainer.engine.runtime.session import Runtime

@dataclass(frozen=True)
class Segment:
    """The part of one weight that lies inside this rank's chunk: elements [start, stop) of the
    flattened weight, at `flat_start` in the flat buffer."""

    weight: str
    start: int
    stop: int
    flat_start: int

    @property
    def size(self):
        return self.stop - self.start


class FlatLayout:
    """Weights laid end to end (in the given order) in one flat fp32 buffer, each starting on a
    64-byte boundary (as a tensor of its own would: sgemm reads aligned rows faster), padded to a
    multiple of `world_size` so that every rank's chunk has the same size. Padding is never written
    by any run, so it stays zero through every reduction."""

    ALIGN = 16  # elements of fp32: 64 bytes

    def __init__(self, shapes: dict, world_size: int):
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.offsets = {}
        offset = 0
        for name, shape in self.shapes.items():
            offset = -(-offset // self.ALIGN) * self.ALIGN
            self.offsets[name] = offset
            offset += math.prod(shape)
        self.numel = offset
        self.world_size = world_size
        self.chunk = -(-offset // world_size) if offset else 0
        self.padded = self.chunk * world_size

    def empty(self, device, dtype=torch.float32):
        """A zeroed flat buffer whose first element is 64-byte aligned."""
        extra = self.ALIGN
        raw = torch.zeros(self.padded + extra, dtype=dtype, device=device)
        skip = (-raw.data_ptr() // raw.element_size()) % self.ALIGN
        return raw[skip:skip + self.padded]

    def views(self, flat):
        """{weight: view of `flat` with the weight's shape}."""
        return {name: flat[self.offsets[name]:self.offsets[name] + math.prod(shape)].view(shape)
                for name, shape in self.shapes.items()}

    def chunk_range(self, rank):
        return rank * self.chunk, (rank + 1) * self.chunk

    def segments(self, rank):
        """The weight segments in rank's chunk, in flat order."""
        lo, hi = self.chunk_range(rank)
        found = []
        for name, shape in self.shapes.items():
            start, size = self.offsets[name], math.prod(shape)
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                found.append(Segment(name, a - start, b - start, a))
        return found


@dataclass
class _FlatBuffers:
    """The distributed runtime's part of the shared TrainingState (`state.distributed`)."""

    layout: FlatLayout
    flat_gradients: torch.Tensor
    flat_weights: torch.Tensor | None
    reduced: torch.Tensor
    reduce_scatter_out: torch.Tensor | None
    global_norm: torch.Tensor
    direction_norms: torch.Tensor
    direction_square_sums: torch.Tensor
    micro_steps_in_window: int = 0
    adasum: object = None  # adasum.Adasum when distributed.enable_adasum (its groups are made once)


class DistributedRuntime(Runtime):
    """A Runtime whose train step is micro run → torch.distributed → apply run (module docstring).

    Gradients accumulate into views of `flat_gradients`. Data parallel reduces that buffer in place
    and the apply run reads it whole; ZeRO-1 reduce-scatters it into this rank's chunk, updates the
    segments of `flat_weights` inside the chunk, then all-gathers the chunks. With
    `allreduce_post_accumulation=False` every micro-step's gradient is reduced and summed into a
    window buffer (same result, `gradient_accumulation_steps` times the traffic).
    """

    def __init__(self, graph: tg.TrainingGraph, group: ProcessGroup, *, gradient_accumulation_steps,
                 allreduce_post_accumulation, check_finite, adasum=False, sharded=frozenset(),
                 **runtime_options):
        super().__init__(graph, **runtime_options)
        self.group = group
        self.sharded = sharded  # tensor parallel: the weights this rank holds a shard of
        self.segments = graph.partition.segments  # None: data parallel
        self.check_finite = check_finite
        self.use_adasum = adasum and group.active  # one rank: Adasum of one update is that update
        self.per_micro_step = (not allreduce_post_accumulation and gradient_accumulation_steps > 1
                               and group.active and not self.use_adasum)
        # Wall seconds per phase since the session started (bench/distributed_bench.py reads them).
        self.seconds = {"micro": 0.0, "communication": 0.0, "apply": 0.0}
        if self.state.distributed is None:
            self.state.distributed = self._create_flat_buffers(group)
        buffers = self.state.distributed
        self.layout = buffers.layout
        self.flat_gradients, self.flat_weights = buffers.flat_gradients, buffers.flat_weights
        self.reduced, self._reduce_scatter_out = buffers.reduced, buffers.reduce_scatter_out
        self._global_norm = buffers.global_norm
        self._direction_norms, self._direction_square_sums = buffers.direction_norms, buffers.direction_square_sums
        if self.segments is not None:  # ZeRO-1 computes the global norm in torch (`_apply`)
            self.has_gradient_norm = True
        self.adasum = buffers.adasum

    @property
    def _micro_steps_in_window(self):
        return self.state.distributed.micro_steps_in_window

    @_micro_steps_in_window.setter
    def _micro_steps_in_window(self, value):
        self.state.distributed.micro_steps_in_window = value

    def _create_flat_buffers(self, group):
        """The flat buffers, created once per trainer: gradients accumulate into views of one flat
        buffer; under ZeRO-1 the weights become views of another. Later Runtimes adopt them."""
        device, graph = self.device, self.graph
        layout = FlatLayout({w: tuple(self._pairs[w][0].shape) for w in graph.weights}, group.world_size)
        flat_gradients = layout.empty(device)
        for w, view in layout.views(flat_gradients).items():
            self._accumulators[tg.accumulation_buffer(w)] = view
        flat_weights = None
        if self.segments is not None:
            flat_weights = layout.empty(device)
            for w, view in layout.views(flat_weights).items():
                view.copy_(self._pairs[w][0])
                self._pairs[w] = (view, view)
                # The flat buffer holds the weight now; the graph's initial value (whose memory the
                # replaced tensor shared) is only read for its shape and dtype from here on.
                spec = graph.states[w]
                spec.initial = np.broadcast_to(np.zeros((), spec.initial.dtype), spec.initial.shape)
        # What the apply run reads (a fixed tensor: bindings hold its address): the reduced flat buffer
        # (data parallel) or this rank's chunk of it (ZeRO-1, where the collective sums in place); a
        # buffer of its own where NCCL reduce-scatters out of place, or per-micro-step sums accumulate.
        in_place = self.segments is None or group.chunks_in_place
        lo, hi = layout.chunk_range(group.rank)
        own = flat_gradients if self.segments is None else flat_gradients[lo:hi]
        reduced = own if in_place and not self.per_micro_step else torch.zeros_like(own)
        direction_norms = torch.zeros([len(graph.weights)], dtype=torch.float32, device=device)
        buffers = _FlatBuffers(
            layout=layout, flat_gradients=flat_gradients, flat_weights=flat_weights, reduced=reduced,
            # Where NCCL's reduce_scatter writes a micro-step's sum before it is added to the window.
            reduce_scatter_out=None if in_place else (reduced if not self.per_micro_step else torch.zeros_like(own)),
            global_norm=torch.zeros([], dtype=torch.float32, device=device),
            direction_norms=direction_norms, direction_square_sums=torch.zeros_like(direction_norms))
        if self.use_adasum:
            from orttrainer.engine.parallel.adasum import Adasum

            # NCCL: sum within a node, Adasum across nodes; gloo: flat (docs/distributed.md, "Adasum").
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if group.backend == "nccl" else 1
            buffers.adasum = Adasum(layout, group, device, local_size=local)
        # Every rank starts from rank 0's weights: ranks that built their models from different seeds
        # would otherwise train different models under one name. (Optimizer state starts at fixed
        # values, and under ZeRO-1 differs in shape between ranks.) Only here: a later Runtime
        # adopting these buffers is built by one rank alone, so it must not call a collective.
        if self.segments is not None:
            group.broadcast_(flat_weights)
        else:
            for w in self.graph.weights:
                group.broadcast_(self._pairs[w][self._parity])
        self._wait_for_torch()
        return buffers

    # ------------------------------------------------------------------ views the apply run binds
    def _reduced_views(self):
        """{weight: view of `self.reduced` holding its reduced gradient (segment under ZeRO-1)}."""
        if self.segments is None:
            return self.layout.views(self.reduced)
        lo, _ = self.layout.chunk_range(self.group.rank)
        return {w: self.reduced[s.flat_start - lo:s.flat_start - lo + s.size] for w, s in self.segments.items()}

    def _shard_views(self):
        return {w: self.flat_weights[s.flat_start:s.flat_start + s.size] for w, s in self.segments.items()}

    def _tensor_parallel_square(self):
        """Σ g² of this rank's reduced gradients over the whole model: replicated weights (equal on the
        horizontal ranks) once, shards summed over the horizontal group. Summed apart, so every
        horizontal rank gets the same bits (their replicas must stay equal)."""
        from orttrainer.engine.parallel.megatron import _all_reduce

        views = self._reduced_views()

        def square_sum(names):
            sums = [views[w].square().sum() for w in names]
            return torch.stack(sums).sum() if sums else torch.zeros([], device=self.reduced.device)

        shards = _all_reduce(square_sum([w for w in views if w in self.sharded]).clone())
        return square_sum([w for w in views if w not in self.sharded]) + shards

    def _make_binding(self, kind, output_names):
        if kind not in ("apply", "lamb_norms"):
            return super()._make_binding(kind, output_names)
        binding = self._optimizer_binding()
        for w, view in self._reduced_views().items():
            self._bind_tensor(binding, tg.reduced_gradient(w), view)
        if self.segments is not None:
            shards = self._shard_views()
            for w, view in shards.items():
                self._bind_tensor(binding, tg.weight_shard(w), view)
            for name, tensor in ((tg.GLOBAL_NORM, self._global_norm),
                                 (tg.LAMB_DIRECTION_NORMS, self._direction_norms)):
                if name in self.input_names:
                    self._bind_tensor(binding, name, tensor)
        elif kind == "apply" and self.has_gradient_norm:
            self._bind_tensor(binding, tg.GLOBAL_NORM, self.gradient_norm, output=True)
        if kind == "lamb_norms":
            for w in self.segments:
                index = self.graph.weights.index(w)
                self._bind_tensor(binding, direction_square_sum(w), self._direction_square_sums[index], output=True)
            return binding
        for name, pair in self._pairs.items():
            if self.segments is not None and name in self.layout.shapes:
                if name in self.segments:  # in place: the segment's update overwrites it
                    self._bind_tensor(binding, tg.updated_name(tg.weight_shard(name)), shards[name], output=True)
            else:
                self._bind_tensor(binding, self.graph.states[name].updated, pair[1 - self._parity], output=True)
        return binding

    def _execute(self, kind):
        binding = self._binding(kind, (), ())
        placement.wait_for_torch(self.device)  # the norms and scalars torch just wrote (CUDA streams)
        self.session.run_with_iobinding(binding, self._run_options[kind])

    # ------------------------------------------------------------------ the step
    def _timed(self, phase, started):
        now = time.perf_counter()
        self.seconds[phase] += now - started
        return now

    def _reduce(self):
        """This micro-step's (or window's) gradients summed over ranks; returns where they are."""
        started = time.perf_counter()
        if self.segments is None:
            out = self.group.all_reduce_(self.flat_gradients, "all_reduce of the gradients")
        else:
            out = self.group.reduce_scatter(self.flat_gradients, self._reduce_scatter_out)
        self._wait_for_torch()
        self._timed("communication", started)
        return out

    def _wait_for_torch(self):
        """CUDA: NCCL's results are ordered on torch's stream, onnxruntime runs on its own; its next run
        must not start before they land. (The CPU is synchronous. Not run here: no GPU on this machine.)"""
        placement.wait_for_torch(self.device)

    def train(self, inputs, outputs=None, *, update, lr, gradient_scale, loss_scale):
        started = time.perf_counter()
        results, _ = self.run("micro", inputs, outputs, loss_scale=loss_scale)
        self._timed("micro", started)
        self._micro_steps_in_window += 1
        if self.per_micro_step:
            reduced = self._reduce()
            if self._micro_steps_in_window == 1:
                self.reduced.copy_(reduced)
            else:
                self.reduced.add_(reduced)
            self._scalars[tg.LAZY_RESET].fill_(True)  # the next micro run overwrites the flat buffer
        if not update:
            return results, None
        if self.adasum is not None:
            finite = self.adasum.step(self, lr, gradient_scale)
        else:
            if not self.per_micro_step:
                self._reduce()  # into self.reduced
            finite = self._apply(lr, gradient_scale)
        self._micro_steps_in_window = 0
        self._scalars[tg.LAZY_RESET].fill_(True)
        return results, torch.tensor([finite])

    def _apply(self, lr, gradient_scale):
        """Scale, clip and update from the reduced gradients, then (ZeRO-1) all-gather the weights.
        Every rank sees the same reduced values, so every rank takes the same skip decision."""
        zero = self.segments is not None
        started = time.perf_counter()
        if zero or self.check_finite:
            # ‖scaled gradient‖ over every rank's chunk (data parallel: the whole, identical buffer)
            square = torch.linalg.vector_norm(self.reduced).square()
            if self.sharded:  # shards' squares summed over the horizontal group, replicas' once
                square = self._tensor_parallel_square()
            if zero:
                self.group.all_reduce_(square, "all_reduce of the gradient norm")
            norm = square.sqrt() * gradient_scale
            if self.check_finite and not bool(torch.isfinite(norm)):
                self._timed("communication", started)
                return False
            self._global_norm.copy_(norm)
            self.gradient_norm.copy_(norm)
        started = self._timed("communication", started)
        self.set_scalars(lr=lr, gradient_scale=gradient_scale)
        if zero and tg.LAMB_DIRECTION_NORMS in self.input_names:
            self._direction_square_sums.zero_()
            self._execute("lamb_norms")
            self.group.all_reduce_(self._direction_square_sums, "all_reduce of LAMB's direction norms")
            if self.sharded:  # a shard's direction: summed over the horizontal group too
                from orttrainer.engine.parallel.megatron import _all_reduce

                index = [self.graph.weights.index(w) for w in self.graph.weights if w in self.sharded]
                sums = _all_reduce(self._direction_square_sums[index].clone())
                self._direction_square_sums[index] = sums
            torch.sqrt(self._direction_square_sums, out=self._direction_norms)
        self._execute("apply")
        self._parity = 1 - self._parity  # counters are ping-pong pairs; everything else is in place
        started = self._timed("apply", started)
        if zero:
            self.group.all_gather_chunks_(self.flat_weights)
            self._wait_for_torch()
            self._timed("communication", started)
        return True

    # ------------------------------------------------------------------ state
    def accumulators(self):
        if self.group.active:  # each rank holds only its own, unreduced part of the window
            return {}
        return super().accumulators()

    def load_accumulators(self, values: dict):
        super().load_accumulators(values)
        self._micro_steps_in_window = 0 if not values else 1
