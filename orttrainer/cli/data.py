"""`orttrainer data ...`: build training data from a text corpus.

CORPUS arguments are text files (one sentence per line, blank lines between documents),
folders (their ``*.txt`` files), globs, ``.jsonl`` / ``.parquet`` / ``.csv`` files or ``save_to_disk``
folders (one document per record, text in ``--text-field``), or the word ``stdlib`` for the bundled
corpus built from Python's standard library documentation (written next to the output as
``corpus.txt``). Without ``--tokenizer`` a tokenizer is trained on the corpus and saved with the
output. A build holds ``orttrainer.lock`` in its output folder: a second build into the same folder
at the same time stops with an error instead of mixing its files with the first one's.
"""

import os
import sys
import time
from pathlib import Path

STDLIB = "stdlib"


def register(subparsers):
    parser = subparsers.add_parser("data", help="build training data (corpus, tokenizer, BERT/GPT/GLUE)",
                                   description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="data_command", metavar="WHAT")
    sub.required = True

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=lambda args: _run(name, func, args))
        return p

    p = add("corpus", _corpus, "write the bundled stdlib-documentation corpus to a text file")
    p.add_argument("out", metavar="OUT.txt")
    _max_mb(p)

    p = add("tokenizer", _tokenizer, "train a WordPiece (BERT) or byte-level BPE (GPT) tokenizer")
    _corpus_args(p)
    p.add_argument("--kind", choices=("wordpiece", "bpe"), default="wordpiece")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--cased", action="store_true", help="keep case (WordPiece; BPE is always cased)")
    p.add_argument("--out", required=True, metavar="DIR")

    p = add("bert", _bert, "build NVIDIA-format BERT pretraining HDF5 shards")
    _corpus_args(p)
    p.add_argument("--out", required=True, metavar="DIR")
    _tokenizer_args(p, "WordPiece")
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--max-predictions", type=int, default=20, help="max_predictions_per_seq")
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--dupe-factor", type=int, default=5, help="passes over the corpus, each masked anew")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--eval-fraction", type=float, default=0.0,
                   help="documents held out for eval_shard_0000.hdf5")
    p.add_argument("--seed", type=int, default=12345)

    p = add("gpt", _gpt, "tokenize .txt/.jsonl text into a flat .npy token file for GPT training")
    _corpus_args(p)
    p.add_argument("--out", required=True, metavar="FILE.npy")
    _tokenizer_args(p, "byte-level BPE")
    p.add_argument("--block-size", type=int, default=128, help="recorded as the reader's default")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="documents held out for FILE.eval.npy")
    p.add_argument("--seed", type=int, default=1234)

    p = add("glue", _glue, "write a bundled classification task (train.tsv, dev.tsv)")
    _corpus_args(p)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--task", choices=["topic", "next-sentence"], default="next-sentence",
                   help="topic: which of the largest documents a passage comes from; next-sentence: "
                        "does sentence 2 follow sentence 1")
    p.add_argument("--topics", type=int, default=4, help="labels of the topic task")
    p.add_argument("--train", type=int, default=2000, help="training examples")
    p.add_argument("--dev", type=int, default=400, help="dev examples")
    p.add_argument("--seed", type=int, default=0)


def _max_mb(parser):
    parser.add_argument("--max-mb", type=float, default=None, help="cap the bundled corpus at N MB")


def _corpus_args(parser):
    parser.add_argument("corpus", nargs="+", metavar="CORPUS",
                        help=f"text file(s), folder(s), glob(s), .jsonl/.parquet/.csv, dataset folder(s), or '{STDLIB}'")
    parser.add_argument("--text-field", default="text", help="the text field of JSONL / Parquet / CSV records")
    _max_mb(parser)


def _tokenizer_args(parser, kind):
    parser.add_argument("--tokenizer", metavar="T", help="tokenizer.json, vocab.txt or a folder with one; "
                        f"default: train a {kind} tokenizer on the corpus")
    parser.add_argument("--vocab-size", type=int, default=8192, help="of the trained tokenizer")


def _run(name, func, args):
    from orttrainer.run.data.common import DataError
    from orttrainer.run.lock import OutputLock
    from orttrainer.run.recipe.spec import RecipeError

    start = time.perf_counter()
    lock = None
    try:
        if name != "corpus":  # one build per output folder at a time
            folder = Path(args.out).parent if name == "gpt" else Path(args.out)
            folder.mkdir(parents=True, exist_ok=True)
            lock = OutputLock(folder, what="--out", hint="wait for that build to end, or build into another folder")
            lock.acquire(lambda line: print(line, file=sys.stderr))
        func(args)
    except (DataError, OSError, RecipeError) as exc:
        print(f"orttrainer data {name}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if lock is not None:
            lock.release()
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


def _corpus_files(args, out_dir, sentences=True, keep_jsonl=False):
    """The CORPUS arguments as text files, building the stdlib corpus into out_dir if asked for and
    converting records (JSONL, Parquet, CSV, saved datasets) into a text file there."""
    if args.corpus == [STDLIB] and not os.path.exists(STDLIB):
        from orttrainer.run.data.corpus import build_corpus

        path = Path(out_dir) / "corpus.txt"
        stats = build_corpus(path, _max_bytes(args))
        print(f"corpus: {path} ({stats.documents} documents, {stats.sentences} sentences, "
              f"{stats.bytes} bytes)")
        return [str(path)]
    from orttrainer.run.data.sources import check_text, expand_corpus, plain_text_files

    files = plain_text_files(expand_corpus(args.corpus), args.text_field, out_dir, sentences=sentences,
                             keep_jsonl=keep_jsonl)
    check_text(files, args.text_field)  # UTF-8 and not empty, before a tokenizer is trained
    return files


def _max_bytes(args):
    return None if args.max_mb is None else int(args.max_mb * 1e6)


def _where(path, base):
    return "(given object)" if path is None else os.path.join(base, path)


def _corpus(args):
    from orttrainer.run.data.corpus import build_corpus

    stats = build_corpus(args.out, _max_bytes(args))
    print(f"wrote {stats.path}: {stats.documents} documents, {stats.sentences} sentences, "
          f"{stats.bytes} bytes, sha256 {stats.sha256[:16]}")


def _tokenizer(args):
    from orttrainer.run.data.tokenizer import save_tokenizer, train_tokenizer

    files = _corpus_files(args, args.out, sentences=args.kind == "wordpiece")
    tok = train_tokenizer(files, kind=args.kind, vocab_size=args.vocab_size,
                          min_frequency=args.min_frequency, lowercase=not args.cased)
    path = save_tokenizer(tok, args.out)
    print(f"wrote {path} ({args.kind}, vocab size {tok.get_vocab_size()})")


def _bert(args):
    from orttrainer.run.data.bert import build_bert_shards

    meta = build_bert_shards(
        _corpus_files(args, args.out), args.out, args.tokenizer, max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions, masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob, dupe_factor=args.dupe_factor, num_shards=args.shards,
        seed=args.seed, eval_fraction=args.eval_fraction, vocab_size=args.vocab_size)
    for name, count in meta["shards"].items():
        print(f"wrote {Path(args.out) / name}: {count} instances")
    print(f"tokenizer: {_where(meta['tokenizer'], args.out)} (vocab size {meta['vocab_size']}); "
          f"metadata: {Path(args.out) / 'metadata.json'}")


def _gpt(args):
    from orttrainer.run.data.gpt import build_gpt_tokens

    files = _corpus_files(args, Path(args.out).parent, sentences=False, keep_jsonl=True)
    meta = build_gpt_tokens(files, args.out, args.tokenizer,
                            text_field=args.text_field, block_size=args.block_size,
                            eval_fraction=args.eval_fraction, seed=args.seed, vocab_size=args.vocab_size)
    print(f"wrote {args.out}: {meta['num_tokens']} tokens ({meta['dtype']}) from {meta['num_documents']} "
          f"documents; tokenizer: {_where(meta['tokenizer'], Path(args.out).parent)} "
          f"(vocab size {meta['vocab_size']})")


def _glue(args):
    from orttrainer.run.data.glue import build_next_sentence_task, build_topic_task

    files = _corpus_files(args, args.out)
    if args.task == "topic":
        counts = build_topic_task(files, args.out, num_train=args.train, num_dev=args.dev, seed=args.seed,
                                  num_topics=args.topics)
        columns = f"columns sentence, label (labels {counts['labels']})"
    else:
        counts = build_next_sentence_task(files, args.out, num_train=args.train, num_dev=args.dev,
                                          seed=args.seed)
        columns = "columns sentence1, sentence2, label"
    print(f"wrote {Path(args.out) / 'train.tsv'} ({counts['train']} examples) and "
          f"{Path(args.out) / 'dev.tsv'} ({counts['dev']} examples); {columns}")
