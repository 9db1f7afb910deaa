"""Tensor parallel checkpoints in the legacy layout, in real processes (2 gloo ranks, a free port, a
timeout on every wait), with files the trainer wrote: 2 ranks save after K steps -> aggregate ->
one process continues like the uninterrupted one-process run; a one-process checkpoint loaded on 2
ranks (re-cut) continues alike. GPT-2 covers the stride-3 q|k|v shards, BERT the axis-0 concatenation
of nn.Linear column weights."""

import numpy as np
import pytest

pytest.importorskip("transformers")

from helpers import tensor_parallel_worker as worker  # noqa: E402

from orttrainer import checkpoint  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

K = 3  # steps before the checkpoint; worker.STEPS in all
CASES = [("gpt2", "adam"), ("bert", "lamb")]


@pytest.fixture(scope="module")
def runs(tensor_parallel_launch):
    """{(kind, optim): (uninterrupted one-process losses, one-process file at K, per rank {"file": its
    file at K, "resumed": losses of the 1 -> 2 resume, "warnings"})}. The 2-rank runs are conftest.py's
    launch shared with test_tensor_parallel: their files are saved mid-run, after K of STEPS steps."""
    out = {}
    for kind, optim in CASES:
        one = worker.reference(kind, optim)  # run (and saved at K) beside the launch
        ranks = [{"file": r[f"{kind}-{optim}"]["file_at_k"], "warnings": r[f"{kind}-{optim}"]["warnings"],
                  "resumed": r[f"{kind}-{optim}-resume"]["resumed"]} for r in tensor_parallel_launch]
        assert one["file"] and len(one["losses"]) == worker.STEPS
        out[(kind, optim)] = (one["losses"], one["file"], ranks)
    return out


def _flat(state):
    """{'model/w' | 'optimizer/w/key': array} of a legacy state_dict's tensors."""
    flat = {f"model/{n}": v for n, v in state["model"]["full_precision"].items()}
    for w, per in state.get("optimizer", {}).items():
        flat.update({f"optimizer/{w}/{k}": v for k, v in per.items()})
    return flat


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_rank_files_aggregate_to_the_one_process_state(runs, case):
    from orttrainer import _checkpoint_storage

    _, one_file, ranks = runs[case]
    files = [r["file"] for r in ranks]
    rank0 = _checkpoint_storage.load(files[0])
    info = rank0["partition_info"]
    assert info and int(np.ravel(rank0["trainer_options"]["horizontal_parallel_size"])[0]) == 2
    for name, entry in info.items():  # shards of the weight's shape / 2 along the recorded axis
        shard, whole = np.shape(rank0["model"]["full_precision"][name]), list(np.ravel(entry["original_dim"]))
        axis = len(whole) - 1 if int(np.ravel(entry["megatron_row_partition"])[0]) == 0 else 0
        assert list(shard) == [d // 2 if i == axis else d for i, d in enumerate(whole)], name
        assert np.shape(rank0["optimizer"][name]["Moment_1"]) == shard, name
    if case[0] == "gpt2":
        assert any(int(np.ravel(e["megatron_stride"])[0]) == 3 for e in info.values())
    merged = _flat(checkpoint.aggregate_checkpoints(files[::-1], pytorch_format=False))
    expected = _flat(_checkpoint_storage.load(one_file))
    assert set(merged) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(np.asarray(merged[key]), np.asarray(value), rtol=1e-5, atol=5e-6,
                                   err_msg=key)


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_two_ranks_to_one_process_continues(runs, case):
    kind, optim = case
    losses, _, ranks = runs[case]
    t = worker.trainer(kind, optim)
    t.load_checkpoint(*[r["file"] for r in ranks])
    resumed, _ = worker.train(t, kind, worker.STEPS - K, start=K)
    np.testing.assert_allclose(resumed, losses[K:], rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_one_process_to_two_ranks_continues(runs, case):
    losses, _, ranks = runs[case]
    for rank, result in enumerate(ranks):
        np.testing.assert_allclose(result["resumed"], losses[K:], rtol=1e-5, err_msg=f"rank {rank}")


def test_pytorch_format_warns_incomplete(runs):
    for result in runs[CASES[0]][2]:
        assert "Incomplete state_dict: Megatron enabled" in result["warnings"]
