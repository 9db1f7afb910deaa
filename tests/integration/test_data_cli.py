"""`orttrainer data ...` on small inputs: outputs readable by the readers, errors -> exit 2."""

import json

import pytest

from orttrainer.cli import main
from orttrainer.run.data.bert import BertPretrainingDataset, read_metadata
from orttrainer.run.data.glue import GlueDataset
from orttrainer.run.data.gpt import GPTBlockDataset


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "corpus.txt"
    assert main(["data", "corpus", str(path), "--max-mb", "0.08"]) == 0
    assert 70_000 < path.stat().st_size <= 80_000
    return path


def test_bert_trains_a_tokenizer_when_none_given(corpus, tmp_path, capsys):
    out = tmp_path / "bert"
    rc = main(["data", "bert", str(corpus), "--out", str(out), "--vocab-size", "500",
               "--max-seq-length", "64",
               "--max-predictions", "8", "--shards", "2", "--dupe-factor", "1", "--seed", "3"])
    assert rc == 0
    assert "training_shard_0001.hdf5" in capsys.readouterr().out
    meta = read_metadata(out)
    assert meta["vocab_size"] == 500 and meta["kind"] == "wordpiece" and meta["max_seq_length"] == 64
    ds = BertPretrainingDataset(out)
    assert len(ds) == sum(meta["shards"].values()) and ds.max_seq_length == 64
    assert int(ds[0]["input_ids"].max()) < 500


def test_tokenizer_then_gpt_with_it(corpus, tmp_path):
    assert main(["data", "tokenizer", str(corpus), "--kind", "bpe", "--vocab-size", "400",
                 "--out", str(tmp_path / "tok")]) == 0
    assert main(["data", "gpt", str(corpus), "--tokenizer", str(tmp_path / "tok"), "--out",
                 str(tmp_path / "gpt" / "train.npy"), "--block-size", "32"]) == 0
    ds = GPTBlockDataset(tmp_path / "gpt" / "train.npy")
    assert ds.block_size == 32 and ds.meta["vocab_size"] == 400 and len(ds) > 100


def test_gpt_from_jsonl(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"Line {i} of the story goes on and on."}) + "\n"
                           for i in range(50)), encoding="utf-8")
    assert main(["data", "gpt", str(src), "--out", str(tmp_path / "t.npy"), "--vocab-size", "300",
                 "--block-size", "8"]) == 0
    assert len(GPTBlockDataset(tmp_path / "t.npy")) > 10


def test_glue_task(corpus, tmp_path):
    assert main(["data", "glue", str(corpus), "--out", str(tmp_path), "--train", "40", "--dev", "10"]) == 0
    assert main(["data", "tokenizer", str(corpus), "--vocab-size", "300",
                 "--out", str(tmp_path / "tok")]) == 0
    assert len(GlueDataset(tmp_path / "train.tsv", tmp_path / "tok", max_length=32)) == 40


@pytest.mark.parametrize("argv, message", [
    (["data", "bert", "no-such-corpus.txt", "--out", "{tmp}/x"], "corpus file not found: no-such-corpus.txt"),
    (["data", "gpt", "{corpus}", "--out", "{tmp}/x.bin"], "the output must be a .npy file"),
    (["data", "bert", "{corpus}", "--out", "{tmp}/x", "--tokenizer", "{tmp}/missing"], "tokenizer not found"),
    (["data", "bert", "{corpus}", "--out", "{tmp}/x", "--max-predictions", "0"], "max_predictions_per_seq"),
])
def test_expected_errors_are_one_line_and_exit_2(corpus, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, corpus=corpus) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"orttrainer data {argv[1]}: error: ") and message in err
