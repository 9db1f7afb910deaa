"""The user's own text: files, folders of ``.txt``, globs, JSONL, and tables read with `datasets`.

`expand_corpus` turns what a recipe's ``data.corpus`` (or ``orttrainer data``'s CORPUS) names into a
sorted list of files; `plain_text_files` turns those into text files in the corpus format (one
sentence per line, a blank line between documents) that every builder reads: ``.txt`` files are
used as they are, records of JSONL / Parquet / CSV files and of ``save_to_disk`` folders are written,
one document per record, into a text file in a work folder.

Text must be UTF-8: a file with other bytes is refused, naming the file and the byte offset
(`check_utf8`); nothing is decoded with a guessed code page.
"""

import glob
import hashlib
import json
import os
import tempfile

from orttrainer.run.data.common import DataError, as_path_list
from orttrainer.run.data.text import check_utf8, split_sentences

TABLE_SUFFIXES = (".parquet", ".csv")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")




def is_hf_dataset(path):
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in _HF_MARKERS)


def expand_corpus(entries, what="corpus "):
    """Files named by `entries`: a file, a folder (its ``*.txt`` files, recursively, sorted), a glob
    (``data/*.txt``, ``**`` recursive) or a `datasets` ``save_to_disk`` folder (kept as it is).
    `what` starts the error messages ("" where the caller names the key, as in "data.corpus: ...")."""
    files = []
    for entry in as_path_list(entries):
        if os.path.isfile(entry) or is_hf_dataset(entry):
            files.append(entry)
        elif os.path.isdir(entry):
            found = sorted(glob.glob(os.path.join(glob.escape(entry), "**", "*.txt"), recursive=True))
            if not found:
                raise DataError(f"{what}folder {entry} has no .txt files")
            files += found
        elif glob.has_magic(entry):
            found = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
            if not found:
                raise DataError(f"{what}pattern {entry} matches no file")
            files += found
        else:
            raise DataError(f"{what}file not found: {entry}")
    return files


def corpus_identity(files, text_field):
    """A key naming the content of `files` (path, size, mtime; a dataset folder's files too)."""
    parts = [text_field]
    for f in files:
        members = [f]
        if os.path.isdir(f):
            members = sorted(os.path.join(d, n) for d, _, names in os.walk(f) for n in names)
        parts += [(os.path.abspath(m), os.path.getsize(m), os.stat(m).st_mtime_ns) for m in members]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:10]


def needs_conversion(path, keep_jsonl=False):
    suffix = os.path.splitext(path)[1].lower()
    return is_hf_dataset(path) or suffix in TABLE_SUFFIXES or (suffix == ".jsonl" and not keep_jsonl)


def _load_table(path):
    """A `datasets.Dataset` from a Parquet/CSV file or a ``save_to_disk`` folder (its train split)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the hub
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading Parquet, CSV and saved datasets needs the `datasets` package "
                        "(pip install datasets)") from None
    datasets.disable_progress_bars()
    try:
        if os.path.isdir(path):
            table = datasets.load_from_disk(path)
            if isinstance(table, datasets.DatasetDict):
                if "train" not in table:
                    raise DataError(f"{path}: a dataset dictionary without a 'train' split "
                                    f"(splits: {', '.join(table)})")
                table = table["train"]
            return table
        builder = "parquet" if path.lower().endswith(".parquet") else "csv"
        # Read into memory; the builder's cache goes to a folder of its own, not the user's HF cache.
        with tempfile.TemporaryDirectory(prefix="orttrainer-datasets-") as cache:
            return datasets.load_dataset(builder, data_files=os.path.abspath(path), split="train",
                                         keep_in_memory=True, cache_dir=cache)
    except DataError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types for unreadable files
        raise DataError(f"cannot read {path} with datasets: {type(exc).__name__}: {exc}") from None


def json_objects(path):
    """(line number, object) of each non-blank line of a JSON-lines file; a line that is not a JSON
    object is a DataError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def iter_records(path, text_field):
    """The text of each record of a JSONL, Parquet or CSV file or saved dataset."""
    if path.lower().endswith(".jsonl"):
        check_utf8(path)
        for lineno, record in json_objects(path):
            if not isinstance(record.get(text_field), str):
                raise DataError(f"{path}:{lineno}: no string field {text_field!r} (fields: {sorted(record)}); "
                                "set data.gpt.text_field (--text-field)")
            yield record[text_field]
        return
    table = _load_table(path)
    if text_field not in table.column_names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {table.column_names}); set "
                        "data.gpt.text_field (--text-field)")
    for row, text in enumerate(table[text_field]):
        if text is not None and not isinstance(text, str):
            raise DataError(f"{path}: row {row}: column {text_field!r} holds {type(text).__name__}, not text")
        yield text or ""


def write_documents(files, text_field, out_path, sentences):
    """Write the records of `files` as documents of the corpus format into `out_path`.

    `sentences`: split each line into sentences (what BERT's segment pairs want); else lines are kept.
    """

    tmp = f"{out_path}.tmp{os.getpid()}"
    first = True
    with open(tmp, "w", encoding="utf-8") as out:
        for path in files:
            for text in iter_records(path, text_field):
                lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
                if sentences:
                    lines = [s for line in lines for s in split_sentences(line)]
                if lines:
                    out.write(("" if first else "\n") + "\n".join(lines) + "\n")
                    first = False
    os.replace(tmp, out_path)
    return out_path


def plain_text_files(files, text_field, work_dir, *, sentences, keep_jsonl=False):
    """`files` with every JSONL/table source converted to one text file in `work_dir` (cached by the
    sources' identity). See `check_text` for what the callers check next."""
    tables = [f for f in files if needs_conversion(f, keep_jsonl)]
    out = [f for f in files if f not in tables]
    if tables:
        os.makedirs(work_dir, exist_ok=True)
        name = f"records-{'sent' if sentences else 'lines'}-{corpus_identity(tables, text_field)}.txt"
        path = os.path.join(work_dir, name)
        if not os.path.isfile(path):
            write_documents(tables, text_field, path, sentences)
        out.append(path)
    return out


def check_text(files, text_field="text", utf8=True):
    """DataError unless the files hold some text (and, with `utf8`, are UTF-8)."""
    for f in files if utf8 else ():
        check_utf8(f)
    if not any(_has_text(f, text_field) for f in files):
        raise DataError(f"the corpus is empty: no text in {', '.join(files)}")


def _has_text(path, text_field):
    if path.lower().endswith(".jsonl"):
        return any(t.strip() for t in iter_records(path, text_field))
    try:
        with open(path, encoding="utf-8") as f:
            return any(line.strip() for line in f)
    except UnicodeDecodeError:
        check_utf8(path)  # the error that names the file and the offset
        raise
