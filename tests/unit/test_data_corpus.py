"""The bundled stdlib corpus: deterministic, capped, in the one-sentence-per-line format."""

import subprocess
import sys

import pytest

from orttrainer.run.data.corpus import build_corpus, iter_documents, read_documents, split_sentences

CAP = 60_000


def test_two_builds_are_byte_identical_and_capped(tmp_path):
    a = build_corpus(tmp_path / "a.txt", max_bytes=CAP)
    b = build_corpus(tmp_path / "b.txt", max_bytes=CAP)
    assert a.sha256 == b.sha256
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()
    assert CAP * 0.9 < a.bytes <= CAP
    assert (tmp_path / "a.txt").stat().st_size == a.bytes


def test_format_round_trips_through_read_documents(tmp_path):
    stats = build_corpus(tmp_path / "c.txt", max_bytes=CAP)
    text = (tmp_path / "c.txt").read_text(encoding="utf-8")
    assert "\t" not in text and "\n\n\n" not in text and not text.startswith("\n")
    docs = read_documents(tmp_path / "c.txt")
    assert len(docs) == stats.documents > 5
    assert sum(map(len, docs)) == stats.sentences
    # Prose, not code: sentences are mostly letters and end like sentences.
    sentences = [s for d in docs for s in d]
    assert not any(s.startswith(">>>") for s in sentences)
    ends = sum(s.rstrip("\"')]*`").endswith((".", "!", "?", ":")) for s in sentences)
    assert ends / len(sentences) > 0.95


def test_prefix_of_full_order():
    # The cap keeps whole documents from the start of the fixed order: the same documents
    # a larger cap starts with.
    docs = iter_documents()
    first = [next(docs) for _ in range(3)]
    again = iter_documents()
    assert first == [next(again) for _ in range(3)]


@pytest.mark.multiprocess
def test_building_imports_nothing_with_side_effects(tmp_path):
    code = ("import sys; from orttrainer.run.data.corpus import build_corpus; "
            f"build_corpus({str(tmp_path / 'x.txt')!r}, max_bytes=20000); "
            "bad = [m for m in ('antigravity', 'this', 'tkinter', 'turtle', 'idlelib', 'readline') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert out.stderr == ""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_with_its_own_sys_hooks_builds_the_same_corpus(tmp_path):
    # torchrun's ranks (and pytest, IDEs) replace sys.excepthook & co.: the corpus is the same text.
    reference = build_corpus(tmp_path / "a.txt", max_bytes=250_000)
    code = ("import sys; from orttrainer.run.data.corpus import build_corpus\n"
            "def hook(*args):\n    'Report an uncaught exception the way this launcher does.'\n"
            "sys.excepthook = sys.displayhook = sys.unraisablehook = sys.breakpointhook = hook\n"
            f"print(build_corpus({str(tmp_path / 'b.txt')!r}, max_bytes=250_000).sha256)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == reference.sha256
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()


def test_split_sentences():
    assert split_sentences("Return x. See also y, e.g. Foo. Done!") == [
        "Return x.", "See also y, e.g. Foo.", "Done!"]
    assert split_sentences("Call 'f(x)'. Then stop.") == ["Call 'f(x)'.", "Then stop."]
    assert split_sentences("Version 3.11 is here.") == ["Version 3.11 is here."]
