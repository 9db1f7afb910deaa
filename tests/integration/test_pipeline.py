"""Pipeline parallel (issue 24, phase 1): the cut string, the automatic cut, and 2 stages in 2 real
processes (gloo) trained against one process on the whole batch."""

import numpy as np
import pytest
import torch
from helpers.pipeline_worker import launch, make_trainer, reference, stage_file, train

from orttrainer.engine.parallel import pipeline_cut as cut

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

SAVE_AT = 4  # the adam scenario saves its stage files after 4 steps
SCENARIOS = [
    {"name": "adam", "optim": "adam", "save_at": SAVE_AT},
    {"name": "lamb", "optim": "lamb", "save_at": SAVE_AT, "prefix": "lamb_"},
    {"name": "adam_gas2", "optim": "adam", "gas": 2},
]


# ---------------------------------------------------------------------- the cut string
def test_parse_cut_string_reads_edges_cuts_and_consumers():
    cuts = cut.parse_cut_string("a:b-n1/n2,c", 3)
    assert cuts == [[cut.Edge("a"), cut.Edge("b", ("n1", "n2"))], [cut.Edge("c")]]


@pytest.mark.parametrize("text, stages, named", [
    ("a,b", 2, "has 2 cut\\(s\\) but pipeline_parallel_size=2 needs 1"),
    ("a", 3, "has 1 cut\\(s\\) but pipeline_parallel_size=3 needs 2"),
    ("a::b", 2, "malformed edge ''"),
    ("a-", 2, "malformed edge 'a-'"),
    ("a-n1//n2", 2, "malformed edge 'a-n1//n2'"),
])
def test_bad_cut_strings_name_the_piece(text, stages, named):
    with pytest.raises(cut.PipelineCutError, match=named):
        cut.parse_cut_string(text, stages)


@pytest.fixture(scope="module")
def forward():
    """TinyGPT's forward model as the trainer exports it (loss + logits)."""
    from helpers.pipeline_worker import batch

    trainer = make_trainer({"optim": "adam"})
    trainer.eval_step(*batch(0, 0))
    return cut.infer_types(trainer._onnx_model)


OUTPUTS = ["loss", "logits"]


def _node_cost(model, stage):
    sizes = {i.name: int(np.prod(i.dims)) for i in model.graph.initializer}
    return sum(sizes.get(t, 0) for i in stage.nodes for t in model.graph.node[i].input if sizes.get(t, 0) > 1)


def test_auto_cut_is_valid_and_balanced(forward):
    text = cut.auto_cut(forward, 2, "loss", OUTPUTS)
    stages = cut.split(forward, cut.parse_cut_string(text, 2), "loss", OUTPUTS)
    assert [s.sent for s in stages] == [[text], []] and stages[1].received == [text]
    costs = [_node_cost(forward, s) for s in stages]
    assert min(costs) / max(costs) > 0.5, costs
    # the tied embedding is read on both stages (lookup first, output head last)
    assert "tok.weight" in stages[0].weights and "tok.weight" in stages[1].weights
    three = cut.split(forward, cut.parse_cut_string(cut.auto_cut(forward, 3, "loss", OUTPUTS), 3), "loss", OUTPUTS)
    assert all(s.nodes for s in three)


def test_stage_models_are_runnable_sub_models(forward):
    import onnx

    text = cut.auto_cut(forward, 2, "loss", OUTPUTS)
    stages = cut.split(forward, cut.parse_cut_string(text, 2), "loss", OUTPUTS)
    for s in stages:
        onnx.checker.check_model(cut.stage_model(forward, s, s.index == 1, "loss", OUTPUTS))


def test_an_edge_that_is_no_tensor_is_named(forward):
    with pytest.raises(cut.PipelineCutError, match="edge 'no_such_tensor' is not a tensor of the forward graph"):
        cut.split(forward, cut.parse_cut_string("no_such_tensor", 2), "loss", OUTPUTS)
    with pytest.raises(cut.PipelineCutError, match="edge 'input_ids' is a model input or initializer"):
        cut.split(forward, cut.parse_cut_string("input_ids", 2), "loss", OUTPUTS)


def test_a_cut_that_does_not_separate_names_the_crossing_tensor(forward):
    # The first LayerNorm's output: the residual stream beside it crosses the cut too.
    ln = next(n for n in forward.graph.node if n.op_type in ("LayerNormalization", "ReduceMean"))
    with pytest.raises(cut.PipelineCutError, match="does not separate the graph: tensor '.*' .* not an edge of cut 0"):
        cut.split(forward, cut.parse_cut_string(ln.output[0], 2), "loss", OUTPUTS)


def test_a_consumer_that_does_not_read_the_edge_is_named(forward):
    text = cut.auto_cut(forward, 2, "loss", OUTPUTS)
    with pytest.raises(cut.PipelineCutError, match="names consumer 'nobody'"):
        cut.split(forward, cut.parse_cut_string(f"{text}-nobody", 2), "loss", OUTPUTS)


# ---------------------------------------------------------------------- 2 stages against one process
BAD_CUT = {"name": "bad_cut", "optim": "adam", "cut": "no_such_tensor", "bad_cut": True}
FAILURES = {"name": "failures", "optim": "adam", "failures": True}  # last: leaves the ranks out of step


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def one_process_file(out_dir):
    """Where the adam reference writes its checkpoint after SAVE_AT steps (the file the trainer writes)."""
    return str(out_dir / "one_process.ort.h5")


@pytest.fixture(scope="module")
def ranks(out_dir, one_process_file):
    # After the adam scenario saved its stage files: fresh 2-stage trainers load a one-process
    # checkpoint, or the stage files, and continue from step SAVE_AT. The one-process references run
    # here meanwhile (the adam one writes one_process_file, which resume_one waits for).
    def references():
        reference(SCENARIOS[0], save_to=one_process_file)
        for scenario in SCENARIOS[1:]:
            reference(scenario)

    resumes = [{"name": "resume_one", "optim": "adam", "load": [one_process_file], "start": SAVE_AT},
               {"name": "resume_stages", "optim": "adam", "load": [], "start": SAVE_AT}]
    results = launch([BAD_CUT] + SCENARIOS + resumes + [FAILURES], out_dir, beside=references)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result"
        assert "error" not in result, result["error"]
    return results


@pytest.fixture(scope="module")
def adam_reference(ranks):
    return reference(SCENARIOS[0])


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_two_stages_train_like_one_process(ranks, scenario, adam_reference):
    expected = adam_reference if scenario["name"] == "adam" else reference(scenario)
    name = scenario["name"]
    for rank in range(2):  # every rank returns the losses and outputs
        got = ranks[rank][name]
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
        for a, b in zip(got["logits"], expected["logits"]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)  # logits up to ~7
        for a, b in zip(got["eval"], expected["eval"]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)  # logits up to ~7
    merged = {}
    for rank in range(2):
        for w, value in ranks[rank][name]["weights"].items():
            if w in merged:  # a tied weight: both stages' copies stay equal
                torch.testing.assert_close(value, merged[w], rtol=0, atol=0)
            merged[w] = value
    reference_weights = expected["weights"]
    assert set(merged) == {w for w in reference_weights if w != "head.weight"}
    # atol 1e-5 = 1e-4 of the 10 steps' largest possible move (lr 0.01 each): 4 micro-batch sums are
    # not one batch sum bit for bit, and Adam's m/sqrt(v) amplifies that noise where a gradient is ~0.
    for w, value in merged.items():
        np.testing.assert_allclose(value.numpy(), reference_weights[w].numpy(), rtol=1e-5, atol=1e-5, err_msg=w)


# ---------------------------------------------------------------------- checkpoints per stage
def _stage_files(out_dir):
    return [stage_file(str(out_dir), rank) for rank in range(2)]


def test_each_stage_file_holds_its_stage_in_the_legacy_layout(ranks, out_dir, one_process_file):
    from orttrainer import _checkpoint_storage

    whole = _checkpoint_storage.load(one_process_file)
    files = [_checkpoint_storage.load(path) for path in _stage_files(out_dir)]
    for rank, state in enumerate(files):
        options = state["trainer_options"]
        assert (int(options["pipeline_parallel_size"]), int(options["pipeline_stage"])) == (2, rank)
        assert (int(options["world_rank"]), int(options["world_size"])) == (rank, 2)
        for w, moments in state["optimizer"].items():  # moments in the weights' legacy shapes
            assert moments["Moment_1"].shape == whole["model"]["full_precision"][w].shape, w
    model = [set(state["model"]["full_precision"]) for state in files]
    assert model[0] | model[1] == set(whole["model"]["full_precision"])
    assert model[0] & model[1] >= {"tok.weight", "head.weight"}  # the tied embedding, on both stages
    assert model[0] != model[1]


def test_stage_files_aggregate_into_the_one_process_state(ranks, out_dir, one_process_file):
    from orttrainer import _checkpoint_storage, checkpoint

    whole = _checkpoint_storage.load(one_process_file)
    merged = checkpoint.aggregate_checkpoints(_stage_files(out_dir), pytorch_format=False)
    assert merged["trainer_options"] == {k: v for k, v in whole["trainer_options"].items()}
    assert {k: int(v) for k, v in merged["train_step_info"].items()} == \
        {k: int(v) for k, v in whole["train_step_info"].items()}
    for section in ("model", "optimizer"):
        got, expected = merged[section], whole[section]
        assert set(got) == set(expected)
        atol = 1e-5 if section == "model" else 1e-6  # weights: as in test_two_stages_train_like_one_process
        for key in expected:
            assert set(got[key]) == set(expected[key]), key
            for name in expected[key]:
                np.testing.assert_allclose(got[key][name], expected[key][name], rtol=1e-5, atol=atol,
                                           err_msg=f"{section}/{key}/{name}")


def test_aggregated_stage_files_continue_in_one_process(ranks, out_dir, adam_reference):
    trainer = make_trainer({"optim": "adam"})
    trainer.load_checkpoint(*_stage_files(out_dir))  # strict: every key of the one-process state
    got = train(trainer, {}, start=SAVE_AT)
    np.testing.assert_allclose(got["losses"], adam_reference["losses"][SAVE_AT:], rtol=1e-5)


@pytest.mark.parametrize("name", ["resume_one", "resume_stages"])
def test_a_checkpoint_loaded_into_two_stages_continues_like_one_process(ranks, adam_reference, name):
    for rank in range(2):
        np.testing.assert_allclose(ranks[rank][name]["losses"], adam_reference["losses"][SAVE_AT:], rtol=1e-5)
    # and the uninterrupted 2-stage run was not changed by saving
    np.testing.assert_allclose(ranks[0]["adam"]["losses"], adam_reference["losses"], rtol=1e-5)


def test_a_bad_cut_string_fails_every_rank_naming_the_edge(ranks):
    for rank in range(2):
        assert "PipelineCutError: pipeline cut 0: edge 'no_such_tensor' is not a tensor" in \
            ranks[rank]["bad_cut"]["error"]


def test_the_automatic_cut_was_used_on_both_ranks(ranks):
    assert ranks[0]["adam"]["cut"] == ranks[1]["adam"]["cut"] != ""


# ---------------------------------------------------------------------- micro-batches and options
def _pipeline(**pipe):
    from orttrainer import ORTTrainerOptions
    from orttrainer.engine.parallel.pipeline_stage import Pipeline

    options = ORTTrainerOptions({"distributed": {"world_size": 2, "pipeline_parallel": dict(
        {"pipeline_parallel_size": 2, "num_pipeline_micro_batches": 4}, **pipe)}})
    return Pipeline(None, options, 0)


def test_micro_batches_are_slices_along_the_sliced_axes():
    ids, labels = torch.arange(8 * 6).reshape(8, 6), torch.arange(12 * 8).reshape(12, 8)
    pieces = _pipeline(sliced_axes={"labels": 1}).slice({"input_ids": ids, "labels": labels})
    assert len(pieces) == 4
    torch.testing.assert_close(torch.cat([p["input_ids"] for p in pieces]), ids)
    torch.testing.assert_close(torch.cat([p["labels"] for p in pieces], 1), labels)
    only = _pipeline(sliced_tensor_names=["input_ids"]).slice({"input_ids": ids, "labels": labels})
    assert all(p["labels"] is labels for p in only)


def test_a_batch_that_does_not_divide_or_fit_the_schema_is_named():
    with pytest.raises(ValueError, match="input 'input_ids' has 6 rows on axis 0, not a multiple of .*=4"):
        _pipeline().slice({"input_ids": torch.zeros(6, 3)})
    with pytest.raises(ValueError, match=r"input 'input_ids': a micro-batch has shape \[2, 3\] but .*\[2, 4\]"):
        _pipeline(sliced_schema={"input_ids": [2, 4]}).slice({"input_ids": torch.zeros(8, 3)})


@pytest.mark.parametrize("distributed, named", [
    ({"world_size": 2, "enable_adasum": True}, "distributed.enable_adasum with pipeline_parallel_size=2"),
    ({"world_size": 2, "deepspeed_zero_optimization": {"stage": 1}}, "deepspeed_zero_optimization.stage > 0"),
])
def test_what_pipeline_does_not_run_with_is_named(distributed, named):
    from orttrainer import ORTTrainerOptions
    from orttrainer.placement.dims import pipeline_unsupported as unsupported

    options = ORTTrainerOptions({"distributed": dict(distributed, pipeline_parallel={"pipeline_parallel_size": 2})})
    assert any(named in problem for problem in unsupported(options.distributed))


# ---------------------------------------------------------------------- failures
def test_a_bad_token_id_fails_every_stage_before_anything_is_sent(ranks):
    for rank in range(2):  # the same clear error on both ranks, and both trained the next batch
        assert "ValueError" in ranks[rank]["failures"]["bad_ids"] and "999" in ranks[rank]["failures"]["bad_ids"]


def test_a_stage_that_raises_mid_step_stops_the_other_within_the_timeout(ranks):
    last, first = ranks[1]["failures"], ranks[0]["failures"]
    assert "injected crash of the last stage" in last["crash"]
    assert first["crash"].startswith("DistributedError: pipeline stage 0: receiving"), first["crash"]
    assert "has probably exited or stopped answering" in first["crash"]
    assert first["seconds"] < 3 + 10  # the 3 s timeout, not the default


def test_lamb_stage_files_aggregate_into_the_one_process_state(ranks, out_dir):
    """LAMB's shared Step counter is on every stage and merges once."""
    from orttrainer import checkpoint

    whole = reference(SCENARIOS[1])["state_at_save"]  # the one-process state after SAVE_AT steps
    merged = checkpoint.aggregate_checkpoints([stage_file(str(out_dir), r, "lamb_") for r in range(2)],
                                              pytorch_format=False)
    assert set(merged["optimizer"]) == set(whole["optimizer"]) and "shared_optimizer_state" in whole["optimizer"]
    for w, states in whole["optimizer"].items():
        for key, value in states.items():
            np.testing.assert_allclose(merged["optimizer"][w][key], value, rtol=1e-5, atol=1e-6, err_msg=f"{w}/{key}")
    for w, value in whole["model"]["full_precision"].items():
        np.testing.assert_allclose(merged["model"]["full_precision"][w], value, rtol=1e-5, atol=1e-5, err_msg=w)
