"""placement/process_group.release_at_exit in two real gloo ranks: registered once by init_process_group,
it destroys the group and returns only when gloo's worker threads sleep (a worker that drops a finished
collective while Python finalises aborts the process; docs/distributed.md)."""

import atexit
import os

import pytest
import torch
from helpers.distributed_worker import spawn_ranks

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

TIMEOUT = 120


def _rank(rank, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from orttrainer.placement import process_group

    before = atexit._ncallbacks()
    process_group.init_process_group("cpu")
    registered = atexit._ncallbacks() - before
    torch.distributed.all_reduce(torch.ones(8))  # its tensor's Python object is gone once the call returns
    workers = process_group.gloo_thread_states()
    process_group.release_at_exit()
    result = {"registered": registered, "workers": len(workers),
              "initialized": torch.distributed.is_initialized(),
              "states": sorted(process_group.gloo_thread_states().values())}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_release_at_exit_destroys_the_group_and_leaves_the_gloo_workers_asleep(tmp_path):
    results, _ = spawn_ranks(lambda rank, port: (rank, port, str(tmp_path)), 2, tmp_path, TIMEOUT,
                             target=_rank)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} saved nothing"
        assert result["registered"] == 1
        assert result["workers"] >= 1  # the wait looks at real threads: /proc names them pt_gloo_*
        assert not result["initialized"]
        assert set(result["states"]) <= {"S"}  # joined (nothing holds the group here) or asleep
