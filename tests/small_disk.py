"""A small disk for the tests of a full one: a tmpfs of a given size mounted on a folder, filled up on request.

Mounting needs root (a CI container usually is) and a kernel that allows it; where it cannot be had the test is
skipped with the reason. Shared by tests/test_bad_inputs.py (a folder full before the run) and
tests/test_fault_matrix.py (a folder that fills up while the run goes on).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

FILLER = "filler.bin"  # the file that fills a disk; a test's own checks leave it out


@contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """`folder` as a tmpfs of `size` (mount's syntax: 64k, 2m) for the duration; skips the test where no tmpfs can
    be mounted."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small disk needs a tmpfs mounted as root (mount -t tmpfs); this test runs without root")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or f'mount exited {mounted.returncode}'}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def fill(folder: Path) -> None:
    """Write into `folder` until its disk has no room left (ENOSPC), keeping what was written."""
    chunk = bytes(64 << 10)
    with open(folder / FILLER, "ab", buffering=0) as f:
        try:
            while True:
                f.write(chunk)  # a partial write at the end, then ENOSPC
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
