"""Data x pipeline parallel (issue 24, phase 2): 4 real processes as 2 data-parallel replicas of a
2-stage pipeline (stage-major ranks: stage = rank // 2) train like one process on the whole batch."""

import numpy as np
import pytest
import torch
from pipeline_worker import launch, reference

DP = {"name": "dp", "optim": "adam", "data": 2, "micro": 2}  # each replica: 4 rows as 2 micro-batches


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = launch([DP], tmp_path_factory.mktemp("pipeline_data"), timeout=240, world=4)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result"
        assert "error" not in result, result["error"]
    return [r["dp"] for r in results]


def test_two_by_two_trains_like_one_process_on_the_whole_batch(ranks):
    expected = reference({"optim": "adam"})
    for stage in range(2):  # the stages of a pipeline return their replica's outputs
        torch.testing.assert_close(ranks[2 * stage]["losses"], ranks[0]["losses"], rtol=0, atol=0)
        torch.testing.assert_close(ranks[2 * stage + 1]["losses"], ranks[1]["losses"], rtol=0, atol=0)
    # equal halves of the batch: the whole batch's mean loss is the mean of the replicas' losses
    mean = (np.array(ranks[0]["losses"]) + np.array(ranks[1]["losses"])) / 2
    np.testing.assert_allclose(mean, expected["losses"], rtol=1e-5)
    for step, whole in enumerate(expected["logits"]):
        np.testing.assert_allclose(torch.cat([ranks[0]["logits"][step], ranks[1]["logits"][step]]).numpy(),
                                   whole.numpy(), rtol=1e-5, atol=1e-5)
    for rank in range(4):
        for w, value in ranks[rank]["weights"].items():
            torch.testing.assert_close(value, ranks[rank ^ 1]["weights"][w], rtol=0, atol=0)  # replicas equal
            np.testing.assert_allclose(value.numpy(), expected["weights"][w].numpy(), rtol=1e-5, atol=1e-5,
                                       err_msg=w)
