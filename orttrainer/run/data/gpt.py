"""GPT language-modelling data: a flat token file and a dataset of fixed-length blocks.

Builder: documents from ``.txt`` files (blank-line-separated blocks, lines kept as they
are -- the format ``orttrainer data corpus`` writes) or ``.jsonl`` files (one JSON object
per line, text in `text_field`) are tokenized without added specials, each followed by
the end-of-text token, and concatenated into one ``.npy`` array (uint16 when the vocab
fits, else int32) with a ``.json`` sidecar next to it (vocab size, tokenizer, eos id,
token count, default block size).

Reader: `GPTBlockDataset` cuts the stream into consecutive non-overlapping blocks. By
default ``labels`` equals ``input_ids``: Hugging Face's ``GPT2LMHeadModel`` shifts labels
inside its forward. With ``shift_labels=True`` blocks are ``block_size + 1`` tokens apart
by ``block_size`` and ``labels`` is the input shifted left by one, for models that do not
shift themselves. The tail shorter than a block is dropped.
"""

import os
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from orttrainer.run.data.common import DataError, as_path_list, dump_json, load_json, relative_to, resolve_from
from orttrainer.run.data.manifest import new_build_id, object_digest, tokenizer_digest
from orttrainer.run.data.sources import check_utf8, iter_records
from orttrainer.run.data.tokenizer import resolve_tokenizer, tokenizer_info

_BATCH = 1000  # documents per encode_batch call: bounded memory, still parallel


def iter_texts(paths, text_field="text"):
    """Yield document strings from .txt (blank-line-separated) and .jsonl files."""
    for path in as_path_list(paths):
        if not os.path.isfile(path):
            raise DataError(f"corpus file not found: {path}")
        if path.endswith(".jsonl"):
            yield from (text for text in iter_records(path, text_field) if text)
            continue
        check_utf8(path)
        with open(path, encoding="utf-8") as f:
            block = []
            for line in f:
                if line.strip():
                    block.append(line.rstrip("\n"))
                elif block:
                    yield "\n".join(block)
                    block = []
            if block:
                yield "\n".join(block)


def _batches(iterable, size):
    batch = []
    for item in iterable:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 65536 else np.int32


def sidecar_path(npy_path):
    return Path(npy_path).with_suffix(".json")


def build_gpt_tokens(corpus, out_path, tokenizer=None, *, text_field="text", block_size=128,
                     eval_fraction=0.0, seed=1234, vocab_size=8192):
    """Tokenize corpus file(s) into `out_path` (``.npy``) plus its ``.json`` sidecar.

    `tokenizer`: a `tokenizers.Tokenizer`, a path, or None to train a byte-level BPE of
    `vocab_size` on the corpus (saved to ``<out stem>_tokenizer/``). With `eval_fraction`
    > 0, whole documents picked by ``random.Random(seed)`` go to ``<out stem>.eval.npy``
    instead. `block_size` is only recorded as the reader's default. Returns the sidecar dict.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    out_path = Path(out_path)
    if out_path.suffix != ".npy":
        raise DataError(f"the output must be a .npy file, got {out_path}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    files = as_path_list(corpus)
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"corpus file not found: {f}")
    tok_dir = out_path.with_name(out_path.stem + "_tokenizer")
    tok, tok_path = resolve_tokenizer(tokenizer, "bpe", vocab_size, tok_dir,
                                      texts=(t for t in iter_texts(files, text_field)))
    info = tokenizer_info(tok)
    eos_id = info["special_ids"]["eos"]
    if eos_id is None:
        raise DataError("the tokenizer has no end-of-text token (<|endoftext|>, </s> or [SEP])")

    dtype = token_dtype(info["vocab_size"])
    rng = random.Random(seed)
    chunks = {"train": [], "eval": []}
    documents = {"train": 0, "eval": 0}
    eos = np.array([eos_id], dtype=dtype)
    for batch in _batches(iter_texts(files, text_field), _BATCH):
        # Split by whole documents; one rng draw per document keeps it reproducible.
        split = ["eval" if eval_fraction and rng.random() < eval_fraction else "train" for _ in batch]
        for name, enc in zip(split, tok.encode_batch(batch, add_special_tokens=False)):
            chunks[name] += [np.asarray(enc.ids, dtype=dtype), eos]
            documents[name] += 1
    if not documents["train"]:
        raise DataError(f"no text found in {', '.join(files)}")
    meta = {"format": "orttrainer-gpt-tokens", "dtype": np.dtype(dtype).name, "eos_id": eos_id,
            "block_size": block_size, "corpus": [os.path.abspath(f) for f in files],
            "text_field": text_field, "tokenizer": relative_to(tok_path, out_path.parent), **info,
            "build_id": new_build_id(),
            "tokenizer_sha256": tokenizer_digest(tok_path) if tok_path else object_digest(tok)}
    for name in ("eval", "train"):
        if not documents[name]:
            continue
        path = out_path if name == "train" else out_path.with_name(out_path.stem + ".eval.npy")
        tokens = np.concatenate(chunks.pop(name))
        split_meta = dict(meta, split=name, num_tokens=int(tokens.size), num_documents=documents[name])
        np.save(path, tokens)
        dump_json(sidecar_path(path), split_meta)
    return split_meta


class GPTBlockDataset(Dataset):
    """Fixed-length blocks of a token file written by `build_gpt_tokens` (memory-mapped).

    Items: ``{"input_ids": LongTensor[block_size], "labels": LongTensor[block_size]}``.
    `block_size` defaults to the sidecar's. See the module docstring for `shift_labels`.
    `meta` is the sidecar (``vocab_size``, ``eos_id``, ``tokenizer`` as an absolute path...).
    """

    def __init__(self, path, block_size=None, shift_labels=False):
        path = Path(path)
        meta = load_json(sidecar_path(path)) if sidecar_path(path).is_file() else {}
        if meta.get("tokenizer"):
            meta["tokenizer"] = resolve_from(meta["tokenizer"], path.parent)
        self.block_size = int(block_size or meta.get("block_size") or 0)
        if self.block_size < 1:
            raise DataError(f"no block_size given and none recorded in {sidecar_path(path)}")
        try:
            self.tokens = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read token file {path}: {exc}") from None
        if self.tokens.ndim != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise DataError(f"{path}: expected a 1-D integer array, "
                            f"got {self.tokens.dtype} {self.tokens.shape}")
        self.meta = meta
        self.shift_labels = shift_labels
        self._num = (len(self.tokens) - int(shift_labels)) // self.block_size
        if self._num < 1:
            raise DataError(f"{path} has {len(self.tokens)} tokens: "
                            f"fewer than one block of {self.block_size}")

    def __len__(self):
        return self._num

    def __getitem__(self, index):
        if index < 0:
            index += self._num
        if not 0 <= index < self._num:
            raise IndexError(index)
        start = index * self.block_size
        block = torch.from_numpy(self.tokens[start:start + self.block_size + int(self.shift_labels)]
                                 .astype(np.int64))
        if self.shift_labels:
            return {"input_ids": block[:-1], "labels": block[1:]}
        return {"input_ids": block, "labels": block.clone()}
