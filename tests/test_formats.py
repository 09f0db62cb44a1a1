"""Corpora as they are stored: compressed JSON Lines and text, Parquet shards in a hub snapshot's layout. Each gives the
token ids its plain form gives; a damaged stream, a bad row or a missing column is one line naming the file."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from trainer.config import PROJECT_ROOT, Config
from trainer.data.cache import CacheInfo, TokenCache, prepare
from trainer.data.corpus import open_corpus
from trainer.data.formats import file_format
from trainer.errors import UserError

ROWS = [{"text": f"row {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(i % 40 + 1))
         + ("\nsecond line é ✓" if i % 3 else ""), "id": i} for i in range(300)]
ROWS[5]["text"] = None  # no document
ROWS[9]["text"] = ""  # no document either


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


def two_streams(compress: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    """Each half compressed on its own, one stream after the other, a row cut between them: as multi-threaded
    compressors (pbzip2, lbzip2, zstd -T) and files joined with `cat` write them."""
    def both(data: bytes) -> bytes:
        return compress(data[:len(data) // 2]) + compress(data[len(data) // 2:])
    return both


ONE_STREAM = {".gz": gzip.compress, ".zst": zstandard.ZstdCompressor(write_checksum=True).compress,
              ".bz2": bz2.compress, ".xz": lzma.compress}
COMPRESS = {suffix: two_streams(compress) for suffix, compress in ONE_STREAM.items()}
zstd_frames = COMPRESS[".zst"]


def config(tmp_path: Path, source: Path, tokenizer: str = "bpe", **data: object) -> Config:
    return Config.from_dict({"data": {"source": str(source), "vocab_size": 300, "context_length": 16,
                                      "val_fraction": 0.1, "cache_dir": str(tmp_path / "cache"),
                                      "tokenizer": tokenizer, **data}})


def ids(info: CacheInfo) -> tuple[list[int], list[int], list[int]]:
    cache = TokenCache.open(info.path)
    return cache.train.tolist(), cache.val.tolist(), np.asarray(cache.doc_offsets).tolist()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CacheInfo]:
    """The plain JSON Lines corpus, its cache, and the tokenizer every other form is encoded with."""
    folder = tmp_path_factory.mktemp("plain")
    source = folder / "rows.jsonl"
    source.write_bytes(jsonl_bytes(ROWS))
    return folder, prepare(config(folder, source), show_progress=False)


@pytest.mark.parametrize("name", ["rows.jsonl.gz", "rows.jsonl.zst", "rows.jsonl.bz2", "rows.jsonl.xz",
                                  "rows.json.gz"])
def test_compressed_json_lines_of_two_streams_give_the_plain_files_ids(plain: tuple[Path, CacheInfo], tmp_path: Path,
                                                        name: str) -> None:
    folder, reference = plain
    source = tmp_path / name
    source.write_bytes(COMPRESS[Path(name).suffix](jsonl_bytes(ROWS)))
    info = prepare(config(tmp_path, source, tokenizer=str(reference.path)), show_progress=False)
    again = prepare(config(tmp_path, folder / "rows.jsonl", tokenizer=str(reference.path)), show_progress=False)
    assert info.key != again.key  # the key hashes the stored (compressed) bytes
    assert ids(info) == ids(again) and info.documents == again.documents == len(ROWS) - 2
    hit = prepare(config(tmp_path, source, tokenizer=str(reference.path)), show_progress=False)
    assert not hit.built and hit.key == info.key


@pytest.mark.parametrize("suffix", [".gz", ".zst", ".bz2"])
def test_compressed_text_files_give_the_plain_files_ids(plain: tuple[Path, CacheInfo], tmp_path: Path,
                                                        suffix: str) -> None:
    text = "\n\n".join(str(row["text"]) for row in ROWS if row["text"]) + "\r\n"
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "book.txt").write_text(text)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / f"book.txt{suffix}").write_bytes(COMPRESS[suffix](text.encode()))
    tokenizer = str(plain[1].path)
    one, other = (prepare(config(tmp_path, tmp_path / name, tokenizer=tokenizer, sample_by="paragraph"),
                          show_progress=False) for name in ("plain", "packed"))
    assert ids(one) == ids(other) and one.documents == len(ROWS) - 2


def test_parquet_shards_in_a_hub_snapshot_give_the_json_lines_ids(plain: tuple[Path, CacheInfo],
                                                                  tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot"
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "sample" / "10BT").mkdir(parents=True)
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table.slice(0, 120), snapshot / "data" / "train-00000-of-00002.parquet", row_group_size=50)
    pq.write_table(table.slice(120), snapshot / "data" / "train-00001-of-00002.parquet", row_group_size=50)
    pq.write_table(table.slice(0, 10), snapshot / "data" / "test-00000-of-00001.parquet")  # another split: left out
    (snapshot / "README.md").write_text("# a dataset card\n")
    info = prepare(config(tmp_path, snapshot, tokenizer=str(plain[1].path)), show_progress=False)
    assert ids(info) == ids(plain[1])
    # nested shards without split names (sample/10BT/000_00000.parquet) are taken in sorted order
    pq.write_table(table.slice(0, 150), snapshot / "sample" / "10BT" / "000_00000.parquet")
    pq.write_table(table.slice(150), snapshot / "sample" / "10BT" / "001_00000.parquet")
    nested = prepare(config(tmp_path, snapshot / "sample", tokenizer=str(plain[1].path)), show_progress=False)
    assert ids(nested) == ids(plain[1])
    with pytest.raises(UserError, match="holds the splits test, train; set data.split"):
        open_corpus(config(tmp_path, snapshot / "data", split="validation").data)


def test_a_parquet_file_without_the_text_column_lists_its_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table({"content": ["a b"], "url": ["x"]}), tmp_path / "part.parquet")
    with pytest.raises(UserError, match=r"part.parquet has no field 'text' \(fields: content, url\)"):
        list(open_corpus(config(tmp_path, tmp_path / "part.parquet").data).pieces())
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "numbers.parquet")
    with pytest.raises(UserError, match="column 'text' holds int64, not text"):
        list(open_corpus(config(tmp_path, tmp_path / "numbers.parquet").data).pieces())
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "part.parquet").read_bytes()[:40])
    with pytest.raises(UserError, match="cannot read .*cut.parquet as Parquet"):
        list(open_corpus(config(tmp_path, tmp_path / "cut.parquet").data).pieces())


def test_a_dictionary_encoded_text_column_is_text(tmp_path: Path) -> None:
    """A pandas categorical column is stored as pyarrow's dictionary<int32, string>: its strings are the text."""
    texts = [row["text"] for row in ROWS]
    table = pa.Table.from_pandas(pd.DataFrame({"text": pd.Categorical(texts)}))
    assert pa.types.is_dictionary(table.schema.field("text").type)
    pq.write_table(table, tmp_path / "categorical.parquet", row_group_size=100)
    pieces = open_corpus(config(tmp_path, tmp_path / "categorical.parquet").data).pieces()
    assert [text for text, _ in pieces] == [text for text in texts if text]


def test_a_bad_row_is_named_by_its_line_in_a_compressed_file_too(tmp_path: Path) -> None:
    data = jsonl_bytes(ROWS[:20]) + b'{"text": "broken\n' + jsonl_bytes(ROWS[:5])
    for name, content in (("rows.jsonl", data), ("rows.jsonl.zst", zstd_frames(data))):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=rf"{name}, line 21, column \d+: not valid JSON"):
            list(open_corpus(config(tmp_path, tmp_path / name).data).pieces())


@pytest.mark.parametrize("name, damage", [("rows.jsonl.zst", "truncate"), ("rows.jsonl.gz", "truncate"),
                                          ("rows.jsonl.gz", "flip"), ("rows.jsonl.zst", "flip"),
                                          ("rows.txt.xz", "truncate"), ("rows.jsonl.bz2", "second stream"),
                                          ("rows.jsonl.xz", "second stream"), ("rows.jsonl.bz2", "trailing bytes")])
def test_a_damaged_stream_is_one_line_naming_the_file_and_where(tmp_path: Path, name: str, damage: str) -> None:
    """Damage anywhere, in a later stream of the file or after its last one too, as a damaged download or a bad
    `cat` leaves it: one line naming the file and the offset, never the documents before it alone."""
    data = jsonl_bytes(ROWS * 20)
    packed = bytearray(COMPRESS[Path(name).suffix](data))
    second = len(ONE_STREAM[Path(name).suffix](data[:len(data) // 2]))  # where the second stream begins
    if damage == "truncate":
        packed = packed[:len(packed) * 2 // 3]
    elif damage == "trailing bytes":
        second = len(packed)
        packed += b"trailing bytes that are no stream"
    else:
        start = len(packed) // 2 if damage == "flip" else second
        packed[start:start + 8] = bytes(b ^ 0x5A for b in packed[start:start + 8])
    (tmp_path / name).write_bytes(bytes(packed))
    cfg = config(tmp_path, tmp_path / name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"data": cfg.to_dict()["data"]}))
    result = subprocess.run([sys.executable, str(PROJECT_ROOT / "prepare_dataset.py"), "--config", str(path),
                             "--quiet"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    # flipped bytes may decode to text that is no JSON before the stream's checksum is reached: then the row is named
    said = {"truncate": f"error: {tmp_path / name} is damaged at byte ", "flip": f"error: {tmp_path / name}"}.get(
        damage, f"error: {tmp_path / name} is damaged at byte {second:,} of {len(packed):,}")
    assert len(lines) == 1 and lines[0].startswith(said), lines
    assert "Traceback" not in result.stderr and not list((tmp_path / "cache").glob("[0-9a-f]*"))


def test_file_names_say_the_format() -> None:
    assert [file_format(Path(n)) and (file_format(Path(n)).reader, file_format(Path(n)).compression)
            for n in ("a.jsonl.zst", "a.json.gz", "a.JSON", "a.txt.bz2", "a.parquet", "a.csv.gz", "README.md")] == [
        ("jsonl", ".zst"), ("jsonl", ".gz"), ("json", None), ("text", ".bz2"), ("parquet", None), None, None]
