"""Adasum (`distributed.enable_adasum`): the ranks combine their optimizer UPDATES, not sum gradients.

Each rank runs the optimizer on its own accumulated gradients (scaled to its own mean, clipped by its
own norm), giving an update d_r = w_new - w_old per weight tensor. The updates are combined pairwise,
per tensor, by

    adasum(a, b) = a·(1 - a·b / (2‖a‖²)) + b·(1 - a·b / (2‖b‖²))

(a zero vector's coefficient is 1: adasum(0, b) = b; a result that cancels to rounding noise is
zero, see `coefficients`), by recursive halving over a power-of-two number of ranks: at level k a
rank swaps half of its piece of the flat update buffer with the rank 2^k away, the dot products
and norms of its half are summed over the 2^(k+1) ranks that together hold the two vectors, and
the rank combines its half. The mirror phase swaps the halves back, so every rank ends
with the same combined update (each element is computed by one rank only), and w = w_old + combined.
Optimizer moments stay per rank.

Hierarchical, as the original: on NCCL the ranks of a node (torchrun's LOCAL_WORLD_SIZE consecutive
ranks) first sum their gradients (scaled to the node's mean), then Adasum runs across nodes among the
ranks of the same local rank. On gloo (CPU) every rank is its own "node": flat Adasum over all ranks.
"""

import math
import time
import warnings

import torch

from orttrainer.placement.dims import is_power_of_two
from orttrainer.placement.process_group import DistributedSetupError


CANCELLED = 2.0 ** -16


def coefficients(dot, aa, bb):
    """(ca, cb) of adasum(a, b) = ca·a + cb·b from a·b, ‖a‖², ‖b‖² (floats).

    A zero vector's coefficient is 1 (it contributes nothing; adasum(0, b) = b). A result that cancels
    to below CANCELLED of its terms' size (‖c‖ ≤ 2^-16 (|ca|‖a‖ + |cb|‖b‖), e.g. b = -a) is rounding
    noise in float32, whose direction the next level would amplify (the a-term subtracts half of b's
    projection on a, whatever ‖a‖): both coefficients are then 0, an exactly zero update.
    """
    ca = 1.0 - dot / (2.0 * aa) if aa > 0.0 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb > 0.0 else 1.0
    square = ca * ca * aa + cb * cb * bb + 2.0 * ca * cb * dot  # ‖ca·a + cb·b‖², from the same sums
    if square <= (CANCELLED * (abs(ca) * math.sqrt(aa) + abs(cb) * math.sqrt(bb))) ** 2:
        return 0.0, 0.0
    return ca, cb


def _new_group(members, world_size):
    """A torch process group of `members` (the default group when that is everyone). Every rank must
    call this for every group, in the same order (torch.distributed.new_group's rule)."""
    if len(members) == world_size:
        return None
    return torch.distributed.new_group(list(members))


class Adasum:
    """The groups and buffers of Adasum for one trainer; `step` replaces data parallel's all_reduce →
    apply. Created once, collectively, by DistributedRuntime with the flat buffers."""

    def __init__(self, layout, group, device, local_size=1):
        world, rank = group.world_size, group.rank
        if local_size < 1 or world % local_size:
            raise DistributedSetupError(f"Adasum: {local_size} ranks per node (LOCAL_WORLD_SIZE) do not divide "
                                        f"world_size={world}; start the same number of ranks on every node")
        nodes = world // local_size
        if not is_power_of_two(nodes):
            raise DistributedSetupError(f"Adasum: {nodes} nodes of {local_size} ranks (world_size={world}): the "
                                        "number of nodes must be a power of two")
        self.layout, self.group, self.local_size = layout, group, local_size
        self.node, self.local_rank = divmod(rank, local_size)
        # Gradients are summed within a node only: each rank's (node's) mean, not the world's.
        self.scale_factor = world / local_size
        self.bounds = [(layout.offsets[w], layout.offsets[w] + math.prod(shape))
                       for w, shape in layout.shapes.items()]
        self.node_group = None
        if local_size > 1:
            for node in range(nodes):
                made = _new_group(range(node * local_size, (node + 1) * local_size), world)
                if node == self.node:
                    self.node_group = made
        # Per level: (distance in nodes, partner rank, the group that holds both vectors).
        self.levels = []
        for level in range(nodes.bit_length() - 1):
            distance = 1 << level
            mine = None
            for local in range(local_size):
                for block in range(nodes // (2 * distance)):
                    members = [(block * 2 * distance + j) * local_size + local for j in range(2 * distance)]
                    made = _new_group(members, world)
                    if rank in members:
                        mine = made
            partner = (self.node ^ distance) * local_size + self.local_rank
            self.levels.append((distance, partner, mine))
        self.old_weights = layout.empty(device)  # w_old, to form the update and to restore a skipped step
        self._warned = False
        if group.backend == "nccl" and nodes == 1:
            warnings.warn(f"distributed.enable_adasum=True on one node ({local_size} ranks, NCCL): Adasum "
                          "runs across nodes, so here the ranks only sum their gradients (plain data "
                          "parallel). See docs/distributed.md, 'Adasum'.", UserWarning, stacklevel=2)

    # ------------------------------------------------------------------ collectives
    def _exchange(self, send, receive, partner, what):
        def swap():
            request = torch.distributed.isend(send, partner)
            torch.distributed.recv(receive, partner)
            request.wait()
        self.group._collective(what, swap)

    def _agree_finite(self, tensor):
        """Whether `tensor` is finite on every rank (one small all_reduce: every rank decides alike)."""
        bad = (~torch.isfinite(tensor)).any().to(torch.float32).reshape(1)
        self.group.all_reduce_(bad, "all_reduce of Adasum's finite flag")
        return float(bad) == 0.0

    # ------------------------------------------------------------------ the combination
    def _sums(self, start, a, b):
        """[tensors, 3] float64: a·b, ‖a‖², ‖b‖² of each weight tensor's part inside [start, start+len)."""
        stop = start + a.numel()
        sums = torch.zeros(len(self.bounds), 3, dtype=torch.float64, device=a.device)
        for i, (first, last) in enumerate(self.bounds):
            lo, hi = max(first, start), min(last, stop)
            if lo < hi:
                x, y = a[lo - start:hi - start].double(), b[lo - start:hi - start].double()
                sums[i, 0], sums[i, 1], sums[i, 2] = x @ y, x @ x, y @ y
        return sums

    def combine_(self, flat):
        """Replace this rank's flat update buffer by the Adasum of every rank's (across nodes), in place."""
        lo, hi = 0, flat.numel()
        kept = []
        for distance, partner, level_group in self.levels:
            mid = lo + (hi - lo) // 2
            lower = not self.node & distance  # the lower rank holds `a`, keeps the first half
            keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
            mine = flat[keep[0]:keep[1]]
            theirs = torch.empty_like(mine)
            self._exchange(flat[give[0]:give[1]], theirs, partner, "Adasum's exchange of update halves")
            a, b = (mine, theirs) if lower else (theirs, mine)
            sums = self._sums(keep[0], a, b)
            self.group._collective("all_reduce of Adasum's dot products", torch.distributed.all_reduce, sums,
                                   group=level_group)
            for i, (first, last) in enumerate(self.bounds):
                s, e = max(first, keep[0]) - keep[0], min(last, keep[1]) - keep[0]
                if s < e:
                    ca, cb = coefficients(*sums[i].tolist())
                    c_own, c_other = (ca, cb) if lower else (cb, ca)
                    mine[s:e].mul_(c_own).add_(theirs[s:e] * c_other)
            kept.append(((lo, hi), keep, partner))
            lo, hi = keep
        for (lo, hi), keep, partner in reversed(kept):  # mirror: every rank gets every combined half
            other = (keep[1], hi) if keep[0] == lo else (lo, keep[0])
            received = torch.empty(other[1] - other[0], dtype=flat.dtype, device=flat.device)
            self._exchange(flat[keep[0]:keep[1]], received, partner, "Adasum's exchange of combined halves")
            flat[other[0]:other[1]].copy_(received)
        return flat

    # ------------------------------------------------------------------ the step
    def step(self, runtime, lr, gradient_scale):
        """Node sum → agreed finiteness → local optimizer update → Adasum of the updates → w_old + combined.
        Returns whether the step was applied (the same on every rank)."""
        flat = runtime.flat_gradients
        started = time.perf_counter()
        if self.node_group is not None:
            self.group._collective("all_reduce of the node's gradients", torch.distributed.all_reduce, flat,
                                   group=self.node_group)
        # The criterion of DistributedRuntime._apply (‖g‖² finite), so its own check agrees with this one.
        finite = self._agree_finite(torch.linalg.vector_norm(flat).square())
        started = runtime._timed("communication", started)
        if not finite:  # nothing ran: weights, moments and counters untouched on every rank
            return False
        names = list(self.layout.shapes)
        old, delta = self.layout.views(self.old_weights), self.layout.views(flat)
        for w in names:
            old[w].copy_(runtime.current(w))
        runtime._wait_for_torch()  # CUDA: the node sum and the copy land before onnxruntime's run
        if not runtime._apply(lr, gradient_scale * self.scale_factor):  # flips the parity
            raise AssertionError("Adasum: the apply run refused gradients that every rank found finite")
        started = runtime._timed("apply", started)
        for w in names:  # the update overwrites the gradients: the next micro run resets them anyway
            torch.sub(runtime.current(w), old[w], out=delta[w])
        self.combine_(flat)
        finite = self._agree_finite(flat)
        if finite:
            for w in names:
                torch.add(old[w], delta[w], out=runtime.current(w))
        else:
            self._discard(runtime, old)
        runtime._wait_for_torch()
        runtime._timed("communication", started)
        return finite

    def _discard(self, runtime, old):
        """A non-finite combined update: weights back to w_old. The apply graph updates every state in
        place (training_graph: a distributed step is skipped before its apply run), so the moments and
        step counters keep this step; rare (every rank's own update was finite), hence one warning."""
        for w, value in old.items():
            runtime.current(w).copy_(value)
        if not self._warned:
            self._warned = True
            warnings.warn("Adasum: the combined update was not finite although every rank's own was; the "
                          "weights were left unchanged, the optimizer moments and step counters keep this "
                          "step.", RuntimeWarning, stacklevel=2)
