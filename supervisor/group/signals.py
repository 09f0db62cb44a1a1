"""Signals as readable events: the watcher's loop sleeps in one ``select`` and wakes for a signal like for any fd.

``signal.set_wakeup_fd`` makes the C-level handler write each signal's number to a non-blocking pipe the moment it
arrives; the Python handlers do nothing. SIGCHLD is how the loop learns that a rank exited (no polling); SIGINT,
SIGTERM, SIGHUP and SIGUSR1 are the stop requests (SIGINT no longer raises KeyboardInterrupt once installed). SIGUSR1 is
Slurm's warning before the time limit (``#SBATCH --signal=B:USR1@120``, which the job script passes on to a supervisor
alone: a rank answers SIGUSR1 with a stack dump, `supervisor.slurm.job`): the same graceful stop, every rank
checkpoints, and the supervisor exits 138 (128 + 10) so the job script can requeue a run that ``--resume auto``
continues.

Before any rank runs (the nodes joining, the dataset build), a stop signal is an exception instead (`interruptible`):
the first raises `Interrupted` where the supervisor is, and it stops what it was doing, its build child included.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The wakeup fd carries the signal; the handler only has to exist (and to not raise)."""


class Interrupted(Exception):
    """A stop signal received while no rank runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def interruptible() -> Iterator[None]:
    """While no rank runs: the first stop signal raises `Interrupted` in the main thread, and the later ones are
    ignored, so that an impatient second Ctrl-C cannot cut short the clean-up that follows (a build waits for the batch
    being encoded; the other nodes are told, the sentinel dismissed). Left without an interruption, the handlers before
    are restored; after one they stay ignored: the supervisor is on its way out."""
    interrupted: list[int] = []

    def first(signum: int, frame: FrameType | None) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        interrupted.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, first) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        if not interrupted:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def on_stop_signal(callback: Callable[[], None]) -> Iterator[None]:
    """While the supervisor winds down (the ranks gone): a stop signal calls `callback` (it may cut a wait short)
    instead of killing the supervisor half-way through its clean-up. The handlers before are restored after."""
    previous = {sig: signal.signal(sig, lambda signum, frame: callback()) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class SignalInbox:
    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        for fd in (self.fd, self._write_fd):
            os.set_blocking(fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, _ignore) for sig in (*STOP_SIGNALS, signal.SIGCHLD)}
        self.pending: list[int] = []

    def read(self) -> list[int]:
        """Every signal received since the last call, in order (SIGCHLD included)."""
        got, self.pending = self.pending, []
        while True:
            try:
                data = os.read(self.fd, 256)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            got.extend(data)
        return got

    def peek_stop(self) -> int | None:
        """The first stop signal received so far, if any, without losing it (between groups of a restart)."""
        self.pending = self.read()
        return next((s for s in self.pending if s in STOP_SIGNALS), None)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        os.close(self.fd)
        os.close(self._write_fd)
