"""Quiet is not hung, piece by piece: what a real process's main thread is blocked in (a sleep, its stdin, a socket,
its child: quiet; a lock: not), a node's finding on its ranks, the decision from every node's findings, the other
nodes' progress as heard, the messages that carry both, and the culprit across nodes named from evidence alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from supervisor.control.wire import BUSY, QUIET, WAITS, finding_message, parse_finding, parse_progress, progress_message
from supervisor.diagnosis import quiet
from supervisor.diagnosis.culprit import Frame
from supervisor.diagnosis.stacks import RankRead, Stacks, Thread, verdict_on
from supervisor.diagnosis.verdicts import NodeFindings, NodeVerdicts
from supervisor.group.liveness import OtherNodes

PROGRAMS = {
    "sleep": ("import time\ntime.sleep(60)", "clock_nanosleep", "a sleep", True),
    "input": ("input()", "read", "a read of its stdin, a pipe", True),
    "socket": ("import socket\na, b = socket.socketpair()\na.recv(1)", "recvfrom", "a socket", True),
    "child": ("import subprocess\nsubprocess.run(['sleep', '60'])", "wait4", "a wait for its child process", True),
    "lock": ("import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()", "futex", quiet.LOCK, False),
}


def blocked_program(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)


def settled(process: subprocess.Popen, syscall: str) -> quiet.Blocked | None:
    """The process's main thread once it is blocked in `syscall` (the interpreter starts first), or what it was in."""
    deadline = time.monotonic() + 20
    while (found := quiet.blocked(process.pid)) is None or found.syscall != syscall:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return found


@pytest.mark.parametrize("name", PROGRAMS)
def test_what_a_main_thread_waits_for_says_whether_it_is_quiet(name: str) -> None:
    code, syscall, what, is_quiet = PROGRAMS[name]
    process = blocked_program(code)
    try:
        assert settled(process, syscall) == quiet.Blocked(syscall, what, is_quiet)
    finally:
        process.kill()
        process.wait()


def rank(number: int, frames: list[Frame] | None, pid: int = 0, stopped: bool = False,
         helper: list[Frame] | None = None) -> RankRead:
    """A rank read as py-spy reads one; `helper`: the frames of its second thread, the process's other task."""
    threads = [Thread("MainThread", pid, frames)] if frames else []
    if helper is not None:
        tid = next(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        threads.append(Thread("worker", tid, helper))
    return RankRead(number, f"CPU{number}", pid, Stacks(pid, threads, None if frames else "no stack"), stopped)


OWN = [Frame("/x/train.py", 12, "main"), Frame("/x/train.py", 30, "<module>")]
WAITING = [Frame("/v/torch/distributed/distributed_c10d.py", 2800, "all_reduce"), *OWN]


def test_a_node_is_quiet_when_a_rank_of_its_own_sleeps_and_the_others_wait() -> None:
    sleeper = blocked_program(PROGRAMS["sleep"][0])
    locked = blocked_program(PROGRAMS["lock"][0])
    try:
        settled(sleeper, "clock_nanosleep")
        settled(locked, "futex")
        found = quiet.find([rank(0, OWN, sleeper.pid), rank(1, WAITING)], node=2)
        line = "CPU0 (rank 0, node 2) is quiet in a sleep (clock_nanosleep) at main (x/train.py:12)"
        assert found == quiet.Finding(QUIET, [line], waiting=True)
        assert quiet.find([rank(0, WAITING), rank(1, WAITING)], None).kind == WAITS
        # a lock nobody releases, a stopped process, a stack that could not be read: a stall
        for ranks in ([rank(0, OWN, locked.pid), rank(1, WAITING)], [rank(0, OWN, sleeper.pid, stopped=True)],
                      [rank(0, None, sleeper.pid), rank(1, OWN, sleeper.pid)]):
            assert quiet.find(ranks, None).kind == quiet.STALLED
    finally:
        for process in (sleeper, locked):
            process.kill()
            process.wait()


THREADED = """import threading, time
def work():
    {work}
thread = threading.Thread(target=work)
thread.start()
print(flush=True)
thread.join()"""
WORKING = [Frame("/x/train.py", 4, "work"), Frame("/usr/lib/python3.11/threading.py", 982, "run")]


def test_a_main_thread_waiting_for_its_own_thread_is_quiet_when_that_thread_is() -> None:
    """``Thread.join()`` (as ``Future.result()``, ``Event.wait()``): the main thread is on a lock, and the thread it
    waits for decides: asleep, it is quiet; on a lock of its own, a stall."""
    sleeping = blocked_program(THREADED.format(work="time.sleep(60)"))
    stuck = blocked_program(THREADED.format(work="lock = threading.Lock(); lock.acquire(); lock.acquire()"))
    try:
        for process in (sleeping, stuck):
            settled(process, "futex")
        deadline = time.monotonic() + 20
        while (found := quiet.find([rank(0, OWN, sleeping.pid, helper=WORKING)], None)).kind != QUIET:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        assert found.quiet == ["CPU0 (rank 0) is quiet in a sleep (clock_nanosleep) at work (x/train.py:4) in thread "
                               "worker, its main thread waiting at main (x/train.py:12)"]
        assert quiet.find([rank(0, OWN, stuck.pid, helper=WORKING)], None).kind == quiet.STALLED
        # a thread that waits for other ranks itself is not one the main thread's wait can be blamed on
        assert quiet.find([rank(0, OWN, sleeping.pid, helper=WAITING)], None).kind == quiet.STALLED
    finally:
        for process in (sleeping, stuck):
            process.kill()
            process.wait()


def test_a_node_whose_ranks_are_all_stopped_names_them_unless_they_are_the_whole_group() -> None:
    ranks = [rank(0, OWN, stopped=True)]
    assert verdict_on(ranks, whole_group=True).culprits == []  # a job suspended: nobody is singled out
    alone = verdict_on(ranks, whole_group=False)  # the other nodes' ranks run: they wait for it
    assert [c.rank for c in alone.culprits] == [0] and alone.method == "process state"


def test_every_nodes_finding_decides_and_a_quiet_one_is_said_the_same_everywhere() -> None:
    findings = NodeFindings(3)
    findings.open(since=10.0)
    findings.add(0, WAITS, "every rank waits for another", 5.0)  # heard before: another decision's
    findings.add(2, QUIET, "CPU0 (rank 2, node 2) is quiet in a sleep (clock_nanosleep) at main (x/train.py:12)", 11.0)
    assert findings.outcome(due=False) is None  # a quiet node waits for the others, so every node says one line
    findings.add(0, WAITS, "every rank waits for another", 12.0)
    assert findings.outcome(due=True) == QUIET
    findings.add(1, WAITS, "every rank waits for another", 12.5)
    assert findings.quiet_line(waiting_here=False) == (
        "CPU0 (rank 2, node 2) is quiet in a sleep (clock_nanosleep) at main (x/train.py:12); the others wait for it "
        "in a collective; not a stall")
    findings.close(20.0)
    findings.open(since=18.0)  # the next decision: nothing heard for it yet
    assert findings.outcome(due=False) is None
    findings.add(1, BUSY, "a rank was on the CPU", 21.0)
    assert findings.outcome(due=False) == BUSY  # progress: decided at once
    waits = NodeFindings(2)
    waits.add(0, WAITS, "every rank waits for another", 1.0)
    assert waits.outcome(due=False) is None and waits.outcome(due=True) == quiet.STALLED  # node 1 never said
    waits.add(1, WAITS, "every rank waits for another", 2.0)
    assert waits.outcome(due=False) == quiet.STALLED


def test_the_other_nodes_progress_is_an_age_heard_on_this_nodes_clock() -> None:
    others = OtherNodes()
    assert others.silence(100.0) == float("inf")
    others.hear({1: (100.0, 4.0), 2: (99.0, 30.0)})
    others.hear({1: (101.0, 20.0)})  # an older sign of life than one heard already changes nothing
    assert others.silence(110.0) == pytest.approx(14.0)


def test_progress_and_findings_cross_the_wire_checked() -> None:
    assert parse_progress(progress_message(2, 12.345), 3) == (2, 12.3)
    assert parse_finding(finding_message(1, QUIET, "CPU0 (rank 1, node 1) is quiet in a sleep"), 3) == (
        1, QUIET, "CPU0 (rank 1, node 1) is quiet in a sleep")
    for bad in ("progress 3 1.0", "progress 1 nan", "progress 1 -2", "progress 1", "progress x 1.0"):
        assert isinstance(parse_progress(bad, 3), str), bad
    for bad in ("finding 1 stalled text", "finding 4 quiet text", "finding 1 quiet", "finding 1 waits \x07"):
        assert isinstance(parse_finding(bad, 3), str), bad


def test_only_evidence_names_a_node_across_the_nodes() -> None:
    verdicts = NodeVerdicts(3)
    verdicts.expect(0.0)
    verdicts.add(0, False, "stalled (no progress for 3.0 s); the evidence singles out no rank (stacks)")
    verdicts.add(1, False, "stalled (no progress for 3.0 s); the evidence singles out no rank (stacks)")
    verdicts.add(2, True, "CPU0 (rank 2) stalled at step 7 in fault (rank_scripts/worker.py:156) (...; by stack)")
    assert verdicts.headline() == "node 2: CPU0 (rank 2) stalled at step 7 in fault (rank_scripts/worker.py:156) " \
                                  "(...; by stack)"
    both = NodeVerdicts(2)
    both.add(0, True, "CPU0 (rank 0) stalled while its process is stopped")
    both.add(1, True, "CPU0 (rank 1) stalled in main (x/train.py:12)")
    assert both.headline() == ("node 0: CPU0 (rank 0) stalled while its process is stopped; node 1: CPU0 (rank 1) "
                               "stalled in main (x/train.py:12)")
