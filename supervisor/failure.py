"""The failure rule: which rank's failure is the run's, when ranks fail one after another.

The failure is the rank that failed first, not the first to exit: a rank that catches an error says ``failing`` on
the progress channel before it leaves its process group, and a peer whose collective that cuts short (gloo's
"Connection closed by peer") says so too, but may exit before it. So at the first non-zero exit (or death by a
signal) the records already in the pipes are read; if the exiting rank said ``failing``, the rank with the earliest
``failing`` record, when it is still running, is the failure: it is left to exit on its own (its exit code and its
headline come then), the others are stopped. A rank that exits without saying it (killed, crashed, or ended outside
the trainer's error handler) failed hard, and is the failure itself: the records its peers write once it is gone come
after its end, however early they are read.

While the failure is being settled, the other ranks' stderr stays off the console (`quiet_fallout`): their collectives
were cut short by the failure, and their tracebacks would bury its lines.
"""

from __future__ import annotations

from pathlib import Path

from supervisor.diagnosis import oom
from supervisor.pump import Stream
from supervisor.worker import Worker, describe_exit
from trainer.diagnosis.oom_report import OOM_EXIT_CODE


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

    def quiet_fallout(self, failing: int | None) -> None:
        """Keep the other ranks' stderr off the console from now on (it goes on into their log files). Called until
        the stop begins, each time with the earliest failure known (an earlier announcement read after a later one
        takes over); `None` quiets every rank here."""
        for rank, stream in self.tails.items():
            stream.mute(rank != failing)

    def detail(self, w: Worker, code: int) -> str:
        """The failure's headline."""
        if code == OOM_EXIT_CODE:
            return oom.describe(self.run_dir, w.label, w.spec.rank)
        if w.killed:
            return (f"{w.label} (rank {w.spec.rank}) failed: it reported an error, then was killed after the grace "
                    f"period ({describe_exit(code)})")
        return f"{w.label} (rank {w.spec.rank}) failed: {describe_exit(code)}"
