"""2-rank runs (gloo, a free port, a timeout on every wait) for tests/integration/test_legacy_clients_distributed.py,
each a call of the original distributed-checkpoint tests: train a few steps, then save
`checkpoint<rank>.ortcp` (as their _test_helpers._save did) or inspect the backend getters (as
orttraining_test_backend_api did). Not a test module."""

import os
import traceback

import torch

STEPS = 3


def _batches(rank, data_parallel_size, steps=STEPS):
    """The data-parallel rank's rows of each batch (the ranks of a horizontal group share them)."""
    g = torch.Generator().manual_seed(7)
    part = 8 // data_parallel_size
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        yield x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]


def trainer(rank, world_size, *, model="torch", optim="lamb", zero=0, horizontal=1, mixed=False):
    from helpers.models import MLP, MLP_DESC, cross_entropy

    from orttrainer import ORTTrainer, ORTTrainerOptions
    from orttrainer import optim as optims

    torch.manual_seed(0)
    options = {"device": {"id": "cpu"}, "debug": {"deterministic_compute": True},
               "distributed": {"world_rank": rank, "world_size": world_size, "local_rank": rank,
                               "allreduce_post_accumulation": True, "horizontal_parallel_size": horizontal,
                               "deepspeed_zero_optimization": {"stage": zero}}}
    if mixed:
        options["mixed_precision"] = {"enabled": True}
    config = optims.LambConfig(lr=0.01) if optim == "lamb" else optims.AdamConfig(lr=0.01)
    if model == "onnx":  # the original's Megatron checkpoints came from an ONNX model (BART)
        import onnx
        from helpers.models import export_mlp_with_loss

        return ORTTrainer(onnx.load_from_string(export_mlp_with_loss()), MLP_DESC, config,
                          options=ORTTrainerOptions(options))
    return ORTTrainer(MLP(), MLP_DESC, config, loss_fn=cross_entropy, options=ORTTrainerOptions(options))


def run(scenario, rank, world_size, out_dir):
    t = trainer(rank, world_size, **scenario["trainer"])
    horizontal = scenario["trainer"].get("horizontal", 1)
    for x, y in _batches(rank // horizontal, world_size // horizontal):
        t.train_step(x, y)
    result = {"state_dict": t.state_dict()}
    if scenario.get("save"):
        folder = os.path.join(out_dir, scenario["name"])
        os.makedirs(folder, exist_ok=True)
        t.save_checkpoint(os.path.join(folder, f"checkpoint{rank}.ortcp"))
        result["folder"] = folder
    if scenario.get("backend_getters"):
        session = t._training_session
        result["get_state"] = session.get_state()
        result["model_state"] = session.get_model_state(include_mixed_precision_weights=True)
        result["partition_info"] = session.get_partition_info_map()
    return result


def _rank_main(rank, world_size, port, out_dir, scenarios):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ORTTRAINER_DIST_TIMEOUT": "60"})
    torch.set_num_threads(1)
    results = {}
    for scenario in scenarios:
        try:
            results[scenario["name"]] = run(scenario, rank, world_size, out_dir)
        except Exception as exc:  # reported to the test through the file; the next scenario still runs
            results[scenario["name"]] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def launch(scenarios, out_dir, timeout=300):
    from helpers.distributed_worker import spawn_ranks

    results, _ = spawn_ranks(lambda rank, port: (rank, 2, port, str(out_dir), scenarios), 2, out_dir, timeout,
                             target=_rank_main, what="legacy client ranks")
    return results
