"""Per-rank settings of a data-parallel run in real processes (2 ranks, gloo, torchrun's environment):
dropout masks differ between ranks and repeat for a fixed seed (run/loop.py's step seed), and each
rank's onnxruntime intra-op pool gets its share of the cores unless the user chose a thread count.
Also, in one process: the trainer leaves the caller's model and SessionOptions as they were.
"""

import os
import time
import traceback

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers.distributed_worker import free_port

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.run.loop import _step_seed

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

WORLD = 2
SEED = 7
MICRO_STEPS = 3
DESC = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])],
        "outputs": [("loss", [], True), ("kept", ["batch", 6])]}


class DropoutProbe(torch.nn.Module):
    """Computes its own loss; `kept` is dropout applied to ones: the mask (times 2) itself."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x, y):
        kept = self.drop(torch.ones_like(x))
        return F.cross_entropy(self.fc(x * kept), y), kept


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)


def trainer(rank=0, world_size=1, session_options=None, debug=None):
    torch.manual_seed(0)
    options = {"device": {"id": "cpu"}, "session_options": session_options, "debug": debug or {},
               "distributed": {"world_rank": rank, "world_size": world_size, "local_rank": rank}}
    return ORTTrainer(DropoutProbe(), DESC, optim.SGDConfig(lr=0.1), options=ORTTrainerOptions(options))


def masks(t, rank):
    """The dropout masks of MICRO_STEPS train steps, seeded as the training loop seeds them."""
    result = []
    for micro in range(MICRO_STEPS):
        ort.set_seed(_step_seed(SEED, micro, rank))
        result.append(t.train_step(*batch())[1] != 0)
    return torch.stack(result)


def session_threads(t):
    return t._build.runtime.session.get_session_options().intra_op_num_threads


def _rank_main(rank, port, out_dir):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    result = {}
    try:
        first = trainer(rank, WORLD)
        result["masks"] = [masks(first, rank), masks(first, rank)]  # the same seeds again: the same masks
        result["threads"] = session_threads(first)
        users = ort.SessionOptions()
        users.intra_op_num_threads = 3
        chosen = trainer(rank, WORLD, users)
        chosen.train_step(*batch())
        result["user_threads"] = session_threads(chosen)
        result["user_object_after"] = users.intra_op_num_threads
        unset = ort.SessionOptions()  # given, but its thread count left at onnxruntime's default
        unset_trainer = trainer(rank, WORLD, unset)
        unset_trainer.train_step(*batch())
        result["unset_threads"] = session_threads(unset_trainer)
        result["unset_object_after"] = unset.intra_op_num_threads
    except Exception as exc:  # reported to the test through the file
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def launch(out_dir, timeout=180):
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(rank, port, str(out_dir))) for rank in range(WORLD)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            assert not process.is_alive(), f"ranks still running after {timeout} s"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result['error']}"
    return results


def test_two_ranks_draw_different_masks_and_split_the_cores(tmp_path):
    results = launch(tmp_path)
    for result in results:
        first, again = result["masks"]
        assert torch.equal(first, again)  # a fixed seed draws the same masks (what exact resume needs)
        assert 0.2 < first.float().mean() < 0.8  # dropout really ran
    for micro in range(MICRO_STEPS):
        assert not torch.equal(results[0]["masks"][0][micro], results[1]["masks"][0][micro]), micro

    # One process: rank 0's seeds, and so its masks, are the ones a one-process run always drew.
    assert _step_seed(SEED, 5) == SEED * 1_000_003 + 5
    assert torch.equal(masks(trainer(), 0), results[0]["masks"][0])

    expected = max(1, len(os.sched_getaffinity(0)) // WORLD)
    for result in results:
        assert result["threads"] == expected
        assert result["unset_threads"] == expected
        assert result["unset_object_after"] == 0  # the caller's object is not changed
        assert result["user_threads"] == 3 and result["user_object_after"] == 3  # the user's choice is kept


def test_one_process_keeps_onnxruntime_default_threads():
    t = trainer()
    t.train_step(*batch())
    assert session_threads(t) == 0


# --------------------------------------------------------------------------- the caller's objects
class Recording(torch.nn.Module):
    """An MLP that records every in-place conversion of itself (.cpu(), .to(), .float(), ... all go
    through Module._apply)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.applied = []

    def _apply(self, fn, *args, **kwargs):
        self.applied.append(fn)
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_the_callers_model_is_not_converted_in_place():
    torch.manual_seed(0)
    model = Recording()
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    ref = Recording()
    ref.load_state_dict(model.state_dict())
    t = ORTTrainer(model, {"inputs": DESC["inputs"], "outputs": [("loss", [], True), ("logits", ["batch", 4])]},
                   optim.SGDConfig(lr=0.1), loss_fn=lambda logits, y: F.cross_entropy(logits, y),
                   options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    x, y = batch()
    loss = t.train_step(x, y)[0]
    assert model.applied == []
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    np.testing.assert_allclose(loss.item(), F.cross_entropy(ref(x), y).item(), rtol=1e-6)


def test_the_callers_session_options_are_not_changed(tmp_path):
    users = ort.SessionOptions()
    users.intra_op_num_threads = 1
    optimized = tmp_path / "optimized.onnx"
    t = trainer(session_options=users, debug={"deterministic_compute": True, "graph_save_paths": {
        "model_with_training_graph_after_optimization_path": str(optimized)}})
    t.train_step(*batch())
    session = t._build.runtime.session.get_session_options()
    assert session.use_deterministic_compute and session.intra_op_num_threads == 1
    assert optimized.is_file()  # the trainer's setting reached the session
    assert not users.use_deterministic_compute and users.optimized_model_filepath == ""
    assert users.intra_op_num_threads == 1
