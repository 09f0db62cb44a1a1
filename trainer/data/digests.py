"""Content digests of files, and the memo that lets a launch skip re-reading the files that did not change.

The token cache's key includes a digest of every source file's bytes. Reading a large corpus on every launch would make
a hit cost O(bytes); `DigestMemo` remembers each file's digest under its stat — (path, size, mtime_ns, inode,
device) — in `<cache_dir>/.file-digests.json`, so a launch re-hashes only files whose stat changed and a hit costs
O(files). The trade-off is make's and rsync's: an edit that keeps a file's size and modification time (a tool that
restores mtimes, a clock set back) is not seen. `prepare_dataset.py --verify` re-reads every source file by content
(and refreshes the memo); deleting the memo file, or touching a file, forces the same.

A digest is remembered only when the file's stat did not change while it was read and its mtime is more than
`SETTLE_NS` in the past (git's "racily clean" rule: a file written in the same clock tick as it was hashed could be
written again without its mtime moving).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HASH_CHUNK = 1 << 20
MEMO_FILE = ".file-digests.json"
MEMO_VERSION = 1
SETTLE_NS = 2_000_000_000


def file_digest(path: Path, digest_size: int = 32) -> str:
    """blake2b of a file's bytes, read in chunks so a large file never sits in memory."""
    h = hashlib.blake2b(digest_size=digest_size)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest(value: Any) -> str:
    """The key of a JSON-able description (a cache's key material, a mixture): blake2b of its canonical JSON."""
    return hashlib.blake2b(canonical_json(value).encode(), digest_size=16).hexdigest()


def fingerprint(files: Iterable[Path], root: Path, digest: Callable[[Path], str] = file_digest) -> str:
    """One digest over (relative name, content) of every file: renaming, editing or adding a file changes it."""
    h = hashlib.blake2b(digest_size=16)
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(bytes.fromhex(digest(path)))
    return h.hexdigest()


def stamp(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev]


@dataclass
class DigestMemo:
    """File digests remembered under their stat. `rehash`: read every file anyway (and remember the result)."""

    path: Path  # the memo file
    rehash: bool = False
    entries: dict[str, list] = field(default_factory=dict)  # absolute path → stamp + [digest]
    changed: dict[str, list] = field(default_factory=dict)  # what this process learnt, merged in on save

    @classmethod
    def load(cls, folder: Path, rehash: bool = False) -> "DigestMemo":
        memo = cls(path=folder / MEMO_FILE, rehash=rehash)
        memo.entries = read_entries(memo.path)
        return memo

    def digest(self, path: Path) -> str:
        name = os.path.abspath(path)
        before = stamp(os.stat(name))
        entry = self.entries.get(name)
        if not self.rehash and entry is not None and entry[:4] == before:
            return entry[4]
        value = file_digest(path)
        if stamp(os.stat(name)) == before and time.time_ns() - before[1] > SETTLE_NS:
            self.entries[name] = self.changed[name] = [*before, value]
        return value

    def save(self) -> None:
        """Merge what was learnt into the memo file (another process may have saved meanwhile) and replace it
        atomically. Best effort: the memo is only a shortcut, so a folder that cannot be written is no error."""
        if not self.changed or not self.path.parent.is_dir():
            return
        entries = {**read_entries(self.path), **self.changed}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"version": MEMO_VERSION, "files": entries}))
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):  # a read-only file system refuses even to unlink a missing file
                tmp.unlink(missing_ok=True)
            return
        self.changed = {}


def read_entries(path: Path) -> dict[str, list]:
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict) or memo.get("version") != MEMO_VERSION or not isinstance(memo.get("files"), dict):
        return {}
    return {name: entry for name, entry in memo["files"].items() if isinstance(entry, list) and len(entry) == 5}
