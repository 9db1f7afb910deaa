"""GLUE-style TSV data for sentence and sentence-pair classification, and a bundled task.

Files are tab-separated, UTF-8, one example per line, usually with a header row. By
default fields are read raw, as the GLUE files themselves must be (their sentences hold
unbalanced quote characters; Hugging Face also reads them with quoting off). TSVs written
with CSV quoting (pandas' ``to_csv(sep="\\t")``: ``"a ""quoted"" field"``) need
``quotechar='"'``.

Columns are named by header name or by 0-based index (``text_b=None`` for single
sentences). The label set is the sorted set of labels in the file unless `label_list` is
given -- pass the training set's `label_list` to the dev set so ids agree.
"""

import csv
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from orttrainer.run.data.common import DataError
from orttrainer.run.data.corpus import read_documents
from orttrainer.run.data.sources import check_utf8, json_objects
from orttrainer.run.data.tokenizer import load_tokenizer, special_token_ids

# Header names of the GLUE tasks' columns, tried in order when a column is not given.
_TEXT_A = ("sentence", "sentence1", "question1", "question", "#1 String", "text", "text_a")
_TEXT_B = ("sentence2", "question2", "#2 String", "text_b")
_LABEL = ("label", "gold_label", "Quality", "is_duplicate")

csv.field_size_limit(2**31 - 1)  # long documents in one field


@dataclass
class Example:
    text_a: str
    text_b: str | None
    label: str


def _column(spec, header, candidates, what, path, required=True):
    if isinstance(spec, int):
        return spec
    if header is None:
        if spec is None and not required:
            return None
        raise DataError(f"{path}: has no header row, so the {what} column must be given as an index")
    if spec is None:
        spec = next((c for c in candidates if c in header), None)
        if spec is None:
            if not required:
                return None
            raise DataError(f"{path}: no {what} column; header is {header}; pass its name or index")
    if spec not in header:
        raise DataError(f"{path}: no column {spec!r} for the {what}; header is {header}")
    return header.index(spec)


def read_glue_tsv(path, text_a=None, text_b=None, label=None, header=True, quotechar=None,
                  single_sentence=False):
    """Read examples from a TSV file -> list of `Example`.

    `text_a`/`text_b`/`label`: column names or indices; None picks a GLUE column name
    from the header (text_b: none found -> single sentence; `single_sentence=True` forces
    it). A row with a different field count than the first row is an error.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path.suffix[1:].upper() or 'TSV'} file not found: {path}")
    check_utf8(path)
    if path.suffix.lower() == ".jsonl":
        return _read_jsonl(path, text_a, text_b, label, single_sentence)
    delimiter = "," if path.suffix.lower() == ".csv" else "\t"
    if delimiter == ",":
        quotechar = quotechar or '"'  # CSV files are quoted (RFC 4180)
    quoting = csv.QUOTE_MINIMAL if quotechar else csv.QUOTE_NONE
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter=delimiter, quotechar=quotechar, quoting=quoting, strict=bool(quotechar))
        try:
            first = next(rows)
        except StopIteration:
            raise DataError(f"{path}: empty file") from None
        except csv.Error as exc:
            raise DataError(f"{path}:1: {exc}") from None
        names = first if header else None
        ia = _column(text_a, names, _TEXT_A, "first text", path)
        ib = None if single_sentence else _column(text_b, names, _TEXT_B, "second text", path,
                                                  required=text_b is not None)
        il = _column(label, names, _LABEL, "label", path)
        width = len(first)
        if max(i for i in (ia, ib, il) if i is not None) >= width:
            raise DataError(f"{path}: column index out of range for rows of {width} fields")
        examples = [] if header else [first]
        try:
            for row in rows:
                if row == []:
                    continue
                if len(row) != width:
                    hint = "" if quotechar else " (if fields are CSV-quoted, set quotechar='\"')"
                    raise DataError(f"{path}:{rows.line_num}: {len(row)} fields, expected {width}{hint}")
                examples.append(row)
        except csv.Error as exc:
            raise DataError(f"{path}:{rows.line_num}: {exc}") from None
    return [Example(r[ia], r[ib] if ib is not None else None, r[il]) for r in examples]


def _read_jsonl(path, text_a, text_b, label, single_sentence):
    """Examples from JSON lines; columns are field names (None: the GLUE names, as for TSVs)."""
    examples, names = [], None
    for lineno, record in json_objects(path):
        if names is None:
            header = list(record)
            if any(isinstance(c, int) for c in (text_a, text_b, label)):
                raise DataError(f"{path}: JSONL fields are named, not numbered; fields: {header}")
            names = (_column(text_a, header, _TEXT_A, "first text", path),
                     None if single_sentence else _column(text_b, header, _TEXT_B, "second text", path,
                                                          required=text_b is not None),
                     _column(label, header, _LABEL, "label", path))
            names = [None if i is None else header[i] for i in names]
        values = []
        for name in names:
            if name is not None and name not in record:
                raise DataError(f"{path}:{lineno}: no field {name!r}; fields: {sorted(record)}")
            values.append(None if name is None else str(record[name]))
        examples.append(Example(*values))
    return examples


def sort_labels(labels):
    """The label list of a training split: sorted as numbers when all are integers, else as text."""
    labels = set(labels)
    try:
        return sorted(labels, key=lambda x: (int(x), x))
    except ValueError:
        return sorted(labels)


class GlueDataset(Dataset):
    """A tokenized GLUE-style TSV: items are dicts of int64 tensors ``input_ids``,
    ``token_type_ids``, ``attention_mask`` (all [max_length]) and ``labels`` (scalar;
    float32 with `regression=True`, e.g. STS-B).

    Pairs are truncated longest-first and padded to `max_length`. The tokenizer is a
    `tokenizers.Tokenizer` or a path for `load_tokenizer`; it is copied, never changed.
    Padding uses [PAD], or the end-of-text token for tokenizers without one (GPT-2 style).
    """

    def __init__(self, path, tokenizer, max_length=128, label_list=None, regression=False, **read_args):
        self.examples = read_glue_tsv(path, **read_args)
        if not self.examples:
            raise DataError(f"{path}: no examples")
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        tok = Tokenizer.from_str(tok.to_str())  # private copy: padding/truncation settings
        special = special_token_ids(tok)
        pad_id = special["pad"] if special["pad"] is not None else special["eos"]
        if pad_id is None:
            raise DataError("the tokenizer has neither a [PAD] nor an end-of-text token to pad with")
        tok.enable_truncation(max_length, strategy="longest_first")
        tok.enable_padding(length=max_length, pad_id=pad_id, pad_token=tok.id_to_token(pad_id))

        self.regression = regression
        if regression:
            self.label_list = None
            try:
                labels = [float(e.label) for e in self.examples]
            except ValueError as exc:
                raise DataError(f"{path}: regression labels must be numbers ({exc})") from None
        else:
            found = {e.label for e in self.examples}
            self.label_list = list(label_list) if label_list is not None else sort_labels(found)
            index = {name: i for i, name in enumerate(self.label_list)}
            unknown = sorted(found - set(index))
            if unknown:
                raise DataError(f"{path}: labels {unknown} are not in the label list {self.label_list} "
                                "(the training split's labels): fix the file, or list every label in "
                                "data.glue.label_list")
            labels = [index[e.label] for e in self.examples]

        if self.examples[0].text_b is None:
            encodings = tok.encode_batch([e.text_a for e in self.examples])
        else:
            encodings = tok.encode_batch([(e.text_a, e.text_b) for e in self.examples])
        self.input_ids = torch.tensor(np.array([e.ids for e in encodings], dtype=np.int64))
        self.token_type_ids = torch.tensor(np.array([e.type_ids for e in encodings], dtype=np.int64))
        self.attention_mask = torch.tensor(np.array([e.attention_mask for e in encodings], dtype=np.int64))
        self.labels = torch.tensor(labels, dtype=torch.float32 if regression else torch.int64)

    @property
    def num_labels(self):
        return 1 if self.regression else len(self.label_list)

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return {"input_ids": self.input_ids[index], "token_type_ids": self.token_type_ids[index],
                "attention_mask": self.attention_mask[index], "labels": self.labels[index]}


# ---------------------------------------------------------------- bundled task


def build_next_sentence_task(corpus, out_dir, *, num_train=2000, num_dev=400, seed=0, dev_fraction=0.2):
    """Write a binary sentence-pair task from a corpus: ``train.tsv`` and ``dev.tsv``.

    Columns ``sentence1``, ``sentence2``, ``label``: label 1 when sentence2 is the sentence
    that follows sentence1 in the same document, 0 when it is a random sentence from another
    document (balanced 50/50). Train and dev come from disjoint documents. This is next
    sentence prediction posed as classification: negatives often differ in topic, so it is
    easier than coherence alone, and a BERT pretrained with NSP on the same corpus has seen
    the dev documents' text (not these labels). It exists to exercise fine-tuning on real
    text offline, not as a benchmark.
    """
    docs = [d for d in read_documents(corpus) if len(d) >= 2]
    if len(docs) < 4:
        raise DataError(f"the corpus needs at least 4 documents of 2+ sentences, has {len(docs)}")
    rng = random.Random(seed)
    rng.shuffle(docs)
    n_dev = min(max(2, int(round(dev_fraction * len(docs)))), len(docs) - 2)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, part, count in (("dev", docs[:n_dev], num_dev), ("train", docs[n_dev:], num_train)):
        rows = []
        for k in range(count):
            d = rng.randrange(len(part))
            i = rng.randrange(len(part[d]) - 1)
            if k % 2 == 0:
                b, label = part[d][i + 1], 1
            else:
                other = rng.randrange(len(part) - 1)
                other += other >= d  # any document but d
                b, label = rng.choice(part[other]), 0
            rows.append((part[d][i], b, label))
        rng.shuffle(rows)
        with open(out_dir / f"{name}.tsv", "w", encoding="utf-8", newline="") as f:
            f.write("sentence1\tsentence2\tlabel\n")
            for a, b, label in rows:
                f.write(f"{_clean(a)}\t{_clean(b)}\t{label}\n")
        counts[name] = len(rows)
    return counts


def _clean(text):
    return " ".join(text.replace("\t", " ").split())


def build_topic_task(corpus, out_dir, *, num_train=480, num_dev=160, seed=0, num_topics=4,
                     sentences_per_passage=2):
    """Write a topic classification task from a corpus: ``train.tsv`` and ``dev.tsv``.

    Columns ``sentence``, ``label``: a passage of `sentences_per_passage` consecutive sentences and
    the document it comes from, among the corpus's `num_topics` largest documents (for the bundled
    stdlib corpus: modules such as tkinter, decimal, turtle and the built-ins). Each label is named
    after its document's most distinctive word (tf-idf). Passages never overlap; train and dev hold
    different passages of the same documents, the same number per label (so the majority-class rate
    is 1 / num_topics), at most num_train / num_topics and num_dev / num_topics of them. This is what
    a small BERT pretrained on the same corpus can learn, unlike next-sentence prediction.
    Deterministic for a given corpus and seed. Returns {'train': n, 'dev': n, 'labels': [...]}.
    """
    docs = read_documents(corpus)
    if len(docs) < num_topics or num_topics < 2:
        raise DataError(f"the topic task needs at least {max(2, num_topics)} documents, the corpus has {len(docs)}")
    order = sorted(range(len(docs)), key=lambda i: (-len(docs[i]), i))[:num_topics]
    labels = _distinctive_words(docs, order)
    rng = random.Random(seed)
    per_dev, per_train = max(1, num_dev // num_topics), max(1, num_train // num_topics)
    passages = {}
    for index in order:
        doc = docs[index]
        chunks = [" ".join(doc[i:i + sentences_per_passage])
                  for i in range(0, len(doc) - sentences_per_passage + 1, sentences_per_passage)]
        rng.shuffle(chunks)
        passages[index] = chunks
    # Same count per label in each split: the smallest document decides.
    smallest = min(len(p) for p in passages.values())
    if smallest < 2:
        raise DataError(f"the topic task needs 2+ passages per document; one of the {num_topics} largest has "
                        f"{smallest}")
    n_dev = min(per_dev, smallest // 2)
    n_train = min(per_train, smallest - n_dev)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {"labels": [labels[i] for i in order]}
    for name, start, count in (("dev", 0, n_dev), ("train", n_dev, n_train)):
        rows = [(text, labels[i]) for i in order for text in passages[i][start:start + count]]
        rng.shuffle(rows)
        with open(out_dir / f"{name}.tsv", "w", encoding="utf-8", newline="") as f:
            f.write("sentence\tlabel\n")
            for text, label in rows:
                f.write(f"{_clean(text)}\t{label}\n")
        counts[name] = len(rows)
    return counts


def _distinctive_words(docs, chosen):
    """{document index: its highest tf-idf word (5+ letters), unique among `chosen`}."""
    words = [Counter(w.lower() for w in re.findall(r"[A-Za-z]{5,}", " ".join(doc))) for doc in docs]
    frequency = Counter(w for counts in words for w in counts)
    names, taken = {}, set()
    for index in chosen:
        ranked = sorted(words[index], key=lambda w: (-words[index][w] * math.log(len(docs) / frequency[w]), w))
        names[index] = next((w for w in ranked if w not in taken), f"document{index}")
        taken.add(names[index])
    return names
