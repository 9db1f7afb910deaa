"""Tokenizers trained offline, saved and loaded back (tokenizer.json, vocab.txt)."""

import pytest

from orttrainer.run.data import DataError
from orttrainer.run.data.tokenizer import (BERT_SPECIAL_TOKENS, load_tokenizer, save_tokenizer, special_token_ids,
                                       train_tokenizer)

TEXT = ["The for statement is used to iterate over the elements of a sequence.",
        "Return the square root of x.", "An iterator is created for that iterable object.",
        "Names in the target list are not deleted when the loop is finished."] * 20


def test_wordpiece_save_load_and_vocab_txt(tmp_path):
    tok = train_tokenizer(texts=TEXT, kind="wordpiece", vocab_size=300)
    assert [tok.token_to_id(t) for t in BERT_SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    enc = tok.encode("Return the root.", "Iterate over it.")
    assert enc.tokens[0] == "[CLS]" and enc.tokens.count("[SEP]") == 2
    first_sep = enc.tokens.index("[SEP]")
    assert enc.type_ids == [0] * (first_sep + 1) + [1] * (len(enc.ids) - first_sep - 1)

    path = save_tokenizer(tok, tmp_path / "tok")
    assert path.name == "tokenizer.json" and (tmp_path / "tok" / "vocab.txt").is_file()
    for source in (path, tmp_path / "tok", tmp_path / "tok" / "vocab.txt"):
        loaded = load_tokenizer(source)
        assert loaded.encode("Return the root.", "Iterate over it.").ids == enc.ids
    # vocab.txt has no upper case tokens -> loaded lower-casing, like bert-base-uncased;
    # its special tokens stay whole.
    from_vocab = load_tokenizer(tmp_path / "tok" / "vocab.txt")
    assert from_vocab.encode("RETURN").ids == tok.encode("return").ids
    assert from_vocab.encode("a [MASK] b").tokens == tok.encode("a [MASK] b").tokens
    assert "[MASK]" in from_vocab.encode("a [MASK] b").tokens


def test_bpe_is_lossless_with_eos(tmp_path):
    tok = train_tokenizer(texts=TEXT, kind="bpe", vocab_size=300)
    special = special_token_ids(tok)
    assert special["eos"] == 0 and special["pad"] is None
    text = "Return the square root of x.\n  Ünïcode too!"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    loaded = load_tokenizer(save_tokenizer(tok, tmp_path))
    assert loaded.encode(text).ids == ids


def test_training_from_files_is_deterministic(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXT), encoding="utf-8")
    a = train_tokenizer(corpus, kind="wordpiece", vocab_size=200)
    b = train_tokenizer([corpus], kind="wordpiece", vocab_size=200)
    assert a.to_str() == b.to_str()


@pytest.mark.parametrize("make", [lambda p: p / "missing.json", lambda p: p])
def test_load_errors(tmp_path, make):
    with pytest.raises(DataError):
        load_tokenizer(make(tmp_path))


def test_bad_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_bad_kind():
    with pytest.raises(DataError, match="unknown tokenizer kind"):
        train_tokenizer(texts=TEXT, kind="sentencepiece")
