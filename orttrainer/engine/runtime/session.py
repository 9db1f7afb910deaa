"""Runs a TrainingGraph in one onnxruntime InferenceSession, with all state in torch tensors.

All state lives in a `state.TrainingState` that several Runtimes of one trainer share (one session per
input signature, see `lifecycle`). Weights and moments are updated in place: the update's output is
bound to its input buffer (the graph orders every update after the last reader of any weight, see
`training_graph`). Counters, and
under mixed precision every state, have two buffers ("ping-pong"): a step reads the current one and
writes the other, then the roles swap, so a non-finite step is discarded by not swapping. Nothing
is copied per step.

IOBindings are built once per (kind of run, parity, fed inputs, fetched outputs) and reused: a step
only rebinds the caller's batch tensors and its model outputs. Scalars the graph reads each step
(learning rate, flags) live in persistent tensors that are bound once and updated in place.
"""

import numpy as np
import onnxruntime as ort
import torch

from orttrainer.placement import device as placement
from orttrainer.engine.pyop import python_op
from orttrainer.engine.graph import training_graph as tg
from orttrainer.engine.graph.recompute import create_session_with_recompute
from orttrainer.engine.kernels import library as kernels
from orttrainer.engine.runtime.state import TrainingState

_NP_DTYPES = {
    torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_,
}


class Runtime:
    """The session plus the tensors it reads and writes across steps."""

    def __init__(self, graph: tg.TrainingGraph, *, providers, provider_options=None, session_options=None,
                 device: torch.device = torch.device("cpu"), state: TrainingState | None = None, adopt=None):
        """`state`: the tensors of another Runtime of the same trainer to adopt (the new session reads
        and writes them, nothing is copied); None creates them from the graph's initial values, or
        where `adopt` ({weight: torch parameter}) allows, uses the parameter itself (TrainingState)."""
        self.graph = graph
        self.device = device
        if state is None:
            state = TrainingState(graph, device, adopt)
        else:
            state.check_fits(graph)
        self.state = state
        options = session_options or ort.SessionOptions()
        # onnxruntime 1.19.2's PreShapeNodeElimination rule dereferences a null producer (segfault at
        # session creation) on graphs where a Cast of a graph input feeds a Shape -- every fp16 graph
        # (weights are graph inputs, cast to fp16 by the autocast export). It only saves a Cast.
        disabled = ["PreShapeNodeElimination"] if graph.low_precision else None
        if kernels.uses(graph.model):  # products on torch's kernels (engine/graph/torch_matmul.py)
            kernels.register(options)
        if graph.recompute is None:
            self.session = ort.InferenceSession(graph.model.SerializeToString(), options, providers=providers,
                                                provider_options=provider_options, disabled_optimizers=disabled)
        else:
            self.session = create_session_with_recompute(graph.model, graph.recompute, options, providers=providers,
                                                         provider_options=provider_options,
                                                         disabled_optimizers=disabled)
        self.input_names = {i.name for i in self.session.get_inputs()}  # the exporter drops unused ones
        # The state's own dicts (not copies): what one Runtime rebinds, every Runtime sees.
        self._pairs = state.pairs
        self._accumulators = state.accumulators
        self._scalars = state.scalars
        self._train_mode = state.train_mode
        self._eval_mode = state.eval_mode
        self._run_options = {}
        for kind in ("eval", "micro", "update", "apply", "lamb_norms"):
            opts = ort.RunOptions()
            opts.only_execute_path_to_fetches = True
            opts.training_mode = kind != "eval"
            self._run_options[kind] = opts
        self._bindings = {}
        # The global gradient norm of the last optimizer step (before clipping), written by the update
        # run into this tensor when the graph computes it (clipping or mixed precision); else unknown.
        self.gradient_norm = torch.full([], float("nan"), dtype=torch.float32, device=device)
        self.has_gradient_norm = tg.GLOBAL_NORM in {o.name for o in self.session.get_outputs()}

    # ------------------------------------------------------------------ state access
    @property
    def _parity(self):
        return self.state.parity

    @_parity.setter
    def _parity(self, value):
        self.state.parity = value

    def current(self, name):
        """The current value of a state tensor (a view of the live buffer, do not keep it across steps)."""
        return self._pairs[name][self._parity]

    def load(self, values: dict):
        """Copy values into the current buffers (shapes were checked by the caller)."""
        for name, value in values.items():
            self.current(name).copy_(torch.as_tensor(np.asarray(value)).reshape(self.current(name).shape))

    def accumulators(self):
        """{weight: accumulated gradient buffer} (only meaningful inside an accumulation window)."""
        return {w: self._accumulators[tg.accumulation_buffer(w)] for w in self.graph.accumulated}

    def load_accumulators(self, values: dict):
        """Restore an unfinished window's gradients; with none given, the next micro-step starts afresh."""
        for w, value in values.items():
            self._accumulators[tg.accumulation_buffer(w)].copy_(torch.as_tensor(np.asarray(value)))
        self._scalars[tg.LAZY_RESET].fill_(not values)

    # ------------------------------------------------------------------ binding
    def _bind_tensor(self, binding, name, tensor, output=False):
        kind = "cuda" if tensor.is_cuda else "cpu"
        index = tensor.device.index or 0
        method = binding.bind_output if output else binding.bind_input
        method(name, kind, index, _NP_DTYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    def _binding(self, kind, input_names, output_names):
        """The binding for this kind of run, parity, set of fed inputs and set of model outputs.

        Keyed by the input and output names too, so a binding never holds an input from an earlier
        call that this call did not give (onnxruntime would read a stale, maybe freed, tensor) and
        only the requested outputs' paths run. Callers use one or two such sets: the cache stays small.
        """
        key = (kind, self._parity, input_names, output_names)
        if key not in self._bindings:
            self._bindings[key] = self._make_binding(kind, output_names)
        return self._bindings[key]

    def _bind_current_state(self, binding):
        """The current buffers of the state tensors this session reads."""
        for name, pair in self._pairs.items():
            if name in self.input_names:
                self._bind_tensor(binding, name, pair[self._parity])

    def _optimizer_binding(self):
        """The start of a separate optimizer run's binding (the distributed 'apply' and 'lamb_norms'):
        the current state and the learning rate and gradient scale; the caller binds the rest."""
        binding = self.session.io_binding()
        self._bind_current_state(binding)
        for name in (tg.LEARNING_RATE, tg.GRADIENT_SCALE):
            self._bind_tensor(binding, name, self._scalars[name])
        return binding

    def _make_binding(self, kind, output_names):
        binding = self.session.io_binding()
        self._bind_current_state(binding)
        if self.graph.uses_training_mode:
            self._bind_tensor(binding, tg.TRAINING_MODE, self._eval_mode if kind == "eval" else self._train_mode)
        if kind != "eval":
            for name, tensor in self._scalars.items():
                if name in self.input_names:
                    self._bind_tensor(binding, name, tensor)
            for name, tensor in self._accumulators.items():
                self._bind_tensor(binding, name, tensor)
        # Model outputs first: after a run only they (and all_finite) are read back.
        for name in output_names:
            binding.bind_output(name, self.device.type, self.device.index or 0)
        if kind == "update" and self.graph.mixed_precision:
            binding.bind_output(tg.ALL_FINITE, "cpu", 0)
        if kind == "update" and self.has_gradient_norm:
            self._bind_tensor(binding, tg.GLOBAL_NORM, self.gradient_norm, output=True)
        if kind == "micro":
            for w in self.graph.accumulated:
                binding.bind_output(tg.accumulation_flag(w), self.device.type, self.device.index or 0)
        elif kind == "update":
            for name, pair in self._pairs.items():
                self._bind_tensor(binding, self.graph.states[name].updated, pair[1 - self._parity], output=True)
        return binding

    # ------------------------------------------------------------------ training
    def train(self, inputs: dict, outputs=None, *, update, lr, gradient_scale, loss_scale):
        """One train_step: a micro run, or (update=True) the window's last micro-batch and the optimizer
        step in one run. Returns (outputs, all_finite or None) as `run` does."""
        return self.run("update" if update else "micro", inputs, outputs, lr=lr, gradient_scale=gradient_scale,
                        loss_scale=loss_scale)

    # ------------------------------------------------------------------ running
    def set_scalars(self, *, lr=None, gradient_scale=None, loss_scale=None):
        """Write the step's scalars into the tensors the bindings read (None: left as they are)."""
        for name, value in ((tg.LEARNING_RATE, lr), (tg.GRADIENT_SCALE, gradient_scale), (tg.LOSS_SCALE, loss_scale)):
            if value is not None:
                self._scalars[name].fill_(value)

    def run(self, kind, inputs: dict, outputs=None, *, lr=None, gradient_scale=None, loss_scale=None):
        """Run one step. kind: 'eval', 'micro' (accumulate only) or 'update' (optimizer step).

        `inputs` maps graph input names to tensors already checked by the caller; `outputs` names the
        model outputs wanted (default: all, in graph.outputs order). Returns (those outputs as torch
        tensors, all_finite or None).
        """
        output_names = tuple(outputs or self.graph.outputs)
        binding = self._binding(kind, tuple(sorted(inputs)), output_names)
        self.set_scalars(lr=lr, gradient_scale=gradient_scale, loss_scale=loss_scale)
        for name, tensor in inputs.items():
            self._bind_tensor(binding, name, tensor)
        # Rebinding by device drops the tensors of the previous run, which the caller may still hold:
        # otherwise onnxruntime would write this step's outputs into them.
        for name in output_names:
            binding.bind_output(name, self.device.type, self.device.index or 0)
        # CUDA: the fills above, the batch and the last collective are torch kernels on torch's stream;
        # onnxruntime's own stream must not start before they are done (docs/ort-notes.md, "CUDA streams").
        placement.wait_for_torch(self.device)
        with python_op.function_errors():  # a custom autograd.Function's own error, if it caused a failure
            self.session.run_with_iobinding(binding, self._run_options[kind])
        ort_outputs = binding._iobinding.get_outputs()
        n = len(output_names)
        results = [torch.from_dlpack(ort_outputs[i].to_dlpack()) for i in range(n)]
        all_finite = None
        if kind == "micro":
            self._scalars[tg.LAZY_RESET].fill_(False)
        elif kind == "update":
            if self.graph.mixed_precision:
                all_finite = torch.from_dlpack(ort_outputs[n].to_dlpack()).to(torch.bool)  # dlpack gives uint8
            if all_finite is None or bool(all_finite.item()):
                self._parity = 1 - self._parity  # the written buffers become current
            self._scalars[tg.LAZY_RESET].fill_(True)
        return results, all_finite
