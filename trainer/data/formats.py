"""The file formats a local corpus may be stored in, and how each is read: streaming, in bounded memory, with errors
that name the file and the place.

A file's format is its name's ending: `.txt`, `.jsonl` and `.parquet` are read here, `.json` (a JSON array, or JSON
Lines) through `datasets`. `.txt`, `.jsonl` and `.json` may be compressed as distributed corpora ship them: `.gz`,
`.zst`, `.bz2`, `.xz` (The Pile, SlimPajama, RedPajama: `.jsonl.zst`; Dolma: JSON Lines as `.json.gz`, so a compressed
`.json` is read as JSON Lines). A compressed file is decompressed as it is read, never onto disk, and gives the rows,
errors and line numbers its uncompressed form would. A file of several streams (pbzip2's, lbzip2's, zstd's frames, files
joined with `cat`) is read to its end, every stream; a damaged stream (truncated, a bad checksum, bytes that do not
decode, after a complete stream too) is one error naming the file, the compressed byte offset reached and the line.

Parquet is read with pyarrow directly (`ParquetFile.iter_batches`, the text column only, a row group at a time), its
strings handed on a batch at a time: `datasets` would first convert every batch to Python rows and dicts of its own.
A dictionary-encoded text column (what a pandas categorical becomes) is decoded a batch at a time.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trainer.errors import UserError

READERS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
COMPRESSED = (".txt", ".jsonl", ".json")  # what may carry a compression suffix
COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")
SUPPORTED = ", ".join(READERS) + f" (the first three also {'/'.join(COMPRESSIONS)}-compressed)"
FIELDS_NAMED = 12  # fields listed when rows lack data.text_field
STREAM_BUFFER = 1 << 20  # bytes of decompressed text buffered per read
COMPRESSED_READ = 1 << 17  # compressed bytes read at a time
PARQUET_BATCH_ROWS = 1024  # rows per Arrow batch: the per-batch overhead vanishes, memory stays a few MB


@dataclass(frozen=True)
class FileFormat:
    """How one file is read: `reader` text | jsonl | json | parquet, and its compression suffix (or None)."""

    reader: str
    compression: str | None = None


def file_format(path: Path) -> FileFormat | None:
    """The format a file name says, or None for a file that is no corpus (a README, a .csv)."""
    name = path.name.lower()
    for compression in COMPRESSIONS:
        if name.endswith(compression):
            inner = name[:-len(compression)]
            ending = next((e for e in COMPRESSED if inner.endswith(e)), None)
            if ending is None:
                return None
            return FileFormat("text" if ending == ".txt" else "jsonl", compression)  # .json.gz: JSON Lines (Dolma)
    ending = next((e for e in READERS if name.endswith(e)), None)
    return FileFormat(READERS[ending]) if ending else None


# ---------------------------------------------------------------------------------------------------------------------
# Decompressing as the file is read


class DamagedStream(ValueError):
    """A compressed stream that does not decode, at `offset`, the compressed byte where it was found."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(reason)
        self.offset = offset


class ZstdFrame:
    """zstandard's decompressor of one frame, with the bounded interface of the standard library's (`max_length`,
    `needs_input`): zstandard hands out all a chunk of input decompresses to at once, this `max_length` at a time."""

    def __init__(self) -> None:
        import zstandard

        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.pending = b""

    @property
    def eof(self) -> bool:
        return bool(self.frame.eof) and not self.pending

    @property
    def unused_data(self) -> bytes:
        return bytes(self.frame.unused_data)

    @property
    def needs_input(self) -> bool:
        return not self.pending and not self.frame.eof

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if data:
            self.pending += self.frame.decompress(data)
        out, self.pending = self.pending[:max_length], self.pending[max_length:]
        return out


DECOMPRESSORS: dict[str, Callable[[], Any]] = {".bz2": bz2.BZ2Decompressor, ".xz": lzma.LZMADecompressor,
                                               ".zst": ZstdFrame}


class StreamsReader(io.RawIOBase):
    """The decompressed bytes of a `.bz2`, `.xz` or `.zst` file of one or more streams, one after the other (pbzip2's
    and lbzip2's output, zstd's frames, files joined with `cat`), at most a read's worth decompressed at a
    time. The standard library's bz2 and lzma readers stop without a word at bytes after a complete stream that do
    not decode (a damaged second stream, trailing garbage: the documents before them, exit 0), and zstandard's at a
    file cut inside a frame; this reader raises `DamagedStream` with the offset instead, as gzip's does. Zero bytes
    between and after `.xz` streams are the format's stream padding, skipped as `xz` skips them."""

    def __init__(self, raw: IO[bytes], compression: str) -> None:
        self.raw = raw
        self.new_stream = DECOMPRESSORS[compression]
        self.padded = compression == ".xz"
        self.stream: Any = None  # None before the first stream
        self.streams = 0
        self.consumed = 0  # compressed bytes read so far

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            if self.stream is None or self.stream.eof:
                data = self.next_stream()
                if not data:
                    return 0  # the file ends between streams: complete
                self.stream = self.new_stream()
                self.streams += 1
            elif self.stream.needs_input:
                data = self.read_raw()
                if not data:
                    raise DamagedStream(self.consumed, f"the file ends inside compressed stream {self.streams}")
            else:
                data = b""  # output of what the stream was already given
            out = self.decompress(data, len(buffer))
            if out:
                buffer[:len(out)] = out
                return len(out)

    def next_stream(self) -> bytes:
        """The compressed bytes after the current stream, its padding skipped; empty at the end of the file."""
        data = (self.stream.unused_data if self.stream is not None else b"") or self.read_raw()
        while self.padded and data and not data.strip(b"\0"):
            data = self.read_raw()
        return data.lstrip(b"\0") if self.padded else data

    def read_raw(self) -> bytes:
        chunk = self.raw.read(COMPRESSED_READ)
        self.consumed += len(chunk)
        return chunk

    def decompress(self, data: bytes, limit: int) -> bytes:
        try:
            return self.stream.decompress(data, limit)
        except stream_errors() as e:
            raise DamagedStream(self.consumed - len(data),
                                f"compressed stream {self.streams} does not decode: {type(e).__name__}: {e}") from None


def decompressing(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    """A buffered binary stream of the file's content, decompressed on the fly."""
    if compression is None:
        return raw
    reader = gzip.GzipFile(fileobj=raw, mode="rb") if compression == ".gz" else StreamsReader(raw, compression)
    return io.BufferedReader(reader, STREAM_BUFFER)  # type: ignore[arg-type]


def stream_errors() -> tuple[type[BaseException], ...]:
    """What a damaged compressed stream raises, whichever the compression."""
    import zstandard

    return OSError, EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError, DamagedStream


@contextmanager
def opened(path: Path, compression: str | None, where: list[int]) -> Iterator[IO[bytes]]:
    """The file's content as a binary stream; a damaged compressed stream becomes one `UserError` naming the file, the
    compressed byte offset reached and `where[0]`, the line the caller had reached (updated by the caller)."""
    with open(path, "rb") as raw:
        try:
            with decompressing(raw, compression) as stream:
                yield stream
        except stream_errors() as e:
            if compression is None:
                raise
            offset, reason = ((e.offset, str(e)) if isinstance(e, DamagedStream)
                              else (raw.tell(), f"{type(e).__name__}: {e}"))
            line = f", after line {where[0]:,}" if where and where[0] else ""
            raise UserError(f"{path} is damaged at byte {offset:,} of {path.stat().st_size:,}{line} ({reason}); "
                            f"re-download or recompress it") from None


# ---------------------------------------------------------------------------------------------------------------------
# JSON Lines


def jsonl_texts(path: Path, compression: str | None, text_field: str) -> Iterator[str]:
    """The non-empty `text_field` strings of a JSON Lines file, one row in memory at a time. A row without the field
    is an error (a misspelt data.text_field shows on the first row, not as an empty corpus); a null value is no text."""
    reached = [0]
    with opened(path, compression, reached) as stream:
        for number, line in enumerate(stream, 1):
            reached[0] = number
            if line.isspace():
                continue
            if text := jsonl_row_text(line, text_field, f"{path}, line {number}"):
                yield text


def jsonl_row_text(line: bytes, text_field: str, where: str) -> str | None:
    try:
        row = json.loads(line.rstrip(b"\r\n"))
    except UnicodeDecodeError as e:
        raise UserError(f"{where} is not UTF-8 text (byte {e.start}: {e.reason}); convert the file to UTF-8") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{where}, column {e.pos + 1}: not valid JSON ({e.msg}); each line of a .jsonl file must be "
                        f"one JSON object") from None
    except RecursionError:
        raise UserError(f"{where} is nested too deeply to parse; each line of a .jsonl file must be one JSON "
                        f"object") from None
    if not isinstance(row, dict):
        raise UserError(f"{where} holds a JSON {type(row).__name__}, not an object; each line of a .jsonl file must "
                        f"be one JSON object with a '{text_field}' field")
    if text_field not in row:
        raise no_field(text_field, row, where)
    return text_of(row[text_field], text_field, where)


def no_field(text_field: str, fields: Iterable[str], where: str) -> UserError:
    names = list(fields)
    listed = ", ".join(names[:FIELDS_NAMED]) + (", ..." if len(names) > FIELDS_NAMED else "")
    return UserError(f"{where} has no field '{text_field}' (fields: {listed or 'none'}); set data.text_field to the "
                     f"one that holds the text")


def text_of(value: object, text_field: str, where: str) -> str | None:
    """A row's text; None (no document) for a null or empty value. Any other type means the field is not the text.
    A JSON string may hold an unpaired UTF-16 surrogate (an escape `"\\ud800"` without its pair, or its bytes, which
    `json` lets through), which is no Unicode text: the tokenizer would fail on it with a traceback naming no row, so
    it is refused here, where the row is known (the check, a UTF-8 encode, is skipped for ASCII text, most rows)."""
    if value is None or isinstance(value, str):
        if value and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise UserError(f"{where}: field '{text_field}' holds an unpaired surrogate "
                                f"({ascii(value[e.start])[1:-1]} at character {e.start + 1:,}), which is not Unicode "
                                f"text; fix or drop the row") from None
        return value or None
    raise UserError(f"{where}: field '{text_field}' holds a {type(value).__name__}, not text; set data.text_field to "
                    f"a text field")


# ---------------------------------------------------------------------------------------------------------------------
# Parquet


def parquet_texts(path: Path, text_field: str) -> Iterator[str]:
    """The non-empty strings of one column of a Parquet file, read with pyarrow a batch at a time (only that column
    is read from disk): no row dicts, no `datasets` conversion; the strings are made once, for the tokenizer."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        if text_field not in names:
            raise no_field(text_field, names, str(path))
        kind = parquet.schema_arrow.field(text_field).type
        strings = kind.value_type if pa.types.is_dictionary(kind) else kind  # pandas' categorical: strings by index
        if not (pa.types.is_string(strings) or pa.types.is_large_string(strings) or pa.types.is_string_view(strings)):
            raise UserError(f"{path}: column '{text_field}' holds {kind}, not text; set data.text_field to a text "
                            f"column")
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field], use_threads=False):
            column = batch.column(0)
            if pa.types.is_dictionary(column.type):
                column = column.dictionary_decode()
            yield from pc.filter(column, pc.greater(pc.binary_length(column), 0)).to_pylist()
    except UnicodeDecodeError as e:  # pyarrow writes string columns without checking them: a writer's bad bytes
        raise UserError(f"{path}: column '{text_field}' holds a value that is not UTF-8 text (byte {e.start}: "
                        f"{e.reason}); rewrite the file with valid UTF-8 strings") from None
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"cannot read {path} as Parquet ({type(e).__name__}: {first_line(e)}); check the file is "
                        f"complete, valid Parquet") from None


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
