"""Quiet is not hung: a rank of a program that reports nothing, in its own code and waiting for something of its own.

A program written for torchrun is watched by its output and CPU time (`supervisor.group.liveness`). When no rank of
any node showed either for ``--hang-timeout``, one rank may still be doing its work: asleep (``time.sleep``), reading
a file or a socket of its own, waiting on its input (stdin, ``input()``) or on a child process, while the others wait
for it in a collective and go on when it comes. Its Python stack (py-spy) is in its own code, and the system call its
main thread is blocked in (``/proc/<pid>/syscall``, which the supervisor, an ancestor of the rank, may read under the
same rules as py-spy) says what it waits for:

* **quiet**: a sleep (``clock_nanosleep``, ``nanosleep``); a read (``read`` and its kin) of a file, a pipe, a
  terminal or a socket (``/proc/<pid>/fd/<n>`` names it), or an open of a file; a socket's ``recv``, ``accept`` or
  ``connect``; ``poll``, ``select`` or ``epoll`` (its own files or sockets); ``wait4``/``waitid`` (its child process);
* **stuck**: anything else: a ``futex`` (a lock, a condition, a queue: with no CPU time used anywhere in the group,
  nobody will release it), a read of an eventfd (the same, between threads), a system call not in this table, or a
  main thread that could not be read;
* except that a main thread waiting on a lock may wait for a thread of its own (``Future.result()``,
  ``Thread.join()``, ``Event.wait()``): when another Python thread of the rank (py-spy names each with its OS thread
  id) is itself in one of the quiet waits above, in the rank's own code, the rank is quiet in that thread's wait.
  A lock with no such thread behind it (a deadlock, a thread stuck on a lock too) is still stuck.

A node's ranks, read this way, give its `Finding`: **stalled** when one is stopped (SIGSTOP, a debugger), stuck, or
unread (no stack); else **quiet** when one is quiet (the others then all wait in a collective or the rendezvous);
else **waits** (every rank waits for another: on one node, a stall; across nodes, every node's finding decides,
`supervisor.diagnosis.verdicts.NodeFindings`). A rank found on the CPU makes it **busy**. Never a stop for quiet: the
watchdog looks again after another hang timeout.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.control.wire import BUSY, QUIET, WAITS
from supervisor.diagnosis.culprit import joining, own_frame, waiting_in
from supervisor.diagnosis.stacks import RankRead, Thread

SLEEP, READ, OPEN, SOCKET, POLL, CHILD = "a sleep", "read", "an open of a file", "a socket", \
    "a wait on its own files or sockets", "a wait for its child process"
LOCK = "a lock, a condition or a queue (another thread)"
UNKNOWN = "a wait this table does not know"
QUIET_WAITS = (SLEEP, READ, OPEN, SOCKET, POLL, CHILD)
STALLED = "stalled"  # a node's own finding only: it stops the run at once (the other findings: supervisor.control.wire)
QUIET_WORDS = " is quiet in "
# system call number → (its name, what a rank blocked in it waits for), per architecture (x86_64's own table; aarch64
# has the generic one, without poll, select and epoll_wait)
SYSCALLS = {
    "x86_64": {0: ("read", READ), 17: ("pread64", READ), 19: ("readv", READ), 295: ("preadv", READ),
               327: ("preadv2", READ), 45: ("recvfrom", SOCKET), 47: ("recvmsg", SOCKET), 299: ("recvmmsg", SOCKET),
               43: ("accept", SOCKET), 288: ("accept4", SOCKET), 42: ("connect", SOCKET), 7: ("poll", POLL),
               23: ("select", POLL), 271: ("ppoll", POLL), 270: ("pselect6", POLL), 232: ("epoll_wait", POLL),
               281: ("epoll_pwait", POLL), 441: ("epoll_pwait2", POLL), 35: ("nanosleep", SLEEP),
               230: ("clock_nanosleep", SLEEP), 61: ("wait4", CHILD), 247: ("waitid", CHILD), 2: ("open", OPEN),
               257: ("openat", OPEN), 202: ("futex", LOCK)},
    "aarch64": {63: ("read", READ), 67: ("pread64", READ), 65: ("readv", READ), 69: ("preadv", READ),
                286: ("preadv2", READ), 207: ("recvfrom", SOCKET), 212: ("recvmsg", SOCKET), 243: ("recvmmsg", SOCKET),
                202: ("accept", SOCKET), 242: ("accept4", SOCKET), 203: ("connect", SOCKET), 73: ("ppoll", POLL),
                72: ("pselect6", POLL), 22: ("epoll_pwait", POLL), 441: ("epoll_pwait2", POLL),
                101: ("nanosleep", SLEEP), 115: ("clock_nanosleep", SLEEP), 260: ("wait4", CHILD),
                95: ("waitid", CHILD), 56: ("openat", OPEN), 98: ("futex", LOCK)},
}


@dataclass(frozen=True)
class Blocked:
    """Where a main thread is blocked in the kernel: the system call's name and what it waits for; `quiet` when that
    is something of the rank's own (a sleep, its files, sockets, input or child), not another thread or rank."""

    syscall: str
    what: str
    quiet: bool


RUNNING = Blocked("running", "the CPU", False)


def blocked(pid: int, tid: int | None = None) -> Blocked | None:
    """The system call of the main thread (or of thread `tid`), from ``/proc`` (`RUNNING` when it is on the CPU);
    None when it cannot be read (the process is gone, or reading it is not permitted)."""
    try:
        words = Path(f"/proc/{pid}/task/{tid or pid}/syscall").read_text().split()
    except OSError:
        return None
    if words[:1] == ["running"]:
        return RUNNING
    if not words or not words[0].isdigit():  # "-1": blocked outside any system call (a page fault)
        return Blocked("no system call", "the kernel", False)
    number = int(words[0])
    name, what = SYSCALLS.get(platform.machine(), {}).get(number, (f"system call {number}", UNKNOWN))
    if what == READ:
        return read_of(pid, int(words[1], 16) if len(words) > 1 else -1, name)
    return Blocked(name, what, what in QUIET_WAITS)


def read_of(pid: int, fd: int, syscall: str) -> Blocked:
    """A blocked read, by what its file descriptor is: a socket, a pipe, a terminal or a file is the rank's own
    input; an eventfd or another anonymous inode is a wake-up between threads (a lock by another name)."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return Blocked(syscall, f"a read of file descriptor {fd}", False)
    if target.startswith("anon_inode:"):
        return Blocked(syscall, f"a read of {target.removeprefix('anon_inode:')}", False)
    kind = ("a socket" if target.startswith("socket:") else "a pipe" if target.startswith("pipe:") else
            "a terminal" if target.startswith(("/dev/pts/", "/dev/tty")) else target)
    return Blocked(syscall, f"a read of its stdin, {kind}" if fd == 0 else f"a read of {kind}", True)


@dataclass
class Finding:
    """What a node's ranks showed when no rank had made progress for the hang timeout (the module's docstring)."""

    kind: str  # QUIET, WAITS or BUSY (supervisor.control.wire), or STALLED
    quiet: list[str] = field(default_factory=list)  # one line per quiet rank: who, waiting for what, where
    waiting: bool = False  # a rank of this node waits in a collective or the rendezvous

    @property
    def text(self) -> str:
        """What the other nodes hear of it."""
        return "; ".join(self.quiet) if self.quiet else {WAITS: "every rank waits for another",
                                                          BUSY: "a rank was on the CPU"}.get(self.kind, self.kind)


def find(ranks: list[RankRead], node: int | None) -> Finding:
    """A node's finding from its ranks' stacks and process states (`node`: named in each line, on several nodes)."""
    quiet = []
    for r in ranks:
        main = r.stacks.main
        if r.stopped or not main:
            return Finding(STALLED)
        if waiting_in(main) or joining(main):
            continue
        how = blocked(r.pid)
        at = own_frame(main).short()
        if how is not None and how.what == LOCK and (helper := working_thread(r)) is not None:
            thread, how = helper
            at = f"{own_frame(thread.frames).short()} in thread {thread.name}, its main thread waiting at {at}"
        if how is RUNNING:
            return Finding(BUSY)
        if how is None or not how.quiet:
            return Finding(STALLED)
        where = "" if node is None else f", node {node}"
        quiet.append(f"{r.label} (rank {r.rank}{where}){QUIET_WORDS}{how.what} ({how.syscall}) at {at}")
    return Finding(QUIET if quiet else WAITS, quiet, waiting=len(quiet) < len(ranks))


def working_thread(r: RankRead) -> tuple[Thread, Blocked] | None:
    """Another Python thread of the rank, in its own code, that is on the CPU or in a quiet wait, with what it is in:
    what a main thread blocked on a lock may be waiting for (None: there is none, the lock is a stall)."""
    for thread in r.stacks.threads[1:]:
        if thread.tid is None or not thread.frames or waiting_in(thread.frames) or joining(thread.frames):
            continue
        how = blocked(r.pid, thread.tid)
        if how is not None and (how is RUNNING or how.quiet):
            return thread, how
    return None
