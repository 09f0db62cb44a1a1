"""Supervising a program written for torchrun, which reports nothing: no timeout kills it while it works, however long;
a rank asleep in its own code while the others wait for it is quiet, not hung: one line, and the run goes on; a frozen
rank is seen (no output and no CPU time anywhere in the group), every rank's Python stack is read from outside
(py-spy) and the frozen rank is named; no rank is ever sent a stack request it cannot answer."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from rank_scripts.harness import ROOT, clean_env, start, survivors

QUIET = ROOT / "tests" / "rank_scripts" / "quiet_ddp.py"
QUIET_RANK = ROOT / "tests" / "torchrun_programs" / "quiet_rank.py"
# The hang timeouts here are short, for fast tests, but not shorter than HANG_FLOOR: a rank still importing torch on a
# machine whose cores and disk are both busy (the suite under two busy loops) has been seen to wait on the disk for
# 3 s with no CPU time, which this rule rightly cannot tell from a stall.
HANG_FLOOR = "5"


def wait_for_pids(folder: Path, count: int, run_proc, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(files := sorted(folder.glob("rank*.pid"))) < count:
        assert run_proc.poll() is None and time.monotonic() < deadline, "the ranks did not train a step"
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


@pytest.mark.slow
def test_a_quiet_program_outlasts_the_startup_timeout(tmp_path: Path) -> None:
    """No progress records and no output for longer than both timeouts, but CPU time all along: it is working."""
    r = start(tmp_path, "--nproc", "2", "--startup-timeout", "1", "--hang-timeout", HANG_FLOOR, entry=QUIET,
              entry_args=("--seconds", "6")).wait(timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"rank 0: \d+ steps, loss", r.stdout)
    assert "stalled" not in r.stderr and "SIGUSR1" not in r.stderr


def sleeps_while_the_other_waits(tmp_path: Path, hang_timeout: str, seconds: float) -> None:
    r = start(tmp_path, "--nproc-per-node", "2", "--hang-timeout", hang_timeout, str(QUIET_RANK), "--rank", "0",
              "--seconds", str(seconds), entry=None).wait(timeout=seconds + 90)
    assert r.returncode == 0, r.stderr[-3000:]
    said = re.findall(r"^supervisor: CPU0 \(rank 0\) is quiet in a sleep \(clock_nanosleep\) at quiet "
                      r"\(torchrun_programs/quiet_rank\.py:\d+\); the others wait for it in a collective; not a stall$",
                      r.stderr, re.M)
    assert len(said) == 1, r.stderr[-3000:]  # said once, however many times the watchdog looked again
    assert "stalled" not in r.stderr
    assert "CPU0:rank 0: 4 steps" in r.stdout and "CPU1:rank 1: 4 steps" in r.stdout


@pytest.mark.slow
def test_a_rank_waiting_for_its_own_sleeping_thread_is_quiet_not_hung(tmp_path: Path) -> None:
    """Rank 0's main thread waits on `Future.result()` (a lock) for a worker thread asleep for 12 s, with a 5 s hang
    timeout: the thread it waits for is what it is quiet in, and the run finishes."""
    r = start(tmp_path, "--nproc-per-node", "2", "--hang-timeout", HANG_FLOOR, str(QUIET_RANK), "--rank", "0",
              "--seconds", "12", "--how", "thread", entry=None).wait(timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^supervisor: CPU0 \(rank 0\) is quiet in a sleep \(clock_nanosleep\) at \S+ \(\S+\) in thread "
                     r"\S+, its main thread waiting at \S+ \(\S+\); the others wait for it in a collective; not a stall$",
                     r.stderr, re.M), r.stderr[-3000:]
    assert "stalled" not in r.stderr and "CPU0:rank 0: 4 steps" in r.stdout


def test_a_rank_asleep_in_its_own_code_is_quiet_not_hung(tmp_path: Path) -> None:
    """Rank 0 sleeps 12 s (time.sleep) while rank 1 waits for it in an all-reduce, with a 5 s hang timeout: no rank
    writes or uses CPU time, the stacks show rank 0 asleep in its own code, and the run finishes (torchrun: 0)."""
    sleeps_while_the_other_waits(tmp_path, HANG_FLOOR, 12)


@pytest.mark.slow
def test_forty_seconds_asleep_at_an_eight_second_hang_timeout(tmp_path: Path) -> None:
    sleeps_while_the_other_waits(tmp_path, "8", 40)


def test_a_frozen_rank_is_named_with_every_rank_stack(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = start(tmp_path, "--nproc", "2", "--hang-timeout", HANG_FLOOR, "--grace-period", "5", entry=QUIET,
                entry_args=("--seconds", "600", "--pid-dir", str(pid_dir)))
    pids = wait_for_pids(pid_dir, 2, run.proc)
    os.kill(pids[1], signal.SIGSTOP)  # what a hung host or a deadlocked rank looks like from outside
    r = run.wait(timeout=60)
    assert r.returncode == 124, r.stderr[-4000:]
    err = r.stderr
    assert re.search(r"no rank has written output or used CPU time for [\d.]+ s and the stacks read from outside "
                     r"\(py-spy\) show a stall; stopping", err), err[-4000:]
    # both ranks' stacks, read without their cooperation (the frozen one included)
    for rank, pid in enumerate(pids):
        block = err[err.index(f"CPU{rank} (rank {rank}, pid {pid}) Python stacks:"):]
        assert "thread MainThread:" in block.splitlines()[1], block[:2000]
        assert "quiet_ddp.py" in block[:4000]
    headline = re.search(r"^supervisor: (CPU1 \(rank 1\) stalled while its process is stopped .*)$", err, re.M)
    assert headline, err[-4000:]
    assert "CPU0 (rank 0) waits for it in" in headline[1] and "by process state" in headline[1]
    assert survivors(pids, timeout=5.0) == []  # a stopped rank is SIGKILLed, not left behind
    report = err[err.index("supervisor: run failed"):]
    assert re.search(r"CPU1\s+1\s+\d+\s+\S+ \(\d+\)\s+stalled", report), report


@pytest.mark.slow
def test_no_stack_request_by_signal_reaches_a_quiet_program(tmp_path: Path) -> None:
    """A hang of a program that installed no SIGUSR1 handler: the ranks are killed by the stop, not by a request."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = start(tmp_path, "--nproc", "2", "--hang-timeout", HANG_FLOOR, "--grace-period", "5", entry=QUIET,
                entry_args=("--seconds", "600", "--pid-dir", str(pid_dir)), env=clean_env())
    pids = wait_for_pids(pid_dir, 2, run.proc)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    r = run.wait(timeout=60)
    assert r.returncode == 124, r.stderr[-3000:]
    assert "SIGUSR1" not in r.stderr
    # every rank stopped: nobody is singled out rather than a guess
    assert re.search(r"stalled \(no progress for [\d.]+ s\); the evidence singles out no rank", r.stderr), \
        r.stderr[-3000:]
    assert survivors(pids, timeout=5.0) == []
