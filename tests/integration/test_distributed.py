"""Data parallel and ZeRO-1 in real processes (2 ranks, gloo, the trainer initialising the process
group from torchrun's environment) against one process.

The reference for 2 ranks × gradient_accumulation_steps k is one process accumulating 2k micro-batches
in rank order: with k = 1 and no clipping the sums are the same additions, so the results are
bitwise equal (docs/ort-notes.md, "Distributed"). Where the summation order differs (k > 1, ZeRO-1's
global norm, LAMB's sharded direction norm) the bound is rtol 1e-6.
"""

import numpy as np
import pytest
import torch
from helpers.distributed_worker import STEPS, batch, launch, make_trainer, rank_slice, train, weights

from orttrainer import checkpoint

pytestmark = pytest.mark.multiprocess  # every test here starts processes, or reads runs that did

WORLD = 2

SCENARIOS = [dict(name=f"{optim}-zero{zero}", optim=optim, zero=zero)
             for optim in ("sgd", "adam", "lamb") for zero in (0, 1)]
SCENARIOS += [
    dict(name="adam-clip-zero0", optim="adam", clip=True),
    dict(name="adam-clip-zero1", optim="adam", clip=True, zero=1),
    dict(name="lamb-clip-zero1", optim="lamb", clip=True, zero=1),
    dict(name="sgd-gas2", optim="sgd", gas=2),
    dict(name="sgd-gas2-per-micro-step", optim="sgd", gas=2, post=False),
    dict(name="adam-gas2-per-micro-step-zero1", optim="adam", gas=2, post=False, zero=1),
    dict(name="adam-mixed-zero0", optim="adam", mixed=True, clip=True),
    dict(name="adam-mixed-zero1", optim="adam", mixed=True, clip=True, zero=1),
    dict(name="adam-mixed-overflow-zero0", optim="adam", mixed=True, clip=True, poison=(1, 1)),
    dict(name="adam-mixed-overflow-zero1", optim="adam", mixed=True, clip=True, zero=1, poison=(1, 1)),
    dict(name="adam-bf16-zero0", optim="adam", mixed=True, compute="bfloat16", clip=True),
    dict(name="adam-bf16-zero1", optim="adam", mixed=True, compute="bfloat16", clip=True, zero=1),
    dict(name="adam-save-zero1", optim="adam", zero=1, save=True),
    dict(name="adam-save-zero0", optim="adam", save=True),
]
BITWISE = ["sgd-zero0", "sgd-zero1", "adam-zero0", "adam-zero1", "lamb-zero0", "adam-clip-zero0",
           "adam-mixed-zero0", "adam-mixed-zero1", "adam-mixed-overflow-zero0", "adam-mixed-overflow-zero1",
           "adam-bf16-zero0", "adam-bf16-zero1"]
CLOSE = ["lamb-zero1", "adam-clip-zero1", "lamb-clip-zero1", "sgd-gas2", "sgd-gas2-per-micro-step",
         "adam-gas2-per-micro-step-zero1"]
BY_NAME = {s["name"]: s for s in SCENARIOS}


def ranks_ok(results):
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result"
        assert "error" not in result, f"rank {rank}: {result['error']}"
    return results


@pytest.fixture(scope="module")
def ranks(two_rank_launch):
    return ranks_ok(two_rank_launch)  # SCENARIOS run in the session's shared 2-rank launch (conftest.py)


def accumulation_reference(scenario, steps=STEPS, trainer=None, first_step=0):
    """One process, gradient accumulation over every rank's slice of each micro-step, in rank order."""
    gas = scenario.get("gas", 1)
    trainer = trainer or make_trainer(dict(scenario, gas=gas * WORLD, zero=0))
    losses = []
    for step in range(first_step, first_step + steps):
        for micro in range(gas):
            for rank in range(WORLD):
                loss, _ = trainer.train_step(*rank_slice(batch(step, micro), rank, WORLD, scenario, step))
                losses.append(float(loss))
    return trainer, losses


def assert_weights(actual, expected, rtol=0.0):
    assert actual.keys() == expected.keys()
    for name in expected:
        if rtol == 0.0:
            assert torch.equal(actual[name], expected[name]), name
        else:
            torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=1e-7, msg=name)


@pytest.mark.parametrize("name", BITWISE + CLOSE)
def test_ranks_train_like_one_process_accumulating_their_halves(ranks, name):
    scenario = BY_NAME[name]
    reference, losses = accumulation_reference(scenario)
    rtol = 0.0 if name in BITWISE else 1e-6
    for result in ranks:
        assert_weights(result[name]["weights"], weights(reference), rtol)
    # Rank r's loss is the reference's loss on the same slice (the same weights saw it).
    gas = scenario.get("gas", 1)
    for rank, result in enumerate(r[name] for r in ranks):
        expected = [losses[(i // gas) * gas * WORLD + (i % gas) * WORLD + rank] for i in range(len(result["losses"]))]
        np.testing.assert_allclose(result["losses"], expected, rtol=max(rtol, 1e-7))
    skipped = 1 if "poison" in scenario else 0
    for result in ranks:
        optimization_step = result[name]["state_dict"]["train_step_info"]["optimization_step"]
        assert optimization_step == reference.state_dict()["train_step_info"]["optimization_step"]
        assert optimization_step == STEPS - skipped


def test_sgd_matches_one_process_on_the_whole_global_batch(ranks):
    trainer = make_trainer(BY_NAME["sgd-zero1"])
    for step in range(STEPS):
        trainer.train_step(*batch(step, 0))
    for result in ranks:
        assert_weights(result["sgd-zero1"]["weights"], weights(trainer), rtol=1e-5)


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_every_rank_holds_the_same_weights(ranks, name):
    # The ranks built their models from different seeds: rank 0's weights were broadcast.
    assert_weights(ranks[1][name]["weights"], ranks[0][name]["weights"])


def test_mixed_precision_scaler_is_identical_on_every_rank(ranks):
    for name in ("adam-mixed-zero0", "adam-mixed-zero1"):
        states = [r[name]["state_dict"]["loss_scaler"] for r in ranks]
        assert states[0] == states[1]
        assert states[0]["stable_steps_count"] == STEPS


def test_bf16_mixed_precision_keeps_the_scale_at_one_on_every_rank(ranks):
    # bf16 products (rows are independent, so 2 ranks equal one process bitwise, above) need no loss
    # scaling: the scaler the trainer makes stays at 1 and never counts a skipped step.
    reference, _ = accumulation_reference(BY_NAME["adam-bf16-zero0"], steps=1)
    assert reference.compute_dtype == torch.bfloat16
    for name in ("adam-bf16-zero0", "adam-bf16-zero1"):
        states = [r[name]["state_dict"]["loss_scaler"] for r in ranks]
        assert states[0] == states[1] and states[0]["loss_scale"] == 1.0


@pytest.mark.parametrize("name", ["adam-mixed-overflow-zero0", "adam-mixed-overflow-zero1"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(ranks, name):
    # Rank 1 alone sees an inf at step 1: the reduced gradient is non-finite, so both ranks skip that
    # update, halve the scale and go on in step (the weights equality is checked above).
    for result in ranks:
        scaler = result[name]["state_dict"]["loss_scaler"]
        assert scaler["loss_scale"] == 65536.0 / 2 and scaler["stable_steps_count"] == STEPS - 2
    assert not np.isfinite(ranks[1][name]["losses"][1]) and np.isfinite(ranks[0][name]["losses"][1])


def test_zero1_rank_state_is_the_legacy_partitioned_layout(ranks):
    full = {name: tuple(value.shape) for name, value in ranks[0]["adam-zero1"]["weights"].items()}
    total = 0
    for rank, result in enumerate(ranks):
        state = result["adam-zero1"]["state_dict"]
        options = state["trainer_options"]
        assert (options["world_rank"], options["world_size"], options["zero_stage"]) == (rank, WORLD, 1)
        assert options["data_parallel_size"] == WORLD
        info = state["partition_info"]
        assert set(info) == set(state["optimizer"])
        for weight, per_weight in state["optimizer"].items():
            assert tuple(info[weight]["original_dim"]) == full[weight]
            assert per_weight["Moment_1"].ndim == 1 and per_weight["Moment_1"].shape == per_weight["Moment_2"].shape
            total += per_weight["Moment_1"].size
    # fc1.weight (96 elements at offset 16 of the 192-element flat buffer) straddles the two chunks of 96.
    assert "fc1.weight" in ranks[0]["adam-zero1"]["state_dict"]["optimizer"]
    assert "fc1.weight" in ranks[1]["adam-zero1"]["state_dict"]["optimizer"]
    assert total == sum(int(np.prod(shape)) for shape in full.values())


def _moment_bytes(state):
    return sum(v.nbytes for per_weight in state.get("optimizer", {}).values()
               for k, v in per_weight.items() if k.startswith("Moment"))


def test_zero1_keeps_half_the_optimizer_state_per_rank(ranks):
    from orttrainer.engine.parallel.data_parallel import FlatLayout

    unsharded = _moment_bytes(ranks[0]["adam-zero0"]["state_dict"])
    per_rank = [_moment_bytes(r["adam-zero1"]["state_dict"]) for r in ranks]
    assert sum(per_rank) == unsharded
    # Half each, up to the alignment padding between the 4 weights (each starts on 64 bytes).
    padding = 2 * 4 * FlatLayout.ALIGN * 4  # two moments, 4 weights, ALIGN floats of 4 bytes
    assert all(abs(b - unsharded / WORLD) <= padding for b in per_rank), (per_rank, unsharded)


def test_zero1_rank_files_aggregate_to_the_one_process_state(ranks):
    paths = [r["adam-save-zero1"]["checkpoint"] for r in ranks]
    merged = checkpoint.aggregate_checkpoints(paths, pytorch_format=False)
    reference, _ = accumulation_reference(BY_NAME["adam-save-zero1"])
    expected = reference.state_dict()
    for name, value in expected["model"]["full_precision"].items():
        np.testing.assert_array_equal(merged["model"]["full_precision"][name], value)
    for weight, per_weight in expected["optimizer"].items():
        for key, value in per_weight.items():
            np.testing.assert_array_equal(merged["optimizer"][weight][key], value, err_msg=f"{weight} {key}")


def test_two_rank_checkpoint_continues_in_one_process(ranks):
    scenario = BY_NAME["adam-save-zero1"]
    paths = [r[scenario["name"]]["checkpoint"] for r in ranks]
    trainer = make_trainer(dict(scenario, gas=WORLD, zero=0), seed=5)
    trainer.load_checkpoint(*paths)
    accumulation_reference(scenario, trainer=trainer, first_step=STEPS)
    assert_weights(weights(trainer), ranks[0][scenario["name"]]["weights_after"])


def test_data_parallel_rank_files_are_whole_and_equal(ranks):
    paths = [r["adam-save-zero0"]["checkpoint"] for r in ranks]
    trainer = make_trainer(dict(BY_NAME["adam-save-zero0"], gas=WORLD), seed=5)
    with pytest.raises(AssertionError, match="Expected number of files to load: 1, got 2"):
        trainer.load_checkpoint(*paths)
    trainer.load_checkpoint(paths[1])
    accumulation_reference(BY_NAME["adam-save-zero0"], trainer=trainer, first_step=STEPS)
    assert_weights(weights(trainer), ranks[0]["adam-save-zero0"]["weights_after"])


@pytest.fixture(scope="module")
def resumed(ranks, tmp_path_factory):
    """Second launch: 2 ranks resume from the 2-rank ZeRO-1 files, and from a 1-process checkpoint."""
    out = tmp_path_factory.mktemp("resumed")
    single = dict(BY_NAME["adam-save-zero1"], gas=WORLD, zero=0)
    trainer, _ = accumulation_reference(BY_NAME["adam-save-zero1"])
    single_path = str(out / "single.ortcp")
    trainer.save_checkpoint(single_path)
    accumulation_reference(BY_NAME["adam-save-zero1"], trainer=trainer, first_step=STEPS)
    scenarios = [
        dict(BY_NAME["adam-save-zero1"], name="from-ranks", save=False,
             resume_from=[r["adam-save-zero1"]["checkpoint"] for r in ranks]),
        dict(BY_NAME["adam-save-zero1"], name="from-one-process", save=False, resume_from=[single_path]),
    ]
    results, _ = launch(WORLD, scenarios, out)
    del single
    return ranks_ok(results), weights(trainer)


def test_two_rank_run_resumed_from_its_rank_files_matches_the_uninterrupted_run(ranks, resumed):
    results, _ = resumed
    for result in results:
        assert_weights(result["from-ranks"]["resumed_weights"], ranks[0]["adam-save-zero1"]["weights_after"])
        np.testing.assert_array_equal(result["from-ranks"]["resumed_losses"],
                                      ranks[results.index(result)]["adam-save-zero1"]["losses_after"])


def test_one_process_checkpoint_continues_in_two_ranks(resumed):
    results, uninterrupted = resumed
    for result in results:
        assert_weights(result["from-one-process"]["resumed_weights"], uninterrupted)


def test_a_crashed_rank_is_a_clear_error_on_the_others(tmp_path):
    scenarios = [dict(name="crash", optim="adam", zero=1, crash_rank=1), dict(name="after", optim="adam")]
    results, seconds = launch(WORLD, scenarios, tmp_path, timeout=120, env={"ORTTRAINER_DIST_TIMEOUT": "30"})
    assert results[1] is None  # it died before writing anything
    error = results[0]["error"]
    assert "DistributedError: rank 0 of 2" in error and "Another rank has probably exited" in error
    assert seconds < 100


# ---------------------------------------------------------------------------- set-up errors, one process
def _options(**distributed):
    from orttrainer import ORTTrainerOptions

    return ORTTrainerOptions({"device": {"id": "cpu"}, "distributed": distributed})


def _trainer(options):
    from helpers.models import MLP, MLP_DESC, cross_entropy

    from orttrainer import ORTTrainer, optim

    return ORTTrainer(MLP(), MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=cross_entropy, options=options)


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_world_size_without_a_launcher_names_the_torchrun_command(no_launcher):
    from orttrainer.placement.process_group import DistributedSetupError

    with pytest.raises(DistributedSetupError, match=r"world_size is 2 but this process was not started by a "
                                                    r"launcher.*torchrun --nproc_per_node=2"):
        _trainer(_options(world_size=2, world_rank=1))


def test_world_size_disagreeing_with_the_launcher_names_both(no_launcher):
    from orttrainer.placement.process_group import DistributedSetupError

    no_launcher.setenv("WORLD_SIZE", "2")
    no_launcher.setenv("RANK", "1")
    no_launcher.setenv("MASTER_ADDR", "127.0.0.1")
    no_launcher.setenv("MASTER_PORT", "1")
    with pytest.raises(DistributedSetupError, match=r"world_size=4, world_rank=1 but the launcher's environment "
                                                    r"\(WORLD_SIZE/RANK\) says world size 2, rank 1"):
        _trainer(_options(world_size=4, world_rank=1))


@pytest.mark.parametrize("distributed, named", [
    ({"world_size": 2, "pipeline_parallel": {"pipeline_parallel_size": 2}, "deepspeed_zero_optimization": {"stage": 1}},
     "deepspeed_zero_optimization.stage > 0 with pipeline_parallel_size=2"),
    ({"world_size": 4, "horizontal_parallel_size": 2, "pipeline_parallel": {"pipeline_parallel_size": 2}},
     "horizontal_parallel_size > 1 with pipeline_parallel_size=2"),
    ({"world_size": 2, "enable_adasum": True, "deepspeed_zero_optimization": {"stage": 1}},
     "enable_adasum=True with deepspeed_zero_optimization.stage=1"),
])
def test_unsupported_parallelism_says_what_runs(no_launcher, distributed, named):
    with pytest.raises(NotImplementedError, match=rf"{named}.*What runs: data parallel .* ZeRO stage 1"):
        _trainer(_options(**distributed))


def test_zero1_on_one_process_trains_like_plain_training():
    plain = make_trainer(dict(optim="adam"))
    zero = make_trainer(dict(optim="adam", zero=1))
    for trainer in (plain, zero):
        for step in range(STEPS):
            trainer.train_step(*batch(step, 0))
    assert_weights(weights(zero), weights(plain))
    state = zero.state_dict()
    assert state["trainer_options"]["zero_stage"] == 1 and set(state["partition_info"]) == set(state["optimizer"])
    for weight, per_weight in plain.state_dict()["optimizer"].items():
        np.testing.assert_array_equal(state["optimizer"][weight]["Moment_1"], per_weight["Moment_1"].reshape(-1))


def test_zero1_one_process_state_dict_loads_into_plain_and_back():
    zero = make_trainer(dict(optim="adam", zero=1))
    train(zero, dict(optim="adam"), 0, 1)
    plain = make_trainer(dict(optim="adam"), seed=3)
    plain.train_step(*batch(0, 0))
    plain.load_state_dict(zero.state_dict())  # a one-rank state: flat moments of whole weights
    again = make_trainer(dict(optim="adam", zero=1), seed=4)
    again.train_step(*batch(0, 0))
    again.load_state_dict(plain.state_dict())
    for trainer in (zero, plain, again):
        train(trainer, dict(optim="adam"), 0, 1, first_step=STEPS)
    assert_weights(weights(plain), weights(zero))
    assert_weights(weights(again), weights(zero))


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_flat_layout_segments_cover_every_element_once(world):
    from orttrainer.engine.parallel.data_parallel import FlatLayout

    shapes = {"a": (3, 5), "b": (7,), "c": (1,), "d": (40, 2)}
    layout = FlatLayout(shapes, world)
    assert layout.padded % world == 0 and layout.padded >= layout.numel
    assert all(layout.offsets[name] % FlatLayout.ALIGN == 0 for name in shapes)
    flat = layout.empty("cpu")
    assert flat.data_ptr() % 64 == 0 and flat.numel() == layout.padded
    seen = {name: np.zeros(int(np.prod(shape)), int) for name, shape in shapes.items()}
    for rank in range(world):
        lo, hi = layout.chunk_range(rank)
        for segment in layout.segments(rank):
            assert lo <= segment.flat_start and segment.flat_start + segment.size <= hi
            assert segment.flat_start == layout.offsets[segment.weight] + segment.start
            seen[segment.weight][segment.start:segment.stop] += 1
    assert all((count == 1).all() for count in seen.values())
    views = layout.views(flat)
    views["d"].fill_(2.0)
    assert flat.sum() == 160.0 and views["d"].shape == (40, 2)
