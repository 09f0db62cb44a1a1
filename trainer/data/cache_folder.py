"""The cache folder as `prepare_dataset.py --list` and `--remove` see it: every token cache with its validation status,
and the safe removal of one.

Building and opening a cache is `trainer.data.cache`; this module only reads manifests and renames folders, under the
same per-key lock a builder takes, so a cache is never removed while it is being written.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.data.build_progress import BuildProgress
from trainer.data.cache import manifest_problem, read_manifest
from trainer.data.staging import TRASH_PREFIX, build_lock, ensure_writable, process_tag
from trainer.errors import UserError

KEY_PATTERN = re.compile(r"[0-9a-f]{32}")  # a cache folder's name: its key (staging and lock folders start with '.')


@dataclass
class CacheEntry:
    key: str
    path: Path
    bytes: int
    age_seconds: float
    manifest: dict[str, Any] | None  # None when unreadable
    problem: str | None  # why it does not validate, None when it does


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def list_caches(root: Path) -> list[CacheEntry]:
    """Every token cache under `root`, newest first, with its validation status (a bounded read each)."""
    entries = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not (folder.is_dir() and KEY_PATTERN.fullmatch(folder.name)):
            continue
        try:
            manifest: dict[str, Any] | None = read_manifest(folder)
            problem = manifest_problem(folder, manifest)
        except UserError as e:
            manifest, problem = None, str(e)
        created = (manifest or {}).get("build", {}).get("created") or folder.stat().st_mtime
        entries.append(CacheEntry(key=folder.name, path=folder, bytes=folder_bytes(folder),
                                  age_seconds=time.time() - created, manifest=manifest, problem=problem))
    return sorted(entries, key=lambda e: e.age_seconds)


def remove_cache(root: Path, key: str) -> Path:
    """Remove the cache whose key is `key` (or a unique prefix of it), waiting for a build of it to finish first."""
    if not key.strip():  # a prefix of every key: refused, not taken as "all" nor as "none"
        raise UserError("--remove needs a cache key (or a unique prefix of one), got an empty one; "
                        "prepare_dataset.py --list shows the keys")
    matches = [e.path for e in list_caches(root) if e.key.startswith(key.lower())]
    if len(matches) != 1:
        found = "no cache" if not matches else f"{len(matches)} caches"
        raise UserError(f"{found} in {root} match key '{key}'; see prepare_dataset.py --list")
    final = matches[0]
    ensure_writable(root)
    with build_lock(root, final.name, BuildProgress("off")):
        trash = root / f"{TRASH_PREFIX}{final.name}-{process_tag()}"
        os.rename(final, trash)
        shutil.rmtree(trash)
    return final
