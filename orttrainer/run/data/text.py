"""Plain-text helpers every data builder shares: the UTF-8 check that names the file and offset, and
the rule-based sentence splitter of the corpus format."""

import re

from orttrainer.run.data.common import DataError

_CHUNK = 1 << 20
_ABBREVIATIONS = {"e.g", "i.e", "etc", "vs", "cf", "mr", "mrs", "dr", "no", "approx", "resp",
                  "incl", "fig", "sec", "al", "st", "jr", "sr"}
_INITIALISM = re.compile(r"(?:[a-z]\.)+[a-z]")  # e.g, i.e, u.s
_SENTENCE_END = re.compile(r"([.!?])([\"')\]]*)\s+(?=[\"'(\[]?[A-Z0-9])")


def check_utf8(path):
    """DataError naming `path` and the byte offset of the first byte that is not UTF-8."""
    offset, carry = 0, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            data = carry + block
            if not data:
                return
            try:
                data.decode("utf-8")
                offset, carry = offset + len(data), b""
            except UnicodeDecodeError as exc:
                # A character cut by the chunk boundary: decode it with the next chunk.
                if block and exc.end == len(data) and "unexpected end" in exc.reason:
                    offset, carry = offset + exc.start, data[exc.start:]
                    continue
                raise DataError(f"{path}: not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset "
                                f"{offset + exc.start}; convert the file to UTF-8 (e.g. iconv -f latin1 "
                                "-t utf-8)") from None
            if not block:
                return


def split_sentences(paragraph):
    """Split one paragraph into sentences (a small rule-based splitter, no model)."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(paragraph):
        end = match.end(2)
        last_word = paragraph[start:match.start(1)].rsplit(None, 1)[-1:] or [""]
        raw = last_word[0].lstrip("(\"'")
        word = raw.lower()
        # "e.g. Foo", "etc. The", initials ("J. Smith"): not sentence ends; "of x. The" is.
        if word in _ABBREVIATIONS or (len(raw) <= 1 and not raw.islower()) or _INITIALISM.fullmatch(word):
            continue
        sentences.append(paragraph[start:end].strip())
        start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences
