"""The first `--resume` of a run reads the data its first run built: nothing is re-tokenized.

A checkpoint keeps its own copy of the tokenizer (written compactly, tokenizer.to_str()); the data
cache is named by the tokenizer's content, so that copy must name the same cached data as the
pretty tokenizer.json the first run trained. Observed through the log and the cache folder.
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from orttrainer.cli import main  # noqa: E402
from orttrainer.run import hf_models as models  # noqa: E402

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SMALL = ["data.corpus_max_mb=0.25", "data.vocab_size=1024", "data.eval_fraction=0.1", "run.eval_batches=1",
         "data.batch_size=4", "data.seq_length=32", "run.log_every=1", "run.save_every=2"]
MODEL = {"bert-pretrain-tiny.yaml": ["model.config.hidden_size=32", "model.config.intermediate_size=64",
                                     "model.config.num_hidden_layers=1", "data.bert.max_predictions_per_seq=5",
                                     "data.bert.dupe_factor=1", "trainer.batch.gradient_accumulation_steps=1"],
         "gpt2-pretrain-tiny.yaml": ["model.config.n_embd=32", "model.config.n_layer=1"]}


def run(recipe, out, cache, steps, resume=None):
    argv = ["train", str(RECIPES / recipe), "--output-dir", str(out)]
    for item in [f"data.cache_dir={cache}", *SMALL, *MODEL[recipe], f"run.max_steps={steps}"]:
        argv += ["--set", item]
    return main(argv + (["--resume", resume] if resume else []))


@pytest.mark.parametrize("recipe", sorted(MODEL))
def test_first_resume_does_not_rebuild_the_data(recipe, data_cache, tmp_path, capsys):
    cache = Path(data_cache)
    out = tmp_path / "run"
    assert run(recipe, out, cache, 2) == 0
    capsys.readouterr()  # the first run may build the data, or find it built by another test
    before = sorted(p.name for p in cache.iterdir())
    checkpoint = models.complete_checkpoints(out)[-1] / models.TOKENIZER_JSON
    cached = [p for p in cache.glob("tokenizer-*/tokenizer.json")]
    # The situation of the bug: same tokenizer, different bytes on disk.
    assert any(json.loads(p.read_text()) == json.loads(checkpoint.read_text()) and
               p.read_bytes() != checkpoint.read_bytes() for p in cached), (cached, checkpoint)

    assert run(recipe, out, cache, 4, "auto") == 0
    resumed = capsys.readouterr().out
    assert "resum" in resumed.lower()
    assert "data: building" not in resumed, resumed
    assert sorted(p.name for p in cache.iterdir()) == before
