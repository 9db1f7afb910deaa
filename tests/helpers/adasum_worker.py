"""Direct checks of engine.adasum.Adasum inside the ranks of tests/helpers/distributed_worker.py (not a test
module): a scenario {"combine": True} runs `combine` on the process group the trainer scenarios
before it initialised; tests/integration/test_adasum.py compares the results with NumPy."""

import torch

# Uneven sizes, so that halves cut through tensors; "zero" is all zero on rank 0, "all_zero" everywhere.
SHAPES = {"w1": (7, 5), "zero": (3,), "w2": (33,), "all_zero": (4, 2), "b": (1,)}


def update(rank, shape, name):
    if name == "all_zero" or (name == "zero" and rank == 0):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(100 * rank + len(name))
    return torch.randn(shape, generator=g) * (1 + rank)


def combine(rank, world_size, local_sizes):
    """{local_size: this rank's combined seeded updates} for each layout (ranks per node)."""
    from orttrainer.engine.parallel.adasum import Adasum
    from orttrainer.engine.parallel.data_parallel import FlatLayout
    from orttrainer.placement.process_group import ProcessGroup

    layout = FlatLayout(SHAPES, world_size)
    group = ProcessGroup(rank=rank, world_size=world_size, backend="gloo")
    result = {}
    for local_size in local_sizes:
        adasum = Adasum(layout, group, torch.device("cpu"), local_size=local_size)
        flat = layout.empty(torch.device("cpu"))
        for name, view in layout.views(flat).items():
            view.copy_(update(rank, SHAPES[name], name))
        adasum.combine_(flat)
        result[local_size] = {"combined": {name: view.clone() for name, view in layout.views(flat).items()},
                              "padding_zero": bool((flat[layout.numel:] == 0).all())}
        if adasum.node_group is not None:
            ranks = torch.tensor([float(rank)])
            torch.distributed.all_reduce(ranks, group=adasum.node_group)
            result[local_size]["node_sum"] = float(ranks)
    return result
