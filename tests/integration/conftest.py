"""The integration tier's shared runs: rank launches and recipe trainings that several modules check,
each started once per session (starting processes and building data costs more than the checks)."""

import contextlib
import io

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """data.cache_dir shared by every recipe test of the session: each data set is built once."""
    return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def two_rank_launch(tmp_path_factory):
    """One 2-rank launch (tests/helpers/distributed_worker.py) running the scenarios of test_distributed,
    test_distributed_checkpoints and test_adasum in sequence in the same pair of processes: starting
    and importing ranks costs more than their training. The raw per-rank results; each module checks
    them (ranks_ok) and reads its own scenarios by name."""
    import test_adasum
    import test_distributed
    import test_distributed_checkpoints
    from helpers.distributed_worker import launch

    scenarios = [*test_distributed.SCENARIOS, *test_distributed_checkpoints.SCENARIOS, *test_adasum.SCENARIOS]
    names = [s["name"] for s in scenarios]
    assert len(names) == len(set(names)), "scenario names must be unique across the three modules"
    results, _ = launch(2, scenarios, tmp_path_factory.mktemp("two_ranks"), timeout=900)
    return results


@pytest.fixture(scope="session")
def two_rank_bert_run(tmp_path_factory, data_cache):
    """`orttrainer train --nproc 2` (torchrun) of the tiny BERT recipe, ZeRO-1, 6 steps, with
    run.export_at_end=hf (after the run's metrics and results are written): the uninterrupted reference
    of test_recipes_distributed and the exported run of test_export_distributed, in one launch. Its
    rank 0 builds the data into a cache of its own (folder/'data'), which test_recipes_distributed
    compares with the one-process build of data_cache. Tests must not change its folder (copy what
    they damage)."""
    from test_recipes_distributed import overrides, train_2_ranks

    out = tmp_path_factory.mktemp("2ranks") / "run"
    code, output = train_2_ranks(out, [*overrides(out.parent / "data", 6), "run.export_at_end=hf"])
    assert code == 0, output
    return out, output


@pytest.fixture(scope="session")
def bert_phase1_run(tmp_path_factory, data_cache):
    """`orttrainer train` (in process) of the tiny BERT recipe, 8 steps, run.export_at_end=[hf, onnx]:
    test_recipes' phase 1 (phase 2 and fine-tuning start from it) and the exported run of test_export,
    in one training. Tests must not change its folder."""
    from helpers.recipes import SMALL_BERT, sets, train

    out = tmp_path_factory.mktemp("phase1") / "run"
    overrides = sets(data_cache, *SMALL_BERT, "run.max_steps=8", "run.log_every=1", "run.eval_every=4",
                     "run.save_every=2", "run.save_total_limit=2", "run.export_at_end=[hf, onnx]")
    assert train("bert-pretrain-tiny.yaml", out, overrides) == 0
    return out


@pytest.fixture(scope="session")
def bert_finetune_run(tmp_path_factory, data_cache, bert_phase1_run):
    """The tiny classification fine-tuning (fp16 compute, the recipe's default) from bert_phase1_run,
    12 steps: test_recipes checks its training, test_export its HF and ONNX exports. Returns (folder,
    what it printed). Tests must not change its folder."""
    from helpers.recipes import sets, train

    out = tmp_path_factory.mktemp("finetune") / "run"
    overrides = sets(data_cache, f"model.from={bert_phase1_run}", "data.seq_length=64", "data.batch_size=16",
                     "data.glue.num_train=32", "data.glue.num_dev=32", "trainer.optimizer.lr=5e-3",
                     "run.max_steps=12", "run.log_every=1", "run.eval_every=6", "run.save_every=6")
    capture = io.StringIO()
    with contextlib.redirect_stdout(capture):
        assert train("bert-finetune-classification-tiny.yaml", out, overrides) == 0
    return out, capture.getvalue()


@pytest.fixture(scope="session")
def gpt2_run(tmp_path_factory, data_cache):
    """The tiny GPT-2 recipe, 8 steps, started with --resume auto in a folder whose metrics.jsonl
    holds one line of a run that died before saving (loss 99.0): test_recipes checks the training and
    the fresh start, test_export the HF and ONNX exports. Returns (folder, what it printed). Tests
    must not change its folder."""
    from helpers.recipes import sets, train

    out = tmp_path_factory.mktemp("gpt2") / "run"
    out.mkdir()
    from orttrainer.run import run_folder

    run_folder.mark(out)  # what that run wrote first, as every run does
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 99.0}\n')
    overrides = sets(data_cache, "model.config.n_embd=64", "data.seq_length=64", "data.batch_size=8",
                     "run.max_steps=8", "run.log_every=1", "run.eval_every=4", "run.save_every=4")
    capture = io.StringIO()
    with contextlib.redirect_stdout(capture):
        assert train("gpt2-pretrain-tiny.yaml", out, overrides, "auto") == 0
    return out, capture.getvalue()


@pytest.fixture(scope="session")
def tensor_parallel_launch(tmp_path_factory):
    """One 2-rank launch (tests/helpers/tensor_parallel_worker.py) for test_tensor_parallel and
    test_tensor_parallel_checkpoint: starting and importing ranks and exporting costs more than their
    10 steps. GPT-2 and BERT x Adam and LAMB; the checkpoint cases also save their rank files after K
    steps and train on; then the 1 -> 2 resumes from the one-process files (worker.reference, shared
    with the tests, run here beside the ranks); last the heads-not-divisible refusal (it raises during
    set-up). Per-rank results."""
    from helpers import tensor_parallel_worker as worker
    import test_tensor_parallel_checkpoint as ckpt

    out = tmp_path_factory.mktemp("tp")
    scenarios = []
    for kind in ("gpt2", "bert"):
        for optim in ("adam", "lamb"):
            scenario = {"name": f"{kind}-{optim}", "kind": kind, "optim": optim}
            if (kind, optim) in ckpt.CASES:
                scenario.update(save_at=ckpt.K, dir=str(out))
            scenarios.append(scenario)
    for kind, optim in ckpt.CASES:
        scenarios.append({"name": f"{kind}-{optim}-resume", "kind": kind, "optim": optim, "k": ckpt.K,
                          "resume_from": worker.reference_file(str(out), kind, optim)})
    scenarios.append({"name": "gpt2-adam-bf16", "kind": "gpt2", "optim": "adam", "bf16": True})
    scenarios.append({"name": "odd", "kind": "gpt2", "optim": "adam", "expect_error": True, "model": {"heads": 1}})

    def references():  # in this process while the ranks run; the resumes wait for the saved files
        for kind, optim in ckpt.CASES:
            worker.reference(kind, optim, save_at=ckpt.K, save_dir=str(out))
        for kind in ("gpt2", "bert"):
            for optim in ("adam", "lamb"):
                worker.reference(kind, optim)
        worker.reference("gpt2", "adam", bf16=True)

    results = worker.launch(2, scenarios, out, timeout=420, beside=references)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result"
        assert "error" not in result, f"rank {rank}: {result['error']}"
    return results
