"""Runs pipeline-parallel scenarios in real ranks for tests/integration/test_pipeline.py (not a test module).

`launch(scenarios, out_dir)` starts 2 processes (the environment torchrun gives, a free port); each
builds the same TinyGPT from the same seed, trains it as one stage of 2 and saves
{name: {losses, outputs, eval, weights}} to out_dir/rank<r>.pt. `reference(scenario)` trains the
same model in this process, unsplit, on the same batches.
"""

import copy
import os
import time
import traceback

import torch
from helpers.distributed_worker import spawn_ranks
from helpers.models import GPT_DESC, TinyGPT, cross_entropy

STAGES = 2
STEPS = 10
BATCH, SEQ = 8, 8


def batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, 50, (BATCH, SEQ), generator=g), torch.randint(0, 50, (BATCH, SEQ), generator=g)


def make_trainer(scenario, rank=0, world_size=1):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    torch.manual_seed(0)
    model = TinyGPT()
    config = optim.AdamConfig(lr=0.01) if scenario["optim"] == "adam" else optim.LambConfig(lr=0.01)
    options = {"device": {"id": "cpu"}, "batch": {"gradient_accumulation_steps": scenario.get("gas", 1)},
               "debug": {"deterministic_compute": True}}
    if world_size > 1:
        options["distributed"] = {
            "world_rank": rank, "world_size": world_size, "local_rank": rank,
            "pipeline_parallel": {"pipeline_parallel_size": world_size // scenario.get("data", 1),
                                  "num_pipeline_micro_batches": scenario.get("micro", 4),
                                  "pipeline_cut_info_string": scenario.get("cut", "")}}
    return ORTTrainer(model, GPT_DESC, config, loss_fn=cross_entropy, options=ORTTrainerOptions(options))


def train(trainer, scenario, start=0, stop=STEPS, at_save=None, rank=0):
    """Steps start..stop-1; `at_save(trainer)` runs after step scenario["save_at"] - 1. With
    scenario["data"] = D ranks per stage (stage-major ranks), data rank rank % D trains its 1/D of the
    rows of each batch."""
    data = scenario.get("data", 1)

    def part(step, micro):
        return [t.chunk(data)[rank % data] for t in batch(step, micro)]

    losses, logits = [], []
    for step in range(start, stop):
        if step == scenario.get("save_at") and at_save is not None:
            at_save(trainer)
        for micro in range(scenario.get("gas", 1)):
            loss, out = trainer.train_step(*part(step, micro))
            losses.append(float(loss))
            logits.append(out.clone())
    evaluated = trainer.eval_step(*part(STEPS, 0))
    return {"losses": losses, "logits": logits, "eval": [t.clone() for t in evaluated]}


def stage_file(out_dir, rank, prefix=""):
    return os.path.join(out_dir, f"{prefix}stage{rank}.ort.h5")


_REFERENCES = {}


def reference(scenario, save_to=None):
    """The one-process run of `scenario`, memoized per process (test_pipeline*.py share it). With
    scenario["save_at"] = k, result["state_at_save"] is its state_dict() after k steps and, with
    `save_to`, its checkpoint is written there then (renamed into place: a rank may wait for it)."""
    key, k = (scenario["optim"], scenario.get("gas", 1)), scenario.get("save_at")
    known = _REFERENCES.get(key)
    if known and (k is None or known["saved_at"] == k) and (save_to is None or os.path.exists(save_to)):
        return known
    at_save = {}

    def save(trainer):
        at_save["state"] = copy.deepcopy(trainer.state_dict())
        if save_to:
            trainer.save_checkpoint(save_to + ".part")
            os.replace(save_to + ".part", save_to)

    trainer = make_trainer(scenario)
    result = train(trainer, scenario, at_save=save)
    result["weights"] = {k: v.clone() for k, v in trainer.state_dict(pytorch_format=True).items()}
    result["state_at_save"], result["saved_at"] = at_save.get("state"), k
    _REFERENCES[key] = result
    return result


def _wait_for(paths, timeout=120):
    """A one-process file that the test process writes beside the ranks (reference(save_to=...))."""
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no file {paths} after {timeout} s")
        time.sleep(0.2)


def stage_weights(trainer):
    """{weight name: value} of this rank's stage (the tied embedding appears on both stages)."""
    runtime = trainer._pipeline.runtime
    return {w: runtime.current(w).clone() for w in runtime.graph.weights}


def _rank_main(rank, port, out_dir, scenarios, world):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ORTTRAINER_DIST_TIMEOUT": "60"})
    torch.set_num_threads(1)
    results = {}
    try:
        for scenario in scenarios:
            trainer = make_trainer(scenario, rank, world)
            if scenario.get("bad_cut"):  # every rank must fail alike, before any collective
                try:
                    trainer.train_step(*batch(0, 0))
                except ValueError as exc:
                    results[scenario["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            if scenario.get("failures"):
                results[scenario["name"]] = _failures(trainer, rank)
                continue
            if "load" in scenario:  # a checkpoint (one file, or the stage files) before the first step
                paths = scenario["load"] or [stage_file(out_dir, r) for r in range(STAGES)]
                _wait_for(paths)
                trainer.load_checkpoint(*paths)

            def save(trainer):
                trainer.save_checkpoint(stage_file(out_dir, rank, scenario.get("prefix", "")))
                torch.distributed.barrier()  # every stage file exists before any rank reads them

            result = train(trainer, scenario, start=scenario.get("start", 0), at_save=save, rank=rank)
            result["weights"] = stage_weights(trainer)
            result["cut"] = trainer._pipeline.cut_string
            results[scenario["name"]] = result
    except Exception as exc:  # reported to the test through the file
        results["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # a crashed peer's unfinished transfers must not hold the process at exit


def _failures(trainer, rank):
    """A bad token id (every rank must fail alike, before sending), then the last stage raising
    mid-step: the first stage must stop with a DistributedError within the (short) timeout. Last
    scenario of a launch: the ranks are out of step afterwards."""
    ids, labels = batch(0, 0)
    result = {}
    trainer.train_step(ids, labels)  # builds the stages
    try:
        trainer.train_step(ids.clone().fill_(999), labels)
    except ValueError as exc:
        result["bad_ids"] = f"{type(exc).__name__}: {exc}"
    trainer.train_step(ids, labels)  # still in step after the refused batch
    if rank == 0:  # the waiting stage's timeout (the crashing one keeps 60 s, so a slow machine cannot
        os.environ["ORTTRAINER_DIST_TIMEOUT"] = "3"  # time it out before its injected crash)
    else:
        runtime = trainer._pipeline.runtime
        run = runtime.run

        def crash(kind, *args, **kwargs):
            if kind == "micro":
                raise RuntimeError("injected crash of the last stage")
            return run(kind, *args, **kwargs)
        runtime.run = crash
    started = time.monotonic()
    try:
        trainer.train_step(ids, labels)
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        result["crash"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = time.monotonic() - started
    return result


def launch(scenarios, out_dir, timeout=180, world=STAGES, beside=None):
    """[per-rank results] of the scenarios on `world` ranks; every rank killed after `timeout` seconds;
    `beside()` runs in this process meanwhile (distributed_worker.spawn_ranks)."""
    results, _ = spawn_ranks(lambda rank, port: (rank, port, str(out_dir), scenarios, world), world, out_dir,
                             timeout, target=_rank_main, what="pipeline ranks", beside=beside)
    return results
