"""Tensor x data parallel in real processes: 4 gloo ranks = 2 horizontal x 2 data (horizontal groups
[0, 1] and [2, 3], data groups [0, 2] and [1, 3]), each data group rank on its half of the batch; the
reference is one process on the whole batch. Also with ZeRO-1 over the data group. Each rank saves
its file; the files aggregate to the one-process state.

Two of the four model/optimizer x ZeRO pairs: GPT-2/Adam with ZeRO-1 and BERT/LAMB without cover both
models, both optimizers and both ZeRO stages (4 ranks on 2 cores cost ~45 s a scenario); the 2-rank
files (test_tensor_parallel*.py) run all four model/optimizer pairs."""

import numpy as np
import pytest

pytest.importorskip("transformers")

from helpers import tensor_parallel_worker as worker  # noqa: E402

from orttrainer import checkpoint  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

STEPS, ROWS = 4, 2 * worker.BATCH
CASES = [("gpt2", "adam", 1), ("bert", "lamb", 0)]
IDS = [f"{k}-{o}-zero{z}" for k, o, z in CASES]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2x2")
    scenarios = [{"name": name, "kind": k, "optim": o, "zero": z, "horizontal": 2, "steps": STEPS,
                  "rows": ROWS, "dir": str(out)} for name, (k, o, z) in zip(IDS, CASES)]
    results = worker.launch(4, scenarios, out, timeout=400)  # 4 ranks keep both cores busy: no reference beside
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result"
        assert "error" not in result, f"rank {rank}: {result['error']}"
    return results


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_two_by_two_equals_one_process_on_the_whole_batch(four_ranks, case):
    kind, optim, _ = case
    name = IDS[CASES.index(case)]
    one = worker.reference(kind, optim, STEPS, ROWS)
    reference, losses, norms = one["trainer"], one["losses"], one["norms"]
    assert len(losses) == len(norms) == STEPS
    got = [r[name] for r in four_ranks]
    for horizontal in (0, 1):  # each data rank's loss is its half's mean: their mean is the whole batch's
        data = [got[horizontal]["losses"], got[horizontal + 2]["losses"]]
        np.testing.assert_allclose(np.mean(data, axis=0), losses, rtol=1e-5,
                                   err_msg=f"horizontal rank {horizontal}")
    for rank, result in enumerate(got):
        np.testing.assert_allclose(result["norms"], norms, rtol=1e-5, err_msg=f"rank {rank} gradient norms")
    # the rank files (written by each rank's save_checkpoint) aggregate to the one-process state
    merged = checkpoint.aggregate_checkpoints([r["file"] for r in got], pytorch_format=False)
    expected = reference.state_dict()
    for w, value in expected["model"]["full_precision"].items():
        np.testing.assert_allclose(merged["model"]["full_precision"][w], value, rtol=1e-5, atol=5e-6,
                                   err_msg=w)
    for w, per in expected["optimizer"].items():
        for key, value in per.items():
            # atol: the summation order differs (shards, two data halves): 1e-5 of the tensor's scale, and
            # 1e-12 for moments of gradients that are 0 in exact arithmetic (rounding noise ~1e-17)
            atol = 1e-5 * float(np.abs(value).max()) + 1e-12
            np.testing.assert_allclose(np.reshape(merged["optimizer"][w][key], np.shape(value)), value,
                                       rtol=1e-5, atol=atol, err_msg=f"{w} {key}")
