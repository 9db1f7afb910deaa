"""Tensor parallel (Megatron) ranks for tests/integration/test_tensor_parallel.py:
tiny Hugging Face GPT-2 / BERT trainers, the same batches on every rank, dropout off."""

import contextlib
import os
import time
import traceback

import torch
import transformers
from helpers.distributed_worker import bf16_units_assumed

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
        from orttrainer.run.hf_models import _gpt2_class

        return _gpt2_class()(config)  # the recipe runner's: an all-ones mask, so no aten::diff
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=2 * hidden,
                                     max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForPreTraining(config)


def batch(kind, step, rows=BATCH, part=(0, 1)):
    """The batch of `step` (`rows` rows), or part i of n of its rows (data-parallel rank i of n)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    if kind == "gpt2":
        tensors = (ids, ids.clone())
    else:
        labels = torch.full((rows, SEQ), -100)
        labels[:, 1::3] = ids[:, 1::3]
        tensors = (ids, torch.ones(rows, SEQ, dtype=torch.long), torch.zeros(rows, SEQ, dtype=torch.long), labels,
                   torch.randint(0, 2, (rows,), generator=g))
    i, n = part
    return tuple(t[i * rows // n:(i + 1) * rows // n] for t in tensors)


def trainer(kind, optim_name, rank=0, world_size=1, horizontal=1, zero=0, bf16=False, **model_args):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    config = {"adam": optim.AdamConfig(lr=1e-3), "lamb": optim.LambConfig(lr=1e-2)}[optim_name]
    options = {
        "device": {"id": "cpu"}, "utils": {"grad_norm_clip": True},
        "distributed": {"world_rank": rank, "world_size": world_size, "local_rank": rank,
                        "horizontal_parallel_size": horizontal,
                        "deepspeed_zero_optimization": {"stage": zero}}}
    if bf16:  # every product, sharded or not, in bf16 on torch's kernel
        options["mixed_precision"] = {"enabled": True, "compute_dtype": "bfloat16"}
    with bf16_units_assumed() if bf16 else contextlib.nullcontext():
        return ORTTrainer(model(kind, **model_args), DESCS[kind], config, options=ORTTrainerOptions(options))


def train(t, kind, steps=STEPS, norms=None, start=0, rows=BATCH, part=(0, 1)):
    losses, seconds = [], []
    for step in range(start, start + steps):
        started = time.perf_counter()
        losses.append(float(t.train_step(*batch(kind, step, rows, part))[0]))
        seconds.append(time.perf_counter() - started)
        if norms is not None:
            norms.append(float(t.last_gradient_norm))
    return losses, seconds


_REFERENCES = {}


def reference(kind, optim_name, steps=STEPS, rows=BATCH, save_at=None, save_dir=None, bf16=False):
    """The one-process run on the whole batches, memoized per process so that the test files share it:
    {"trainer", "losses", "norms", "file"}; with `save_at`, `file` is its checkpoint after that many
    steps (saved mid-run: the steps after it must still equal the ranks' uninterrupted ones)."""
    key = (kind, optim_name, steps, rows, bf16)
    if key not in _REFERENCES:
        t, norms, file = trainer(kind, optim_name, bf16=bf16), [], None
        losses, _ = train(t, kind, save_at or steps, norms, rows=rows)
        if save_at:
            file = reference_file(save_dir, kind, optim_name)
            part = os.path.join(save_dir, "part-" + os.path.basename(file))
            t.save_checkpoint(part)
            os.replace(part, file)  # whole or absent: a rank may be waiting for it (run_resume)
            losses += train(t, kind, steps - save_at, norms, start=save_at, rows=rows)[0]
        _REFERENCES[key] = {"trainer": t, "losses": losses, "norms": norms, "file": file}
    if save_at and _REFERENCES[key]["file"] is None:
        raise RuntimeError(f"reference {key} was first run without save_at={save_at}")
    return _REFERENCES[key]


def reference_file(save_dir, kind, optim_name):
    """Where reference(..., save_at, save_dir) writes its checkpoint."""
    return os.path.join(save_dir, f"{kind}-{optim_name}.one.ortcp")


def run_scenario(scenario, rank, world_size):
    """Train `steps`; with `save_at`, save this rank's file into `dir` after that many steps (and record
    the warnings of a pytorch_format state_dict there), then go on: one trainer for both proofs."""
    kind = scenario["kind"]
    if scenario.get("resume_from"):
        return run_resume(scenario, rank, world_size)
    if scenario.get("expect_error"):
        try:
            t = trainer(kind, scenario["optim"], rank, world_size, world_size, **scenario.get("model", {}))
            t.train_step(*batch(kind, 0))
        except Exception as exc:  # the test checks the message
            return {"raised": f"{type(exc).__name__}: {exc}"}
        return {"raised": None}
    horizontal = scenario.get("horizontal", world_size)
    t = trainer(kind, scenario["optim"], rank, world_size, horizontal, scenario.get("zero", 0),
                bf16=scenario.get("bf16", False))
    norms, part = [], (rank // horizontal, world_size // horizontal)  # data groups: r, r+H, ...
    steps, rows, k = scenario.get("steps", STEPS), scenario.get("rows", BATCH), scenario.get("save_at")
    result = {}
    losses, seconds = train(t, kind, k or steps, norms, rows=rows, part=part)
    if k:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.state_dict(pytorch_format=True)
        result["warnings"] = [str(w.message) for w in caught]
        result["file_at_k"] = os.path.join(scenario["dir"], f"{scenario['name']}.k{k}.rank{rank}.ortcp")
        t.save_checkpoint(result["file_at_k"])
        more = train(t, kind, steps - k, norms, start=k, rows=rows, part=part)
        losses, seconds = losses + more[0], seconds + more[1]
    state = t._training_session.get_state()
    result.update({"losses": losses, "seconds": seconds, "norms": norms,
                   "weights": {w: state[w] for w in t._training_session.runtime.graph.weights}})
    if scenario.get("dir") and not k:
        result["file"] = os.path.join(scenario["dir"], f"{scenario['name']}.rank{rank}.ortcp")
        t.save_checkpoint(result["file"])
    return result


def run_resume(scenario, rank, world_size):
    """1 -> H: load the one-process file `scenario['resume_from']` (saved after `k` steps) before the
    first step and train on to STEPS."""
    kind, optim_name, k = scenario["kind"], scenario["optim"], scenario["k"]
    t = trainer(kind, optim_name, rank, world_size, scenario.get("horizontal", world_size))
    deadline = time.monotonic() + 120  # the test process writes the file beside the ranks
    while not os.path.exists(scenario["resume_from"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no file {scenario['resume_from']} after 120 s")
        time.sleep(0.2)
    t.load_checkpoint(scenario["resume_from"])
    resumed, _ = train(t, kind, STEPS - k, start=k)
    return {"resumed": resumed}


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


def launch(world_size, scenarios, out_dir, timeout=180, beside=None):
    """Run the scenarios on `world_size` spawned ranks (gloo, a free port); per-rank results;
    `beside()` runs in this process meanwhile (distributed_worker.spawn_ranks)."""
    from helpers.distributed_worker import spawn_ranks

    results, _ = spawn_ranks(lambda rank, port: (rank, world_size, port, str(out_dir), scenarios), world_size,
                             out_dir, timeout, target=_rank_main, what="tensor parallel ranks", beside=beside)
    return results
