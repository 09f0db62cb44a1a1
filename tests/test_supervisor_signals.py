"""Signals to the supervisor: Ctrl-C, SIGTERM, SIGHUP, a second Ctrl-C, SIGKILL. Nothing may survive any of them."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rank_scripts.harness import start, survivors

CHILDREN = ("--children", "2", "--escaped-child")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129),
                                       (signal.SIGUSR1, 138)])  # SIGUSR1: Slurm's warning before the time limit
def test_stop_signal_stops_every_rank_and_its_children(tmp_path, sig, code):
    r = start(tmp_path, "--nproc", "2", "--grace-period", "5", entry_args=CHILDREN)
    pids = r.wait_for_ranks(2)
    os.kill(r.proc.pid, sig)
    r.wait()
    assert r.returncode == code, r.stderr[-2000:]
    assert survivors(pids, timeout=0.5) == []
    assert "stopped by the supervisor" in r.stderr
    assert f"interrupted by {signal.Signals(sig).name}" in r.stderr


def test_sigkill_of_the_supervisor_leaves_no_survivor(tmp_path):
    """PDEATHSIG takes the ranks; the sentinel takes their children, even one in a session of its own."""
    r = start(tmp_path, "--nproc", "2", entry_args=CHILDREN)
    pids = r.wait_for_ranks(2)
    assert len(pids) == 2 * 4
    os.kill(r.proc.pid, signal.SIGKILL)
    r.wait()
    assert r.returncode == -signal.SIGKILL
    assert survivors(pids, timeout=3.0) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGUSR1])
def test_ranks_get_their_grace_period_to_checkpoint(tmp_path, sig):
    r = start(tmp_path, "--nproc", "2", "--grace-period", "10", entry_args=("--on-term", "slow", "--term-time", "0.5"))
    pids = r.wait_for_ranks(2)
    os.kill(r.proc.pid, sig)
    r.wait()
    assert r.returncode == 128 + sig
    for rank in (0, 1):
        assert f"CPU{rank}:rank {rank} checkpoint written" in r.stdout
    assert r.stderr.count("exit 0  stopped by the supervisor") == 2
    assert survivors(pids, timeout=0.5) == []


def test_second_ctrl_c_kills_at_once(tmp_path):
    r = start(tmp_path, "--nproc", "2", "--grace-period", "60", entry_args=("--on-term", "slow", "--term-time", "60"))
    pids = r.wait_for_ranks(2)
    os.kill(r.proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.kill(r.proc.pid, signal.SIGINT)
    r.wait(timeout=20)
    assert r.returncode == 130
    assert "SIGINT again: killing every rank now" in r.stderr
    assert r.stderr.count("SIGKILL (137)  killed (SIGKILL)") == 2
    assert survivors(pids, timeout=0.5) == []


def test_a_first_signal_during_another_stop_keeps_the_grace_period(tmp_path):
    """A stop already under way for another cause (here rank 1 failed; with Slurm, another node's stop that arrived
    before this node's own USR1): the signal is the first, not "again", so rank 0 still checkpoints."""
    r = start(tmp_path, "--nproc", "2", "--grace-period", "30",
              entry_args=("--fail", "exit", "--fail-rank", "1", "--fail-step", "3", "--on-term", "slow",
                          "--term-time", "1.5"))
    pids = r.wait_for_ranks(2)
    deadline = time.monotonic() + 20
    while "stopping the other ranks" not in r.err_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(r.proc.pid, signal.SIGUSR1)
    r.wait(timeout=30)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "SIGUSR1: already stopping (CPU1 (rank 1) failed: exit 3); SIGUSR1 again to kill at once" in r.stderr
    assert "again: killing" not in r.stderr
    assert "CPU0:rank 0 checkpoint written" in r.stdout
    assert survivors(pids, timeout=0.5) == []


def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    r = start(tmp_path, "--nproc", "2", "--grace-period", "0.5", entry_args=("--on-term", "ignore", "--children", "1"))
    pids = r.wait_for_ranks(2)
    stopped = time.monotonic()
    os.kill(r.proc.pid, signal.SIGTERM)
    r.wait(timeout=20)
    assert r.returncode == 143
    assert time.monotonic() - stopped >= 0.5, "SIGKILL came before the grace period ended"
    assert r.stderr.count("killed (SIGKILL)") == 2
    assert survivors(pids, timeout=0.5) == []
