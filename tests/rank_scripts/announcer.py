"""Two ranks for the culprit rule: rank 1 fails first, rank 0 exits first.

Rank 1 announces its error (a ``failing`` record, as `trainer.loop.train` sends) and exits 7 only once the
supervisor has reaped rank 0; rank 0 exits 1 as soon as that announcement is out, as a peer whose collective the
failure cut short would ("Connection closed by peer"). The order is fixed by files in the folder given as the first
argument, not by timing, so the supervisor always sees rank 0's exit before rank 1's.
"""

from __future__ import annotations

import os
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
        time.sleep(0.01)


def main() -> None:
    folder, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    reporter = ProgressReporter()
    reporter.phase("startup")
    pid_file, announced = folder / "rank0.pid", folder / "announced"
    if rank == 0:
        pid_file.write_text(str(os.getpid()))
        wait_until(announced.exists, "announcement from rank 1")
        print("RuntimeError: Connection closed by peer", file=sys.stderr, flush=True)
        sys.exit(1)
    wait_until(pid_file.exists, "pid file from rank 0")
    reporter.failing()
    print("RuntimeError: the first error", file=sys.stderr, flush=True)
    announced.touch()
    rank0 = Path("/proc", pid_file.read_text())  # gone once the supervisor has reaped rank 0 (a zombie keeps it)
    wait_until(lambda: not rank0.exists(), "exit of rank 0")
    sys.exit(7)


if __name__ == "__main__":
    main()
