"""NVIDIA-format BERT shards: built from a corpus, read back as the model's tensors."""

import h5py
import numpy as np
import pytest

from orttrainer.run.data import DataError
from orttrainer.run.data.bert import KEYS, BertPretrainingDataset, build_bert_shards, find_shards, read_metadata
from orttrainer.run.data.corpus import build_corpus
from orttrainer.run.data.tokenizer import load_tokenizer

L, P = 64, 10


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    build_corpus(root / "corpus.txt", max_bytes=120_000)
    meta = build_bert_shards(root / "corpus.txt", root / "out", max_seq_length=L, max_predictions_per_seq=P,
                             dupe_factor=2, num_shards=2, eval_fraction=0.1, vocab_size=600, seed=7)
    return root, meta


def test_files_and_nvidia_dtypes(built):
    root, meta = built
    out = root / "out"
    assert find_shards(out) == [str(out / "training_shard_0000.hdf5"), str(out / "training_shard_0001.hdf5")]
    assert find_shards(out, "eval") == [str(out / "eval_shard_0000.hdf5")]
    with h5py.File(out / "training_shard_0000.hdf5") as f:
        n = meta["shards"]["training_shard_0000.hdf5"]
        expected = {"input_ids": ("i4", (n, L)), "input_mask": ("i1", (n, L)), "segment_ids": ("i1", (n, L)),
                    "masked_lm_positions": ("i4", (n, P)), "masked_lm_ids": ("i4", (n, P)),
                    "next_sentence_labels": ("i1", (n,))}
        assert {k: (f[k].dtype.str[1:], f[k].shape) for k in f} == expected
    assert read_metadata(out)["tokenizer"] == str(out / "tokenizer" / "tokenizer.json")


def test_reader_items(built):
    root, meta = built
    ds = BertPretrainingDataset(root / "out")
    assert len(ds) == meta["shards"]["training_shard_0000.hdf5"] + meta["shards"]["training_shard_0001.hdf5"]
    assert len(BertPretrainingDataset(root / "out", split="eval")) == meta["shards"]["eval_shard_0000.hdf5"]
    tok = load_tokenizer(read_metadata(root / "out")["tokenizer"])
    cls, sep, pad, mask = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))
    item = ds[len(ds) - 1]
    assert set(item) == {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
    assert all(v.dtype.is_floating_point is False and v.dtype.itemsize == 8 for v in item.values())
    assert item["input_ids"].shape == item["labels"].shape == (L,) and item["next_sentence_label"].shape == ()

    predicted = real = kept = masked = 0
    for i in range(0, len(ds), 3):
        x = {k: v.numpy() for k, v in ds[i].items()}
        n = int(x["attention_mask"].sum())
        ids, seg, labels = x["input_ids"], x["token_type_ids"], x["labels"]
        assert ids[0] == cls and ids[n - 1] == sep and (ids[n:] == pad).all()
        assert (x["attention_mask"][:n] == 1).all()
        # segment ids: 0 for [CLS] A [SEP], then 1 up to the last [SEP], 0 on padding
        first_sep = int(np.flatnonzero(ids == sep)[0]) if ids[0] != sep else 0
        assert (seg[:first_sep + 1] == 0).all() and (seg[first_sep + 1:n] == 1).all() and (seg[n:] == 0).all()
        at = np.flatnonzero(labels != -100)
        assert 1 <= len(at) <= P and at.max() < n
        assert not np.isin(labels[at], [cls, sep, pad, mask]).any()  # originals are real tokens
        predicted += len(at)
        real += n
        masked += int((ids[at] == mask).sum())
        kept += int((ids[at] == labels[at]).sum())
    assert 0.13 < predicted / real < 0.16  # 15%, rounded per sequence, at least one
    assert abs(masked / predicted - 0.8) < 0.04 and abs(kept / predicted - 0.1) < 0.04


def test_next_sentence_labels(built):
    root, meta = built
    labels = []
    for name in ("training_shard_0000.hdf5", "training_shard_0001.hdf5"):
        with h5py.File(root / "out" / name) as f:
            labels.append(f["next_sentence_labels"][:])
    labels = np.concatenate(labels)
    assert set(np.unique(labels)) == {0, 1}
    # 50% random, plus chunks of one segment which are always random (as in Google's script)
    assert 0.45 < labels.mean() < 0.65
    assert meta["training_random_next_fraction"] == pytest.approx(labels.mean(), abs=1e-4)


def test_same_seed_same_bytes_other_seed_differs(built, tmp_path):
    root, _ = built
    tok = root / "out" / "tokenizer"
    args = dict(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=1)
    build_bert_shards(root / "corpus.txt", tmp_path / "a", tok, seed=1, **args)
    build_bert_shards(root / "corpus.txt", tmp_path / "b", tok, seed=1, **args)
    build_bert_shards(root / "corpus.txt", tmp_path / "c", tok, seed=2, **args)
    read = lambda d: BertPretrainingDataset(d)._arrays[0]  # noqa: E731
    a, b, c = read(tmp_path / "a"), read(tmp_path / "b"), read(tmp_path / "c")
    assert all(np.array_equal(a[k], b[k]) for k in KEYS)
    assert not np.array_equal(a["input_ids"], c["input_ids"])


def test_reads_nvidia_style_shard_with_other_dtypes(tmp_path):
    # Hand-made shard as NVIDIA's loader sees them: predictions end at the first 0 position.
    path = tmp_path / "books_wiki_en_corpus_training_0.hdf5"
    with h5py.File(path, "w") as f:
        f["input_ids"] = np.array([[101, 7, 8, 102, 9, 102, 0, 0], [101, 5, 102, 6, 102, 0, 0, 0]],
                                  dtype=np.int64)
        f["input_mask"] = np.array([[1] * 6 + [0] * 2, [1] * 5 + [0] * 3], dtype=np.int64)
        f["segment_ids"] = np.array([[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0]], dtype=np.int64)
        f["masked_lm_positions"] = np.array([[1, 4, 0], [0, 0, 0]], dtype=np.int32)
        f["masked_lm_ids"] = np.array([[70, 90, 0], [0, 0, 0]], dtype=np.int32)
        f["next_sentence_labels"] = np.array([[1], [0]], dtype=np.int64)  # (N, 1) works too
    ds = BertPretrainingDataset(tmp_path)
    assert len(ds) == 2
    first, second = ds[0], ds[1]
    assert first["labels"].tolist() == [-100, 70, -100, -100, 90, -100, -100, -100]
    assert second["labels"].tolist() == [-100] * 8
    assert first["next_sentence_label"].item() == 1 and second["next_sentence_label"].item() == 0
    assert first["token_type_ids"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]


def test_missing_dataset_is_a_clear_error(tmp_path):
    with h5py.File(tmp_path / "training.hdf5", "w") as f:
        f["input_ids"] = np.zeros((2, 4), dtype=np.int32)
    with pytest.raises(DataError, match="missing input_mask"):
        BertPretrainingDataset(tmp_path / "training.hdf5")
    with pytest.raises(DataError, match="no such shard file or folder"):
        BertPretrainingDataset(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no training .hdf5 shards"):
        BertPretrainingDataset(tmp_path / "empty")


def test_tokenizer_without_mask_token_is_rejected(built, tmp_path):
    root, _ = built
    from orttrainer.run.data.tokenizer import save_tokenizer, train_tokenizer
    bpe = save_tokenizer(train_tokenizer(root / "corpus.txt", kind="bpe", vocab_size=300), tmp_path / "bpe")
    with pytest.raises(DataError, match="needs a WordPiece tokenizer"):
        build_bert_shards(root / "corpus.txt", tmp_path / "x", bpe)
