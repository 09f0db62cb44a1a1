"""Durable, atomic publication of folders and files: what the dataset cache and checkpoints share.

Both write into a temporary name, flush every byte to disk, then rename into place, so a reader sees either the old
complete version or the new complete one, never a half-written one, even after a power loss (the rename is only
durable once the parent folder is fsynced too).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trainer.errors import UserError

MIN_FREE_BYTES = 1 << 20  # a folder a run writes into with less than this free is full for it


def free_bytes(folder: Path) -> int | None:
    """The bytes an unprivileged writer may still use on `folder`'s file system; None where it cannot be asked or the
    file system reports no size at all (some FUSE mounts), so that such a folder is never taken for a full one."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def check_writable(folder: Path, what: str, fix: str) -> None:
    """Write a scratch file where `folder` is or would be created (the folder itself, else its nearest existing
    parent): a folder the run cannot write (permissions, a read-only mount, a file in the way, a symbolic link that
    leads nowhere, a name too long, a full disk) is one line naming `what` it is for and the `fix`, before any work
    that would write there. Nothing is created, so a run that cannot start leaves no folder behind, and ranks or runs
    checking the same folder at once cannot trip each other up."""
    try:
        existing = nearest_existing(folder)
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=existing):
            pass
        free = free_bytes(existing)  # an empty file fits on a full disk: its free space is asked for too
        if free is not None and free < MIN_FREE_BYTES:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}, {free:,} bytes free")
    except OSError as e:
        raise UserError(f"{what} {folder} is not writable ({e.strerror or e}); {fix}") from None


def nearest_existing(folder: Path) -> Path:
    """`folder`, else its nearest parent that exists. A symbolic link on the way that leads nowhere (to nothing, or
    round in a loop) is an OSError naming it: creating the folder there would fail with a baffling 'File exists'."""
    for path in (folder, *folder.parents):
        if path.is_symlink() and not path.exists():
            try:
                os.stat(path)
            except OSError as e:
                raise OSError(e.errno, f"{path} is a symbolic link that leads nowhere: {e.strerror}") from None
        if path.exists():
            return path
    return folder


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and folder under `path` (or the file `path`) to disk."""
    if path.is_file():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        return
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(folder))


def write_json_durably(path: Path, value: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(value, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def publish(tmp: Path, final: Path, aside: Path) -> None:
    """Move the finished `tmp` (a folder or a file) to `final` atomically.

    An older `final` is first renamed to `aside` and deleted once the new one is in place: `os.replace` cannot
    replace a non-empty folder, and a crash in between leaves `aside`, which the caller's clean-up knows by its name.
    """
    fsync_tree(tmp)
    shutil.rmtree(aside, ignore_errors=True)  # what a crash between the two renames left behind
    if final.is_dir():
        os.rename(final, aside)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
