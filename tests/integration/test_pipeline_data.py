"""Data x pipeline parallel (issue 24, phase 2): 4 real processes as 2 data-parallel replicas of a
2-stage pipeline (stage-major ranks: stage = rank // 2) train like one process on the whole batch."""

import numpy as np
import pytest
import torch
from helpers.pipeline_worker import launch, make_trainer, reference, stage_file, train

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

# each replica: 4 rows as 2 micro-batches; every rank saves its stage file after 4 steps
DP = {"name": "dp", "optim": "adam", "data": 2, "micro": 2, "save_at": 4}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline_data")


@pytest.fixture(scope="module")
def expected(ranks):
    # memoized: shared with test_pipeline.py. Not run beside these 4 ranks: they keep both cores busy
    # (measured: beside was 15% slower)
    return reference({"optim": "adam"})


@pytest.fixture(scope="module")
def ranks(out_dir):
    results = launch([DP], out_dir, timeout=240, world=4)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result"
        assert "error" not in result, result["error"]
    return [r["dp"] for r in results]


def test_two_by_two_trains_like_one_process_on_the_whole_batch(ranks, expected):
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


def test_two_by_two_stage_files_aggregate_and_continue_in_one_process(ranks, out_dir, expected):
    files = [stage_file(str(out_dir), rank) for rank in range(4)]
    trainer = make_trainer({"optim": "adam"})
    trainer.load_checkpoint(*files)  # merges the stages of replica 0 (ranks 0 and 2)
    got = train(trainer, {}, start=DP["save_at"])
    np.testing.assert_allclose(got["losses"], expected["losses"][DP["save_at"]:], rtol=1e-5)


def test_a_world_that_is_no_multiple_of_the_stages_is_named():
    from orttrainer import ORTTrainerOptions

    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(2\) = 2 must divide distributed.world_size \(3\)"):
        ORTTrainerOptions({"distributed": {"world_size": 3, "pipeline_parallel": {"pipeline_parallel_size": 2}}})
