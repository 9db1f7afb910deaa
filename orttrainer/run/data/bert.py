"""BERT pretraining data in NVIDIA's HDF5 shard format: builder and reader.

The builder follows Google's / NVIDIA's ``create_pretraining_data.py``: documents are cut
into segment pairs up to ``max_seq_length - 3`` tokens (10% shorter, ``short_seq_prob``),
B is the true continuation or -- with probability 0.5, and always when the chunk has a
single segment, as in the original -- text from another document (then
``next_sentence_labels = 1``); 15% of the tokens (at most ``max_predictions_per_seq``,
never [CLS]/[SEP]) are picked for prediction and replaced by [MASK] 80% of the time, a
random token 10%, kept 10%. Random replacements are drawn from the non-special tokens
(the original draws from the whole vocabulary, specials included). Whole-word masking is
not implemented. All randomness comes from ``random.Random(seed)``: same corpus,
tokenizer and arguments -> identical files.

Each shard holds, like NVIDIA's (``N`` instances, ``L = max_seq_length``,
``P = max_predictions_per_seq``; all gzip-compressed):

==========================  =========  ======  ========================================
dataset                     shape      dtype   meaning
==========================  =========  ======  ========================================
``input_ids``               (N, L)     int32   token ids, padded with [PAD]
``input_mask``              (N, L)     int8    1 for real tokens, 0 for padding
``segment_ids``             (N, L)     int8    0 for [CLS] A [SEP], 1 for B [SEP]
``masked_lm_positions``     (N, P)     int32   positions of predicted tokens, 0-padded
``masked_lm_ids``           (N, P)     int32   their original ids, 0-padded
``next_sentence_labels``    (N,)       int8    1 if B is random text, 0 if it follows A
==========================  =========  ======  ========================================

Position 0 is always [CLS], which is never predicted, so a 0 in ``masked_lm_positions``
marks the end of the predictions (NVIDIA's loader relies on that too). The reader accepts
any integer dtypes.
"""

import bisect
import os
import random
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from orttrainer.run.data.common import DataError, as_path_list, dump_json, load_json, relative_to, resolve_from
from orttrainer.run.data.corpus import read_documents
from orttrainer.run.data.manifest import new_build_id, object_digest, tokenizer_digest
from orttrainer.run.data.tokenizer import resolve_tokenizer, special_token_ids, tokenizer_info

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
        "next_sentence_labels")
_DTYPES = {"input_ids": "i4", "input_mask": "i1", "segment_ids": "i1", "masked_lm_positions": "i4",
           "masked_lm_ids": "i4", "next_sentence_labels": "i1"}
TRAIN_PATTERN = "training_shard_{:04d}.hdf5"
EVAL_FILE = "eval_shard_0000.hdf5"


# ---------------------------------------------------------------- builder


def _truncate_pair(a, b, max_tokens, rng):
    # Trim the longer side, from the front or the back at random (as the original does).
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _instances_from_document(documents, index, max_seq_length, short_seq_prob, rng):
    """(tokens_a, tokens_b, is_random_next) pairs cut from documents[index] (lists of ids)."""
    document = documents[index]
    max_tokens = max_seq_length - 3
    target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    pairs, chunk, length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = [t for seg in chunk[:a_end] for t in seg]
            b = []
            is_random = len(chunk) == 1 or rng.random() < 0.5
            if is_random:
                for _ in range(10):
                    other = rng.randint(0, len(documents) - 1)
                    if other != index:
                        break
                other_doc = documents[other]
                for seg in other_doc[rng.randint(0, len(other_doc) - 1):]:
                    b.extend(seg)
                    if len(b) >= target - len(a):
                        break
                i -= len(chunk) - a_end  # the unused segments start the next chunk
            else:
                b = [t for seg in chunk[a_end:] for t in seg]
            _truncate_pair(a, b, max_tokens, rng)
            if a and b:
                pairs.append((a, b, is_random))
            chunk, length = [], 0
        i += 1
    return pairs


def _mask(tokens, special, replace_ids, masked_lm_prob, max_predictions, rng):
    """Masks `tokens` in place; returns (positions, original ids), sorted by position."""
    candidates = [i for i, t in enumerate(tokens) if t != special["cls"] and t != special["sep"]]
    count = min(max_predictions, len(candidates), max(1, int(round(len(tokens) * masked_lm_prob))))
    picked = sorted(rng.sample(candidates, count))  # = shuffle + take `count`, cheaper
    originals = [tokens[i] for i in picked]
    for i in picked:
        if rng.random() < 0.8:
            tokens[i] = special["mask"]
        elif rng.random() < 0.5:
            pass  # keep the original token
        else:
            tokens[i] = replace_ids[rng.randint(0, len(replace_ids) - 1)]
    return picked, originals


def _tokenize_documents(tok, documents):
    flat = [s for doc in documents for s in doc]
    ids = [e.ids for e in tok.encode_batch(flat, add_special_tokens=False)]
    out, k = [], 0
    for doc in documents:
        segs = [s for s in ids[k:k + len(doc)] if s]
        k += len(doc)
        if segs:
            out.append(segs)
    return out


def _make_instances(documents, special, replace_ids, *, max_seq_length, max_predictions_per_seq,
                    masked_lm_prob, short_seq_prob, dupe_factor, rng):
    L, P = max_seq_length, max_predictions_per_seq
    instances = []
    for _ in range(dupe_factor):
        for index in range(len(documents)):
            instances.extend(_instances_from_document(documents, index, L, short_seq_prob, rng))
    rng.shuffle(instances)
    n = len(instances)
    arrays = {k: np.zeros((n, L) if k in ("input_ids", "input_mask", "segment_ids") else (n, P),
                          dtype=_DTYPES[k]) for k in KEYS[:5]}
    arrays["input_ids"][:] = special["pad"]
    arrays["next_sentence_labels"] = np.zeros(n, dtype=_DTYPES["next_sentence_labels"])
    for row, (a, b, is_random) in enumerate(instances):
        tokens = [special["cls"], *a, special["sep"], *b, special["sep"]]
        positions, originals = _mask(tokens, special, replace_ids, masked_lm_prob, P, rng)
        arrays["input_ids"][row, :len(tokens)] = tokens
        arrays["input_mask"][row, :len(tokens)] = 1
        arrays["segment_ids"][row, len(a) + 2:len(tokens)] = 1
        arrays["masked_lm_positions"][row, :len(positions)] = positions
        arrays["masked_lm_ids"][row, :len(originals)] = originals
        arrays["next_sentence_labels"][row] = int(is_random)
    return arrays


def write_shard(path, arrays, build_id=None):
    """Write one HDF5 shard (dict of the six arrays) in NVIDIA's layout; `build_id` as an attribute."""
    with h5py.File(path, "w") as f:
        if build_id:
            f.attrs["orttrainer_build_id"] = build_id
        for key in KEYS:
            f.create_dataset(key, data=np.asarray(arrays[key], dtype=_DTYPES[key]), compression="gzip")


def build_bert_shards(corpus, out_dir, tokenizer=None, *, max_seq_length=128, max_predictions_per_seq=20,
                      masked_lm_prob=0.15, short_seq_prob=0.1, dupe_factor=5, num_shards=1, seed=12345,
                      eval_fraction=0.0, vocab_size=8192):
    """Build NVIDIA-format pretraining shards from corpus file(s) into `out_dir`.

    `tokenizer`: a `tokenizers.Tokenizer`, a path (tokenizer.json / vocab.txt / folder), or
    None to train a WordPiece tokenizer of `vocab_size` on the corpus (saved to
    ``out_dir/tokenizer/``). Writes ``training_shard_XXXX.hdf5`` files (instances split
    evenly), ``eval_shard_0000.hdf5`` when `eval_fraction` > 0 (built from held-out whole
    documents), and ``metadata.json``. Returns the metadata dict.
    """
    if max_seq_length < 8:
        raise DataError(f"max_seq_length must be at least 8, got {max_seq_length}")
    if not 1 <= max_predictions_per_seq <= max_seq_length:
        raise DataError(f"max_predictions_per_seq must be in 1..{max_seq_length}, "
                        f"got {max_predictions_per_seq}")
    if num_shards < 1 or dupe_factor < 1:
        raise DataError("num_shards and dupe_factor must be at least 1")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    files = as_path_list(corpus)
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"corpus file not found: {f}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_earlier_build(out_dir)
    tok, tok_path = resolve_tokenizer(tokenizer, "wordpiece", vocab_size, out_dir / "tokenizer", files=files)
    special = special_token_ids(tok)
    missing = [k for k in ("pad", "cls", "sep", "mask") if special[k] is None]
    if missing:
        raise DataError(f"the tokenizer has no {'/'.join(missing)} token; BERT data needs a WordPiece "
                        "tokenizer with [PAD] [CLS] [SEP] [MASK]")
    special_ids = {i for i in special.values() if i is not None}
    replace_ids = [i for i in range(tok.get_vocab_size()) if i not in special_ids]

    documents = _tokenize_documents(tok, read_documents(files))
    if len(documents) < 2:
        raise DataError(f"the corpus has {len(documents)} non-empty document(s); need at least 2 "
                        "(documents are separated by blank lines)")
    rng = random.Random(seed)
    rng.shuffle(documents)
    n_eval = int(round(eval_fraction * len(documents)))
    if eval_fraction > 0:
        n_eval = min(max(n_eval, 2), len(documents) - 2)
    splits = {"training": documents[n_eval:], "eval": documents[:n_eval]}
    options = dict(max_seq_length=max_seq_length, max_predictions_per_seq=max_predictions_per_seq,
                   masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob)

    meta = {"format": "nvidia-bert-hdf5", **options, "dupe_factor": dupe_factor, "seed": seed,
            "corpus": [os.path.abspath(f) for f in files], "tokenizer": relative_to(tok_path, out_dir),
            **tokenizer_info(tok), "shards": {}, "build_id": new_build_id(),
            "tokenizer_sha256": tokenizer_digest(tok_path) if tok_path else object_digest(tok)}
    for split, docs in splits.items():
        if not docs:
            continue
        arrays = _make_instances(docs, special, replace_ids, dupe_factor=dupe_factor, rng=rng, **options)
        n = len(arrays["input_ids"])
        bounds = np.linspace(0, n, num_shards + 1).astype(int) if split == "training" else [0, n]
        for k in range(len(bounds) - 1):
            name = TRAIN_PATTERN.format(k) if split == "training" else EVAL_FILE
            write_shard(out_dir / name, {key: a[bounds[k]:bounds[k + 1]] for key, a in arrays.items()},
                        meta["build_id"])
            meta["shards"][name] = int(bounds[k + 1] - bounds[k])
        meta[f"{split}_random_next_fraction"] = round(float(arrays["next_sentence_labels"].mean()), 4)
    dump_json(out_dir / "metadata.json", meta)
    return meta


def _remove_earlier_build(out_dir):
    """Delete the shards and metadata an earlier build wrote here (its metadata.json lists them), so
    that none of them is read with this build's (say, 2 shards then, 1 now)."""
    try:
        meta = load_json(out_dir / "metadata.json")
    except DataError:
        return
    for name in [*meta.get("shards", {}), "metadata.json"]:
        if Path(name).name == name:  # a plain file name of this folder, nothing else
            (out_dir / name).unlink(missing_ok=True)


# ---------------------------------------------------------------- reader


def read_metadata(out_dir):
    """The ``metadata.json`` of a shard folder, with its tokenizer path made absolute."""
    meta = load_json(Path(out_dir) / "metadata.json")
    meta["tokenizer"] = resolve_from(meta.get("tokenizer"), out_dir)
    return meta


def find_shards(path, split="training"):
    """Shard files for `split` ("training", "eval" or NVIDIA's "test"): `path` itself if it is
    a file, else the sorted ``*.hdf5``/``*.h5`` files in that folder whose name contains `split`."""
    path = Path(path)
    if path.is_file():
        return [str(path)]
    if not path.is_dir():
        raise DataError(f"no such shard file or folder: {path}")
    files = sorted(str(p) for p in path.iterdir()
                   if p.suffix in (".hdf5", ".h5") and split in p.name and p.is_file())
    if not files:
        raise DataError(f"no {split} .hdf5 shards in {path}")
    return files


class BertPretrainingDataset(Dataset):
    """NVIDIA BERT pretraining shards as a map-style dataset.

    `paths`: a shard file, a list of them, or a folder (its ``*training*`` shards). All
    shards are read into memory at construction (int32/int8, ~0.5 KB per 128-token
    instance); for corpora larger than memory, make one dataset per shard as NVIDIA's
    trainer does. Items are dicts of int64 tensors, as Hugging Face's
    ``BertForPreTraining`` takes them: ``input_ids``, ``token_type_ids``,
    ``attention_mask``, ``labels`` ([L], -100 where nothing is predicted) and
    ``next_sentence_label`` (scalar; 1 = B is random).
    """

    def __init__(self, paths, split="training"):
        if isinstance(paths, (str, os.PathLike)):
            paths = find_shards(paths, split)
        self.files = as_path_list(paths)
        self._arrays, self._offsets, self.build_ids, total = [], [], [], 0
        for path in self.files:
            arrays, build_id = self._read(path)
            self.build_ids.append(build_id)
            self._arrays.append(arrays)
            self._offsets.append(total)
            total += len(arrays["input_ids"])
        self._len = total
        shapes = {a["input_ids"].shape[1:] for a in self._arrays}
        if len(shapes) > 1:
            raise DataError(f"shards have different sequence lengths: {sorted(s[0] for s in shapes)}")

    @staticmethod
    def _read(path):
        try:
            with h5py.File(path, "r") as f:
                missing = [k for k in KEYS if k not in f]
                if missing:
                    raise DataError(f"{path}: not a BERT pretraining shard (missing {', '.join(missing)})")
                arrays = {k: np.asarray(f[k][:]) for k in KEYS}
                build_id = f.attrs.get("orttrainer_build_id")
        except OSError as exc:
            raise DataError(f"cannot read HDF5 shard {path}: {exc}") from None
        n = len(arrays["input_ids"])
        for k, a in arrays.items():
            if not np.issubdtype(a.dtype, np.integer) or len(a) != n:
                raise DataError(f"{path}: dataset {k} has dtype {a.dtype} and {len(a)} rows; "
                                f"expected integers and {n} rows")
        arrays["next_sentence_labels"] = arrays["next_sentence_labels"].reshape(n)
        return arrays, None if build_id is None else str(build_id)

    @property
    def max_seq_length(self):
        return int(self._arrays[0]["input_ids"].shape[1]) if self._arrays else 0

    def __len__(self):
        return self._len

    def __getitem__(self, index):
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(index)
        shard = bisect.bisect_right(self._offsets, index) - 1
        a = self._arrays[shard]
        row = index - self._offsets[shard]
        positions = a["masked_lm_positions"][row].astype(np.int64)
        ids = a["masked_lm_ids"][row].astype(np.int64)
        # The first 0 position ends the predictions (position 0 is [CLS], never predicted).
        zeros = np.flatnonzero(positions == 0)
        count = int(zeros[0]) if len(zeros) else len(positions)
        labels = np.full(a["input_ids"].shape[1], -100, dtype=np.int64)
        labels[positions[:count]] = ids[:count]
        return {
            "input_ids": torch.from_numpy(a["input_ids"][row].astype(np.int64)),
            "token_type_ids": torch.from_numpy(a["segment_ids"][row].astype(np.int64)),
            "attention_mask": torch.from_numpy(a["input_mask"][row].astype(np.int64)),
            "labels": torch.from_numpy(labels),
            "next_sentence_label": torch.tensor(int(a["next_sentence_labels"][row]), dtype=torch.int64),
        }
