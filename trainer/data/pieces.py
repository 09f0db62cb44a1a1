"""How text becomes documents, and documents become pieces the encoder can take in parallel, in bounded memory.

A document of any size reaches the encoder as pieces of about `PIECE_CHARS` characters: the pieces of one document
and of many are batched together across the encoder's threads, their ids are concatenated in order, and the
end-of-document token follows only a document's last piece. One huge document therefore costs what many small ones
do, in time and in memory (the encoder holds a batch of pieces, never the whole document).

Where a piece ends. Pre-tokenizers split text into words before the model merges anything, and merges never cross
their boundaries; a piece ends only where every common pre-tokenizer splits anyway, so the pieces' ids equal the whole
document's ids:
  - right after a single newline between two non-whitespace characters (`x\\ny` → `x\\n` | `y`), or
  - right before a single space between two non-whitespace characters (`x y` → `x` | ` y`).
Both are word boundaries of the byte-level BPE's GPT-2 pattern and of the Llama-3/tiktoken-style patterns (which glue a
newline to the punctuation before it, hence "after" the newline). They may differ in two places only:
  - a stretch of `MAX_PIECE_CHARS` characters without such a place (minified code, base64, a script written without
    spaces) is cut where it reaches that length, possibly inside a word or a special token;
  - a tokenizer that marks the start of every input (SentencePiece's Metaspace with `prepend_scheme` "always" or
    "first", a `Prepend` normalizer, a BOS post-processor — the build encodes without special tokens, so the last
    does not apply) treats each piece's first word as the start of a text: it gets the `▁` prefix it would not have
    inside the document.

How a `.txt` file becomes documents (`data.sample_by`, named as `datasets`' text builder names it): `document` (the
whole file), `paragraph` (separated by blank lines), `line`, or any other string, which separates documents (for example
`<|endoftext|>`). The file is read in chunks of `READ_CHARS`; the separator itself is dropped, documents of only
whitespace are skipped, and a document runs across chunks (as pieces) as long as it likes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

PIECE_CHARS = 1 << 14  # a piece ends at the first safe place after this many characters...
MAX_PIECE_CHARS = 1 << 16  # ...or here, when there is none
READ_CHARS = 1 << 20  # characters per read of a .txt file
SAMPLE_BY_DOCUMENT = "document"
SEPARATORS = {"paragraph": re.compile(r"\n(?:[^\S\n]*\n)+"), "line": re.compile(r"\n")}
CUT = re.compile(r"(?<=\S)\n(?=\S)|(?<=\S)(?= \S)")  # match end: a safe end for a piece (see the module docstring)

Piece = tuple[str, bool]  # (text, does the document end with it?)
DOCUMENT_END = None  # in a stream of pieces' texts: the document so far is complete


def describe_sample_by(sample_by: str) -> str:
    if sample_by == SAMPLE_BY_DOCUMENT:
        return "one document per file"
    if sample_by in SEPARATORS:
        return f"one document per {sample_by}"
    return f"documents separated by {sample_by!r}"


def separator_of(sample_by: str) -> re.Pattern[str] | None:
    """The pattern between two documents of a .txt file; None: the whole file is one document."""
    if sample_by == SAMPLE_BY_DOCUMENT:
        return None
    return SEPARATORS.get(sample_by) or re.compile(re.escape(sample_by))


def cut_positions(text: str, final: bool = True) -> Iterator[int]:
    """Where the pieces of `text` end. With `final` False the text is the start of a document still being read: the
    last `MAX_PIECE_CHARS` or more characters are left for the caller to carry over (so a separator that is not fully
    read yet is never cut through, and the document's last piece is never yielded early)."""
    start, keep = 0, MAX_PIECE_CHARS if final else 2 * MAX_PIECE_CHARS
    while len(text) - start > keep:
        match = CUT.search(text, start + PIECE_CHARS, start + MAX_PIECE_CHARS)
        start = match.end() if match else start + MAX_PIECE_CHARS
        yield start
    if final and start < len(text):
        yield len(text)


def split_text(text: str, final: bool = True) -> Iterator[str]:
    """The pieces of `text` (a short text is its own single piece, not copied); see `cut_positions`."""
    start = 0
    for end in cut_positions(text, final):
        yield text if (start, end) == (0, len(text)) else text[start:end]
        start = end


def document_items(documents: Iterable[str]) -> Iterator[str | None]:
    """Documents held whole (a jsonl row, a source file) → their pieces' texts, each document followed by
    DOCUMENT_END."""
    for text in documents:
        yield from split_text(text)
        yield DOCUMENT_END


def text_file_items(path: Path, separator: re.Pattern[str] | None) -> Iterator[str | None]:
    """A .txt file → its documents' pieces and DOCUMENT_END marks (`text_items`). Universal newlines, as `datasets`
    reads text."""
    with open(path, encoding="utf-8") as f:
        yield from text_items(f, separator)


def text_items(f: TextIO, separator: re.Pattern[str] | None) -> Iterator[str | None]:
    """Text read from `f` → its documents' pieces and DOCUMENT_END marks, reading `READ_CHARS` at a time: never more
    than a chunk and a carried-over document tail in memory, whatever the file or document size."""
    carried, continuing = "", False  # continuing: pieces of the carried-over document were yielded already
    while True:
        chunk = f.read(READ_CHARS)
        text = carried + chunk
        if separator is None:
            documents, rest = ([text], "") if not chunk else ([], text)
        else:
            # Trailing whitespace waits for the next chunk: a blank-line separator may continue there.
            head = len(text) if not chunk else len(text.rstrip())
            *documents, rest = separator.split(text[:head])
            rest += text[head:]
            if not chunk:
                documents.append(rest)
                rest = ""
        for document in documents:  # the first one may continue pieces yielded from the previous chunk
            if continuing or not document.isspace():
                yield from split_text(document)
                yield DOCUMENT_END
            continuing = False
        taken = 0
        for end in cut_positions(rest, final=False):
            yield rest[taken:end]
            taken = end
        carried, continuing = rest[taken:], continuing or taken > 0
        if not chunk:
            return


def mark_ends(items: Iterable[str | None]) -> Iterator[Piece]:
    """Pieces' texts and DOCUMENT_END marks → (piece, ends the document?). Each piece waits for the next item, which
    says whether its document ends with it; a document without any text is dropped."""
    pending: str | None = None
    for item in items:
        if pending is not None:
            yield pending, item is DOCUMENT_END
        pending = item
    if pending is not None:
        yield pending, True
