"""Tokenizers, trained offline with the `tokenizers` library or loaded from disk.

* ``wordpiece``: BERT style (lower-cased by default, ``##`` continuation pieces), special
  tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` at ids 0..4; encodings get
  ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]`` with token type ids 0/1.
* ``bpe``: GPT-2 style byte-level BPE (no unknown tokens), one special token
  ``<|endoftext|>`` at id 0, no tokens added by `encode`.

The functions return a plain `tokenizers.Tokenizer`; `save_tokenizer` writes its
``tokenizer.json`` (plus ``vocab.txt`` for WordPiece so BERT tooling can read it).
"""

import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from orttrainer.run.data.common import DataError, as_path_list
from orttrainer.run.data.sources import check_utf8

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
EOS_TOKEN = "<|endoftext|>"
KINDS = ("wordpiece", "bpe")


def _bert_pipeline(model, lowercase):
    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=None,
                                                clean_text=True, handle_chinese_chars=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def _bert_post_processor(tok):
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    if cls is None or sep is None:
        raise DataError("a WordPiece vocabulary needs the [CLS] and [SEP] tokens")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])


def _bpe_pipeline(model):
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _train(tok, trainer, files, texts):
    if files is not None:
        tok.train(files, trainer)
    else:
        tok.train_from_iterator(texts, trainer)


def _train_wordpiece(files, texts, vocab_size, min_frequency, lowercase):
    # tokenizers' WordPiece trainer gives the "##x" pieces ids in hash-map order, which
    # changes merges on count ties: two runs differ (huggingface/tokenizers#1794). Fixing
    # their ids up front -- as extra special tokens, in sorted order -- makes training
    # deterministic; the tokenizer is then rebuilt from the vocabulary with only the real
    # special tokens.
    def trainer(size, special):
        return trainers.WordPieceTrainer(vocab_size=size, min_frequency=min_frequency, special_tokens=special,
                                         continuing_subword_prefix="##", show_progress=False)

    probe = _bert_pipeline(models.WordPiece(unk_token="[UNK]"), lowercase)
    _train(probe, trainer(1, BERT_SPECIAL_TOKENS), files, texts)  # vocab = specials + alphabet
    alphabet = sorted(t for t in probe.get_vocab() if t not in BERT_SPECIAL_TOKENS)
    tok = _bert_pipeline(models.WordPiece(unk_token="[UNK]"), lowercase)
    _train(tok, trainer(vocab_size, BERT_SPECIAL_TOKENS + ["##" + c for c in alphabet]), files, texts)
    vocab = tok.get_vocab()
    model = models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##")
    tok = _bert_pipeline(model, lowercase)
    tok.add_special_tokens(BERT_SPECIAL_TOKENS)
    _bert_post_processor(tok)
    return tok


def train_tokenizer(files=None, kind="wordpiece", vocab_size=8192, min_frequency=2, lowercase=True,
                    texts=None):
    """Train a tokenizer on text files (a path or list of paths) or on `texts` (an iterable
    of strings); returns a `tokenizers.Tokenizer`.

    `lowercase` applies to WordPiece only (byte-level BPE is always cased). Training is
    deterministic: the same input and settings give the same tokenizer.json.
    """
    if kind not in KINDS:
        raise DataError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(KINDS)}")
    if vocab_size < 1:
        raise DataError(f"vocab_size must be positive, got {vocab_size}")
    if (files is None) == (texts is None):
        raise DataError("train_tokenizer needs exactly one of files= or texts=")
    if files is not None:
        files = as_path_list(files)
        for f in files:
            if not os.path.isfile(f):
                raise DataError(f"corpus file not found: {f}")
            check_utf8(f)  # the Rust trainer's decode error names no file
    if kind == "wordpiece":
        texts = None if texts is None else list(texts)  # read twice
        return _train_wordpiece(files, texts, vocab_size, min_frequency, lowercase)
    tok = _bpe_pipeline(models.BPE())
    _train(tok, trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                    special_tokens=[EOS_TOKEN], show_progress=False,
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()), files, texts)
    return tok


def save_tokenizer(tok, out_dir):
    """Write ``tokenizer.json`` (and ``vocab.txt`` for WordPiece) into `out_dir`; returns the json path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tok.save(str(path))
    if isinstance(tok.model, models.WordPiece):
        vocab = tok.get_vocab()
        with open(out_dir / "vocab.txt", "w", encoding="utf-8") as f:
            f.writelines(t + "\n" for t in sorted(vocab, key=vocab.get))
    return path


def _vocab_is_cased(vocab_path):
    with open(vocab_path, encoding="utf-8") as f:
        return any(any(c.isupper() for c in line.strip()) and not line.startswith("[") for line in f)


def load_tokenizer(path, lowercase=None):
    """Load a tokenizer from a ``tokenizer.json``, a BERT ``vocab.txt``, or a folder holding
    one of those (or GPT-2's ``vocab.json`` + ``merges.txt``).

    For a ``vocab.txt``, `lowercase=None` guesses from the vocabulary: lower-case unless it
    contains upper-case tokens (as bert-base-cased's does).
    """
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "vocab.txt"):
            if (path / name).is_file():
                return load_tokenizer(path / name, lowercase)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            tok = _bpe_pipeline(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
            if tok.token_to_id(EOS_TOKEN) is not None:
                tok.add_special_tokens([EOS_TOKEN])
            return tok
        raise DataError(f"no tokenizer.json, vocab.txt or vocab.json+merges.txt in {path}")
    if not path.is_file():
        raise DataError(f"tokenizer not found: {path}")
    if path.suffix == ".txt":
        if lowercase is None:
            lowercase = not _vocab_is_cased(path)
        tok = _bert_pipeline(models.WordPiece.from_file(str(path), unk_token="[UNK]"), lowercase)
        tok.add_special_tokens([t for t in BERT_SPECIAL_TOKENS if tok.token_to_id(t) is not None])
        _bert_post_processor(tok)
        return _check_unknown_token(tok, path)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception on bad json
        raise DataError(f"cannot read tokenizer {path}: {exc}") from None
    return _check_unknown_token(tok, path)


def _check_unknown_token(tok, path):
    """A WordPiece (or WordLevel) vocabulary maps every word it cannot split to its unknown token:
    without that token in the vocabulary the first such word fails deep in the Rust encoder."""
    unk = getattr(tok.model, "unk_token", None) if isinstance(tok.model, (models.WordPiece, models.WordLevel)) \
        else None
    if unk is not None and tok.token_to_id(unk) is None:
        raise DataError(f"{path}: the {type(tok.model).__name__} vocabulary has no {unk} token, which every word "
                        f"it cannot split becomes; add {unk} to the vocabulary")
    return tok


def special_token_ids(tok):
    """Ids of the special tokens this tokenizer has: keys pad, unk, cls, sep, mask, eos (None if absent)."""
    names = {"pad": ["[PAD]", "<pad>"], "unk": ["[UNK]", "<unk>"], "cls": ["[CLS]", "<s>"],
             "sep": ["[SEP]", "</s>"], "mask": ["[MASK]", "<mask>"], "eos": [EOS_TOKEN, "</s>", "[SEP]"]}
    out = {}
    for key, candidates in names.items():
        out[key] = next((i for i in map(tok.token_to_id, candidates) if i is not None), None)
    return out


def tokenizer_info(tok):
    """A JSON-able summary (kind, vocab size, special ids) for metadata sidecars."""
    kind = {"WordPiece": "wordpiece", "BPE": "bpe"}.get(type(tok.model).__name__, type(tok.model).__name__)
    return {"kind": kind, "vocab_size": tok.get_vocab_size(), "special_ids": special_token_ids(tok)}


def resolve_tokenizer(tokenizer, kind, vocab_size, out_dir, files=None, texts=None):
    """The tokenizer a builder should use: `tokenizer` itself (a `Tokenizer`), loaded from
    it (a path), or -- when None -- trained on `files`/`texts` and saved into `out_dir`.
    Returns (Tokenizer, path it was loaded from or saved to, or None)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer, None
    if tokenizer is not None:
        return load_tokenizer(tokenizer), os.fspath(tokenizer)
    tok = train_tokenizer(files=files, texts=texts, kind=kind, vocab_size=vocab_size)
    return tok, str(save_tokenizer(tok, out_dir))
