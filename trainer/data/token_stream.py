"""Tokenizing a corpus into the cache's flat files, streaming: memory holds a batch or two, whatever the corpus size.

`encode_pipelined` keeps the Rust encoder busy on one batch while this thread turns the previous one into arrays;
`TokenStream` appends them to a flat token file (uint16 while every id fits, widened to uint32 once one does not) and
their end offsets to a .npy file whose header is rewritten with the final count on close.
"""

from __future__ import annotations

import io
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
BATCH_CHARS = 4 << 20  # text per encode_batch call: enough documents to keep every core of the Rust encoder busy
WIDEN_CHUNK = 1 << 24


def npy_header(length: int) -> bytes:
    """A .npy header for int64[length]; numpy pads it to a fixed size, so it can be rewritten once the count is known."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<i8", "fortran_order": False, "shape": (length,)})
    return buffer.getvalue()


class TokenStream:
    """Appends documents (ids, each ending with the end-of-document id) to a flat token file and their end offsets to
    a .npy file, streaming both: memory holds one batch, whatever the corpus size."""

    def __init__(self, tokens_path: Path, offsets_path: Path) -> None:
        self.tokens_path = tokens_path
        self.dtype = DTYPES["uint16"]
        self.tokens = 0
        self.documents = 0
        self._tokens = open(tokens_path, "wb")
        self._offsets = open(offsets_path, "wb")
        self._header_size = len(npy_header(0))
        self._offsets.write(npy_header(0))
        self._offsets.write(np.zeros(1, dtype="<i8").tobytes())

    def append(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        if self.dtype == DTYPES["uint16"] and int(ids.max()) > np.iinfo(np.uint16).max:
            self.widen()
        self._tokens.write(np.ascontiguousarray(ids, dtype=self.dtype).data)
        ends = self.tokens + np.cumsum(lengths, dtype=np.int64)
        self._offsets.write(np.ascontiguousarray(ends, dtype="<i8").data)
        self.tokens = int(ends[-1])
        self.documents += len(lengths)

    def widen(self) -> None:
        """An id above 65,535 arrived: rewrite what is written so far as uint32 and continue in uint32."""
        if self.dtype == DTYPES["uint32"]:
            return
        self._tokens.close()
        wide = self.tokens_path.with_suffix(".wide")
        with open(self.tokens_path, "rb") as narrow, open(wide, "wb") as out:
            while chunk := narrow.read(WIDEN_CHUNK):
                out.write(np.frombuffer(chunk, dtype=DTYPES["uint16"]).astype(DTYPES["uint32"]).tobytes())
        os.replace(wide, self.tokens_path)
        self._tokens = open(self.tokens_path, "ab")
        self.dtype = DTYPES["uint32"]

    def close(self) -> None:
        """Write the final document count into the .npy header and close both files."""
        header = npy_header(self.documents + 1)
        if len(header) != self._header_size:
            raise RuntimeError(f"numpy wrote a {len(header)}-byte header, expected {self._header_size}")
        self._offsets.seek(0)
        self._offsets.write(header)
        self.abort()

    def abort(self) -> None:
        self._tokens.close()
        self._offsets.close()


@dataclass
class EncodedBatch:
    train_ids: np.ndarray  # uint32, flat, an end-of-document id after each document
    train_lengths: np.ndarray  # int64 per document, end-of-document id included
    val_ids: np.ndarray
    val_lengths: np.ndarray


def flatten(encodings: list[Any], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Encodings → one flat uint32 array with `eos_id` after each document, plus the per-document lengths."""
    eos = np.array([eos_id], dtype=np.uint32)
    parts = []
    for encoding in encodings:
        parts.append(np.array(encoding.ids, dtype=np.uint32))
        parts.append(eos)
    lengths = np.fromiter((len(encoding) + 1 for encoding in encodings), dtype=np.int64, count=len(encodings))
    return (np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)), lengths


def encoded_batch(encodings: list[Any], train_count: int, eos_id: int) -> EncodedBatch:
    train_ids, train_lengths = flatten(encodings[:train_count], eos_id)
    val_ids, val_lengths = flatten(encodings[train_count:], eos_id)
    return EncodedBatch(train_ids, train_lengths, val_ids, val_lengths)


def document_batches(pairs: Iterable[tuple[str, bool]], batch_chars: int) -> Iterator[tuple[list[str], list[str]]]:
    """(training documents, held-out documents) in batches of about `batch_chars` characters."""
    train: list[str] = []
    val: list[str] = []
    size = 0
    for text, held_out in pairs:
        (val if held_out else train).append(text)
        size += len(text)
        if size >= batch_chars:
            yield train, val
            train, val, size = [], [], 0
    if train or val:
        yield train, val


def encode_pipelined(tokenizer: Any, eos_id: int,
                     batches: Iterable[tuple[list[str], list[str]]]) -> Iterator[EncodedBatch]:
    """Keep the Rust encoder busy: while a worker thread encodes batch k+1 (`encode_batch_fast`: every core, GIL
    released, no character offsets), this thread turns batch k into arrays, the caller writes them, and the next
    documents are read. At most two batches are in flight, so memory stays bounded."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
    pending: deque[tuple[Future[list[Any]], int]] = deque()
    try:
        for train, val in batches:
            pending.append((pool.submit(tokenizer.encode_batch_fast, train + val, add_special_tokens=False),
                            len(train)))
            if len(pending) > 1:
                encodings, train_count = pending.popleft()
                yield encoded_batch(encodings.result(), train_count, eos_id)
        while pending:
            encodings, train_count = pending.popleft()
            yield encoded_batch(encodings.result(), train_count, eos_id)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
