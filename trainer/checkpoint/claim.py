"""One run at a time writes a checkpoint folder: the run holds `.run.lock` in `checkpoint.dir` (filelock: the OS
drops the lock when its holder dies, a SIGKILL included) from just before its ranks start to its end, restarts
included, and a second run given the same folder is refused in one line naming the first, before it writes, prunes or
removes anything there. Without it, two experiments started from one working folder (both with the default
`.checkpoints/`, or both with `--resume auto`) would each take the other's checkpoints for their own: pruned as old,
removed as an earlier run's, resumed as the latest.

Who holds it: the supervisor of node 0, for every rank and group of its run; by hand and under torchrun, rank 0. It
is claimed once the data is ready, so a run that fails before leaves no folder; `.run.owner` beside the lock says who
holds it (pid, host, run folder), for the refusal's line; both files go with the claim (a killed holder leaves them,
and the next run takes them over). No torch import (the supervisor claims it).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from trainer.errors import UserError

LOCK_FILE = ".run.lock"
OWNER_FILE = ".run.owner"


@dataclass
class FolderClaim:
    """The lock on a checkpoint folder, held until `release` (or the holder's death)."""

    lock: FileLock | None

    @classmethod
    def take(cls, folder: Path, run_dir: Path | None) -> "FolderClaim":
        """Claim `folder` (made if missing) for the run in `run_dir` (None: not known yet), or refuse the run."""
        lock = FileLock(str(folder / LOCK_FILE), timeout=0)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "run": str(run_dir) if run_dir else None,
                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock.acquire()
            (folder / OWNER_FILE).write_text(json.dumps(owner) + "\n")
        except Timeout:
            raise in_use(folder) from None
        except OSError as e:  # its lock file or its note in the way (a folder of that name), or a folder gone
            lock.release()
            raise UserError(f"cannot claim the checkpoint folder {folder} for this run ({e.strerror or e}: "
                            f"{e.filename or folder}); set checkpoint.dir to a writable folder of its own") from None
        return cls(lock)

    def release(self) -> None:
        """Let go, leaving the folder as the run left it: the owner's note and the lock file removed while the lock is
        still held (a run starting meanwhile makes its own, and this one writes nothing more there)."""
        if self.lock is None:
            return
        folder = Path(self.lock.lock_file).parent
        for name in (OWNER_FILE, LOCK_FILE):
            (folder / name).unlink(missing_ok=True)
        self.lock.release()
        self.lock = None


def in_use(folder: Path) -> UserError:
    return UserError(f"checkpoint.dir {folder} is in use by another run ({holder(folder)}); wait for it to end, or "
                     f"give this run a folder of its own with --set checkpoint.dir=DIR")


def held(folder: Path) -> bool:
    """Whether a live run holds `folder`'s claim now (asked without making a lock file where there is none), so that
    what a run finds in the folder is not taken for an earlier run's while that run is still writing it."""
    if not (folder / LOCK_FILE).is_file():
        return False
    lock = FileLock(str(folder / LOCK_FILE), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return True
    except OSError:
        return False  # one this user cannot take: the claim itself says so when the run takes it
    lock.release()
    return False


def holder(folder: Path) -> str:
    """Who holds `folder`'s claim, as its `.run.owner` says."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
        run = f", run folder {owner['run']}" if owner.get("run") else ""
        return f"pid {int(owner['pid'])} on {owner['host']} since {owner['since']}{run}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it has not said who it is yet"
