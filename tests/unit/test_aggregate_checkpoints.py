"""orttrainer.checkpoint.aggregate_checkpoints against hand-built per-rank files (contract §3.4)."""

import pickle
import random
import warnings
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import torch

from orttrainer import _checkpoint_storage, checkpoint
from orttrainer.state import aggregation
from orttrainer.state import experimental_checkpoint as experimental


def _options(rank, world_size, D, H, zero_stage=1, mixed_precision=False, optimizer_name="AdamOptimizer"):
    return {"mixed_precision": mixed_precision, "zero_stage": zero_stage, "world_rank": rank,
            "world_size": world_size, "optimizer_name": optimizer_name, "data_parallel_size": D,
            "horizontal_parallel_size": H}


def _save_ranks(tmp_path, states):
    paths = []
    for rank, state in enumerate(states):
        path = tmp_path / f"checkpoint{rank}.ortcp"
        _checkpoint_storage.save(state, path)
        paths.append(str(path))
    return paths


def _zero_rank_states(mixed_precision=False):
    """The contract's unit oracle: 2 ranks, ZeRO-1."""
    states = []
    for rank, (weights, m1, m2) in enumerate([([1, 2, 3], [9, 8, 7], [99, 88, 77]),
                                              ([4, 5, 6] if mixed_precision else [1, 2, 3], [6, 5, 4], [66, 55, 44])]):
        states.append({
            "model": {"full_precision": {"sharded": np.array(weights), "non_sharded": np.array([11, 22, 33])}},
            "optimizer": {
                "sharded": {"Moment_1": np.array(m1), "Moment_2": np.array(m2), "Update_Count": np.array([5])},
                "non_sharded": {"Moment_1": np.array([666, 555, 444]), "Moment_2": np.array([6666, 5555, 4444]),
                                "Update_Count": np.array([55])},
            },
            "trainer_options": _options(rank, 2, 2, 1, mixed_precision=mixed_precision),
            "partition_info": {"sharded": {"original_dim": [2, 3], "megatron_row_partition": [-1]}},
            "train_step_info": {"optimization_step": 4, "step": 8},
        })
    states[0]["user_dict"] = _checkpoint_storage.encode_user_dict({"epoch": 2})
    states[0]["loss_scaler"] = {"loss_scale": 1024.0, "stable_steps": 7}
    states[0]["lr_scheduler"] = {"last_lr": np.array([0.1])}
    return states


def _assert_single_process_options(options, mixed_precision=False):
    assert dict(options, optimizer_name=None) == {
        "mixed_precision": mixed_precision, "zero_stage": 0, "world_rank": 0, "world_size": 1,
        "optimizer_name": None, "data_parallel_size": 1, "horizontal_parallel_size": 1}
    assert options["optimizer_name"] == b"AdamOptimizer"


# ------------------------------------------------------------------ ZeRO-1

def test_zero_full_precision_oracle(tmp_path):
    paths = _save_ranks(tmp_path, _zero_rank_states())
    state = checkpoint.aggregate_checkpoints(paths, pytorch_format=False)

    model = state["model"]["full_precision"]
    np.testing.assert_array_equal(model["sharded"], [1, 2, 3])  # identical on both ranks: kept as is
    np.testing.assert_array_equal(model["non_sharded"], [11, 22, 33])
    optimizer = state["optimizer"]
    np.testing.assert_array_equal(optimizer["sharded"]["Moment_1"], [[9, 8, 7], [6, 5, 4]])
    np.testing.assert_array_equal(optimizer["sharded"]["Moment_2"], [[99, 88, 77], [66, 55, 44]])
    np.testing.assert_array_equal(optimizer["sharded"]["Update_Count"], [5])
    np.testing.assert_array_equal(optimizer["non_sharded"]["Moment_1"], [666, 555, 444])
    np.testing.assert_array_equal(optimizer["non_sharded"]["Update_Count"], [55])
    _assert_single_process_options(state["trainer_options"])
    assert "partition_info" not in state

    # Every other top-level entry comes from rank 0 unchanged.
    assert _checkpoint_storage.decode_user_dict(state["user_dict"]) == {"epoch": 2}
    assert state["loss_scaler"] == {"loss_scale": 1024.0, "stable_steps": 7}
    np.testing.assert_array_equal(state["lr_scheduler"]["last_lr"], [0.1])
    assert state["train_step_info"] == {"optimization_step": 4, "step": 8}


def test_zero_mixed_precision_concatenates_model_shards(tmp_path):
    paths = _save_ranks(tmp_path, _zero_rank_states(mixed_precision=True))
    state = checkpoint.aggregate_checkpoints(paths, pytorch_format=False)
    np.testing.assert_array_equal(state["model"]["full_precision"]["sharded"], [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(state["model"]["full_precision"]["non_sharded"], [11, 22, 33])
    np.testing.assert_array_equal(state["optimizer"]["sharded"]["Moment_1"], [[9, 8, 7], [6, 5, 4]])
    _assert_single_process_options(state["trainer_options"], mixed_precision=True)


def test_pytorch_format_is_a_flat_dict_of_tensors(tmp_path):
    paths = _save_ranks(tmp_path, _zero_rank_states(mixed_precision=True))
    state = checkpoint.aggregate_checkpoints(paths)
    assert set(state) == {"sharded", "non_sharded"}
    assert torch.equal(state["sharded"], torch.tensor([[1, 2, 3], [4, 5, 6]]))


def test_the_order_of_paths_does_not_matter(tmp_path):
    paths = _save_ranks(tmp_path, _zero_rank_states(mixed_precision=True))
    forward = checkpoint.aggregate_checkpoints(paths, pytorch_format=False)
    backward = checkpoint.aggregate_checkpoints(paths[::-1], pytorch_format=False)
    np.testing.assert_array_equal(backward["model"]["full_precision"]["sharded"], [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(backward["optimizer"]["sharded"]["Moment_2"],
                                  forward["optimizer"]["sharded"]["Moment_2"])
    assert "user_dict" in backward  # still rank 0's


@patch("orttrainer._checkpoint_storage.load")
def test_the_original_mocked_call_sequence_still_works(load_mock):
    """The original unit test mocks _checkpoint_storage.load: options of paths[0], options of every
    path, then the full files in rank order (here 'abc' is rank 1)."""
    states = _zero_rank_states()
    options = [s["trainer_options"] for s in states]
    load_mock.side_effect = [options[0], options[1], options[0], states[0], states[1]]
    state = checkpoint.aggregate_checkpoints(["abc", "def"], pytorch_format=False)
    np.testing.assert_array_equal(state["optimizer"]["sharded"]["Moment_1"], [[9, 8, 7], [6, 5, 4]])
    assert load_mock.call_args_list[0].kwargs == {"key": "trainer_options"}
    assert [call.args[0] for call in load_mock.call_args_list[3:]] == ["def", "abc"]


# ------------------------------------------------------------------ Megatron

def test_megatron_row_and_column_partitions(tmp_path):
    row = np.arange(12.0).reshape(4, 3)      # row partition (megatron_row_partition 1): axis 0
    column = np.arange(12.0).reshape(3, 4)   # column partition (0): last axis
    moment = np.arange(100.0, 112.0).reshape(4, 3)
    states = []
    for h in range(2):
        states.append({
            "model": {"full_precision": {"row": row[2 * h:2 * h + 2], "column": column[:, 2 * h:2 * h + 2],
                                         "bias": np.ones(3)}},
            "optimizer": {"row": {"Moment_1": moment[2 * h:2 * h + 2], "Moment_2": moment[2 * h:2 * h + 2] * 2,
                                  "Update_Count": np.array([3])},
                          "column": {"Moment_1": column[:, 2 * h:2 * h + 2] + 1,
                                     "Moment_2": column[:, 2 * h:2 * h + 2] + 2, "Update_Count": np.array([3])},
                          "bias": {"Moment_1": np.zeros(3), "Moment_2": np.zeros(3), "Update_Count": np.array([3])}},
            "trainer_options": _options(h, 2, 1, 2, zero_stage=0),
            "partition_info": {"row": {"original_dim": [4, 3], "megatron_row_partition": [1]},
                               "column": {"original_dim": [3, 4], "megatron_row_partition": [0]}},
        })
    paths = _save_ranks(tmp_path, states)
    state = checkpoint.aggregate_checkpoints(paths[::-1], pytorch_format=False)

    model = state["model"]["full_precision"]
    np.testing.assert_array_equal(model["row"], row)
    np.testing.assert_array_equal(model["column"], column)
    np.testing.assert_array_equal(model["bias"], np.ones(3))
    np.testing.assert_array_equal(state["optimizer"]["row"]["Moment_1"], moment)
    np.testing.assert_array_equal(state["optimizer"]["row"]["Moment_2"], moment * 2)
    np.testing.assert_array_equal(state["optimizer"]["column"]["Moment_2"], column + 2)
    assert state["trainer_options"]["horizontal_parallel_size"] == 1

    flat = checkpoint.aggregate_checkpoints(paths)
    assert torch.equal(flat["column"], torch.tensor(column))


def test_zero_and_megatron_combined_over_four_ranks(tmp_path):
    """D=2, H=2: rank r holds Megatron shard r % 2 and ZeRO shard r // 2 of the moments."""
    weight = np.arange(12.0).reshape(4, 3)          # row-partitioned Megatron weight
    moment = np.arange(200.0, 212.0).reshape(4, 3)
    bias = np.arange(4.0)                           # ZeRO-partitioned moments only
    bias_moment = np.arange(50.0, 54.0)
    states = []
    for rank in range(4):
        h, d = rank % 2, rank // 2
        moment_shard = moment[2 * h:2 * h + 2].reshape(-1)[3 * d:3 * d + 3]
        states.append({
            "model": {"full_precision": {"weight": weight[2 * h:2 * h + 2], "bias": bias}},
            "optimizer": {
                "weight": {"Moment_1": moment_shard, "Moment_2": -moment_shard, "Update_Count": np.array([9])},
                "bias": {"Moment_1": bias_moment[2 * d:2 * d + 2], "Moment_2": -bias_moment[2 * d:2 * d + 2],
                         "Update_Count": np.array([9])},
            },
            "trainer_options": _options(rank, 4, 2, 2, zero_stage=1),
            "partition_info": {"weight": {"original_dim": [4, 3], "megatron_row_partition": [1]},
                               "bias": {"original_dim": [4], "megatron_row_partition": [-1]}},
            "train_step_info": {"optimization_step": 3, "step": 3},
        })
    states[0]["user_dict"] = _checkpoint_storage.encode_user_dict({"tag": "d+h"})
    paths = _save_ranks(tmp_path, states)
    shuffled = paths[:]
    random.Random(0).shuffle(shuffled)
    state = checkpoint.aggregate_checkpoints(shuffled, pytorch_format=False)

    np.testing.assert_array_equal(state["model"]["full_precision"]["weight"], weight)
    np.testing.assert_array_equal(state["model"]["full_precision"]["bias"], bias)
    np.testing.assert_array_equal(state["optimizer"]["weight"]["Moment_1"], moment)
    np.testing.assert_array_equal(state["optimizer"]["weight"]["Moment_2"], -moment)
    np.testing.assert_array_equal(state["optimizer"]["bias"]["Moment_1"], bias_moment)
    np.testing.assert_array_equal(state["optimizer"]["weight"]["Update_Count"], [9])
    _assert_single_process_options(state["trainer_options"])
    assert _checkpoint_storage.decode_user_dict(state["user_dict"]) == {"tag": "d+h"}
    assert "partition_info" not in state  # the D pass keeps it only for the Megatron pass
    assert state["train_step_info"] == {"optimization_step": 3, "step": 3}

    flat = checkpoint.aggregate_checkpoints(paths)
    assert torch.equal(flat["weight"], torch.tensor(weight))


# ------------------------------------------------------------------ errors

def _error(paths, match):
    with pytest.raises(ValueError, match=match) as error:
        checkpoint.aggregate_checkpoints(paths, pytorch_format=False)
    assert isinstance(error.value, AssertionError)  # the type the original raised
    return str(error.value)


def test_missing_rank(tmp_path):
    paths = _save_ranks(tmp_path, _zero_rank_states())
    message = _error(paths[1:], r"Missing checkpoint file for rank\(s\) \[0\]")
    assert "checkpoint1.ortcp" in message


def test_duplicate_rank(tmp_path):
    states = _zero_rank_states()
    states[1]["trainer_options"]["world_rank"] = 0
    paths = _save_ranks(tmp_path, states)
    message = _error(paths, "Duplicate rank 0")
    assert "checkpoint0.ortcp" in message and "checkpoint1.ortcp" in message


@pytest.mark.parametrize("key, value, label", [
    ("optimizer_name", "LambOptimizer", "Optimizer name"),
    ("mixed_precision", True, "Mixed precision state"),
    ("world_size", 4, "World size state"),
])
def test_mismatched_options_name_the_file(tmp_path, key, value, label):
    states = _zero_rank_states()
    states[1]["trainer_options"][key] = value
    paths = _save_ranks(tmp_path, states)
    message = _error(paths, f"{label} mismatch among checkpoint files")
    assert "checkpoint1.ortcp" in message


def test_replicated_tensor_that_differs_names_the_tensor_and_the_file(tmp_path):
    states = _zero_rank_states()
    states[1]["model"]["full_precision"]["non_sharded"] = np.array([11, 22, 34])
    message = _error(_save_ranks(tmp_path, states), "Value mismatch for model state non_sharded")
    assert "checkpoint1.ortcp differs from" in message and "checkpoint0.ortcp" in message


def test_replicated_optimizer_state_that_differs(tmp_path):
    states = _zero_rank_states()
    states[1]["optimizer"]["sharded"]["Update_Count"] = np.array([6])
    _error(_save_ranks(tmp_path, states), "Value mismatch for model state sharded and optimizer state Update_Count")


def test_files_saved_at_different_steps(tmp_path):
    states = _zero_rank_states()
    states[1]["train_step_info"]["step"] = 10
    _error(_save_ranks(tmp_path, states), "train_step_info mismatch")


def test_missing_partition_info(tmp_path):
    states = _zero_rank_states()
    del states[1]["partition_info"]
    _error(_save_ranks(tmp_path, states), "Missing information: partition_info in .*checkpoint1.ortcp")


def test_shard_with_the_wrong_size_cannot_be_reshaped(tmp_path):
    states = _zero_rank_states()
    states[1]["optimizer"]["sharded"]["Moment_1"] = np.array([6, 5])
    _error(_save_ranks(tmp_path, states), "Cannot reshape the merged optimizer state Moment_1 of sharded")


def test_unpartitioned_files_give_none(tmp_path):
    state = _zero_rank_states()[0]
    state["trainer_options"] = _options(0, 1, 1, 1, zero_stage=0)
    assert checkpoint.aggregate_checkpoints(_save_ranks(tmp_path, [state])) is None


# ------------------------------------------------------------------ legacy helpers and experimental API

def test_legacy_names_and_groups():
    assert experimental._get_checkpoint_name("ckpt", False) == "ckpt.ort.pt"
    assert experimental._get_checkpoint_name("ckpt", True, 1, 4) == "ckpt.ZeRO.1.3.ort.pt"
    assert aggregation._AGGREGATION_MODE.Zero.value == 0 and aggregation._AGGREGATION_MODE.Megatron.value == 1
    assert aggregation._get_parallelism_groups(2, 2, 4) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    split = experimental._split_state_dict({"w": 1, "w_fp16": 2, "Moment_1_w": 3, "Update_Count_w": 4, "Step": 5})
    assert split == {"fp32_param": {"w": 1}, "fp16_param": {"w_fp16": 2},
                     "optimizer": {"Moment_1_w": 3, "Update_Count_w": 4, "Step": 5}}


def test_combine_zero_checkpoint_of_torch_save_files(tmp_path):
    moment = torch.arange(6.0).reshape(2, 3)
    for rank in range(2):
        torch.save({"model": {"w": torch.ones(2, 3), f"Moment_1_w_view_{rank}": moment.reshape(-1)[3 * rank:3 * rank + 3],
                              f"Update_Count_w_view_{rank}": torch.tensor([4])}, "epoch": 1},
                   tmp_path / f"ckpt.ZeRO.{rank}.1.ort.pt")
    files = experimental._list_checkpoint_files(tmp_path, "ckpt")
    with pytest.warns(DeprecationWarning, match="Please use aggregate_checkpoints"):
        merged = experimental._CombineZeroCheckpoint(files[::-1]).aggregate_checkpoints()
    assert torch.equal(merged["Moment_1_w"], moment) and torch.equal(merged["Update_Count_w"], torch.tensor([4]))
    with pytest.raises(ValueError, match="Could not find 2 files"):
        experimental._CombineZeroCheckpoint(files[:1])
    with pytest.raises(ValueError, match="No checkpoint found with prefix 'other'"):
        experimental._list_checkpoint_files(tmp_path, "other")


class _FakeTrainer:
    """Just the public surface the experimental API uses."""

    def __init__(self):
        self.state = {"model": {"full_precision": {"w": np.ones((2, 2), np.float32)}},
                      "optimizer": {"w": {"Moment_1": np.zeros((2, 2), np.float32), "Update_Count": np.array([2])}},
                      "trainer_options": _options(0, 1, 1, 1, zero_stage=0)}
        self.loaded = None
        self.optim_config = SimpleNamespace(name="AdamOptimizer")
        self.options = SimpleNamespace(distributed=SimpleNamespace(
            world_rank=0, world_size=1, deepspeed_zero_optimization=SimpleNamespace(stage=0)))

    def state_dict(self):
        return self.state

    def load_state_dict(self, state_dict, strict=True):
        self.loaded = state_dict


def test_experimental_api_round_trip_through_the_public_trainer_api(tmp_path):
    trainer = _FakeTrainer()
    with pytest.warns(DeprecationWarning, match=r"experimental_state_dict\(\) will be deprecated soon. "
                                                r"Please use ORTTrainer.state_dict\(\) instead."):
        flat = checkpoint.experimental_state_dict(trainer)
    assert set(flat) == {"w", "Moment_1_w", "Update_Count_w"}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict={"epoch": 3})
        assert (tmp_path / "ORT_checkpoint.ort.pt").exists()
        extras = checkpoint.experimental_load_checkpoint(trainer, str(tmp_path))
        assert extras == {"epoch": 3}
        np.testing.assert_array_equal(trainer.loaded["optimizer"]["w"]["Update_Count"], [2])
        assert trainer.loaded["trainer_options"]["optimizer_name"] == "AdamOptimizer"

        with pytest.raises(RuntimeError, match="Checkpoint tensor: extra is not present in the model."):
            checkpoint.experimental_load_state_dict(trainer, {"extra": torch.ones(1)}, strict=True)


# ------------------------------------------------------------------ the file side of save/load_checkpoint

def test_save_and_load_checkpoint_files(tmp_path):
    state = _zero_rank_states()[0]
    state["trainer_options"] = _options(0, 1, 1, 1, zero_stage=0)
    del state["partition_info"], state["user_dict"]
    path = tmp_path / "ckpt.ortcp"
    checkpoint._save_checkpoint(state, path, user_dict={"epoch": 3}, include_optimizer_states=False)
    assert "user_dict" not in state and "optimizer" in state  # the caller's dict is left alone

    loaded, user_dict = checkpoint._load_checkpoint((str(path),))
    assert user_dict == {"epoch": 3} and "optimizer" not in loaded and "user_dict" not in loaded
    np.testing.assert_array_equal(loaded["model"]["full_precision"]["non_sharded"], [11, 22, 33])

    with pytest.raises(FileExistsError):
        checkpoint._save_checkpoint(state, path)
    with pytest.raises(ValueError, match="Expected number of files to load: 1, got 2"):
        checkpoint._load_checkpoint((str(path), str(path)))


def test_load_checkpoint_files_aggregates_rank_files(tmp_path):
    paths = _save_ranks(tmp_path, _zero_rank_states(mixed_precision=True))
    state, user_dict = checkpoint._load_checkpoint(tuple(paths[::-1]))
    assert user_dict == {"epoch": 2}
    np.testing.assert_array_equal(state["model"]["full_precision"]["sharded"], [[1, 2, 3], [4, 5, 6]])


def test_load_checkpoint_files_refuses_an_unsafe_user_dict_unless_allowed(tmp_path):
    state = {"trainer_options": _options(0, 1, 1, 1, zero_stage=0),
             "user_dict": _checkpoint_storage.to_serialized_hex({"scaler": _FakeTrainer})}
    path = tmp_path / "ckpt.ortcp"
    _checkpoint_storage.save(state, path)
    with pytest.raises(pickle.UnpicklingError, match="_FakeTrainer"):
        checkpoint._load_checkpoint((path,))
    assert checkpoint._load_checkpoint((path,), allow_unsafe_pickle=True)[1] == {"scaler": _FakeTrainer}


@patch("orttrainer.checkpoint.aggregate_checkpoints")
@patch("orttrainer._checkpoint_storage.load")
def test_load_checkpoint_files_makes_the_original_calls(load_mock, aggregate_mock):
    options = _options(0, 1, 1, 1, zero_stage=0)
    load_mock.side_effect = [options, {"model": {}, "trainer_options": options}]
    checkpoint._load_checkpoint(("abc",))
    assert load_mock.call_args_list[0].args == ("abc",) and load_mock.call_args_list[0].kwargs == {"key": "trainer_options"}
    assert load_mock.call_args_list[1].args == ("abc",) and "key" not in load_mock.call_args_list[1].kwargs
    assert not aggregate_mock.called

    load_mock.side_effect = [_options(0, 4, 4, 1, zero_stage=1)]
    checkpoint._load_checkpoint(("abc",))
    assert aggregate_mock.call_args.args[0] == ("abc",)


def test_files_without_parallel_sizes_are_plain_data_parallel(tmp_path):
    states = _zero_rank_states()
    for state in states:
        del state["trainer_options"]["data_parallel_size"], state["trainer_options"]["horizontal_parallel_size"]
    state = checkpoint.aggregate_checkpoints(_save_ranks(tmp_path, states), pytorch_format=False)
    np.testing.assert_array_equal(state["optimizer"]["sharded"]["Moment_1"], [[9, 8, 7], [6, 5, 4]])
