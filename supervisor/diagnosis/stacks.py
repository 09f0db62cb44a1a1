"""Every rank's Python stacks, read from outside without the rank's cooperation.

A program written for torchrun installs no handler for the stack request the project's own trainer answers
(SIGUSR1 → faulthandler): that signal would kill it. py-spy reads a CPython process's stacks from its memory instead
(``--nonblocking``: the process is not paused, and one that is stopped already — SIGSTOP, a debugger — is read as it
is), so a frozen rank gives its stack too. The dumps of every rank run at once, each bounded by `DUMP_TIMEOUT`.

py-spy is a dependency of the project (a binary installed beside the interpreter); where it is missing, or may not
read other processes (no ptrace permission in a container without ``SYS_PTRACE``), the dump says why instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.diagnosis.culprit import Frame, RankEvidence, Verdict, find_culprit, joining, waiting_in

DUMP_TIMEOUT = 10.0  # seconds for all the dumps: py-spy takes well under one per process
PY_SPY = "py-spy"
STOPPED = "while its process is stopped (SIGSTOP, or a debugger)"


@dataclass(frozen=True)
class Thread:
    """One Python thread of a rank, as py-spy read it."""

    name: str  # "MainThread" for the one whose OS thread id is the process id
    tid: int | None  # its OS thread id (/proc/<pid>/task/<tid>), where py-spy gave one
    frames: list[Frame]  # innermost first


@dataclass
class Stacks:
    """One rank's threads as py-spy read them, or why it could not."""

    pid: int
    threads: list[Thread] = field(default_factory=list)  # the main thread first
    error: str | None = None

    @property
    def main(self) -> list[Frame] | None:
        """The main thread's frames."""
        return next((t.frames for t in self.threads if t.name == "MainThread"), None)

    def text(self) -> list[str]:
        """The dump as lines for the console and the log, innermost frame first (as faulthandler prints)."""
        if self.error:
            return [f"no stack: {self.error}"]
        lines = []
        for thread in self.threads:
            lines.append(f"thread {thread.name}:")
            lines += [f"  {frame.func} ({frame.file}:{frame.line})" for frame in thread.frames]
        return lines


def find_py_spy() -> str | None:
    """The py-spy installed with this interpreter (a virtual environment's bin/), else one on PATH."""
    beside = Path(sys.executable).parent / PY_SPY
    return str(beside) if os.access(beside, os.X_OK) else shutil.which(PY_SPY)


def parse(pid: int, output: str) -> Stacks:
    """py-spy's ``--json`` dump: a list of threads, each with its frames innermost first."""
    threads = []
    for thread in json.loads(output):
        frames = [Frame(f.get("filename") or "?", int(f.get("line") or 0), f.get("name") or "?")
                  for f in thread.get("frames", [])]
        tid = thread.get("os_thread_id")
        name = "MainThread" if tid == pid else thread.get("thread_name") or "thread"
        threads.append(Thread(name, tid if isinstance(tid, int) else None, frames))
    threads.sort(key=lambda t: t.name != "MainThread")  # the main thread first
    return Stacks(pid, threads)


def dump(pids: list[int]) -> dict[int, Stacks]:
    """Every process's stacks, read concurrently; pid → its `Stacks` (with `error` set where none could be read)."""
    tool = find_py_spy()
    if tool is None:
        return {pid: Stacks(pid, error="py-spy is not installed (pip install py-spy)") for pid in pids}
    running = {pid: subprocess.Popen([tool, "dump", "--pid", str(pid), "--nonblocking", "--json"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL) for pid in pids}
    deadline = time.monotonic() + DUMP_TIMEOUT
    found = {}
    for pid, process in running.items():
        try:
            out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            found[pid] = Stacks(pid, error=f"py-spy did not answer within {DUMP_TIMEOUT:g} s")
            continue
        if process.returncode != 0:
            reason = next((line for line in err.splitlines() if line.strip()), f"exit {process.returncode}")
            found[pid] = Stacks(pid, error=f"py-spy: {reason.removeprefix('Error: ')}")
            continue
        try:
            found[pid] = parse(pid, out)
        except (ValueError, TypeError, AttributeError):
            found[pid] = Stacks(pid, error="py-spy's output was not the JSON it writes")
    return found


@dataclass
class RankRead:
    """One rank of a group that made no progress: its stacks as py-spy read them, and whether its process is stopped."""

    rank: int
    label: str
    pid: int
    stacks: Stacks
    stopped: bool

    def evidence(self) -> RankEvidence:
        return RankEvidence(self.rank, self.label, STOPPED if self.stopped else "while running", self.stacks.main)


def read(ranks: dict[int, tuple[str, int]]) -> list[RankRead]:
    """Every rank's stacks read from outside (`dump`) and its process state, by rank. `ranks`: rank → (label, pid)."""
    found = dump([pid for _, pid in ranks.values()])
    return [RankRead(rank, label, pid, found[pid], is_stopped(pid)) for rank, (label, pid) in sorted(ranks.items())]


def verdict_on(ranks: list[RankRead], whole_group: bool) -> Verdict:
    """The verdict on a stalled group of a program that reports nothing (`culprit.find_culprit`: the ranks in their
    own code while the others wait in a collective), a stopped process first. `whole_group`: these are every rank of
    the run (one node); on one of several nodes, a node whose ranks are all stopped names them, since the other
    nodes' ranks run and wait for them."""
    evidence = [r.evidence() for r in ranks]
    stopped = [e for r, e in zip(ranks, evidence) if r.stopped]
    verdict = find_culprit(evidence)
    if stopped and len(stopped) == len(evidence) and whole_group:  # a job suspended: nobody is singled out
        verdict.culprits, verdict.waits, verdict.method = [], {}, "process state: every rank is stopped"
    elif stopped:
        # A stopped process cannot run, wherever its stack stands (even inside a collective it was stopped in):
        # the ranks still running wait for it.
        verdict.culprits, verdict.method = stopped, "process state"
        verdict.waits = {e.name: f"{frame.short()}" for e in evidence if e not in stopped and e.stack
                         and (frame := waiting_in(e.stack))}
    return verdict


def waits(pids: list[int]) -> dict[int, tuple[Frame | None, Frame | None]]:
    """Each process's main thread read from outside (`dump`): the frame where it waits to join its process group,
    and, past that, the one where it waits for other ranks in a collective (None for either it is not in)."""
    found = {}
    for pid, stacks in dump(pids).items():
        if stacks.main is not None:
            joins = joining(stacks.main)
            found[pid] = (joins, None if joins is not None else waiting_in(stacks.main))
    return found


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a debugger: it cannot run until someone continues it."""
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False
