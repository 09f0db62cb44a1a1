"""Document sources: the stdlib corpus, local files/folders/globs, .txt files cut into documents by data.sample_by,
hub names offline, the split, and the stat-keyed memo of source digests (a touched file is re-hashed, an untouched one
is not read)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import PROJECT_ROOT, DataConfig
from trainer.data.corpus import (
    Corpus,
    HubCorpus,
    LocalCorpus,
    StdlibCorpus,
    is_validation,
    local_files,
    open_corpus,
    split_documents,
    training_pieces,
)
from trainer.data.digests import DigestMemo
from trainer.errors import UserError


def documents(corpus: Corpus) -> list[str]:
    """The corpus's documents, each its pieces joined."""
    found, current = [], []
    for text, ends in corpus.pieces():
        current.append(text)
        if ends:
            found.append("".join(current))
            current = []
    assert not current, "the last piece must end its document"
    return found


def identity(corpus: Corpus) -> dict:
    """Key material with nothing remembered: every file read by content."""
    return corpus.identity(DigestMemo(Path("/nonexistent") / "memo.json"))


def local(source: Path | str, **kw: str) -> LocalCorpus:
    corpus = open_corpus(DataConfig(source=str(source), **kw))
    assert isinstance(corpus, LocalCorpus)
    return corpus


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_stdlib_corpus_is_the_interpreters_own_sorted_python_files() -> None:
    corpus = open_corpus(DataConfig(source="stdlib"))
    assert isinstance(corpus, StdlibCorpus)
    names = [p.relative_to(corpus.root).as_posix() for p in corpus.files]
    assert len(names) > 500 and names == sorted(names)
    assert all(n.endswith(".py") and "site-packages" not in n for n in names)
    first = list(split_documents(corpus.pieces(), 5, 0.0))
    assert first[0][0] == next(p.read_text() for p in corpus.files if p.stat().st_size)
    assert identity(corpus) == identity(StdlibCorpus())


def test_local_folder_mixes_formats_in_sorted_order_and_skips_hidden_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first line\nsecond line of the same document\n")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "row one", "n": 1}, {"text": "", "n": 2}, {"text": "row three"}])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "d.txt").write_text("nested")
    (tmp_path / ".hidden.txt").write_text("never read")
    (tmp_path / "notes.md").write_text("not a supported suffix inside a folder: ignored")
    corpus = local(tmp_path)
    assert documents(corpus) == ["first line\nsecond line of the same document\n", "row one", "row three",
                                        "nested"]


def test_parquet_glob_and_text_field(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i in range(2):
        pq.write_table(pa.table({"content": [f"doc {i}-{j}" for j in range(3)]}), tmp_path / f"part{i}.parquet")
    corpus = local(tmp_path / "*.parquet", text_field="content")
    assert documents(corpus) == [f"doc {i}-{j}" for i in range(2) for j in range(3)]
    with pytest.raises(UserError, match="no field 'text'.*content"):
        documents(local(tmp_path / "*.parquet"))


def test_jsonl_rows_are_read_here_a_line_at_a_time(tmp_path: Path) -> None:
    """Blank lines and null or empty values are no documents; the text keeps every character JSON can escape; the
    same rows in a .json file (read by `datasets`) give the same documents."""
    rows = [{"text": "tab\t, quote \", é, 😀, \u2028"}, {"text": None}, {"text": ""}, {"text": "last", "n": [1]}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    path.write_text(path.read_text().replace("\n", "\n\n  \n", 1))
    expected = ["tab\t, quote \", é, 😀, \u2028", "last"]
    assert documents(local(path)) == expected
    (tmp_path / "same").mkdir()
    assert documents(local(write_jsonl(tmp_path / "same" / "rows.json", rows))) == expected


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"', r"rows.jsonl, line 2, column 14: not valid JSON \(Expecting ',' delimiter\)"),
    ('["a list"]', r"line 2 holds a JSON list, not an object"),
    ('{"body": "x", "id": 3}', r"line 2 has no field 'text' \(fields: body, id\); set data.text_field"),
    ('{"text": 42}', r"line 2: field 'text' holds a int, not text"),
    (b'{"text": "caf\xe9"}', r"line 2 is not UTF-8 text"),
    (b"[" * 100_000, r"line 2 is nested too deeply to parse"),
])
def test_a_bad_jsonl_row_is_one_line_naming_where(tmp_path: Path, line: str | bytes, message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    with pytest.raises(UserError, match=message) as caught:
        documents(local(path))
    assert "\n" not in str(caught.value)


def test_content_identity_follows_edits_not_mtimes_or_location(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    path = write_jsonl(folder / "data.jsonl", [{"text": "alpha"}, {"text": "beta"}])
    before = identity(local(folder))
    stat = path.stat()
    write_jsonl(path, [{"text": "alpha"}, {"text": "bexa"}])  # same size, and the mtime is put back
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = identity(local(folder))
    assert edited["content"] != before["content"]
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touching alone changes nothing
    assert identity(local(folder)) == edited
    moved = folder.rename(tmp_path / "moved")
    assert identity(local(moved)) == edited


@pytest.mark.parametrize("relative, message", [
    ("missing.jsonl", "does not exist"),
    ("nope/deeper", "does not exist"),
    ("*.jsonl", "matches no files"),
    ("", "holds no .txt"),
    ("table.csv", "is not one of"),
])
def test_bad_local_sources(tmp_path: Path, relative: str, message: str) -> None:
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=message):
        open_corpus(DataConfig(source=str(tmp_path / relative)))


def test_a_name_that_is_not_a_path_is_a_hub_dataset() -> None:
    corpus = open_corpus(DataConfig(source="someone/some-dataset", hub_config="en", split="train", streaming=True))
    assert isinstance(corpus, HubCorpus) and corpus.streaming and corpus.config == "en"


def test_hub_dataset_is_read_at_its_resolved_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from trainer.data import corpus as corpus_module

    calls = []

    def load_dataset(name: str, config: str | None, split: str, revision: str, streaming: bool) -> object:
        calls.append((name, config, split, revision, streaming))
        return datasets.Dataset.from_dict({"body": ["first", "", "second"], "n": [1, 2, 3]}).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(corpus_module, "resolve_hub_commit", lambda name, revision: f"sha-of-{revision}")
    corpus = open_corpus(DataConfig(source="someone/data", hub_config="en", split="validation", revision="v1",
                                    streaming=True, text_field="body"))
    assert identity(corpus) == {"kind": "hub", "name": "someone/data", "config": "en", "split": "validation",
                                 "revision": "sha-of-v1", "text_field": "body"}
    assert documents(corpus) == ["first", "second"]
    assert calls == [("someone/data", "en", "validation", "sha-of-v1", True)]


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["offline-mode", "unreachable-endpoint"])
def test_hub_name_offline_fails_with_one_line(env: dict[str, str]) -> None:
    code = ("from trainer.config import DataConfig\nfrom trainer.data.corpus import open_corpus\n"
            "open_corpus(DataConfig(source='someone/some-dataset')).identity(None)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, **env, "HF_HUB_DISABLE_TELEMETRY": "1"})
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "UserError" in last
    assert "hub cannot be reached" in last and "local file, folder or glob" in last


@pytest.mark.parametrize("n, fraction", [(20, 0.05), (1000, 0.01), (37, 0.1), (10, 0.0), (7, 0.5)])
def test_validation_split_takes_an_exact_even_share(n: int, fraction: float) -> None:
    held = [i for i in range(n) if is_validation(i, fraction)]
    assert len(held) == int(n * fraction + 1e-9)
    if len(held) > 1:  # spread through the corpus, not bunched at one end
        gaps = {b - a for a, b in zip(held, held[1:])}
        assert max(gaps) - min(gaps) <= 1


def test_split_caps_documents_and_is_deterministic() -> None:
    pieces = [(f"doc {i // 2} part {i % 2}", i % 2 == 1) for i in range(200)]  # 100 documents of two pieces
    split = list(split_documents(iter(pieces), 40, 0.1))
    assert [(text, ends) for text, ends, _ in split] == pieces[:80]
    assert sum(held for _, ends, held in split if ends) == 4
    assert all(split[i][2] == split[i + 1][2] for i in range(0, 80, 2))  # both pieces go where their document goes
    assert split == list(split_documents(iter(pieces), 40, 0.1))
    assert list(training_pieces(iter(pieces), 40, 0.1)) == [text for text, _, held in split if not held]


def odd_source(tmp_path: Path, kind: str) -> Path:
    """A path that exists (or seems to) but is no regular file or folder."""
    path = tmp_path / "corpus.txt"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        path.symlink_to(tmp_path / "other.txt")
        (tmp_path / "other.txt").symlink_to(path)
    elif kind == "dangling":
        path.symlink_to(tmp_path / "gone.txt")
    else:
        return Path(kind)
    return path


@pytest.mark.parametrize(("kind", "said"), [
    ("/dev/zero", "is a character device"), ("fifo", "is a named pipe (FIFO)"), ("loop", "is a symbolic link loop"),
    ("dangling", "is a symbolic link to ")])
def test_an_odd_file_as_the_source_is_named_for_what_it_is(tmp_path: Path, kind: str, said: str) -> None:
    """Reading /dev/zero or a FIFO would never end; each is refused at once, for what it is, not as missing."""
    path = odd_source(tmp_path, kind)
    with pytest.raises(UserError, match=re.escape(f"data.source {path} {said}")) as refused:
        local_files(str(path), "train")
    assert "does not exist;" not in str(refused.value)
