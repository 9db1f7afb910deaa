"""Which build a data folder's files come from, so that training never mixes two builds.

A build writes a random ``build_id`` and the digest of its tokenizer into its metadata (BERT's
``metadata.json``, GPT's ``.json`` sidecars) and the ``build_id`` into each HDF5 shard's attributes.
Training checks them (`check_bert`, `check_gpt`): shards of another build, a tokenizer file replaced
by another one, or a token file that is not the one its sidecar describes is a one-line error that
says to rebuild. Data built before this existed has no ``build_id``: it is accepted with one warning.
"""

import hashlib
import json
import uuid
import warnings
from pathlib import Path

from orttrainer.run.data.common import DataError

_warned = set()


def new_build_id():
    return uuid.uuid4().hex


def tokenizer_digest(path):
    """A tokenizer's identity: its parsed JSON (sorted keys, compact), so the compact copy a checkpoint
    holds names the same data as the pretty file it was saved from; other files: their bytes."""
    path = Path(path)
    if path.is_dir():
        path = next((path / n for n in ("tokenizer.json", "vocab.txt", "vocab.json") if (path / n).is_file()), path)
    if path.suffix == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                return string_digest(json.dumps(json.load(f), sort_keys=True, separators=(",", ":"),
                                                ensure_ascii=False))
        except (OSError, ValueError):
            pass  # load_tokenizer reports what is wrong with it
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def string_digest(tokenizer_json):
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]


def object_digest(tok):
    """`tokenizer_digest` of a `tokenizers.Tokenizer` held in memory."""
    return string_digest(json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"),
                                    ensure_ascii=False))


def _rebuild(where):
    return f"; the folder mixes two builds: rebuild it (delete {where} and run the build again)"


def _legacy(where, meta):
    if meta.get("build_id"):
        return False
    if where not in _warned:
        _warned.add(where)
        warnings.warn(f"{where} was built by an earlier orttrainer (no build_id in its metadata): its shards "
                      "and tokenizer cannot be checked to belong together; rebuild it to get the check",
                      stacklevel=3)
    return True


def _check_tokenizer(meta, meta_file, tokenizer, where):
    """The tokenizer named by the metadata must be the one built with; a tokenizer given instead must
    at least have the same vocabulary size."""
    if tokenizer is None:
        return
    own = meta.get("tokenizer")
    if own and Path(own).resolve() == Path(tokenizer).resolve():
        if meta.get("tokenizer_sha256") and tokenizer_digest(tokenizer) != meta["tokenizer_sha256"]:
            raise DataError(f"{tokenizer} is not the tokenizer {meta_file} was built with (its digest "
                            f"differs){_rebuild(where)}")
    if meta.get("vocab_size") is not None:
        from orttrainer.run.data.tokenizer import load_tokenizer

        size = load_tokenizer(tokenizer).get_vocab_size()
        if size != int(meta["vocab_size"]):
            raise DataError(f"the tokenizer {tokenizer} has {size} tokens but {meta_file} says the data was "
                            f"built with {meta['vocab_size']}{_rebuild(where)}")


def check_bert(folder, meta, dataset, tokenizer, eval_dataset=None):
    """`meta`: the folder's metadata.json (tokenizer path resolved); `dataset`: its training shards."""
    folder = Path(folder)
    meta_file = folder / "metadata.json"
    if _legacy(str(folder), meta):
        return
    listed = sorted(n for n in meta.get("shards", {}) if "eval" not in n)
    found = sorted(Path(f).name for f in dataset.files)
    if found != listed:
        raise DataError(f"{folder} holds training shards {found}, {meta_file} lists {listed}{_rebuild(folder)}")
    shards = [dataset, eval_dataset] if eval_dataset is not None else [dataset]
    for path, build in ((p, b) for d in shards for p, b in zip(d.files, d.build_ids)):
        if build != meta["build_id"]:
            raise DataError(f"{path} comes from another build than {meta_file}{_rebuild(folder)}")
    _check_tokenizer(meta, meta_file, tokenizer, folder)


def check_gpt(path, dataset, tokenizer, eval_dataset=None):
    """A token file against its sidecar (and the eval file's sidecar against the training one's)."""
    meta = dataset.meta
    side = Path(path).with_suffix(".json")
    if not meta or _legacy(str(path), meta):  # a bare .npy of the user's has nothing to check against
        return
    if int(meta.get("num_tokens", -1)) != len(dataset.tokens):
        raise DataError(f"{path} holds {len(dataset.tokens)} tokens, its sidecar {side} says "
                        f"{meta.get('num_tokens')}{_rebuild(path)}")
    if eval_dataset is not None and eval_dataset.meta.get("build_id") != meta["build_id"]:
        raise DataError(f"the evaluation tokens next to {path} come from another build{_rebuild(path)}")
    _check_tokenizer(meta, side, tokenizer, path)
