"""One rank: spawned in its own process group, tied to the supervisor's life, signalled and reaped by pid.

- Own session (``setsid``): a Ctrl-C at the terminal reaches only the supervisor, which decides what the ranks get;
  and the rank's children (DataLoader workers) share its process group, so one ``killpg`` takes the whole tree.
- ``PR_SET_PDEATHSIG=SIGKILL`` in the child before ``exec``: if the supervisor dies, even by SIGKILL, the kernel
  kills the rank. The child then checks that its parent is still the supervisor, closing the race in which the
  supervisor died between ``fork`` and ``prctl``. (The signal follows the death of the *thread* that forked, so
  ranks are always spawned from the main thread.)
- Three pipes: stdout and stderr (enlarged to 1 MiB so a chatty rank rarely blocks), and the progress channel,
  whose write end the rank inherits as ``SUPERVISOR_PROGRESS_FD``.
- Stdin: rank 0 reads the supervisor's (pdb at a ``breakpoint()``, ``input()``), as it would under torchrun; every
  other rank reads /dev/null, so that no typed line goes to a rank nobody watches. Rank 0 has no controlling
  terminal (its own session), so it reads the terminal without job control: Ctrl-C still reaches only the supervisor.

Exit detection is the watcher's job: each worker has a pidfd (Linux 5.3+) that becomes readable when the rank
exits, so the watcher's ``select`` learns of exits in the order they happened; on older kernels SIGCHLD wakes the
loop instead. Either way this class peeks with ``waitid(WNOWAIT)`` and kills the process group while the dead
leader still holds its pid (so no pid reuse can redirect that ``killpg``), and only then reaps.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from supervisor.plan.spec import RankSpec
from trainer.progress import PROGRESS_FD_ENV

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPE_SIZE = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphans of our ranks (a grandchild whose rank died first) get re-parented to us instead of init, so the
    final sweep of our descendants finds them."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def enlarge_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass  # over /proc/sys/fs/pipe-max-size: the default 64 KiB still works, just with more wake-ups


def exit_code_of(status: int) -> int:
    """A wait status as a shell would report it: the exit code, or 128 + signal number."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def describe_exit(code: int) -> str:
    """``exit 3``, or ``SIGKILL (137)`` for a code that stands for a signal."""
    if code > 128 and code - 128 in signal.valid_signals():
        return f"{signal.Signals(code - 128).name} ({code})"
    return f"exit {code}"


@dataclass
class RankPipes:
    """A rank's three pipes, (read end, write end) each: stdout and stderr (enlarged to 1 MiB so a chatty rank rarely
    blocks) and the progress channel (its read end non-blocking)."""

    stdout: tuple[int, int]
    stderr: tuple[int, int]
    progress: tuple[int, int]

    def write_ends(self) -> list[int]:
        return [self.stdout[1], self.stderr[1], self.progress[1]]

    def close_write_ends(self) -> None:
        for fd in self.write_ends():
            os.close(fd)

    def close_read_ends(self) -> None:
        for fd in (self.stdout[0], self.stderr[0], self.progress[0]):
            os.close(fd)


def rank_pipes() -> RankPipes:
    pipes = RankPipes(os.pipe(), os.pipe(), os.pipe())
    for fd in (pipes.stdout[0], pipes.stderr[0]):
        enlarge_pipe(fd)
    os.set_blocking(pipes.progress[0], False)
    return pipes


@dataclass
class Adopted:
    """A rank the supervisor did not spawn itself but is the parent of (forked by the standby): its pid, and its exit
    code once reaped, as a Popen's."""

    pid: int
    returncode: int | None = None


@dataclass
class Worker:
    spec: RankSpec
    process: subprocess.Popen | Adopted
    stdout_fd: int  # read ends, owned by the pump
    stderr_fd: int
    progress_fd: int  # read end, owned by the watcher (non-blocking)
    started: float  # time.monotonic()
    exit_code: int | None = None  # set once reaped
    ended: float | None = None
    term_sent_at: float | None = None
    killed: bool = False  # its group got SIGKILL from us
    pidfd: int | None = None  # readable once the rank has exited; None where the kernel has no pidfd_open

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def forked(self) -> bool:
        """Forked by the standby (`supervisor.group.standby`) rather than spawned."""
        return isinstance(self.process, Adopted)

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    @classmethod
    def spawn(cls, spec: RankSpec, argv: list[str], env: dict[str, str], stdin: bool = False) -> "Worker":
        """`stdin`: the rank reads the supervisor's stdin, else /dev/null."""
        pipes = rank_pipes()
        try:
            process = subprocess.Popen(argv, env={**env, PROGRESS_FD_ENV: str(pipes.progress[1])},
                                       stdin=None if stdin else subprocess.DEVNULL, stdout=pipes.stdout[1],
                                       stderr=pipes.stderr[1], pass_fds=(pipes.progress[1],),
                                       start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
        except BaseException:
            pipes.close_read_ends()
            raise
        finally:
            pipes.close_write_ends()
        return cls.adopt(spec, process, pipes)

    @classmethod
    def adopt(cls, spec: RankSpec, process: subprocess.Popen | Adopted | int, pipes: RankPipes) -> "Worker":
        """The Worker of a rank that is already the supervisor's child: spawned here, or forked by the standby and
        re-parented here (`supervisor.group.standby`: `process` is then its pid)."""
        process = Adopted(process) if isinstance(process, int) else process
        try:
            pidfd: int | None = os.pidfd_open(process.pid)
        except (AttributeError, OSError):
            pidfd = None
        return cls(spec, process, pipes.stdout[0], pipes.stderr[0], pipes.progress[0], time.monotonic(), pidfd=pidfd)

    def has_exited(self) -> bool:
        """True once the rank is a zombie; does not reap it."""
        if not self.alive:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def reap(self) -> int:
        """Kill what is left of its process group, then collect the exit code (blocks until it has exited)."""
        self.killpg()
        try:
            _, status = os.waitpid(self.pid, 0)
            self.exit_code = exit_code_of(status)
        except ChildProcessError:  # reaped elsewhere: nothing more to learn
            self.exit_code = self.exit_code if self.exit_code is not None else 1
        self.process.returncode = self.exit_code
        self.ended = time.monotonic()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        return self.exit_code

    def signal(self, sig: int) -> None:
        """Signal the rank process itself (not its children), if it has not been reaped."""
        if self.alive:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        if self.alive and self.term_sent_at is None:
            self.term_sent_at = time.monotonic()
            self.signal(signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL the rank's whole process group: the rank and every child that stayed in its group."""
        if self.alive and not self.has_exited():
            self.killed = True
        self.killpg()

    def killpg(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def run_time(self) -> float:
        return (self.ended or time.monotonic()) - self.started
