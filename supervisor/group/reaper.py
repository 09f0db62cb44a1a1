"""A sentinel that kills every rank's process group when the supervisor dies without cleaning up.

PR_SET_PDEATHSIG takes the ranks down with a SIGKILLed supervisor, but not their children: a DataLoader worker or
any subprocess of a rank would survive as an orphan. So at start-up the supervisor forks this small sentinel (before
any thread exists, so the fork is safe) into a session of its own, where neither a terminal's Ctrl-C nor a
``kill -- -<pgid>`` aimed at the supervisor's group reaches it. The supervisor tells it over a pipe which process
groups exist (``+pgid`` / ``-pgid``). The pipe's write end lives only in the supervisor, so when the supervisor dies
for any reason the kernel closes it, the sentinel reads end-of-file and SIGKILLs every group it still knows.
A clean exit says ``exit`` first and nothing is killed.

The same sentinel removes what the supervisor keeps in the node's shared memory (/dev/shm: the ranks' memory copy of
the latest state, `trainer.checkpoint.memory`): the supervisor makes each such folder (`shared_folder`) and names it
to the sentinel (a line holding its absolute path), which removes it when the supervisor dies or exits cleanly,
after killing what it kills; no exit path leaves it taking the node's memory.

A descendant that left its rank's process group (``setsid``, a double-forked daemon) is out of reach of ``killpg``,
and with the supervisor gone it is re-parented to init, so no tree leads to it either. Such processes still carry
the run's environment, so the sentinel finally kills every process of ours whose environment holds
``SUPERVISOR_RUN_TOKEN=<this run's token>`` (the way some CI servers find a build's leftovers).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

TOKEN_ENV = "SUPERVISOR_RUN_TOKEN"
SHARED_MEMORY = Path("/dev/shm")  # tmpfs on Linux: files there live in memory, and outlive the process that wrote them


class Reaper:
    def __init__(self) -> None:
        self.token = os.urandom(16).hex()  # every rank's environment carries it (see Plan.rank_env's caller)
        self.kept: set[int] = set()  # children that outlive a group: the standby (supervisor.group.standby)
        read_end, self.fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the sentinel
            try:
                os.close(self.fd)
                sentinel(read_end, f"{TOKEN_ENV}={self.token}".encode())
            finally:
                os._exit(0)
        os.close(read_end)

    def _send(self, line: str) -> None:
        if self.fd >= 0:
            try:
                os.write(self.fd, line.encode() + b"\n")
            except OSError:
                pass

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def shared_folder(self, name: str) -> Path | None:
        """A new folder ``/dev/shm/<name>-<token>`` (private to this user) that the sentinel removes on every exit path;
        None where the node has no shared memory to make it in."""
        path = SHARED_MEMORY / f"{name}-{self.token[:8]}"
        try:
            path.mkdir(mode=0o700)
        except OSError:
            return None
        self._send(str(path))
        return path

    def sweep(self, wait: float) -> None:
        """Kill every process still below the supervisor but this sentinel and the kept ones (the standby, with
        their descendants): children that left their rank's process group, and orphans re-parented to the supervisor
        (a child subreaper). Then reap them (`wait` seconds at most), so none is left even as a zombie."""
        if direct_children() == {self.pid, *self.kept}:
            return  # the common case, known without walking the process table
        import psutil

        spared = {self.pid, *self.kept}
        for pid in self.kept:
            try:
                spared |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
            except psutil.Error:
                continue  # gone: its descendants, if any, are orphans to sweep
        try:
            leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid not in spared]
        except psutil.Error:
            return
        for p in leftovers:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(leftovers, timeout=wait)

    def close(self) -> None:
        """Dismiss the sentinel without killing anything (every group it knew is already gone)."""
        if self.fd < 0:
            return
        self._send("exit")
        os.close(self.fd)
        self.fd = -1
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def sentinel(read_end: int, marker: bytes) -> None:
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, read_end)
    os.closerange(read_end + 1, max(os.sysconf("SC_OPEN_MAX"), read_end + 2))
    groups: set[int] = set()
    folders: list[bytes] = []
    pending = b""
    while True:
        try:
            data = os.read(read_end, 4096)
        except InterruptedError:
            continue
        if not data:
            for pgid in groups:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except OSError:
                    pass
            kill_marked(marker)
            remove(folders)
            return
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line == b"exit":
                remove(folders)
                return
            if line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
            elif line[:1] == b"/":
                folders.append(line)


def remove(folders: list[bytes]) -> None:
    for folder in folders:
        shutil.rmtree(os.fsdecode(folder), ignore_errors=True)


def kill_marked(marker: bytes) -> None:
    """SIGKILL every process whose environment holds `marker`; twice, for anything forked during the first pass."""
    me = os.getpid()
    for _ in range(2):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker not in f.read().split(b"\0"):
                        continue
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue


def direct_children() -> set[int] | None:
    """Our child pids from /proc (every thread's list), or None where the kernel does not publish them.

    Anything below us hangs from a child of ours: ranks are reaped by now, and orphans come to us (subreaper)."""
    children: set[int] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
    except OSError:
        return None
    return children
