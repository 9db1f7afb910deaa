"""GLUE-style TSV reading, tokenization, and the bundled next-sentence and topic tasks."""

import collections

import pytest
import torch

from orttrainer.run.data import DataError
from orttrainer.run.data.corpus import build_corpus, read_documents
from orttrainer.run.data.glue import GlueDataset, build_next_sentence_task, build_topic_task, read_glue_tsv
from orttrainer.run.data.tokenizer import save_tokenizer, train_tokenizer

TEXT = ["the cat sat on the mat .", "a dog ran in the park .",
        "the loop stops when the iterator is done ."] * 10


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(texts=TEXT, kind="wordpiece", vocab_size=120), path)
    return path


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_pairs_by_header_names(tmp_path, wordpiece):
    path = _write(tmp_path / "train.tsv", "index\tsentence1\tsentence2\tlabel\n"
                  "0\tthe cat sat .\ta dog ran .\tnot_entailment\n"
                  "1\tthe loop stops .\tthe iterator is done .\tentailment\n")
    ds = GlueDataset(path, wordpiece, max_length=12)
    assert ds.label_list == ["entailment", "not_entailment"] and ds.num_labels == 2
    item = ds[0]
    assert {k: tuple(v.shape) for k, v in item.items()} == {
        "input_ids": (12,), "token_type_ids": (12,), "attention_mask": (12,), "labels": ()}
    assert item["labels"].item() == 1 and ds[1]["labels"].item() == 0
    n = int(item["attention_mask"].sum())
    ids, types = item["input_ids"].tolist(), item["token_type_ids"].tolist()
    assert ids[0] == 2 and ids[n - 1] == 3 and ids[n:] == [0] * (12 - n)  # [CLS] ... [SEP] [PAD]...
    a_end = ids.index(3) + 1  # [CLS] A [SEP] has type 0, B [SEP] type 1, padding 0
    assert types == [0] * a_end + [1] * (n - a_end) + [0] * (12 - n)


def test_single_sentence_by_index_without_header(tmp_path, wordpiece):
    # CoLA's layout: source, label, original label, sentence; no header
    path = _write(tmp_path / "cola.tsv", "gj04\t1\t\tthe cat sat on the mat .\ngj04\t0\t*\tmat the on .\n")
    ds = GlueDataset(path, wordpiece, max_length=8, header=False, text_a=3, label=1)
    assert ds.label_list == ["0", "1"] and ds.labels.tolist() == [1, 0]
    assert ds[0]["token_type_ids"].eq(0).all()
    assert ds[0]["attention_mask"].sum() == 8  # truncated to max_length


def test_raw_quotes_by_default_and_csv_quoting_on_request(tmp_path):
    path = _write(tmp_path / "q.tsv", 'sentence\tlabel\n"Stop," he said.\t1\n')
    assert read_glue_tsv(path)[0].text_a == '"Stop," he said.'  # GLUE files: quotes are text
    quoted = _write(tmp_path / "quoted.tsv", 'sentence\tlabel\n"a ""quoted""\tfield"\t1\nplain\t0\n')
    examples = read_glue_tsv(quoted, quotechar='"')
    assert [e.text_a for e in examples] == ['a "quoted"\tfield', "plain"]
    assert [e.label for e in examples] == ["1", "0"]
    with pytest.raises(DataError, match=r"quoted.tsv:2: 3 fields, expected 2 \(if fields are CSV-quoted"):
        read_glue_tsv(quoted)


def test_bad_rows_and_columns(tmp_path, wordpiece):
    path = _write(tmp_path / "bad.tsv", "sentence\tlabel\nfine\t1\nno label here\n")
    with pytest.raises(DataError, match=r"bad.tsv:3: 1 fields, expected 2"):
        read_glue_tsv(path)
    path = _write(tmp_path / "cols.tsv", "text\tgold\nfine\t1\n")
    with pytest.raises(DataError, match="no label column; header is"):
        read_glue_tsv(path)
    with pytest.raises(DataError, match="no column 'sentence2'"):
        read_glue_tsv(path, label="gold", text_b="sentence2")
    dev = _write(tmp_path / "dev.tsv", "sentence\tlabel\nfine\tmaybe\n")
    with pytest.raises(DataError, match=r"labels \['maybe'\] are not in the label list"):
        GlueDataset(dev, wordpiece, label_list=["0", "1"])


def test_regression_labels(tmp_path, wordpiece):
    path = _write(tmp_path / "sts.tsv", "sentence1\tsentence2\tscore\na cat\ta dog\t3.5\n")
    ds = GlueDataset(path, wordpiece, max_length=8, label="score", regression=True)
    assert ds.labels.dtype == torch.float32 and ds[0]["labels"].item() == 3.5 and ds.num_labels == 1


def test_bundled_next_sentence_task(tmp_path, wordpiece):
    build_corpus(tmp_path / "corpus.txt", max_bytes=40_000)
    counts = build_next_sentence_task(tmp_path / "corpus.txt", tmp_path / "glue", num_train=200, num_dev=50)
    assert counts == {"train": 200, "dev": 50}
    train = read_glue_tsv(tmp_path / "glue" / "train.tsv")
    dev = read_glue_tsv(tmp_path / "glue" / "dev.tsv")
    assert sum(e.label == "1" for e in train) == 100
    # positives really are consecutive sentences of one document
    follows = {(d[i], d[i + 1]) for d in read_documents(tmp_path / "corpus.txt") for i in range(len(d) - 1)}
    assert all((e.text_a, e.text_b) in follows for e in train + dev if e.label == "1")
    doc_of = {s: k for k, d in enumerate(read_documents(tmp_path / "corpus.txt")) for s in d}
    assert not {doc_of[e.text_a] for e in train} & {doc_of[e.text_a] for e in dev}  # disjoint documents
    ds = GlueDataset(tmp_path / "glue" / "dev.tsv", wordpiece, max_length=32)
    assert len(ds) == 50 and ds.label_list == ["0", "1"]


def test_bundled_topic_task(tmp_path, wordpiece):
    build_corpus(tmp_path / "corpus.txt", max_bytes=60_000)
    docs = read_documents(tmp_path / "corpus.txt")
    counts = build_topic_task(tmp_path / "corpus.txt", tmp_path / "topic", num_train=40, num_dev=20, num_topics=3)
    assert counts["train"] == 39 and counts["dev"] == 18 and len(set(counts["labels"])) == 3  # 13 and 6 per label
    train = read_glue_tsv(tmp_path / "topic" / "train.tsv")
    dev = read_glue_tsv(tmp_path / "topic" / "dev.tsv")
    assert train[0].text_b is None  # single passages
    for split in (train, dev):  # balanced: the majority-class rate is 1/3
        assert sorted(collections.Counter(e.label for e in split).values()) == [len(split) // 3] * 3
    # Every passage is 2 consecutive sentences of the document its label names; none is in both splits.
    largest = sorted(range(len(docs)), key=lambda i: (-len(docs[i]), i))[:3]
    label_doc = dict(zip(counts["labels"], largest))
    for e in train + dev:
        doc = docs[label_doc[e.label]]
        assert any(e.text_a == " ".join(doc[i:i + 2]) for i in range(0, len(doc) - 1, 2)), e
    assert not {e.text_a for e in train} & {e.text_a for e in dev}
    again = tmp_path / "again"
    build_topic_task(tmp_path / "corpus.txt", again, num_train=40, num_dev=20, num_topics=3)
    assert (again / "train.tsv").read_bytes() == (tmp_path / "topic" / "train.tsv").read_bytes()  # deterministic
    assert GlueDataset(tmp_path / "topic" / "dev.tsv", wordpiece, max_length=32).num_labels == 3
