"""The data a recipe trains on: built from its corpus into a cache on first use, then read.

Everything is built with the `orttrainer.run.data` builders (what `orttrainer data ...` runs) into
``data.cache_dir`` (default ``runs/data/``), one folder per set of build settings, named by a hash
of them, so a second run -- or another recipe with the same settings (phase 1 and phase 2 share
the corpus and tokenizer) -- reuses it::

    runs/data/corpus/stdlib-py3.12.txt          the bundled corpus (per Python version)
    runs/data/tokenizer-wordpiece-4096-<hash>/  tokenizer.json (+ vocab.txt)
    runs/data/bert-seq128-<hash>/               training_shard_0000.hdf5, eval_shard_0000.hdf5, metadata.json
    runs/data/gpt-seq128-<hash>/                tokens.npy, tokens.eval.npy (+ .json sidecars)
    runs/data/glue-topic-<hash>/                train.tsv, dev.tsv (glue-nsp-<hash>: next-sentence)

Each folder is built under a temporary name and renamed when complete: an interrupted build is
never mistaken for a finished one. ``data.path`` skips building and reads prebuilt data.
"""

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orttrainer.run.data.common import DataError
from orttrainer.run.recipe.spec import RecipeError

STDLIB = "stdlib"
LABELS_FILE = "labels.json"  # {"labels": [...]}: label ids of a classification data folder


@dataclass
class PreparedData:
    train: object                 # a torch Dataset of dicts of tensors
    eval: object | None
    tokenizer: str | None         # the tokenizer file (copied into checkpoints)
    vocab_size: int | None
    special: dict                 # special token ids (pad, eos, ...)
    seq_length: int
    label_list: list | None
    description: str
    seconds: float


def _hash(*parts):
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _tokenizer_hash(path):
    from orttrainer.run.data.manifest import tokenizer_digest

    return tokenizer_digest(path)


def _build_atomically(target, build, log, what):
    """Run build(tmp_dir) and rename tmp_dir to `target`; skip when `target` exists."""
    target = Path(target)
    if target.exists():
        return target
    log(f"data: building {what} -> {target}")
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.exists():  # another process finished the same build first: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _corpus(data, cache, log, kind):
    """(corpus files, key identifying their content for cache names). Folders, globs, JSONL and tables
    are expanded / converted to text files (see orttrainer.run.data.sources)."""
    from orttrainer.run.data.sources import check_text, expand_corpus, needs_conversion, plain_text_files

    corpus = data.corpus
    files = [corpus] if isinstance(corpus, str) else list(corpus)
    if files == [STDLIB] and not os.path.exists(STDLIB):
        from orttrainer.run.data.corpus import build_corpus

        version = f"py{sys.version_info.major}.{sys.version_info.minor}"
        max_mb = data.corpus_max_mb
        name = f"stdlib-{version}" + (f"-{max_mb:g}mb" if max_mb else "") + ".txt"
        path = cache / "corpus" / name
        if not path.is_file():
            log(f"data: building the stdlib documentation corpus -> {path}")
            stats = build_corpus(path, None if max_mb is None else int(max_mb * 1e6))
            log(f"data: corpus of {stats.documents} documents, {stats.sentences} sentences, "
                f"{stats.bytes / 1e6:.1f} MB")
        return [str(path)], name
    try:
        files = expand_corpus(files, what="")
        members = [m for f in files for m in (sorted(str(p) for p in Path(f).rglob("*") if p.is_file())
                                              if os.path.isdir(f) else [f])]
        key = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in members]
        field, gpt = data.gpt.text_field, kind == "gpt2"
        if any(needs_conversion(f, keep_jsonl=gpt) for f in files):
            key.append(field)  # records are read from this column
        files = plain_text_files(files, field, cache / "corpus", sentences=not gpt, keep_jsonl=gpt)
        check_text(files, field, utf8=False)  # the builders check UTF-8 as they read
    except DataError as exc:
        raise RecipeError(f"data.corpus: {exc}") from None
    return files, _hash(key)


def _tokenizer(data, kind, files, corpus_key, cache, hint, log):
    """(tokenizer file, identity) for tokenizer `kind` ('wordpiece' or 'bpe')."""
    from orttrainer.run.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

    given = data.tokenizer or hint
    if given:
        load_tokenizer(given)  # only to fail early (DataError) when it is unreadable
        p = Path(given)
        if p.is_dir():
            p = next(p / n for n in ("tokenizer.json", "vocab.txt", "vocab.json") if (p / n).is_file())
        return str(p), _tokenizer_hash(p)
    folder = cache / f"tokenizer-{kind}-{data.vocab_size}-{_hash(corpus_key, data.gpt.text_field)}"

    def build(tmp):
        if kind == "bpe" and any(f.endswith(".jsonl") for f in files):
            from orttrainer.run.data.gpt import iter_texts

            tok = train_tokenizer(texts=iter_texts(files, data.gpt.text_field), kind=kind,
                                  vocab_size=data.vocab_size)
        else:
            tok = train_tokenizer(files, kind=kind, vocab_size=data.vocab_size)
        save_tokenizer(tok, tmp)

    folder = _build_atomically(folder, build, log, f"a {kind} tokenizer (vocab {data.vocab_size})")
    path = folder / "tokenizer.json"
    return str(path), _tokenizer_hash(path)


def _tokenizer_facts(path):
    from orttrainer.run.data.tokenizer import load_tokenizer, special_token_ids

    tok = load_tokenizer(path)
    return tok.get_vocab_size(), special_token_ids(tok)


def prepare(recipe, tokenizer_hint=None, log=print):
    """Build (if needed) and open the recipe's data. DataError/RecipeError on bad data settings."""
    started = time.perf_counter()
    try:
        prepared = _prepare(recipe, tokenizer_hint, log)
    except DataError as exc:
        raise RecipeError(f"data: {exc}") from None
    prepared.seconds = time.perf_counter() - started
    return prepared


def _prepare(recipe, hint, log):
    data, kind = recipe.data, recipe.kind
    cache = Path(data.cache_dir)
    seq = data.seq_length
    if kind == "bert-pretraining":
        return _bert(data, cache, seq, hint, log)
    if kind == "gpt2":
        return _gpt(data, cache, seq, hint, log)
    return _glue(data, cache, seq, hint, log)


def _bert(data, cache, seq, hint, log):
    from orttrainer.run.data.bert import BertPretrainingDataset, build_bert_shards, find_shards, read_metadata
    from orttrainer.run.data.manifest import check_bert

    if data.path:
        folder = Path(data.path)
        train = BertPretrainingDataset(folder)
        tokenizer = data.tokenizer or hint
        if tokenizer is None and (folder / "metadata.json").is_file():
            tokenizer = read_metadata(folder).get("tokenizer")
        where = f"shards in {folder}"
    else:
        files, corpus_key = _corpus(data, cache, log, "bert")
        tokenizer, tok_id = _tokenizer(data, "wordpiece", files, corpus_key, cache, hint, log)
        b = data.bert
        settings = dict(max_seq_length=seq, max_predictions_per_seq=b.max_predictions_per_seq,
                        masked_lm_prob=b.masked_lm_prob, short_seq_prob=b.short_seq_prob,
                        dupe_factor=b.dupe_factor, seed=data.seed, eval_fraction=data.eval_fraction)
        folder = cache / f"bert-seq{seq}-{_hash(corpus_key, tok_id, settings)}"

        def build(tmp):
            meta = build_bert_shards(files, tmp, tokenizer, **settings)
            log("data: " + ", ".join(f"{name} ({count} instances)" for name, count in meta["shards"].items()))

        what = f"BERT pretraining shards (seq {seq}, dupe factor {b.dupe_factor})"
        _build_atomically(folder, build, log, what)
        train = BertPretrainingDataset(folder)
        where = f"{folder}"
    try:
        evaluation = BertPretrainingDataset(find_shards(folder, "eval"))
    except DataError:
        evaluation = None
    if (folder / "metadata.json").is_file():  # shards from NVIDIA's own scripts have none
        check_bert(folder, read_metadata(folder), train, tokenizer, evaluation)
    if len(train) < data.batch_size:
        raise RecipeError(f"data.batch_size: got {data.batch_size}; {where} hold only {len(train)} "
                          "instances, less than one batch: give more text or a smaller data.batch_size")
    if train.max_seq_length != seq:
        raise RecipeError(f"data.seq_length: got {seq}; the shards in {folder} hold sequences of "
                          f"{train.max_seq_length}")
    vocab, special = _tokenizer_facts(tokenizer) if tokenizer else (None, {})
    return PreparedData(train, evaluation, tokenizer, vocab, special, seq, None,
                        f"{len(train)} BERT instances (seq {seq}) from {where}"
                        + (f", {len(evaluation)} for evaluation" if evaluation else ""), 0.0)


def _gpt(data, cache, seq, hint, log):
    from orttrainer.run.data.gpt import GPTBlockDataset, build_gpt_tokens
    from orttrainer.run.data.manifest import check_gpt

    if data.path:
        path = Path(data.path)
        tokenizer = data.tokenizer or hint
    else:
        files, corpus_key = _corpus(data, cache, log, "gpt2")
        tokenizer, tok_id = _tokenizer(data, "bpe", files, corpus_key, cache, hint, log)
        settings = dict(text_field=data.gpt.text_field, eval_fraction=data.eval_fraction, seed=data.seed)
        folder = cache / f"gpt-{_hash(corpus_key, tok_id, settings)}"

        def build(tmp):
            meta = build_gpt_tokens(files, tmp / "tokens.npy", tokenizer, block_size=seq, **settings)
            log(f"data: {meta['num_tokens']} tokens from {meta['num_documents']} documents")

        _build_atomically(folder, build, log, "GPT token files")
        path = folder / "tokens.npy"
    train = GPTBlockDataset(path, block_size=seq)
    if tokenizer is None:
        tokenizer = train.meta.get("tokenizer")
    eval_path = path.with_name(path.stem + ".eval.npy")
    evaluation = None
    if eval_path.is_file():
        try:
            evaluation = GPTBlockDataset(eval_path, block_size=seq)
        except DataError:  # held-out text shorter than one block
            evaluation = None
    check_gpt(path, train, tokenizer, evaluation)
    if len(train) < data.batch_size:
        raise RecipeError(f"data.batch_size: got {data.batch_size}; {path} holds only {len(train)} blocks "
                          f"of {seq} tokens, less than one batch: give more text, or a smaller data.batch_size "
                          "or data.seq_length")
    vocab, special = _tokenizer_facts(tokenizer) if tokenizer else (None, {})
    if vocab is None and train.meta.get("vocab_size"):
        vocab = int(train.meta["vocab_size"])
    return PreparedData(train, evaluation, tokenizer, vocab, special, seq, None,
                        f"{len(train)} blocks of {seq} tokens from {path}"
                        + (f", {len(evaluation)} for evaluation" if evaluation else ""), 0.0)


def _glue(data, cache, seq, hint, log):
    from orttrainer.run.data.glue import GlueDataset, build_next_sentence_task, build_topic_task

    g = data.glue
    if data.path:
        folder = Path(data.path)
        if data.tokenizer is None and hint is None:
            raise RecipeError("data.tokenizer: got null; GLUE data from data.path needs the tokenizer the "
                              "model was pretrained with (set data.tokenizer, or model.from a checkpoint "
                              "that has one)")
        tokenizer = data.tokenizer or hint
    else:
        files, corpus_key = _corpus(data, cache, log, "glue")
        tokenizer, _ = _tokenizer(data, "wordpiece", files, corpus_key, cache, hint, log)
        settings = dict(num_train=g.num_train, num_dev=g.num_dev, seed=data.seed)
        if g.task == "topic":
            settings["num_topics"] = g.num_topics
        folder = cache / f"glue-{'nsp' if g.task == 'next-sentence' else 'topic'}-{_hash(corpus_key, settings)}"

        def build(tmp):
            from orttrainer.run.data.common import dump_json
            from orttrainer.run.data.glue import read_glue_tsv, sort_labels

            if g.task == "topic":
                counts = build_topic_task(files, tmp, **settings)
                log(f"data: topic task: {counts['train']} train, {counts['dev']} dev passages, labels "
                    f"{counts['labels']}")
            else:
                counts = build_next_sentence_task(files, tmp, **settings)
                log(f"data: next-sentence task: {counts['train']} train, {counts['dev']} dev pairs")
            dump_json(tmp / LABELS_FILE, {"labels": sort_labels(e.label for e in read_glue_tsv(tmp / "train.tsv"))})

        _build_atomically(folder, build, log, f"the bundled {g.task} classification task")
    read_args = {k: getattr(g, k) for k in ("text_a", "text_b", "label") if getattr(g, k) is not None}
    read_args.update(header=g.header, quotechar=g.quotechar, single_sentence=g.single_sentence)
    train_file = folder / g.train_file
    label_list = g.label_list
    if label_list is None and (folder / LABELS_FILE).is_file():  # the ids pinned with the data
        from orttrainer.run.data.common import load_json

        label_list = [str(x) for x in load_json(folder / LABELS_FILE)["labels"]]
    train = GlueDataset(train_file, tokenizer, max_length=seq, label_list=label_list, **read_args)
    if len(train.label_list) < 2:
        raise RecipeError(f"data.glue.label: {train_file} has the single label {train.label_list}; "
                          "classification needs 2 or more labels (regression is not supported)")
    dev_file = folder / g.dev_file
    evaluation = None
    if dev_file.is_file():
        evaluation = GlueDataset(dev_file, tokenizer, max_length=seq, label_list=train.label_list,
                                 **read_args)
    vocab, special = _tokenizer_facts(tokenizer)
    return PreparedData(train, evaluation, tokenizer, vocab, special, seq, list(train.label_list),
                        f"{len(train)} examples from {train_file}, labels {train.label_list}"
                        + (f", {len(evaluation)} dev examples" if evaluation else ""), 0.0)
