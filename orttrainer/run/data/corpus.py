"""The embedded default corpus: English prose from Python's own standard library.

Every machine that runs orttrainer has the standard library, so its documentation is a
real-text corpus that needs no download and nothing committed. It is assembled from:

* the docstrings of the pure-Python stdlib modules (module, class and function
  docstrings, in source order), read with `ast` -- the modules are *not imported*, so
  nothing runs (no browser from `antigravity`, no Tk window, no import-time warnings);
* the docstrings of the public built-in / C-extension modules (`math`, `itertools`,
  `builtins`, ...), which have no source and are imported (importing them is harmless);
* the language reference topics that `help()` shows (`pydoc_data.topics`).

Docstrings are cleaned to prose: code examples, indented blocks, reST headings and
fragments without sentence punctuation are dropped, whitespace is collapsed, and repeated
paragraphs are kept once. Output format is the one NVIDIA's BERT scripts read: one
sentence per line, a blank line between documents (one document per module or topic).

The text is deterministic for a given Python build (same interpreter version -> same
bytes); it differs between Python versions, whose docstrings differ.
"""

import ast
import hashlib
import importlib
import inspect
import os
import pkgutil
import random
import re
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

from orttrainer.run.data.common import DataError
from orttrainer.run.data.text import check_utf8, split_sentences

# Skipped for content, not safety (sources are parsed, never imported): tests, scripts,
# generated tables, and `this` (whose source is rot13 gibberish).
_SKIP_NAMES = {"test", "tests", "idle_test", "__main__", "this", "__phello__", "__hello__",
               "site-packages", "ensurepip", "turtledemo"}
_SKIP_PREFIXES = ("_sysconfigdata", "_test")
# encodings.* are generated codec tables whose docstrings say nothing.
_SKIP_SUBPACKAGES_OF = {"encodings"}
# C modules that are imported for their docstrings; importing `readline` can write
# terminal escapes and the xx* ones are examples.
_SKIP_EXTENSIONS = {"readline", "xxsubtype", "xxlimited", "xxlimited_35"}

# Documents are visited in this fixed pseudo-random order so that a size-capped corpus
# samples the whole library instead of the modules whose names start with "a".
_ORDER_SEED = "orttrainer-stdlib-corpus-v1"



@dataclass
class CorpusStats:
    path: str
    documents: int
    sentences: int
    bytes: int
    sha256: str


# ---------------------------------------------------------------- sources


def _stdlib_dir():
    return Path(sysconfig.get_path("stdlib"))


def _skipped(name):
    return name in _SKIP_NAMES or name.startswith(_SKIP_PREFIXES)


def _python_sources():
    """(module name, source path) for every pure-Python stdlib module, without importing."""
    found = []

    def walk(path, prefix):
        for info in sorted(pkgutil.iter_modules([str(path)]), key=lambda m: m.name):
            if _skipped(info.name):
                continue
            name = prefix + info.name
            if info.ispkg:
                init = path / info.name / "__init__.py"
                if init.is_file():
                    found.append((name, init))
                if info.name not in _SKIP_SUBPACKAGES_OF:
                    walk(path / info.name, name + ".")
            else:
                source = path / (info.name + ".py")
                if source.is_file():
                    found.append((name, source))

    walk(_stdlib_dir(), "")
    return found


def _extension_module_names():
    """Public stdlib modules that have no Python source (built in or in lib-dynload)."""
    names = set(sys.builtin_module_names)
    dynload = _stdlib_dir() / "lib-dynload"
    if dynload.is_dir():
        names.update(p.name.split(".")[0] for p in dynload.iterdir())
    stdlib_names = getattr(sys, "stdlib_module_names", names)
    return sorted(n for n in names if not n.startswith("_") and n in stdlib_names
                  and n not in _SKIP_EXTENSIONS)


def _docstrings_from_source(path):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    docs = []

    def visit(node):  # source order: the module, then each class/function as it appears
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append(doc)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child)
    visit(tree)
    return docs


def _docstrings_from_module(name):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
    except Exception:  # not built on this platform
        return []
    docs = [inspect.cleandoc(module.__doc__)] if module.__doc__ else []
    members = vars(module)
    for attr in sorted(members):
        # sys.excepthook & co. are process state (torchrun, pytest and IDEs replace them): read the
        # originals sys keeps as sys.__excepthook__, so every process builds the same corpus.
        obj = members.get(f"__{attr}__", members[attr])
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if inspect.isclass(obj) or inspect.isroutine(obj):
            if obj.__doc__:
                docs.append(inspect.cleandoc(obj.__doc__))
        if inspect.isclass(obj):
            for member in sorted(vars(obj)):
                doc = getattr(vars(obj)[member], "__doc__", None)
                if not member.startswith("_") and isinstance(doc, str):
                    docs.append(inspect.cleandoc(doc))
    return docs


def _reference_topics():
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [(f"topic:{key}", topics[key]) for key in sorted(topics)]


def _sources():
    """(name, loader) for every document, in the fixed corpus order."""
    items = [(name, lambda p=path: _docstrings_from_source(p)) for name, path in _python_sources()]
    items += [(name, lambda n=name: _docstrings_from_module(n)) for name in _extension_module_names()]
    items += [(name, lambda t=text: [t]) for name, text in _reference_topics()]
    items.sort(key=lambda item: item[0])
    random.Random(_ORDER_SEED).shuffle(items)
    return items


# ---------------------------------------------------------------- cleaning


def _is_prose(paragraph):
    words = paragraph.split()
    if len(words) < 5 or paragraph.startswith((">>>", "...", "$ ", "%")):
        return False
    visible = [c for c in paragraph if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    if letters < 0.7 * len(visible):
        return False
    return paragraph.rstrip("\"')]*`").endswith((".", "!", "?", ":"))


def _paragraphs(doc):
    """Prose paragraphs of one cleaned docstring, each as a single line."""
    out, current = [], []

    def flush():
        if current:
            text = " ".join(" ".join(current).split())
            if _is_prose(text):
                out.append(text)
            current.clear()

    for line in doc.expandtabs().splitlines():
        stripped = line.strip()
        # Blank lines, indented blocks (code, option tables) and reST heading rules all
        # end a paragraph and are themselves dropped.
        if not stripped or line[:1].isspace() or (len(set(stripped)) == 1 and not stripped[0].isalnum()):
            flush()
        elif stripped.startswith((">>>", "...")):
            flush()
        else:
            current.append(stripped)
    flush()
    return out



# ---------------------------------------------------------------- public API


def iter_documents():
    """Yield the corpus documents, each a list of sentences, in the fixed corpus order."""
    seen = set()
    for _name, load in _sources():
        sentences = []
        for doc in load():
            for paragraph in _paragraphs(doc):
                key = paragraph.lower()
                if key in seen:  # the same text is often repeated (overrides, C/Python twins)
                    continue
                seen.add(key)
                sentences.extend(split_sentences(paragraph))
        if sentences:
            yield sentences


def build_corpus(out_path, max_bytes=None):
    """Write the stdlib corpus to `out_path`; stop before `max_bytes` (whole sentences).

    Returns a `CorpusStats`. The file is written to a temporary name and renamed, so a
    reader never sees half a corpus.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"the corpus size cap must be positive, got {max_bytes} bytes")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    size = documents = sentences = 0
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for doc in iter_documents():
            lines = []
            for sentence in doc:
                line = (sentence + "\n").encode("utf-8")
                separator = 1 if documents and not lines else 0
                if max_bytes is not None and size + separator + len(line) > max_bytes:
                    break
                lines.append(line)
                size += separator + len(line)
            if not lines:
                break
            block = (b"\n" if documents else b"") + b"".join(lines)
            f.write(block)
            digest.update(block)
            documents += 1
            sentences += len(lines)
            if len(lines) < len(doc):  # hit the cap inside this document
                break
    os.replace(tmp, out_path)
    return CorpusStats(str(out_path), documents, sentences, size, digest.hexdigest())


def ensure_corpus(path, max_bytes=None):
    """Return `path`, building the stdlib corpus there first if it does not exist yet."""
    path = Path(path)
    if not path.is_file():
        build_corpus(path, max_bytes=max_bytes)
    return path


def read_documents(paths):
    """Read corpus files in the one-sentence-per-line, blank-line-between-documents format.

    Returns a list of documents, each a list of non-empty lines.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    documents = []
    for path in paths:
        current = []
        check_utf8(path)  # names the file and byte offset, unlike a decode error mid-read
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    current.append(line)
                elif current:
                    documents.append(current)
                    current = []
        if current:
            documents.append(current)
    return documents
