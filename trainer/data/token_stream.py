"""Tokenizing a corpus into the cache's flat files, streaming: memory holds a batch or two, whatever the corpus size
and whatever the size of one document.

Documents arrive as pieces (`trainer.data.pieces`); `piece_batches` groups about `BATCH_CHARS` of them, so one huge
document spreads over many batches and every batch spreads over the encoder's threads. `encode_pipelined` keeps the
Rust encoder busy on one batch while this thread turns the previous one into arrays (the end-of-document id only after
a document's last piece); `TokenStream` appends them to a flat token file (uint16 while every id fits, widened to uint32
once one does not) and the documents' end offsets to a .npy file whose header is rewritten with the final count on
close.
"""

from __future__ import annotations

import io
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
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
    """Appends ids (each document ending with the end-of-document id) to a flat token file and the documents' end
    offsets to a .npy file, streaming both: memory holds one batch, whatever the corpus size."""

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

    def append(self, ids: np.ndarray, ends: np.ndarray) -> None:
        """`ids` continue the stream; `ends`: where documents end within them (after their end-of-document id). The
        last document of `ids` may continue in the next call: a document may span any number of batches."""
        if not len(ids):
            return
        if self.dtype == DTYPES["uint16"] and int(ids.max()) > np.iinfo(np.uint16).max:
            self.widen()
        self._tokens.write(np.ascontiguousarray(ids, dtype=self.dtype).data)
        self._offsets.write(np.ascontiguousarray(self.tokens + ends, dtype="<i8").data)
        self.tokens += len(ids)
        self.documents += len(ends)

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
class PieceBatch:
    """About `BATCH_CHARS` of pieces, each split's in corpus order, with whether each ends its document."""

    train: list[str] = field(default_factory=list)
    train_ends: list[bool] = field(default_factory=list)
    val: list[str] = field(default_factory=list)
    val_ends: list[bool] = field(default_factory=list)


@dataclass
class EncodedBatch:
    train_ids: np.ndarray  # uint32, flat, an end-of-document id after each document's last piece
    train_ends: np.ndarray  # int64: where documents end within train_ids (end-of-document id included)
    val_ids: np.ndarray
    val_ends: np.ndarray

    @property
    def documents(self) -> int:
        return len(self.train_ends) + len(self.val_ends)

    @property
    def tokens(self) -> int:
        return len(self.train_ids) + len(self.val_ids)


def flatten(encodings: list[Any], ends: list[bool], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Encoded pieces → one flat uint32 array with `eos_id` after each document's last piece, plus where the
    documents end within it."""
    eos = np.array([eos_id], dtype=np.uint32)
    parts = []
    for encoding, last in zip(encodings, ends):
        parts.append(np.array(encoding.ids, dtype=np.uint32))
        if last:
            parts.append(eos)
    sizes = np.fromiter((len(encoding) + last for encoding, last in zip(encodings, ends)), dtype=np.int64,
                        count=len(encodings))
    ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)
    return ids, np.cumsum(sizes)[np.asarray(ends, dtype=bool)]


def encoded_batch(encodings: list[Any], batch: PieceBatch, eos_id: int) -> EncodedBatch:
    train_ids, train_ends = flatten(encodings[:len(batch.train)], batch.train_ends, eos_id)
    val_ids, val_ends = flatten(encodings[len(batch.train):], batch.val_ends, eos_id)
    return EncodedBatch(train_ids, train_ends, val_ids, val_ends)


def piece_batches(pieces: Iterable[tuple[str, bool, bool]], batch_chars: int) -> Iterator[PieceBatch]:
    """(piece, ends its document?, held out?) → batches of about `batch_chars` characters."""
    batch, size = PieceBatch(), 0
    for text, ends, held_out in pieces:
        if held_out:
            batch.val.append(text)
            batch.val_ends.append(ends)
        else:
            batch.train.append(text)
            batch.train_ends.append(ends)
        size += len(text)
        if size >= batch_chars:
            yield batch
            batch, size = PieceBatch(), 0
    if batch.train or batch.val:
        yield batch


def encode_pipelined(tokenizer: Any, eos_id: int, batches: Iterable[PieceBatch]) -> Iterator[EncodedBatch]:
    """Keep the Rust encoder busy: while a worker thread encodes batch k+1 (`encode_batch_fast`: every core, GIL
    released, no character offsets), this thread turns batch k into arrays, the caller writes them, and the next
    pieces are read. At most two batches are in flight, so memory stays bounded."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
    pending: deque[tuple[Future[list[Any]], PieceBatch]] = deque()
    try:
        for batch in batches:
            pending.append((pool.submit(tokenizer.encode_batch_fast, batch.train + batch.val,
                                        add_special_tokens=False), batch))
            if len(pending) > 1:
                encodings, done = pending.popleft()
                yield encoded_batch(encodings.result(), done, eos_id)
        while pending:
            encodings, done = pending.popleft()
            yield encoded_batch(encodings.result(), done, eos_id)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
