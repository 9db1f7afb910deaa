"""Every bundled recipe's training graph builds and runs fp16-compute steps on the CPU.

Keeps the CPU fence (orttrainer/engine/graph/precision.py FENCED_OPS) honest for the real model kinds:
each recipe's model kind, optimizer and trainer options (opset, accumulation, ...), shrunk to a
tiny config, on a random batch, with mixed_precision.compute_dtype float16; a micro-step and an
optimizer step run, the loss stays finite and close to the fp32 graph's.
"""

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from orttrainer import ORTTrainer, ORTTrainerOptions, amp  # noqa: E402
from orttrainer.run import hf_models as models  # noqa: E402
from orttrainer.run.recipe.spec import load_recipe  # noqa: E402

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
TINY_CONFIG = {
    "gpt2": {"n_embd": 32, "n_layer": 1, "n_head": 2},
    "bert-pretraining": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "intermediate_size": 64},
}
TINY_CONFIG["bert-classification"] = TINY_CONFIG["bert-pretraining"]
VOCAB, SEQ, BATCH = 128, 16, 2


def random_batch(kind, generator):
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.int64),
             "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ).contiguous()}
    if kind == "gpt2":
        return {"input_ids": ids, "labels": ids.clone()}
    if kind == "bert-pretraining":
        labels = torch.full((BATCH, SEQ), -100, dtype=torch.int64)
        labels[:, 1:4] = ids[:, 1:4]
        return {**batch, "labels": labels, "next_sentence_label": torch.tensor([0, 1])}
    return {**batch, "labels": torch.tensor([0, 2])}


def losses(recipe, kind, compute_dtype):
    built = models.build_model(kind, TINY_CONFIG[kind], seed=0, vocab_size=VOCAB, seq_length=SEQ,
                               special={"pad": 0}, label_list=["a", "b", "c"])
    options = recipe.options_dict()
    options["device"] = {"id": "cpu"}
    options["batch"] = {"gradient_accumulation_steps": 2}  # a micro-step, then an optimizer step
    options["mixed_precision"] = {"enabled": True, "compute_dtype": compute_dtype,
                                  "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)}
    trainer = ORTTrainer(built.model, built.desc, recipe.optimizer_config(), options=ORTTrainerOptions(options))
    generator = torch.Generator().manual_seed(0)
    names = [name for name, _ in built.desc["inputs"]]
    out = []
    for _ in range(2):
        batch = random_batch(kind, generator)
        out.append(float(trainer.train_step(**{n: batch[n] for n in names})[0]))
    assert trainer._train_step_info.optimization_step == 1  # the update ran, with finite gradients
    assert trainer._training_session.graph.low_precision == (compute_dtype == "float16")
    return out


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_graph_runs_fp16_steps_on_the_cpu(path):
    recipe = load_recipe(path)
    kind = recipe.kind
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="mixed_precision.compute_dtype is 'float16' on the CPU")
        fp16 = losses(recipe, kind, "float16")
    fp32 = losses(recipe, kind, "float32")
    assert all(map(lambda v: v == v and abs(v) < float("inf"), fp16)), fp16
    assert fp16 == pytest.approx(fp32, rel=2e-2)
