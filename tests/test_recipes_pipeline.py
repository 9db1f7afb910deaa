"""`orttrainer train RECIPE --nproc 2` with trainer.distributed.pipeline_parallel set: the tiny BERT
recipe as 2 pipeline stages (torchrun, gloo) end to end, against the same recipe in one process."""

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")

from test_recipes import FROZEN_EMBEDDINGS, RECIPES, ROOT, SMALL_BERT, records, sets  # noqa: E402

from orttrainer import _checkpoint_storage, checkpoint  # noqa: E402
from orttrainer.run import models  # noqa: E402

TIMEOUT = 300
STEPS = 3


BERT = (*SMALL_BERT, FROZEN_EMBEDDINGS, "model.config.hidden_dropout_prob=0.0",
        "model.config.attention_probs_dropout_prob=0.0")


def run(out, cache, nproc, extra=(), recipe="bert-pretrain-tiny.yaml", small=BERT):
    """`orttrainer train recipe` (torchrun when nproc > 1), STEPS steps, one checkpoint at the end, with the
    `small` overrides (the tiny BERT's by default) and `extra`. Returns what it printed."""
    argv = [sys.executable, "-m", "orttrainer", "train", str(RECIPES / recipe),
            "--output-dir", str(out)] + (["--nproc", str(nproc)] if nproc > 1 else [])
    for item in sets(cache, *small, f"run.max_steps={STEPS}", "run.log_every=1", "run.eval_every=0",
                     f"run.save_every={STEPS}", "trainer.debug.deterministic_compute=true", *extra):
        argv += ["--set", item]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_a_recipe_runs_as_two_pipeline_stages_like_one_process(tmp_path, data_cache):
    run(tmp_path / "one", data_cache, 1)
    output = run(tmp_path / "pipe", data_cache, 2, (
        "trainer.distributed.pipeline_parallel.pipeline_parallel_size=2",
        # one micro-batch: the masked-LM loss is a mean over a batch's masked tokens, which micro-batches
        # split unevenly (their mean of means is not the batch's mean)
        "trainer.distributed.pipeline_parallel.num_pipeline_micro_batches=1"))
    assert "2 processes as 1 data-parallel x 2 pipeline stages" in output, output[-2000:]
    one, pipe = records(tmp_path / "one", "train"), records(tmp_path / "pipe", "train")
    assert len(pipe) == len(one) == STEPS
    np.testing.assert_allclose([r["loss"] for r in pipe], [r["loss"] for r in one], rtol=1e-5)
    # --resume / run.init_from / orttrainer ckpt take both stage files and merge them into the one-process state
    files = models.files_to_load(tmp_path / "pipe" / f"checkpoint-{STEPS}" / models.CHECKPOINT_FILE)
    assert len(files) == 2, files
    merged, _ = checkpoint._load_checkpoint(files)
    whole = _checkpoint_storage.load(str(tmp_path / "one" / f"checkpoint-{STEPS}" / models.CHECKPOINT_FILE))
    got, expected = merged["model"]["full_precision"], whole["model"]["full_precision"]
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
