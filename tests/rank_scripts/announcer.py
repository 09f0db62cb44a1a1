"""Two ranks for the culprit rule, in the order of a failure and its fallout, fixed by process states and files in
the folder given as the first argument (never by timing). The second argument picks the failure:

- ``reported``: rank 1 reports its error (a ``failing`` record, as `trainer.loop.train` sends before it leaves the
  process group) and exits 7 only once the supervisor has reaped rank 0; rank 0, the peer whose collective that cut
  short ("Connection closed by peer"), reports its own error after rank 1's and exits 1 at once: it exits first.
- ``hard``: rank 1 exits 7 without a word (as a rank killed or crashed would); rank 0 reports its error once rank 1 is
  dead, then exits 1 once the supervisor's SIGTERM shows that it has handled rank 1's exit. Whether that report is
  read before then is the supervisor's timing; either way rank 1 failed first.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainer.progress import ProgressReporter

WAIT = 30.0


def wait_until(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not ready():
        if time.monotonic() > deadline:
            sys.exit(f"no {what} within {WAIT:g} s")
        time.sleep(0.001)


def dead(pid: int) -> Callable[[], bool]:
    """True once process `pid` has exited (a zombie, or reaped)."""
    stat = Path(f"/proc/{pid}/stat")

    def check() -> bool:
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    return check


def reaped(pid: int) -> Callable[[], bool]:
    """True once the supervisor has reaped process `pid` (a zombie keeps its /proc entry)."""
    return lambda: not Path(f"/proc/{pid}").exists()


def main() -> None:
    folder, failure, rank = Path(sys.argv[1]), sys.argv[2], int(os.environ["RANK"])
    stopped: list[int] = []
    if rank == 0:  # before its pid file: the supervisor's SIGTERM may follow rank 1's exit at once
        signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    reporter = ProgressReporter()
    reporter.phase("startup")
    mine, peer = folder / f"rank{rank}.pid", folder / f"rank{1 - rank}.pid"
    mine.with_suffix(".tmp").write_text(str(os.getpid()))
    mine.with_suffix(".tmp").replace(mine)  # whole when it appears
    wait_until(peer.exists, "pid file from the other rank")
    peer_pid = int(peer.read_text())
    reported = folder / "reported"
    if rank == 1:
        if failure == "hard":
            print("the first error, unreported", file=sys.stderr, flush=True)
            sys.exit(7)
        reporter.failing()
        print("RuntimeError: the first error", file=sys.stderr, flush=True)
        reported.touch()
        wait_until(reaped(peer_pid), "exit of rank 0")
        sys.exit(7)
    wait_until(reported.exists if failure == "reported" else dead(peer_pid), "failure of rank 1")
    reporter.failing()
    print("RuntimeError: Connection closed by peer", file=sys.stderr, flush=True)
    if failure == "hard":
        wait_until(lambda: bool(stopped), "SIGTERM from the supervisor")
    sys.exit(1)


if __name__ == "__main__":
    main()
