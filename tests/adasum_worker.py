"""Ranks for tests/test_adasum.py's direct checks of engine.adasum.Adasum (not a test module): each
rank initialises gloo itself, combines its own seeded update vector once per layout (ranks per node)
and saves {local_size: result}."""

import os

import torch
import torch.multiprocessing as mp
from distributed_worker import free_port

# Uneven sizes, so that halves cut through tensors; "zero" is all zero on rank 0, "all_zero" everywhere.
SHAPES = {"w1": (7, 5), "zero": (3,), "w2": (33,), "all_zero": (4, 2), "b": (1,)}


def update(rank, shape, name):
    if name == "all_zero" or (name == "zero" and rank == 0):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(100 * rank + len(name))
    return torch.randn(shape, generator=g) * (1 + rank)


def _rank_main(rank, world_size, port, out_dir, local_sizes):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    result = {}
    try:
        import datetime

        from orttrainer.engine.adasum import Adasum
        from orttrainer.engine.distributed import FlatLayout, ProcessGroup

        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        layout = FlatLayout(SHAPES, world_size)
        group = ProcessGroup(rank=rank, world_size=world_size, backend="gloo")
        for local_size in local_sizes:  # one launch, several layouts: starting ranks is the slow part
            adasum = Adasum(layout, group, torch.device("cpu"), local_size=local_size)
            flat = layout.empty(torch.device("cpu"))
            for name, view in layout.views(flat).items():
                view.copy_(update(rank, SHAPES[name], name))
            adasum.combine_(flat)
            result[local_size] = {"combined": {name: view.clone() for name, view in layout.views(flat).items()},
                                  "padding_zero": bool((flat[layout.numel:] == 0).all())}
            if adasum.node_group is not None:
                ones = torch.tensor([float(rank)])
                torch.distributed.all_reduce(ones, group=adasum.node_group)
                result[local_size]["node_sum"] = float(ones)
        torch.distributed.destroy_process_group()
    except Exception as exc:  # reported to the test through the file
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def launch(world_size, out_dir, local_sizes=(1,), timeout=120):
    import time

    deadline = time.monotonic() + timeout
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(rank, world_size, port, str(out_dir), local_sizes))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                raise TimeoutError(f"ranks still running after {timeout} s")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
