"""The training state that outlives a session: one set of torch tensors shared by every Runtime.

A trainer may hold several sessions (one per input signature, see `lifecycle`); they all read and
write the SAME buffers, so a transition between them copies nothing and loses nothing -- weights,
optimizer moments, counters, the parity of the ping-pong pairs, gradient accumulation buffers and the
per-step scalars all live here.
"""

import weakref

import numpy as np
import torch

from orttrainer.engine.graph import training_graph as tg


class TrainingState:
    """Created from the first training graph; every later graph of the same trainer must have the
    same states (names, shapes, dtypes, in-place flags) and accumulation buffers (`check_fits`)."""

    def __init__(self, graph: tg.TrainingGraph, device: torch.device, adopt=None):
        """`adopt`: {state name: torch tensor} that may serve as that state's buffer (see `_adoptable`)."""
        self.device = device
        # Ping-pong pairs, parity 0 = buffer 0 is current; an in-place state is one buffer twice.
        self.pairs = {}
        self.adopted = []
        for name, spec in graph.states.items():
            tensor = (adopt or {}).get(name)
            if spec.in_place and tensor is not None and self._adoptable(tensor, spec.initial):
                first = tensor.detach()
                _ADOPTED[first.untyped_storage().data_ptr()] = self
                self.adopted.append(name)
            else:
                initial = np.ascontiguousarray(spec.initial)
                if not initial.flags.owndata:  # a view of the module's own tensor (the export's stubs)
                    initial = initial.copy()
                first = torch.from_numpy(initial).to(device)
            self.pairs[name] = (first, first if spec.in_place else torch.empty_like(first))
        self.parity = 0
        # Gradient accumulation buffers: written in place by InPlaceAccumulatorV2, never swapped.
        self.accumulators = {tg.accumulation_buffer(w): torch.zeros_like(self.pairs[w][0])
                             for w in graph.accumulated}
        # Scalars fed every step, updated in place (their bound pointers stay valid).
        self.scalars = {
            tg.LEARNING_RATE: torch.zeros([1], dtype=torch.float32, device=device),
            tg.LAZY_RESET: torch.ones([1], dtype=torch.bool, device=device),
            tg.GRADIENT_SCALE: torch.ones([], dtype=torch.float32, device=device),
            tg.LOSS_SCALE: torch.ones([], dtype=torch.float32, device=device),
        }
        self.train_mode = torch.tensor(True, device=device)
        self.eval_mode = torch.tensor(False, device=device)
        self.layout = _layout(graph)
        self.distributed = None  # the distributed runtime's flat buffers, created by the first one

    def _adoptable(self, tensor, initial):
        """Whether the torch model's own parameter can be this state's buffer instead of a copy: the
        same device, dtype, shape and values, dense, and not already the buffer of another live state
        (two trainers of one module each get their own copy, as before)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device != self.device or not tensor.is_contiguous():
            return False
        if tensor.dtype != torch.float32 or initial.dtype != np.float32 or tuple(tensor.shape) != initial.shape:
            return False
        if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.numel() * 4:
            return False  # a view into a larger storage (the rest is not ours to write)
        owner = _ADOPTED.get(tensor.untyped_storage().data_ptr())
        if owner is not None and owner is not self:
            return False
        if initial.__array_interface__["data"][0] == tensor.data_ptr():
            return True  # the initial value is this tensor's memory (the export left it in the module)
        with torch.no_grad():
            return torch.equal(tensor.detach().cpu(), torch.from_numpy(np.ascontiguousarray(initial)))

    def check_fits(self, graph: tg.TrainingGraph):
        """Raise unless `graph` reads and writes exactly the tensors this state holds."""
        theirs = _layout(graph)
        if theirs == self.layout:
            return
        mine_states, their_states = self.layout[0], theirs[0]
        differing = sorted(n for n in set(mine_states) | set(their_states)
                           if mine_states.get(n) != their_states.get(n))
        raise RuntimeError(
            f"The rebuilt training graph does not fit the trainer's state: states {differing[:5]} differ "
            f"(name: (shape, dtype, in place) {[(n, mine_states.get(n), their_states.get(n)) for n in differing[:3]]}), "
            f"or the accumulated weights differ. The model's parameters must not change between exports.")


# storage address -> the live TrainingState whose buffer it is
_ADOPTED = weakref.WeakValueDictionary()


def _layout(graph):
    states = {name: (tuple(spec.initial.shape), str(spec.initial.dtype), bool(spec.in_place))
              for name, spec in graph.states.items()}
    return states, tuple(graph.accumulated)
