"""Every process below a command, collected while it runs, so a test can prove that none of them outlived it.

A pid the kernel hands out again later is told apart from ours by its creation time. Shared by the end-to-end tests
that start real entry points (tests/test_fault_matrix.py, tests/test_bad_inputs.py).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

POLL = 0.02  # seconds between two walks of the tree: short-lived children are still caught, the CPU barely notices


class Descendants:
    """Every process below `root`, collected by a thread until `stop()` or until `root` is gone."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, float] = {}  # pid → creation time
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        while not self.done.is_set():
            try:
                children = psutil.Process(self.root).children(recursive=True)
            except psutil.Error:
                return  # the root is gone: what it left behind is now parented elsewhere, and already recorded
            for p in children:
                try:
                    self.seen.setdefault(p.pid, p.create_time())
                except psutil.Error:
                    continue
            time.sleep(POLL)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def alive(self) -> list[psutil.Process]:
        """The recorded processes still running (a zombie has finished; it only waits for its parent)."""
        left = []
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                continue
        return left

    def survivors(self, timeout: float) -> list[psutil.Process]:
        """Those still alive after up to `timeout` seconds (PDEATHSIG and the sentinel act within milliseconds)."""
        deadline = time.monotonic() + timeout
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(POLL)
        return left

    def kill(self) -> None:
        """Clean-up after a failed test: SIGKILL whatever is still alive."""
        for p in self.alive():
            try:
                p.kill()
            except psutil.Error:
                pass


@contextmanager
def watching(proc: subprocess.Popen) -> Iterator[Descendants]:
    """Collect `proc`'s descendants while the block runs; on the way out, however the test went, kill `proc` and every
    descendant still alive, so a failing test never leaves processes behind for the next one."""
    tree = Descendants(proc.pid)
    try:
        yield tree
    finally:
        tree.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tree.kill()
