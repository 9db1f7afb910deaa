"""`orttrainer train RECIPE --nproc 2` with trainer.distributed.horizontal_parallel_size=2: the tiny GPT-2
recipe as 2 Megatron tensor-parallel ranks (torchrun, gloo) end to end, against the same recipe in one
process on the same data."""

import numpy as np
import pytest

pytest.importorskip("transformers")

from helpers.recipes import records  # noqa: E402
from test_recipes_pipeline import (  # noqa: E402
    STEPS, assert_every_reader_gives_the_trained_weights, run_beside_one_process,
)

from orttrainer import _checkpoint_storage, checkpoint  # noqa: E402
from orttrainer.run import hf_models as models  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

# Small enough for well under ~40 s; dropout off (masks differ between the two runs' graphs).
SMALL_GPT2 = ["model.config.n_embd=64", "model.config.n_head=2", "data.seq_length=64", "data.batch_size=8",
              "model.config.resid_pdrop=0.0", "model.config.embd_pdrop=0.0", "model.config.attn_pdrop=0.0"]


@pytest.fixture(scope="module")
def tensor_parallel_run(tmp_path_factory, data_cache):
    """The tiny GPT-2 recipe on 2 tensor-parallel ranks (tmp/'two') and in one process (tmp/'one'); what
    the 2 processes printed."""
    tmp = tmp_path_factory.mktemp("tensor_parallel")
    output = run_beside_one_process(tmp, data_cache, ("trainer.distributed.horizontal_parallel_size=2",), None,
                                    recipe="gpt2-pretrain-tiny.yaml", small=SMALL_GPT2)
    return tmp, output


def test_gpt2_recipe_runs_as_two_tensor_parallel_ranks_like_one_process(tensor_parallel_run):
    tmp_path, output = tensor_parallel_run
    assert "ranks: 2 processes" in output, output[-2000:]
    one, tp = records(tmp_path / "one", "train"), records(tmp_path / "two", "train")
    assert len(tp) == len(one) == STEPS
    np.testing.assert_allclose([r["loss"] for r in tp], [r["loss"] for r in one], rtol=1e-5)
    # Each rank saved its shard (legacy layout); merged, they are the one-process weights.
    folder = tmp_path / "two" / f"checkpoint-{STEPS}"
    files = [str(models.rank_file(folder, r)) for r in range(2)]
    options = _checkpoint_storage.load(files[1], key="trainer_options")
    assert int(options["horizontal_parallel_size"]) == 2
    shard = _checkpoint_storage.load(files[1], key="model/full_precision")
    merged = checkpoint.aggregate_checkpoints(files, pytorch_format=False)["model"]["full_precision"]
    whole = _checkpoint_storage.load(str(tmp_path / "one" / f"checkpoint-{STEPS}" / models.CHECKPOINT_FILE),
                                     key="model/full_precision")
    assert set(merged) == set(whole)
    cut = [n for n in whole if np.shape(shard[n]) != np.shape(whole[n])]
    assert any("c_attn" in n for n in cut) and any("mlp.c_proj" in n for n in cut), cut  # really sharded
    for name in whole:
        np.testing.assert_allclose(merged[name], whole[name], rtol=0, atol=1e-5, err_msg=name)
    # --resume / run.init_from / orttrainer ckpt take every rank's file of a tensor-parallel checkpoint
    assert models.files_to_load(folder / models.CHECKPOINT_FILE) == files


def test_every_reader_of_a_tensor_parallel_run_folder_merges_its_shards(tensor_parallel_run, tmp_path, capsys):
    assert_every_reader_gives_the_trained_weights(tensor_parallel_run[0] / "two", tmp_path, capsys)
