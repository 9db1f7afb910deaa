"""Watching a run: TensorBoard events (run.report_to), `orttrainer plot` and curves.png, the profile
of run.profile_steps, MFU's FLOPs per token and the logged gradient norm.

References: TensorBoard's own EventAccumulator reads the events back against metrics.jsonl; FLOPs per
token against torch's FlopCounterMode on the eager model; the gradient norm against torch autograd.
Runs are tiny GPT-2s through `orttrainer train` (data built once per session, conftest.data_cache).
"""

import copy
import json
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from helpers.models import CLASSES, D_IN, MLPWithLoss, MLP_DESC  # noqa: E402
from helpers.training import make_options  # noqa: E402

from orttrainer import ORTTrainer, optim  # noqa: E402
from orttrainer.cli import main  # noqa: E402
from orttrainer.run import loop
from orttrainer.run.report import measures as watch  # noqa: E402
from orttrainer.run.recipe.spec import RecipeError, load_recipe  # noqa: E402
from helpers.recipes import RECIPES, records, results, sets  # noqa: E402

GPT = "gpt2-pretrain-tiny.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gpt_overrides(cache, *extra):
    return sets(cache, "model.config.n_embd=64", "data.seq_length=64", "data.batch_size=8", "run.log_every=1",
                *extra)


def train(out, overrides, resume=None):
    argv = ["train", str(RECIPES / GPT), "--output-dir", str(out)]
    for item in overrides:
        argv += ["--set", item]
    return main(argv + (["--resume", resume] if resume else []))


def scalars(out, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / watch.TB_FOLDER), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


# ---------------------------------------------------------------- TensorBoard, resume


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, data_cache):
    """A run that crashes after logging step 3 (newest checkpoint: step 2), resumed with --resume auto."""
    out = tmp_path_factory.mktemp("tb") / "resumed"
    overrides = gpt_overrides(data_cache, "run.max_steps=6", "run.save_every=2", "run.eval_every=3")
    recipe = load_recipe(RECIPES / GPT, overrides, out)

    def crash(run):
        if run.micro_total == 4:  # step 3 is logged, step 4 computed but not logged
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        loop.train(recipe, on_micro_step=crash)
    before = scalars(out, "train/loss")
    assert train(out, overrides, "auto") == 0
    return out, before


def test_tensorboard_has_metrics_jsonl_values_and_resume_does_not_duplicate(resumed):
    out, before = resumed
    assert [step for step, _ in before] == [1, 2, 3]  # the crashed run's step 3 reached the events
    lines = records(out, "train")
    assert [r["step"] for r in lines] == list(range(1, 7))
    for key in ("loss", "lr", "tokens_per_s", "grad_norm", "mfu", "peak_rss_mb"):
        logged = [(r["step"], r[key]) for r in lines if r[key] is not None]
        events = scalars(out, f"train/{key}")
        assert [s for s, _ in events] == [s for s, _ in logged], key  # step 3 once, from the resumed run
        np.testing.assert_allclose([v for _, v in events], [v for _, v in logged], rtol=1e-6, err_msg=key)
    timed = [r for r in lines if r["tokens_per_s"]]  # a run's first step is start-up: untimed, no MFU
    assert len(timed) >= 4 and all(0 < r["mfu"] < 1 for r in timed)
    assert all(r["grad_norm"] > 0 and r["peak_rss_mb"] > 100 for r in lines)
    evals = records(out, "eval")
    events = scalars(out, "eval/eval_loss")
    assert [s for s, _ in events] == [r["step"] for r in evals] == [3, 6]
    np.testing.assert_allclose([v for _, v in events], [r["eval_loss"] for r in evals], rtol=1e-6)
    r = results(out)
    assert 0 < r["mfu"] < 1 and r["matmul_gflops"] > 0 and r["flops_per_token"] > 0 and r["peak_rss_mb"] > 100
    png = (out / "curves.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_tensorboard_missing_warns_once_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.warns(UserWarning, match="tensorboard is not installed") as caught:
        assert watch.Board.open(tmp_path / "tb") is None
    assert len(caught) == 1 and not (tmp_path / "tb").exists()


# ---------------------------------------------------------------- report_to [], profile_steps


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("profiled") / "profiled"
    overrides = gpt_overrides(data_cache, "run.max_steps=4", "run.report_to=[]", "run.profile_steps=[2,3]",
                              "trainer.batch.gradient_accumulation_steps=2", "run.eval_every=2")
    assert train(out, overrides) == 0
    return out


def test_report_to_empty_writes_no_tensorboard(profiled):
    assert not (profiled / watch.TB_FOLDER).exists()
    assert [r["step"] for r in records(profiled, "train")] == [1, 2, 3, 4]
    assert (profiled / "curves.png").read_bytes().startswith(PNG_MAGIC)


def test_profile_covers_exactly_the_steps_asked(profiled, capsys):
    folder = profiled / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["steps-2-3.json", "top-ops-2-3.json"]
    top = json.loads((folder / "top-ops-2-3.json").read_text())
    events = json.loads((folder / "steps-2-3.json").read_text())
    # steps 2 and 3 of gradient_accumulation_steps 2: four train_step calls, one session run each,
    # and the evaluation at step 2 (eval_every 2) left out
    assert top["steps"] == [2, 3] and top["train_step_calls"] == 4 == top["session_runs"]
    assert sum(1 for e in events if e.get("name") == "model_run") == 4
    ops = top["ops"]
    assert ops and ops[0]["percent"] >= ops[-1]["percent"] and 0 < sum(o["percent"] for o in ops) <= 100
    kernel = [e for e in events if e.get("name", "").endswith("_kernel_time")]
    assert {o["op_type"] for o in ops} == {e["args"]["op_name"] for e in kernel}
    assert sum(o["calls"] for o in ops) == len(kernel)
    assert {"MatMul", "FusedMatMul", "Gemm"} & {o["op_type"] for o in ops}


@pytest.mark.parametrize("value, expected", [
    ("[3, 2]", "run.profile_steps: got [3, 2]; expected [from, to] with 1 <= from <= to <= run.max_steps (4)"),
    ("[1, 5]", "run.profile_steps: got [1, 5]; expected [from, to]"),
    ("[0, 1]", "run.profile_steps: got [0, 1]"),
    ("[1, x]", "run.profile_steps[1]: got 'x'; expected an int"),
    ("[1]", "run.profile_steps: got [1]; min length is 2"),
    ("[tensorbord]", "run.report_to[0]: got 'tensorbord'; expected one of ['tensorboard']"),
])
def test_bad_watch_keys_are_recipe_errors(value, expected):
    key = "run.report_to" if "tensorbord" in value else "run.profile_steps"
    with pytest.raises(RecipeError) as caught:
        load_recipe(RECIPES / GPT, ["run.max_steps=4", f"{key}={value}"])
    assert expected in str(caught.value)


# ---------------------------------------------------------------- orttrainer plot


def test_plot_one_and_two_runs(resumed, profiled, tmp_path, capsys):
    out, _ = resumed
    for runs, png in (([out], tmp_path / "one.png"), ([out, profiled], tmp_path / "two.png")):
        assert main(["plot", *map(str, runs), "--out", str(png)]) == 0
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert (tmp_path / "two.png").stat().st_size > (tmp_path / "one.png").stat().st_size  # a second curve set


def test_plot_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no metrics.jsonl" in err[0]
    (empty / "metrics.jsonl").write_text("")
    assert main(["plot", str(empty), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no train or eval record" in err[0]
    assert not (tmp_path / "x.png").exists()


def test_plot_without_matplotlib_is_one_line(profiled, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main(["plot", str(profiled), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib is not installed" in err[0]


# ---------------------------------------------------------------- MFU's FLOPs, the gradient norm


def test_flops_per_token_matches_torch_flop_counter():
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=300, n_positions=32,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    batch, seq = 2, 32
    ids = torch.randint(0, 300, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert watch.flops_per_token(model, seq) * batch * seq == counter.get_total_flops()


@pytest.mark.parametrize("gas", [1, 2])
def test_gradient_norm_matches_torch(gas):
    torch.manual_seed(0)
    model = MLPWithLoss()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, D_IN, generator=g), torch.randint(0, CLASSES, (8,), generator=g))
               for _ in range(gas)]
    trainer = ORTTrainer(model, copy.deepcopy(MLP_DESC), optim.AdamConfig(lr=1e-3),
                         options=make_options({"batch": {"gradient_accumulation_steps": gas}}))
    for x, y in batches:
        trainer.train_step(x, y)
    for x, y in batches:
        (reference(x, y)[0] / gas).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    assert trainer.last_gradient_norm == pytest.approx(float(expected), rel=1e-5)
    sgd = ORTTrainer(MLPWithLoss(), copy.deepcopy(MLP_DESC), optim.SGDConfig(lr=0.1), options=make_options())
    sgd.train_step(*batches[0])
    assert sgd.last_gradient_norm is None  # SGD without clipping computes no norm
