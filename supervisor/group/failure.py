"""The failure rule: which rank's failure is the run's, when ranks fail one after another.

The failure is the rank that failed first, not the first to exit: a rank that catches an error says ``failing`` on
the progress channel before it leaves its process group, and a peer whose collective that cuts short (gloo's
"Connection closed by peer") says so too, but may exit before it. So at the first non-zero exit (or death by a
signal) the records already in the pipes are read; if the exiting rank said ``failing``, the rank with the earliest
``failing`` record, when it is still running, is the failure: it is left to exit on its own (its exit code and its
headline come then), the others are stopped. A rank that exits without saying it (killed, crashed, or ended outside
the trainer's error handler) failed hard, and is the failure itself: the records its peers write once it is gone come
after its end, however early they are read.

A program that reports nothing (one written for torchrun) says no ``failing``. When its first error exit ended on a
lost peer (gloo's "Connection closed by peer", NCCL's remote error: `PEER_LOSS`), that peer may be the failure, still
on its way out: a program that ends with `sys.exit` closes its sockets in the interpreter's teardown, before its
process ends, and on a loaded machine the rank that lost it can exit first. That exit is a `Suspect`: the stop waits
for the peer's own error exit, `PEER_EXIT_WAIT` at most, and the peer that left is the failure if it comes; an exit
that does not end on a lost peer is never delayed. The rank's last lines are read once the pump has taken all it
wrote (`FalloutGate.settle_output`).

While the failure is being settled, the other ranks' stderr stays off the console (`quiet_fallout`): their collectives
were cut short by the failure, and their tracebacks would bury its lines. The pump's thread shows rank output while
the watcher's thread reads records and exits, so `FalloutGate` keeps their order: a rank's stderr lines reach the
console only once every ``failing`` record and exit that came before them has been handled (a failure comes before
its fallout: the failing rank says ``failing``, or exits, before the others' collectives break). Without it, on a
loaded machine the pump could be scheduled first and show the fallout the rule was about to mute.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.diagnosis import oom
from supervisor.group.pump import Stream
from supervisor.group.worker import Worker, describe_exit
from trainer.diagnosis.oom_report import OOM_EXIT_CODE
from trainer.errors import PEER_LOSS

SETTLE_WAIT = 1.0  # the longest a rank's stderr lines wait for the watcher to handle the events before them
OUTPUT_WAIT = 0.5  # the longest the watcher waits for the pump to take an exited rank's last stderr lines
PEER_LOSS_LINES = 10  # where the error a rank ended with is: its last lines of stderr
PEER_EXIT_WAIT = 3.0  # how long a lost-peer exit waits for the peer's own error exit before it is the failure
# What libstdc++ prints when a C++ thread object is destroyed while its thread still runs: in a rank, most often
# gloo's process group torn down in the interpreter's exit (a DDP model freed there), whose worker thread still frees
# a finished collective's tensors: the process aborts (SIGABRT) after its work is done, under torchrun as here.
TEARDOWN_ABORT = "terminate called without an active exception"
SIGABRT_EXIT = 128 + signal.SIGABRT


@dataclass
class Suspect:
    """A first error exit that ended on a lost peer, waiting `PEER_EXIT_WAIT` for that peer's own exit."""

    worker: Worker
    code: int
    until: float  # monotonic


class FailureRule:
    """The watcher's record of ``failing`` announcements, and what it concludes from them."""

    def __init__(self, run_dir: Path, tails: dict[int, Stream]) -> None:
        self.run_dir, self.tails = run_dir, tails
        self.failing: dict[int, float] = {}  # rank → when it said ``failing`` (wall clock, as it wrote the record)

    def announce(self, rank: int, at: float) -> None:
        """A ``failing`` record written at `at`, before the stop."""
        self.failing.setdefault(rank, at)
        self.quiet_fallout(self.first_failing())

    def first_failing(self) -> int:
        return min(self.failing, key=self.failing.__getitem__)

    def culprit(self, exited: Worker, workers: list[Worker]) -> Worker:
        """Whose failure the first error exit (`exited`) is: its own, unless it announced its error and an earlier
        announcer is still running (the exit is fallout of that rank's failure)."""
        if exited.spec.rank not in self.failing:
            return exited  # failed hard: nothing it said, so nothing earlier can be blamed
        first = next(w for w in workers if w.spec.rank == self.first_failing())
        return first if first.alive else exited

    def lost_a_peer(self, w: Worker, gate: FalloutGate) -> str | None:
        """The line of `w`'s last stderr lines (an exited rank's: all it wrote) that says a peer went away under it."""
        stream = self.tails[w.spec.rank]
        gate.settle_output(stream)
        return next((line for line in reversed(stream.tail_lines(PEER_LOSS_LINES))
                     if any(marker in line for marker in PEER_LOSS)), None)

    def aborted_at_teardown(self, w: Worker, gate: FalloutGate) -> bool:
        """Whether `w`'s last stderr line is libstdc++'s abort on a thread left running."""
        stream = self.tails[w.spec.rank]
        gate.settle_output(stream)
        return any(TEARDOWN_ABORT in line for line in stream.tail_lines(1))

    def quiet_fallout(self, failing: int | None) -> None:
        """Keep the other ranks' stderr off the console from now on (it goes on into their log files). Called until
        the stop begins, each time with the earliest failure known (an earlier announcement read after a later one
        takes over); `None` quiets every rank here."""
        for rank, stream in self.tails.items():
            stream.mute(rank != failing)

    def detail(self, w: Worker, code: int, gate: FalloutGate) -> str:
        """The failure's headline."""
        if code == SIGABRT_EXIT and self.aborted_at_teardown(w, gate):
            return (f"{w.label} (rank {w.spec.rank}) failed: {describe_exit(code)}, C++ threads still running as the "
                    f"process ended (\"{TEARDOWN_ABORT}\"): most often a gloo process group torn down in the "
                    f"interpreter's exit (a PyTorch race); end the program with os._exit(0) once its output is flushed")
        if code == OOM_EXIT_CODE:
            return oom.describe(self.run_dir, w.label, w.spec.rank)
        if w.killed:
            return (f"{w.label} (rank {w.spec.rank}) failed: it reported an error, then was killed after the grace "
                    f"period ({describe_exit(code)})")
        return f"{w.label} (rank {w.spec.rank}) failed: {describe_exit(code)}"


class FalloutGate:
    """The watcher handles events inside ``with gate:`` (never while it waits in ``select``); the pump calls `wait`
    before it shows a rank's stderr lines on the console."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.handling = threading.Condition()

    def __enter__(self) -> "FalloutGate":
        self.handling.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.handling.notify_all()
        self.handling.release()

    def wait(self) -> None:
        """Until no record or exit that has already arrived is waiting for the watcher, `SETTLE_WAIT` at most (the
        watcher may be busy; the lines then go on as they would without the gate)."""
        deadline = time.monotonic() + SETTLE_WAIT
        if not self.handling.acquire(timeout=SETTLE_WAIT):
            return
        try:
            while self.unhandled() and (left := deadline - time.monotonic()) > 0:
                self.handling.wait(left)
        finally:
            self.handling.release()

    def settle_output(self, stream: Stream) -> None:
        """Called by the watcher inside ``with gate``: wait, `OUTPUT_WAIT` at most and with the lock released (the pump
        may be waiting in `wait` with the lines in hand), until the pump has taken everything in `stream`'s pipe."""
        deadline = time.monotonic() + OUTPUT_WAIT
        while not stream.caught_up() and (left := deadline - time.monotonic()) > 0:
            self.handling.wait(min(left, 0.01))

    def unhandled(self) -> bool:
        """A progress pipe holds unread records (or its end), or a rank has exited unreaped. Called under the lock,
        so the watcher is not between reading an event and acting on it, nor closing these descriptors."""
        poller = select.poll()
        for w in self.workers:
            if w.progress_fd >= 0:
                poller.register(w.progress_fd, select.POLLIN)
            if w.alive and w.pidfd is not None:
                poller.register(w.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def close_records(self) -> None:
        """The watcher is done: close the progress pipes (under the lock, as `unhandled` polls them)."""
        with self.handling:
            for w in self.workers:
                if w.progress_fd >= 0:
                    os.close(w.progress_fd)
                    w.progress_fd = -1
