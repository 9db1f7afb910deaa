"""The original distributed-checkpoint tests' calls, on 2 real ranks (tests/helpers/legacy_clients_worker.py):
a Megatron run without ZeRO (an ONNX model, as the original's BART) loads into one process; ZeRO-1 +
mixed precision + LAMB reports the backend state orttraining_test_backend_api checks; and the
original checkpoint module's private helpers, which its load tests call, merge the rank files the
trainer wrote as aggregate_checkpoints does."""

import glob
import os

import numpy as np
import pytest
import torch
from helpers.legacy_clients_worker import _batches, launch, trainer

from orttrainer import _checkpoint_storage, checkpoint

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

SCENARIOS = [
    {"name": "megatron", "trainer": {"model": "onnx", "horizontal": 2}, "save": True},
    {"name": "zero", "trainer": {"zero": 1, "optim": "adam"}, "save": True},
    {"name": "zero_mixed_lamb", "trainer": {"zero": 1, "mixed": True}, "backend_getters": True},
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = launch(SCENARIOS, tmp_path_factory.mktemp("legacy_clients"))
    assert all(r is not None for r in results), "a rank died without a result"
    return results


def _result(ranks, name):
    for rank, result in enumerate(ranks):
        assert "error" not in result[name], f"rank {rank}: {result[name]['error']}"
    return [result[name] for result in ranks]


def _files(result):
    return sorted(glob.glob(os.path.join(result["folder"], "checkpoint*.ortcp")))


def _flat(state):
    flat = {f"model/{n}": v for n, v in state["model"]["full_precision"].items()}
    for weight, per in state.get("optimizer", {}).items():
        flat.update({f"optimizer/{weight}/{k}": v for k, v in per.items()})
    return flat


def _assert_same(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(np.asarray(actual[key]), np.asarray(value), rtol=1e-6, err_msg=key)


def test_megatron_rank_files_without_zero_load_into_one_process(ranks):
    results = _result(ranks, "megatron")
    files = _files(results[0])
    assert len(files) == 2
    for path in files:  # every rank file carries partition_info, as aggregation requires
        assert "partition_info" in _checkpoint_storage.load(path)
    one = trainer(0, 1, model="onnx")
    one.load_checkpoint(*files)  # the original load test's call (glob of checkpoint*.ortcp)
    one.eval_step(*next(_batches(0, 1)))
    state = one.state_dict()
    _assert_same(_flat(state), _flat(results[0]["state_dict"]))
    assert int(state["trainer_options"]["horizontal_parallel_size"]) == 1
    merged = checkpoint.aggregate_checkpoints(files, pytorch_format=True)
    _assert_same(merged, {k: torch.from_numpy(np.asarray(v)) for k, v in
                          results[0]["state_dict"]["model"]["full_precision"].items()})


def test_zero_mixed_precision_lamb_backend_state_is_what_the_original_test_checks(ranks):
    """orttraining_test_backend_api.test_distributed_zero_mixed_precision_lamb: verify_model_state,
    verify_opt_state and verify_part_info on the expected states split from get_state()."""
    for rank, result in enumerate(_result(ranks, "zero_mixed_lamb")):
        expected = checkpoint._split_state_dict(result["get_state"])
        actual = result["model_state"]
        assert "mixed_precision" in actual, f"rank {rank}: missing 'mixed_precision' key in mixed precision run"
        assert len(expected["fp32_param"]) == len(actual["full_precision"]) == 4
        for name, value in expected["fp32_param"].items():
            np.testing.assert_allclose(value, actual["full_precision"][name])
        assert len(expected["fp16_param"]) == len(actual["mixed_precision"]) == 4
        for name, value in expected["fp16_param"].items():
            weight = name[:-len("_fp16")]
            np.testing.assert_allclose(value, actual["mixed_precision"][weight])
            assert value.dtype == np.float16
            np.testing.assert_array_equal(value, actual["full_precision"][weight].astype(np.float16))
        shared = result["state_dict"]["optimizer"]["shared_optimizer_state"]
        np.testing.assert_array_equal(expected["optimizer"]["Step"], shared["Step"])
        for weight, info in result["partition_info"].items():
            assert isinstance(info["original_dim"], list) and isinstance(info["original_dim"][0], int)
            assert info["megatron_row_partition"] == [-1]
            assert info["original_dim"] == list(expected["fp16_param"][weight + "_fp16"].shape)


def test_the_original_aggregation_helpers_merge_the_trainers_rank_files(ranks):
    results = _result(ranks, "zero")
    files = _files(results[0])
    options = _checkpoint_storage.load(files[0], key="trainer_options")
    D, H = int(options["data_parallel_size"]), int(options["horizontal_parallel_size"])
    data_groups, horizontal_groups = checkpoint._get_parallellism_groups(D, H, int(options["world_size"]))
    assert (data_groups, horizontal_groups) == ([[0, 1]], [[0], [1]])
    ordered = checkpoint._order_paths(files[::-1], data_groups, horizontal_groups)
    assert ordered == {"D": [files], "H": [[files[0]], [files[1]]]}

    expected = checkpoint.aggregate_checkpoints(files, pytorch_format=False)
    merged = checkpoint._aggregate_over_ranks(ordered["D"][0], data_groups[0], mode=checkpoint._AGGREGATION_MODE.Zero,
                                              pytorch_format=False)
    _assert_same(_flat(merged), _flat(expected))
    assert merged["trainer_options"]["world_size"] == 1 and merged["trainer_options"]["zero_stage"] == 0

    # _test_helpers.aggregate_states: the rank state_dicts merged by the module-level helpers
    aggregated, dims = {}, {}
    for result in results:
        state = result["state_dict"]
        checkpoint._aggregate_model_states(state, dims, aggregated, state["trainer_options"]["mixed_precision"])
        checkpoint._aggregate_optimizer_states(state, dims, aggregated)
    checkpoint._reshape_states(dims, aggregated, False)
    _assert_same(_flat(aggregated), _flat(expected))
    _assert_same(checkpoint._to_pytorch_format(merged), checkpoint.aggregate_checkpoints(files))

    one = trainer(0, 1, optim="adam")  # and the one-process trainer holds the merged state
    one.load_checkpoint(*files)
    one.eval_step(*next(_batches(0, 1)))
    _assert_same(_flat(one.state_dict()), _flat(expected))
