"""GPT token files: text/JSONL -> flat .npy stream -> fixed-length blocks."""

import json

import numpy as np
import pytest

from orttrainer.run.data import DataError
from orttrainer.run.data.gpt import GPTBlockDataset, build_gpt_tokens, iter_texts, token_dtype
from orttrainer.run.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

DOCS = [f"Document {i} says: the loop {'runs' if i % 2 else 'stops'} when the iterator is exhausted.\n"
        f"Its second line mentions item {i * 7}." for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(texts=DOCS, kind="bpe", vocab_size=300), path)
    return path


def _write_txt(path):
    path.write_text("\n\n".join(DOCS) + "\n", encoding="utf-8")
    return path


def test_blocks_reconstruct_the_token_stream(tmp_path, tokenizer_dir):
    meta = build_gpt_tokens(_write_txt(tmp_path / "c.txt"), tmp_path / "t.npy", tokenizer_dir, block_size=16)
    tokens = np.load(tmp_path / "t.npy")
    assert tokens.dtype == np.uint16 and tokens.size == meta["num_tokens"]
    side = json.loads((tmp_path / "t.json").read_text())
    assert side["vocab_size"] == 300 and side["eos_id"] == 0 and side["block_size"] == 16
    assert side["num_documents"] == len(DOCS)

    # the stream is each document's tokens followed by <|endoftext|>
    tok = load_tokenizer(tokenizer_dir)
    expected = [t for d in DOCS for t in tok.encode(d).ids + [0]]
    assert tokens.tolist() == expected
    ds = GPTBlockDataset(tmp_path / "t.npy")  # block size from the sidecar
    assert len(ds) == len(expected) // 16
    joined = np.concatenate([ds[i]["input_ids"].numpy() for i in range(len(ds))])
    assert joined.tolist() == expected[:len(ds) * 16]
    assert all((ds[i]["labels"] == ds[i]["input_ids"]).all() for i in range(3))  # HF models shift
    assert ds.meta["tokenizer"] == str(tokenizer_dir)
    # decoding gives the documents back
    pieces = tok.decode(expected, skip_special_tokens=False).split("<|endoftext|>")
    assert pieces[:-1] == DOCS


def test_shift_labels(tmp_path, tokenizer_dir):
    build_gpt_tokens(_write_txt(tmp_path / "c.txt"), tmp_path / "t.npy", tokenizer_dir)
    tokens = np.load(tmp_path / "t.npy")
    ds = GPTBlockDataset(tmp_path / "t.npy", block_size=10, shift_labels=True)
    assert len(ds) == (len(tokens) - 1) // 10
    item = ds[2]
    assert item["input_ids"].tolist() == tokens[20:30].tolist()
    assert item["labels"].tolist() == tokens[21:31].tolist()


def test_jsonl_field_and_eval_split(tmp_path, tokenizer_dir):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)),
                   encoding="utf-8")
    meta = build_gpt_tokens(src, tmp_path / "t.npy", tokenizer_dir, text_field="body",
                            eval_fraction=0.2, seed=3)
    eval_meta = json.loads((tmp_path / "t.eval.json").read_text())
    assert meta["num_documents"] + eval_meta["num_documents"] == len(DOCS)
    assert 3 <= eval_meta["num_documents"] <= 25
    eos = 0
    n_docs = sum(int((np.load(tmp_path / name) == eos).sum()) for name in ("t.npy", "t.eval.npy"))
    assert n_docs == len(DOCS)


def test_trains_bpe_when_no_tokenizer(tmp_path):
    meta = build_gpt_tokens(_write_txt(tmp_path / "c.txt"), tmp_path / "out" / "t.npy", vocab_size=280)
    assert meta["kind"] == "bpe" and meta["vocab_size"] == 280
    assert (tmp_path / "out" / "t_tokenizer" / "tokenizer.json").is_file()
    assert meta["tokenizer"] == "t_tokenizer/tokenizer.json"  # relative to the sidecar's folder


def test_dtype_choice():
    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.int32


def test_bad_jsonl_names_the_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        list(iter_texts(src))
    src.write_text('{"content": "no text field"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r":1: no string field 'text'"):
        list(iter_texts(src))


def test_too_short_for_one_block(tmp_path, tokenizer_dir):
    (tmp_path / "c.txt").write_text("tiny\n", encoding="utf-8")
    build_gpt_tokens(tmp_path / "c.txt", tmp_path / "t.npy", tokenizer_dir)
    with pytest.raises(DataError, match="fewer than one block"):
        GPTBlockDataset(tmp_path / "t.npy", block_size=64)
