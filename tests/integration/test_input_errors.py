"""Inputs that ended in a traceback or passed silently: a WordPiece tokenizer without [UNK] (config
validate and train), a corpus that is not UTF-8 (train, as `orttrainer data` already said), and an
optimizer parameter group naming a weight the model does not have (a warning, also when the graphs
come from the export cache)."""

import warnings

import pytest
import torch

from helpers.models import MLP, MLP_DESC, mlp_loss
from helpers.training import make_options

from orttrainer import ORTTrainer, optim


def one_error_line(capsys, argv):
    from orttrainer.cli import main

    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def tokenizer_without_unk(tmp_path, form):
    words = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "of", "to", "and", "##s"]
    if form == "vocab.txt":
        path = tmp_path / "vocab.txt"
        path.write_text("\n".join(words) + "\n")
        return path
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]")).save(str(path))
    return path


@pytest.mark.parametrize("form", ["vocab.txt", "tokenizer.json"])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_wordpiece_tokenizer_without_unk_is_one_line(tmp_path, capsys, data_cache, form, command):
    pytest.importorskip("transformers")
    from helpers.recipes import RECIPES, SMALL_BERT, sets

    path = tokenizer_without_unk(tmp_path, form)
    argv = ["config", "validate"] if command == "validate" else ["train"]
    argv += [str(RECIPES / "bert-pretrain-tiny.yaml"), "--output-dir", str(tmp_path / "run")]
    for item in sets(data_cache, *SMALL_BERT, "run.max_steps=1", f"data.tokenizer={path}"):
        argv += ["--set", item]
    line = one_error_line(capsys, argv)
    assert f"{path}: the WordPiece vocabulary has no [UNK] token" in line, line
    assert not (tmp_path / "run").exists()


def test_a_corpus_that_is_not_utf8_is_one_line_at_train(tmp_path, capsys, data_cache):
    pytest.importorskip("transformers")
    from helpers.recipes import RECIPES, SMALL_BERT, sets

    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes(("Une phrase en fran\xe7ais.\n" * 200 + "\n").encode("latin-1"))
    argv = ["train", str(RECIPES / "bert-pretrain-tiny.yaml"), "--output-dir", str(tmp_path / "run")]
    for item in sets(data_cache, *SMALL_BERT, "run.max_steps=1", f"data.corpus={corpus}"):
        argv += ["--set", item]
    line = one_error_line(capsys, argv)
    # The line `orttrainer data` gives for the same file.
    assert line.endswith(f"{corpus}: not UTF-8 text: byte 0xe7 at byte offset 18; convert the file to UTF-8 "
                         "(e.g. iconv -f latin1 -t utf-8)"), line
    assert not (tmp_path / "run").exists()


def test_a_parameter_group_naming_no_weight_warns_once_per_trainer_cache_or_not():
    batches = [(torch.randn(8, 6, generator=torch.Generator().manual_seed(s)), torch.tensor([0, 1, 2, 3] * 2))
               for s in range(3)]
    # The groups are part of the export cache key: the first trainer builds its graphs, the second loads them.
    config = optim.AdamConfig(lr=1e-3, params=[{"params": ["fc1.weight", "fc9.weight"], "alpha": 0.5}])
    for attempt in ("built", "from the export cache"):
        torch.manual_seed(0)
        trainer = ORTTrainer(MLP(), MLP_DESC, config, loss_fn=mlp_loss, options=make_options())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches:
                trainer.train_step(x, y)
        found = [str(w.message) for w in caught if "parameter groups" in str(w.message)]
        assert len(found) == 1, (attempt, found)
        assert found[0].startswith("['fc9.weight'] params from the optimizer's parameter groups not found"), found
    assert trainer._build.source == "export cache"  # the second trainer did hit the cache
