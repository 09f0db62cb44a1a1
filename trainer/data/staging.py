"""Building a folder among concurrent builders, and surviving a builder killed at any instant: the lock, the
private staging folder beside the final one, atomic publication, and removing what dead builders left behind.

The token cache and the trained tokenizers build this way (`trainer.data.cache`): a final folder only ever appears
complete, by rename, so readers never lock; `.build-<name>-<pid>-<start time>/` names its owner, so a leftover whose
owner is gone (psutil, the start time guarding against pid reuse) is deleted by the next run.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
from filelock import FileLock, Timeout

from trainer import durable
from trainer.data.build_progress import BuildProgress
from trainer.errors import UserError

LOCKS_DIR = ".locks"
BUILD_PREFIX = ".build-"
TRASH_PREFIX = ".trash-"
# Bytes the longest path built in the cache folder adds to it, with margin (tokenizers/.build-<key>-<pid>-<start
# time>/tokenizer_config.json: 94).
ROOM_BELOW = 128


def process_tag() -> str:
    """pid and start time (ms): a folder's owner is alive only if both still match (pids get reused)."""
    return f"{os.getpid()}-{round(psutil.Process().create_time() * 1000)}"


def owner_alive(folder_name: str) -> bool:
    match = re.search(r"-(\d+)-(\d+)$", folder_name)
    if match is None:
        return False
    pid, started_ms = int(match.group(1)), int(match.group(2))
    try:
        return abs(round(psutil.Process(pid).create_time() * 1000) - started_ms) < 2000
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # exists, someone else's: leave it


def remove_dead_leftovers(parent: Path) -> list[Path]:
    """Delete the temporary and trash folders of builders that no longer run (killed, crashed, power lost)."""
    removed = []
    if parent.is_dir():
        for entry in parent.iterdir():
            if entry.name.startswith((BUILD_PREFIX, TRASH_PREFIX)) and not owner_alive(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def ensure_writable(root: Path) -> None:
    """The cache folder and its locks' folder, created where missing; refused first, with nothing created, when its
    path leaves no room for the paths built below it (the OS would refuse them only once the folders above exist)."""
    limit = os.pathconf("/", "PC_PATH_MAX")
    if len(os.fsencode(root)) + ROOM_BELOW > limit:
        raise UserError(f"the cache folder {root} is a path of {len(os.fsencode(root)):,} bytes, too long for the "
                        f"files built in it (a path holds at most {limit:,} bytes here); set data.cache_dir to a "
                        f"shorter path")
    durable.check_writable(root, "the cache folder",
                           "set data.cache_dir to a writable folder, e.g. --set data.cache_dir=/tmp/token-cache")
    (root / LOCKS_DIR).mkdir(parents=True, exist_ok=True)


@contextmanager
def build_lock(root: Path, name: str, progress: BuildProgress) -> Iterator[None]:
    """Exclusive across processes (and hosts sharing the folder, where the file system honours flock)."""
    lock = FileLock(root / LOCKS_DIR / f"{name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        progress.message(f"waiting for another process that is building {name}")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def staging(parent: Path, name: str, what: str) -> Iterator[Path]:
    """A private temporary folder beside the final one (same file system, so the rename is atomic); always removed
    unless published. Disk-full and permission errors, and the folder deleted under the build (a clean-up of the
    cache folder), become one clear UserError."""
    folder = parent / f"{BUILD_PREFIX}{name}-{process_tag()}"
    made = False
    try:
        folder.mkdir(parents=True)
        made = True
        yield folder
    except Exception as e:
        if made and not folder.is_dir():  # whatever failed first (a write, the rename), this is why
            gone = folder if parent.is_dir() else parent
            raise UserError(f"{gone} was deleted while the {what} was being built in it; nothing was kept: run again, "
                            f"and leave {parent} alone while it builds") from None
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"no space left on the device while writing the {what} in {parent}; free some space or "
                            f"set data.cache_dir to a folder on a larger disk") from None
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise UserError(f"cannot write the {what} in {parent} ({e.strerror}); set data.cache_dir to a writable "
                            f"folder") from None
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def publish(folder: Path, final: Path) -> None:
    """Make a finished folder visible atomically; an older one in the way goes to a trash folder tagged like a build's,
    so a crash in between leaves nothing `remove_dead_leftovers` would not clean."""
    durable.publish(folder, final, aside=final.parent / f"{TRASH_PREFIX}{final.name}-{process_tag()}")
