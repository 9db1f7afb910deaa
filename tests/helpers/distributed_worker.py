"""Runs training scenarios in real ranks for tests/integration/test_distributed.py (not a test module).

`launch(world_size, scenarios, out_dir)` starts one process per rank with the environment torchrun
would give (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port); the trainer
initialises the gloo process group itself, as it does for a legacy script under torchrun. Each rank
runs the scenarios in order and saves {name: result} to out_dir/rank<r>.pt.
"""

import contextlib
import os
import socket
import time
import traceback
import warnings

import torch
import torch.multiprocessing as mp
from helpers.models import MLP, MLP_DESC, cross_entropy

STEPS = 4
GLOBAL_BATCH = 8


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(step, micro, size=GLOBAL_BATCH):
    """The global batch of one micro-step (identical on every rank and in the reference)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(size, 6, generator=g), torch.randint(0, 4, (size,), generator=g)


def rank_slice(tensors, rank, world_size, scenario=None, step=None):
    """Rank r's part of a global batch; a scenario's `poison` = (rank, step) puts an inf into that
    rank's inputs at that step (a non-finite gradient on one rank only)."""
    per = tensors[0].shape[0] // world_size
    part = [t[rank * per:(rank + 1) * per] for t in tensors]
    if scenario is not None and tuple(scenario.get("poison", ())) == (rank, step):
        part[0] = part[0].clone()
        part[0][0, 0] = float("inf")
    return part


def optim_config(name):
    from orttrainer import optim

    if name == "sgd":
        return optim.SGDConfig(lr=0.1)
    if name == "adam":
        # A second group with its own hyper-parameters exercises per-parameter groups under sharding.
        return optim.AdamConfig(lr=0.01, params=[{"params": ["fc2.weight"], "alpha": 0.8}])
    return optim.LambConfig(lr=0.01)


@contextlib.contextmanager
def bf16_units_assumed():
    """While a trainer is built (its check of the CPU's flags), a CPU without bf16 units passes for one
    with avx512_bf16: torch's oneDNN computes bf16 products there too (emulated, slower)."""
    from orttrainer.placement import cpu

    real_facts = cpu.facts
    if not cpu.bf16_units():
        real = real_facts()
        cpu.facts = lambda path=None: cpu.CpuFacts(real.model, real.vendor, real.flags | {"avx512_bf16"})
    try:
        yield
    finally:
        cpu.facts = real_facts


def make_trainer(scenario, rank=0, world_size=1, seed=0):
    from orttrainer import ORTTrainer, ORTTrainerOptions

    torch.manual_seed(seed)
    options = {
        "device": {"id": "cpu"},
        "batch": {"gradient_accumulation_steps": scenario.get("gas", 1)},
        "utils": {"grad_norm_clip": scenario.get("clip", False)},
        "distributed": {"world_rank": rank, "world_size": world_size, "local_rank": rank,
                        "allreduce_post_accumulation": scenario.get("post", True),
                        "enable_adasum": scenario.get("adasum", False),
                        "deepspeed_zero_optimization": {"stage": scenario.get("zero", 0)}},
    }
    if scenario.get("mixed"):
        # The dynamic loss scaler's scenarios compute in fp32 on every host; "bfloat16" ones in bf16.
        compute = scenario.get("compute", "float32")
        options["mixed_precision"] = {"enabled": True, "compute_dtype": compute}
    with bf16_units_assumed() if scenario.get("compute") == "bfloat16" else contextlib.nullcontext():
        return ORTTrainer(MLP(), MLP_DESC, optim_config(scenario["optim"]), loss_fn=cross_entropy,
                          options=ORTTrainerOptions(options))


def train(trainer, scenario, rank, world_size, first_step=0, steps=STEPS):
    """Train `steps` optimizer steps; rank r takes the r-th slice of every micro-step's global batch."""
    losses = []
    gas = scenario.get("gas", 1)
    for step in range(first_step, first_step + steps):
        for micro in range(gas):
            x, y = rank_slice(batch(step, micro), rank, world_size, scenario, step)
            loss, _ = trainer.train_step(x, y)
            losses.append(float(loss))
    return losses


def weights(trainer):
    return {k: v.clone() for k, v in trainer.state_dict(pytorch_format=True).items()}


def run_scenario(scenario, rank, world_size, out_dir):
    if scenario.get("refused_world_size"):
        return refused_start(scenario, rank, scenario["refused_world_size"])
    if scenario.get("combine"):  # Adasum's combination alone, on the group the trainers made
        from helpers.adasum_worker import combine

        return combine(rank, world_size, scenario["local_sizes"])
    trainer = make_trainer(scenario, rank, world_size, seed=scenario.get("seed", 0) + 17 * rank)
    if scenario.get("per_step"):  # the weights after each step, and Adasum's warnings
        result = {"losses": [], "per_step": [], "warnings": []}
        for step in range(scenario.get("steps", STEPS)):
            with warnings.catch_warnings(record=True) as caught, _broken_combination(scenario, rank, step):
                warnings.simplefilter("always")
                result["losses"] += train(trainer, scenario, rank, world_size, first_step=step, steps=1)
            result["warnings"] += [str(w.message) for w in caught if "Adasum" in str(w.message)]
            result["per_step"].append(weights(trainer))
    else:
        result = {"losses": train(trainer, scenario, rank, world_size)}
    result["weights"] = weights(trainer)
    result["state_dict"] = trainer.state_dict()
    if scenario.get("save"):
        path = os.path.join(out_dir, f"{scenario['name']}.rank{rank}.ortcp")
        trainer.save_checkpoint(path)
        result["checkpoint"] = path
        # Go on training: the uninterrupted reference for a resume from `path`.
        result["losses_after"] = train(trainer, scenario, rank, world_size, first_step=STEPS)
        result["weights_after"] = weights(trainer)
    if scenario.get("probe_mid_window"):
        result["mid_window"] = probe_mid_window(trainer, scenario, rank, world_size, out_dir)
    if scenario.get("resume_saved"):
        # This launch's own files: once every rank has written its file, resume from them.
        import torch.distributed as dist

        dist.barrier()
        files = [os.path.join(out_dir, f"{scenario['name']}.rank{r}.ortcp") for r in range(world_size)]
        # Data parallel files are equal; Adasum's hold each rank's own optimizer moments.
        own = files[rank] if scenario.get("adasum") else files[0]
        scenario = dict(scenario, resume_from=files if scenario.get("zero") else [own])
    if scenario.get("resume_from"):
        trainer = make_trainer(scenario, rank, world_size, seed=99)
        if not scenario.get("deferred"):
            trainer.train_step(*rank_slice(batch(0, 0), rank, world_size))  # creates the session
        # deferred: applied when the first train_step creates the session (the recipes' --resume)
        trainer.load_checkpoint(*scenario["resume_from"])
        result["resumed_losses"] = train(trainer, scenario, rank, world_size, first_step=STEPS)
        result["resumed_weights"] = weights(trainer)
    if scenario.get("crash_rank") == rank:
        os._exit(3)  # a rank dying mid-run: the others must fail, not hang
    return result


@contextlib.contextmanager
def _broken_combination(scenario, rank, step):
    """A scenario's `break_combined` = (rank, step): a NaN in that rank's combined Adasum update then
    (a fault injected in one real rank; the ranks must agree to skip)."""
    if tuple(scenario.get("break_combined", ())) != (rank, step):
        yield
        return
    from orttrainer.engine.parallel.adasum import Adasum

    original = Adasum.combine_

    def combine_(self, flat):
        original(self, flat)
        flat[0] = float("nan")
        return flat

    Adasum.combine_ = combine_
    try:
        yield
    finally:
        Adasum.combine_ = original


def refused_start(scenario, rank, size):
    """Ranks 0..size-1 start a trainer as the ranks of a `size`-rank job (torchrun's WORLD_SIZE) that
    must refuse it: the error is the result and the launch goes on; ranks beyond it take no part.
    Run before any trainer scenario, while no process group exists."""
    if rank >= size:
        return None
    saved = os.environ["WORLD_SIZE"]
    os.environ["WORLD_SIZE"] = str(size)
    try:
        return {"error": _error(lambda: make_trainer(scenario, rank, size))}
    finally:
        os.environ["WORLD_SIZE"] = saved


def _error(call):
    try:
        call()
    except Exception as exc:  # reported to the test
        return f"{type(exc).__name__}: {exc}"
    return None


def probe_mid_window(trainer, scenario, rank, world_size, out_dir):
    """One micro-step into the next window: what state_dict / save_checkpoint do there, then after it."""
    trainer.train_step(*rank_slice(batch(STEPS, 0), rank, world_size))
    path = os.path.join(out_dir, f"{scenario['name']}.mid.rank{rank}.ortcp")
    probe = {"state_dict": _error(trainer.state_dict), "save": _error(lambda: trainer.save_checkpoint(path)),
             "saved_file": os.path.exists(path), "weights": sorted(trainer.state_dict(pytorch_format=True))}
    trainer.train_step(*rank_slice(batch(STEPS, 1), rank, world_size))
    probe["after_window"] = trainer.state_dict()["train_step_info"]
    return probe


def _rank_main(rank, world_size, port, out_dir, scenarios, env):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})
    torch.set_num_threads(1)
    results = {}
    try:
        for scenario in scenarios:
            results[scenario["name"]] = run_scenario(scenario, rank, world_size, out_dir)
    except Exception as exc:  # reported to the test through the file
        results["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def launch(world_size, scenarios, out_dir, timeout=240, env=None):
    """Run the scenarios on `world_size` ranks; returns ([per-rank results or None], seconds)."""
    return spawn_ranks(lambda rank, port: (rank, world_size, port, str(out_dir), scenarios, env or {}),
                       world_size, out_dir, timeout, target=_rank_main)


def spawn_ranks(args_of, world_size, out_dir, timeout, target, what="ranks", beside=None):
    """Start `target(*args_of(rank, port))` for every rank (spawn, one free port); returns ([the
    `rank{r}.pt` result each rank saved in out_dir, or None], seconds).

    `beside()` runs in this process while the ranks start and train (the one-process references: this
    process has its imports already, and the ranks' start-up leaves a core idle); the ranks are killed
    if it raises.

    Ranks are watched one by one (not torch's spawn join, which kills the others as soon as one
    fails: a test of a crashed rank must see what its peers do). Raises TimeoutError, after killing
    every rank, if they do not all end within `timeout` seconds.
    """
    started = time.monotonic()
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=target, args=args_of(rank, port)) for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        if beside is not None:
            beside()
        for process in processes:
            process.join(max(0.0, started + timeout - time.monotonic()))
            if process.is_alive():
                raise TimeoutError(f"{what} still running after {timeout} s")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return results, time.monotonic() - started
