"""`orttrainer ckpt inspect / merge / to-torch` on real checkpoint files (their outputs by `--out`, as
`ckpt export` spells it, or positional)."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from orttrainer import _checkpoint_storage, cli

WEIGHT = np.arange(6, dtype=np.float32).reshape(2, 3)
MOMENT = np.arange(10, 16, dtype=np.float32).reshape(2, 3)


def _state(rank=0, world_size=1, zero_stage=0):
    """One rank of a ZeRO-1 run (mixed precision: the fp32 weights are sharded too), or a whole run."""
    sharded = zero_stage > 0
    weight = WEIGHT.reshape(-1)[3 * rank:3 * rank + 3] if sharded else WEIGHT
    moment = MOMENT.reshape(-1)[3 * rank:3 * rank + 3] if sharded else MOMENT
    state = {
        "model": {"full_precision": {"fc.weight": weight, "fc.bias": np.zeros(2, np.float32)}},
        "optimizer": {"fc.weight": {"Moment_1": moment, "Moment_2": moment * 0, "Update_Count": np.array([4])}},
        "trainer_options": {"mixed_precision": sharded, "zero_stage": zero_stage, "world_rank": rank,
                            "world_size": world_size, "optimizer_name": "AdamOptimizer",
                            "data_parallel_size": world_size, "horizontal_parallel_size": 1},
        "train_step_info": {"optimization_step": 3, "step": 6},
        "loss_scaler": {"loss_scale": 512.0},
        "user_dict": _checkpoint_storage.encode_user_dict({"epoch": 1, "best_loss": 0.5}),
    }
    if sharded:
        state["partition_info"] = {"fc.weight": {"original_dim": [2, 3], "megatron_row_partition": [-1]}}
    return state


@pytest.fixture
def single(tmp_path):
    path = str(tmp_path / "single.ortcp")
    _checkpoint_storage.save(_state(), path)
    return path


@pytest.fixture
def ranks(tmp_path):
    paths = [str(tmp_path / f"checkpoint{rank}.ortcp") for rank in range(2)]
    for rank, path in enumerate(paths):
        _checkpoint_storage.save(_state(rank, world_size=2, zero_stage=1), path)
    return paths


def _run(capsys, *argv):
    code = cli.main(["ckpt", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_expected_error(code, err, *fragments):
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err  # one line, no traceback
    for fragment in fragments:
        assert fragment in err


# ------------------------------------------------------------------ inspect

def test_inspect_shows_steps_options_tree_and_user_dict_keys(capsys, single):
    code, out, _ = _run(capsys, "inspect", single)
    assert code == 0
    assert "train_step_info: optimization_step=3, step=6" in out
    assert "optimizer_name=AdamOptimizer" in out and "zero_stage=0" in out
    assert "user_dict: json, keys: epoch, best_loss" in out
    assert "model: 2 tensors, 8 values" in out
    assert "    fc.weight: float32[2, 3]" in out
    assert "    Update_Count: int64[1] = [4]" in out
    assert "loss_scaler/\n  loss_scale: float64 = 512.0" in out  # unknown groups are shown generically


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_inspect_never_runs_a_pickled_user_dict(capsys, tmp_path):
    path = str(tmp_path / "evil.ortcp")
    _checkpoint_storage.save({"user_dict": pickle.dumps({"x": _RunsCode()}).hex()}, path)
    code, out, _ = _run(capsys, "inspect", path)
    assert code == 0
    assert "user_dict: pickle, holds objects other than plain data (not decoded)" in out
    assert "pwned" not in out


def test_inspect_a_rank_file_says_it_is_a_shard(capsys, ranks):
    code, out, _ = _run(capsys, "inspect", ranks[1])
    assert code == 0 and "world_rank=1" in out and "orttrainer ckpt merge" in out
    assert "original_dim: int64[2] = [2, 3]" in out


def test_inspect_errors(capsys, tmp_path):
    code, _, err = _run(capsys, "inspect", str(tmp_path / "missing.ortcp"))
    _assert_expected_error(code, err, "orttrainer ckpt inspect: error:", "missing.ortcp")

    bad = tmp_path / "bad.ortcp"
    bad.write_text("not hdf5")
    code, _, err = _run(capsys, "inspect", str(bad))
    _assert_expected_error(code, err, "is not an hdf5 file")


# ------------------------------------------------------------------ merge

def test_merge_writes_one_checkpoint_and_refuses_to_overwrite(capsys, tmp_path, ranks):
    out_path = str(tmp_path / "merged.ortcp")
    code, out, _ = _run(capsys, "merge", out_path, *ranks[::-1])
    assert code == 0 and "merged 2 files" in out

    merged = _checkpoint_storage.load(out_path)
    np.testing.assert_array_equal(merged["model"]["full_precision"]["fc.weight"], WEIGHT)
    np.testing.assert_array_equal(merged["optimizer"]["fc.weight"]["Moment_1"], MOMENT)
    assert merged["trainer_options"]["world_size"] == 1 and merged["trainer_options"]["zero_stage"] == 0
    assert merged["loss_scaler"] == {"loss_scale": 512.0}
    assert _checkpoint_storage.decode_user_dict(merged["user_dict"]) == {"epoch": 1, "best_loss": 0.5}

    code, _, err = _run(capsys, "merge", out_path, *ranks)
    _assert_expected_error(code, err, "merged.ortcp already exists", "--overwrite")
    assert _run(capsys, "merge", "--overwrite", out_path, *ranks)[0] == 0


def test_merge_errors(capsys, tmp_path, ranks, single):
    code, _, err = _run(capsys, "merge", str(tmp_path / "out.ortcp"), ranks[0])
    _assert_expected_error(code, err, "Missing checkpoint file for rank(s) [1]")
    code, _, err = _run(capsys, "merge", str(tmp_path / "out.ortcp"), single)
    _assert_expected_error(code, err, "nothing to merge")
    assert not (tmp_path / "out.ortcp").exists()


# ------------------------------------------------------------------ to-torch

def test_to_torch_pt_of_a_single_file_loads_into_a_module(capsys, tmp_path, single):
    out_path = str(tmp_path / "weights.pt")
    code, out, _ = _run(capsys, "to-torch", single, out_path)
    assert code == 0 and "wrote 2 tensors" in out
    weights = torch.load(out_path, weights_only=True)
    model = torch.nn.Linear(3, 2)
    model.load_state_dict({k.removeprefix("fc."): v for k, v in weights.items()}, strict=True)
    assert torch.equal(model.weight.detach(), torch.from_numpy(WEIGHT))


def test_to_torch_safetensors_of_rank_files(capsys, tmp_path, ranks):
    from safetensors.torch import load_file

    out_path = str(tmp_path / "weights.safetensors")
    code, _, _ = _run(capsys, "to-torch", *ranks, out_path)
    assert code == 0
    weights = load_file(out_path)
    assert torch.equal(weights["fc.weight"], torch.from_numpy(WEIGHT))  # merged from two shards

    code, _, err = _run(capsys, "to-torch", *ranks, out_path)
    _assert_expected_error(code, err, "already exists")


def test_to_torch_errors(capsys, tmp_path, ranks, single):
    code, _, err = _run(capsys, "to-torch", single, str(tmp_path / "weights.npz"))
    _assert_expected_error(code, err, "must end with .pt, .pth or .safetensors")
    code, _, err = _run(capsys, "to-torch", ranks[1], str(tmp_path / "weights.pt"))
    _assert_expected_error(code, err, "Missing checkpoint file for rank(s) [0]")
    code, _, err = _run(capsys, "to-torch", single, single, str(tmp_path / "weights.pt"))
    _assert_expected_error(code, err, "expected one checkpoint file")
    assert not (tmp_path / "weights.pt").exists()


# ------------------------------------------------------------------ --out on every command that writes

@pytest.mark.parametrize("out_first", [False, True])
def test_merge_and_to_torch_take_out_like_export(capsys, tmp_path, ranks, single, out_first):
    """`--out OUT` as `ckpt export` spells it, before or after the PATHs; the same files as the older
    positional form."""
    def run(command, out, *paths):
        return _run(capsys, command, *(["--out", out, *paths] if out_first else [*paths, "--out", out]))

    merged = str(tmp_path / "merged.ortcp")
    code, out, _ = run("merge", merged, *ranks)
    assert code == 0 and "merged 2 files" in out
    assert _run(capsys, "merge", str(tmp_path / "positional.ortcp"), *ranks)[0] == 0
    for name in ("model", "optimizer"):
        first, second = (_checkpoint_storage.load(p)[name] for p in (merged, str(tmp_path / "positional.ortcp")))
        np.testing.assert_equal(first, second)

    for source, name in ((single, "single.pt"), (ranks, "ranks.safetensors")):
        path = str(tmp_path / name)
        code, out, _ = run("to-torch", path, *([source] if isinstance(source, str) else source))
        assert code == 0 and f"wrote 2 tensors to {path}" in out
    assert torch.equal(torch.load(tmp_path / "single.pt", weights_only=True)["fc.weight"], torch.from_numpy(WEIGHT))
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "ranks.safetensors")["fc.weight"], torch.from_numpy(WEIGHT))
    code, _, err = run("to-torch", str(tmp_path / "single.pt"), single)
    _assert_expected_error(code, err, "single.pt already exists", "--overwrite")


def test_output_given_twice_or_not_at_all_is_one_clear_error(capsys, tmp_path, ranks, single):
    written = str(tmp_path / "w.pt")
    code, _, err = _run(capsys, "to-torch", single, written, "--out", str(tmp_path / "x.pt"))
    _assert_expected_error(code, err, "orttrainer ckpt to-torch: error: the output is given twice", "w.pt", "x.pt")
    code, _, err = _run(capsys, "to-torch", single)
    _assert_expected_error(code, err, "orttrainer ckpt to-torch: error: no output given; add --out OUT")
    merged = str(tmp_path / "m.ortcp")
    code, _, err = _run(capsys, "merge", merged, *ranks, "--out", str(tmp_path / "n.ortcp"))
    _assert_expected_error(code, err, f"{merged} does not exist; with --out", "give the output once")
    code, _, err = _run(capsys, "merge", ranks[0])
    _assert_expected_error(code, err, "orttrainer ckpt merge: error: no output given; add --out OUT")
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in [*ranks, single])  # nothing written


@pytest.mark.multiprocess
def test_python_dash_m_smoke(single):
    result = subprocess.run([sys.executable, "-m", "orttrainer", "ckpt", "inspect", single],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fc.weight: float32[2, 3]" in result.stdout
