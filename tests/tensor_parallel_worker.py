"""Tensor parallel (Megatron) ranks for tests/test_tensor_parallel.py and bench/tensor_parallel.py:
tiny Hugging Face GPT-2 / BERT trainers, the same batches on every rank, dropout off."""

import os
import time
import traceback

import torch
import torch.multiprocessing as mp
import transformers

VOCAB, SEQ, BATCH, STEPS = 90, 8, 3, 10  # no size equal to a head count or width
DESCS = {
    "gpt2": {"inputs": [("input_ids", ["batch", SEQ]), ("labels", ["batch", SEQ])],
             "outputs": [("loss", [], True), ("logits", ["batch", SEQ, VOCAB])]},
    "bert": {"inputs": [("input_ids", ["batch", SEQ]), ("attention_mask", ["batch", SEQ]),
                        ("token_type_ids", ["batch", SEQ]), ("labels", ["batch", SEQ]),
                        ("next_sentence_label", ["batch"])],
             "outputs": [("loss", [], True), ("prediction_logits", ["batch", SEQ, VOCAB]),
                         ("seq_relationship_logits", ["batch", 2])]},
}


def model(kind, heads=4, hidden=32, layers=2):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=hidden, n_layer=layers,
                                         n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         use_cache=False)
        from orttrainer.run.models import _gpt2_class

        return _gpt2_class()(config)  # the recipe runner's: an all-ones mask, so no aten::diff
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=2 * hidden,
                                     max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForPreTraining(config)


def batch(kind, step):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if kind == "gpt2":
        return ids, ids.clone()
    labels = torch.full((BATCH, SEQ), -100)
    labels[:, 1::3] = ids[:, 1::3]
    return (ids, torch.ones(BATCH, SEQ, dtype=torch.long), torch.zeros(BATCH, SEQ, dtype=torch.long), labels,
            torch.randint(0, 2, (BATCH,), generator=g))


def trainer(kind, optim_name, rank=0, world_size=1, horizontal=1, **model_args):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    config = {"adam": optim.AdamConfig(lr=1e-3), "lamb": optim.LambConfig(lr=1e-2)}[optim_name]
    options = ORTTrainerOptions({
        "device": {"id": "cpu"}, "utils": {"grad_norm_clip": True},
        "distributed": {"world_rank": rank, "world_size": world_size, "local_rank": rank,
                        "horizontal_parallel_size": horizontal}})
    return ORTTrainer(model(kind, **model_args), DESCS[kind], config, options=options)


def train(t, kind, steps=STEPS, norms=None):
    losses, seconds = [], []
    for step in range(steps):
        started = time.perf_counter()
        losses.append(float(t.train_step(*batch(kind, step))[0]))
        seconds.append(time.perf_counter() - started)
        if norms is not None:
            norms.append(float(t.last_gradient_norm))
    return losses, seconds


def run_scenario(scenario, rank, world_size):
    kind = scenario["kind"]
    if scenario.get("expect_error"):
        try:
            t = trainer(kind, scenario["optim"], rank, world_size, world_size, **scenario.get("model", {}))
            t.train_step(*batch(kind, 0))
        except Exception as exc:  # the test checks the message
            return {"raised": f"{type(exc).__name__}: {exc}"}
        return {"raised": None}
    t = trainer(kind, scenario["optim"], rank, world_size, world_size)
    norms = []
    losses, seconds = train(t, kind, scenario.get("steps", STEPS), norms)
    state = t._training_session.get_state()
    result = {"losses": losses, "seconds": seconds, "norms": norms,
              "weights": {w: state[w] for w in t._training_session.runtime.graph.weights}}
    for name in ("state_dict", "save_checkpoint"):
        try:
            getattr(t, name)(*(() if name == "state_dict" else ("/nonexistent/tp.ortcp",)))
            result[name] = None
        except NotImplementedError as exc:
            result[name] = str(exc)
    return result


def _rank_main(rank, world_size, port, out_dir, scenarios):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ORTTRAINER_DIST_TIMEOUT": "60"})
    torch.set_num_threads(1)
    results = {}
    try:
        for scenario in scenarios:
            results[scenario["name"]] = run_scenario(scenario, rank, world_size)
    except Exception as exc:  # reported to the test through the file
        results["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def launch(world_size, scenarios, out_dir, timeout=180):
    """Run the scenarios on `world_size` spawned ranks (gloo, a free port); per-rank results."""
    from distributed_worker import free_port

    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(rank, world_size, port, str(out_dir), scenarios))
                 for rank in range(world_size)]
    started = time.monotonic()
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(max(0.0, started + timeout - time.monotonic()))
            if process.is_alive():
                raise TimeoutError(f"tensor parallel ranks still running after {timeout} s")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return results
