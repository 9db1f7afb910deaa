"""`orttrainer train RECIPE --nproc 2` with trainer.distributed.pipeline_parallel set: the tiny BERT
recipe as 2 pipeline stages (torchrun, gloo) end to end, against the same recipe in one process."""

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")

from helpers.recipes import FROZEN_EMBEDDINGS, RECIPES, ROOT, SMALL_BERT, records, sets  # noqa: E402

from orttrainer import _checkpoint_storage, checkpoint  # noqa: E402
from orttrainer.run import hf_models as models  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

TIMEOUT = 300
STEPS = 3


BERT = (*SMALL_BERT, FROZEN_EMBEDDINGS, "model.config.hidden_dropout_prob=0.0",
        "model.config.attention_probs_dropout_prob=0.0")


def argv(out, cache, nproc, extra=(), recipe="bert-pretrain-tiny.yaml", small=BERT):
    """`orttrainer train recipe`'s arguments (torchrun when nproc > 1): STEPS steps, one checkpoint at the
    end, with the `small` overrides (the tiny BERT's by default) and `extra`."""
    args = ["train", str(RECIPES / recipe), "--output-dir", str(out)] + (["--nproc", str(nproc)] if nproc > 1 else [])
    for item in sets(cache, *small, f"run.max_steps={STEPS}", "run.log_every=1", "run.eval_every=0",
                     f"run.save_every={STEPS}", "trainer.debug.deterministic_compute=true", *extra):
        args += ["--set", item]
    return args


def run_beside_one_process(tmp_path, cache, parallel, capsys, **recipe):
    """The recipe on 2 processes with the `parallel` overrides (into tmp_path/'two') and, meanwhile, in
    this process on one (into tmp_path/'one'): the 2 ranks of a tiny model keep about one core busy, and
    this process has its imports already. Returns what the 2 processes printed."""
    from orttrainer.cli import main

    log = tmp_path / "two.log"
    with open(log, "w") as sink:  # a file, not a pipe: the ranks never wait for this process to read
        proc = subprocess.Popen([sys.executable, "-m", "orttrainer",
                                 *argv(tmp_path / "two", cache, 2, parallel, **recipe)],
                                stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        assert main(argv(tmp_path / "one", cache, 1, **recipe)) == 0, capsys.readouterr().err[-3000:] if capsys else ""
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, data_cache):
    """The tiny BERT recipe as 2 pipeline stages (tmp/'two') and in one process (tmp/'one'); what the
    2 processes printed."""
    tmp = tmp_path_factory.mktemp("pipeline")
    output = run_beside_one_process(tmp, data_cache, (
        "trainer.distributed.pipeline_parallel.pipeline_parallel_size=2",
        # one micro-batch: the masked-LM loss is a mean over a batch's masked tokens, which micro-batches
        # split unevenly (their mean of means is not the batch's mean)
        "trainer.distributed.pipeline_parallel.num_pipeline_micro_batches=1"), None)
    return tmp, output


def test_a_recipe_runs_as_two_pipeline_stages_like_one_process(pipeline_run):
    tmp_path, output = pipeline_run
    assert "2 processes as 1 data-parallel x 2 pipeline stages" in output, output[-2000:]
    one, pipe = records(tmp_path / "one", "train"), records(tmp_path / "two", "train")
    assert len(pipe) == len(one) == STEPS
    np.testing.assert_allclose([r["loss"] for r in pipe], [r["loss"] for r in one], rtol=1e-5)
    # --resume / run.init_from / orttrainer ckpt take both stage files and merge them into the one-process state
    files = models.files_to_load(tmp_path / "two" / f"checkpoint-{STEPS}" / models.CHECKPOINT_FILE)
    assert len(files) == 2, files
    merged, _ = checkpoint._load_checkpoint(files)
    whole = _checkpoint_storage.load(str(tmp_path / "one" / f"checkpoint-{STEPS}" / models.CHECKPOINT_FILE))
    got, expected = merged["model"]["full_precision"], whole["model"]["full_precision"]
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_gpt2_with_a_frozen_tied_embedding_trains_as_two_pipeline_stages_like_one_process(tmp_path, data_cache):
    # The automatic cut leaves stage 0 with the embedding lookup alone: with the tied embedding frozen,
    # a stage without a weight to train (its gradient is the last stage's only).
    from test_recipes_tensor_parallel import SMALL_GPT2

    frozen = [*SMALL_GPT2, "trainer.utils.frozen_weights=[transformer.wte.weight]"]
    output = run_beside_one_process(tmp_path, data_cache, ("trainer.distributed.pipeline_parallel.pipeline_parallel_size=2",),
                                    None, recipe="gpt2-pretrain-tiny.yaml", small=frozen)
    assert "2 processes as 1 data-parallel x 2 pipeline stages" in output, output[-2000:]
    one, pipe = records(tmp_path / "one", "train"), records(tmp_path / "two", "train")
    assert len(pipe) == len(one) == STEPS
    np.testing.assert_allclose([r["loss"] for r in pipe], [r["loss"] for r in one], rtol=1e-5)
    merged, _ = checkpoint._load_checkpoint(models.files_to_load(tmp_path / "two" / f"checkpoint-{STEPS}" /
                                                                 models.CHECKPOINT_FILE))
    whole = _checkpoint_storage.load(str(tmp_path / "one" / f"checkpoint-{STEPS}" / models.CHECKPOINT_FILE))
    got, expected = merged["model"]["full_precision"], whole["model"]["full_precision"]
    assert set(got) == set(expected) and "transformer.wte.weight" in got
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def assert_every_reader_gives_the_trained_weights(run_dir, tmp_path, capsys):
    """model.from, `orttrainer ckpt merge / to-torch / export` of the multi-rank run folder `run_dir`
    (and of its checkpoint folder) read the weights --resume loads: every rank's file, merged."""
    import torch
    from safetensors.torch import load_file

    from orttrainer.cli import main

    folder = run_dir / f"checkpoint-{STEPS}"
    files = models.files_to_load(folder / models.CHECKPOINT_FILE)
    assert len(files) == 2, files
    trained = checkpoint._load_checkpoint(files)[0]["model"]["full_precision"]  # what --resume loads

    def same(got, what, names=None):
        names = set(trained) if names is None else names
        assert names and names <= set(got) and names <= set(trained), (what, sorted(set(trained) ^ set(got)))
        for name in names:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(trained[name]), err_msg=f"{what}: {name}")

    def ckpt(*args):
        code = main(["ckpt", *map(str, args)])
        err = capsys.readouterr().err
        assert code == 0, err
    ckpt("merge", tmp_path / "merged.ortcp", folder)
    same(_checkpoint_storage.load(tmp_path / "merged.ortcp", key="model/full_precision"), "ckpt merge")
    ckpt("to-torch", run_dir, tmp_path / "weights.pt")
    same(torch.load(tmp_path / "weights.pt"), "ckpt to-torch")
    ckpt("to-torch", *files, tmp_path / "weights.safetensors")
    same(load_file(tmp_path / "weights.safetensors"), "ckpt to-torch of the rank files")
    ckpt("export", run_dir, "--format", "hf", "--out", tmp_path / "hf")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    same(hf, "ckpt export --format hf", set(hf) & set(trained))  # save_pretrained keeps one name per tie
    ckpt("export", folder, "--format", "onnx", "--out", tmp_path / "onnx")
    assert (tmp_path / "onnx" / "model.onnx").is_file()

    # model.from=run_dir: the weight source and model the recipe runner builds from it
    source = models.weight_source(str(run_dir))
    assert source.kind == "checkpoint" and source.model_json is not None
    built = models.build_model(source.model_json["kind"], {}, seed=0, vocab_size=None, seq_length=64, source=source)
    same({name: value.numpy() for name, value in built.model.state_dict().items()}, "model.from")


def test_every_reader_of_a_pipeline_run_folder_merges_its_stages(pipeline_run, tmp_path, capsys):
    assert_every_reader_gives_the_trained_weights(pipeline_run[0] / "two", tmp_path, capsys)
