"""Kill-all on the first failure, for every way a rank can fail; the exit code; the report; the hang watchdog."""

from __future__ import annotations

import re

import pytest

from rank_scripts.harness import ROOT, clean_env, run, survivors

FAKE = clean_env(SUPERVISOR_FAKE_GPUS="0,1,2,3")
COMMON = ("--gpus", "0,1,2", "--grace-period", "5")
CHILDREN = ("--children", "1", "--escaped-child")
ANNOUNCER = ROOT / "tests" / "rank_scripts" / "announcer.py"


@pytest.mark.parametrize("fault, code", [("raise", 1), ("exit", 3), ("sigkill", 137), ("segv", 139)])
def test_first_failure_stops_every_rank(tmp_path, fault, code):
    r = run(tmp_path, *COMMON, entry_args=("--fail", fault, "--fail-rank", "1", *CHILDREN), env=FAKE)
    assert r.returncode == code, r.stderr[-3000:]
    pids = r.pids()
    assert len(pids) == 3 * 3  # three ranks, each with two children
    assert survivors(pids, timeout=1.0) == []
    assert f"GPU1 (rank 1, pid {pids[3]}) failed with" in r.stderr


HELD = ("GPU0, GPU2 still training 2 s after SIGTERM while GPU1 is gone: its collectives wait for GPU1, so it "
        "cannot reach a checkpoint; SIGKILL now rather than after the 60 s grace period")


@pytest.mark.parametrize("fault, code", [("sigkill", 137), ("announce", 3)])
def test_ranks_held_by_a_failed_rank_that_is_gone_are_killed_without_the_grace_period(tmp_path, fault, code):
    """The failed rank has exited (killed outright; or it said ``failing`` and left later, as the trainer does once
    its write has ended): the others' collectives wait for it for ever (NCCL's do; gloo's with three ranks or more
    on the ranks that were not paired with it), so a SIGTERM handler that only sets a flag is never reached (here:
    SIGTERM ignored). Those still training get SIGKILL 2 s after SIGTERM, or after the failed rank's exit, instead of
    at the end of the 60 s grace period."""
    r = run(tmp_path, "--gpus", "0,1,2", "--grace-period", "60", timeout=50,
            entry_args=("--fail", fault, "--fail-rank", "1", "--term-time", "1", "--on-term", "ignore"), env=FAKE)
    assert r.returncode == code, r.stderr[-3000:]
    if fault == "sigkill":
        assert "one still training in 2 s (it cannot reach a checkpoint while GPU1 is gone)" in r.stderr
    assert HELD in r.stderr, r.stderr[-3000:]
    assert survivors(r.pids(), timeout=1.0) == []


def test_ranks_held_by_a_failed_rank_that_is_gone_are_killed_at_once_when_a_restart_follows(tmp_path):
    """With a restart left, the ranks still training when the failed rank is gone get SIGKILL at once, not 2 s later
    (SIGTERM ignored, as by a rank waiting in NCCL): the restart resumes from what was saved before the fault, and
    the time they would take to notice their lost peer is time the fault costs. The restarted group trains on."""
    r = run(tmp_path, "--gpus", "0,1,2", "--grace-period", "60", "--max-restarts", "1", timeout=50,
            entry_args=("--fail", "sigkill", "--fail-rank", "1", "--fail-once", "--steps", "150", "--on-term",
                        "ignore"), env=FAKE)  # 3 s of steps: a held rank would still be training 2 s after SIGTERM
    assert r.returncode == 0, r.stderr[-3000:]
    held = r.stderr.index("GPU0, GPU2 still training while GPU1 is gone, with a restart to follow: its collectives "
                          "wait for GPU1, so it cannot reach a checkpoint, and the restart resumes from what was saved "
                          "before the fault; SIGKILL now rather than after the 60 s grace period")
    assert r.stderr.count("still training while GPU1 is gone") == 1, r.stderr[-3000:]
    assert r.stderr.index("SIGTERM sent; a rank still running in 60 s (--grace-period) gets SIGKILL\n") < held
    assert held < r.stderr.index("restart 1 of 1 after GPU1 (rank 1) failed: SIGKILL (137)")
    assert "one still training in 2 s" not in r.stderr and "2 s after SIGTERM" not in r.stderr
    assert r.stdout.count("finished 150 steps") == 3, r.stdout[-3000:]
    assert survivors(r.pids(), timeout=1.0) == []


def test_a_rank_in_its_checkpoint_phase_keeps_the_grace_period_when_a_failed_rank_is_gone(tmp_path):
    """A rank that says it is saving (its checkpoint phase) when the failed rank has exited is left the grace period:
    its save may be its own (the final model is rank 0's alone)."""
    r = run(tmp_path, "--gpus", "0,1,2", "--grace-period", "60", timeout=50,
            entry_args=("--fail", "sigkill", "--fail-rank", "1", "--on-term", "slow", "--term-time", "3"), env=FAKE)
    assert r.returncode == 137, r.stderr[-3000:]
    assert "GPU0:rank 0 checkpoint written" in r.stdout and "GPU2:rank 2 checkpoint written" in r.stdout
    assert "SIGKILL now" not in r.stderr
    assert survivors(r.pids(), timeout=1.0) == []


def test_report_names_every_rank_and_the_failing_stderr(tmp_path):
    r = run(tmp_path, *COMMON, entry_args=("--fail", "raise", "--fail-rank", "2", "--fail-step", "4"), env=FAKE)
    assert r.returncode == 1
    report = r.stderr[r.stderr.index("supervisor: run failed"):]
    assert "GPU2 (rank 2) failed: exit 1" in report
    pids = r.pids()
    for rank, pid in enumerate(pids):
        row = next(line for line in report.splitlines() if re.match(rf"supervisor:\s+GPU{rank}\s", line))
        assert f" {rank} " in row and f" {pid} " in row
        assert ("failed first" in row) == (rank == 2)
        assert ("stopped by the supervisor" in row or "failed after" in row) == (rank != 2), row
    assert re.search(r"last \d+ stderr lines of GPU2 \(rank 2\):", report)
    assert "supervisor:   | RuntimeError: injected fault" in report
    assert "exit code 1; logs in" in report
    log = (r.run_dir() / "supervisor.log").read_text()
    assert "GPU2 (rank 2) failed: exit 1" in log and "RuntimeError: injected fault" in log


def test_success_report_has_steps_and_final_loss(tmp_path):
    r = run(tmp_path, "--nproc", "2", entry_args=("--steps", "4"))
    assert r.returncode == 0, r.stderr
    assert re.search(r"supervisor: run finished in [\d.]+ s: step 4/4, final loss 2\.5000; logs in ", r.stderr)


def test_ranks_exiting_zero_early_are_normal(tmp_path):
    """Rank 1 finishes first; the run goes on until every rank is done, then succeeds."""
    r = run(tmp_path, "--nproc", "2", entry_args=("--steps", "3", "--fail", "exit", "--code", "0"))
    assert r.returncode == 0, r.stderr
    assert "rank 0 finished 3 steps" in r.stdout


def test_hang_is_noticed_dumped_and_stopped(tmp_path):
    hang_timeout = 1.0
    r = run(tmp_path, *COMMON, "--hang-timeout", str(hang_timeout), "--startup-timeout", "10",
            entry_args=("--fail", "hang", "--fail-rank", "1", "--fail-step", "3", *CHILDREN), env=FAKE)
    assert r.returncode == 124, r.stderr[-3000:]
    m = re.search(r"GPU1 \(rank 1\) stalled: no progress for ([\d.]+) s \(since \d\d:\d\d:\d\d; last step 2\)",
                  r.stderr)
    assert m, r.stderr[-3000:]
    assert float(m[1]) < hang_timeout + 1.0
    for gpu in (0, 1, 2):  # every rank printed its Python stacks into its own log before the stop
        assert "most recent call first" in (r.run_dir() / f"gpu{gpu}.log").read_text()
    assert re.search(r"GPU1\s+1\s+\d+\s+\S+ \(\d+\)\s+stalled", r.stderr)
    assert 'line' in r.stderr[r.stderr.index("last "):], "the stalled rank's stack is in the report"
    assert survivors(r.pids(), timeout=1.0) == []


def test_ranks_held_by_a_stalled_rank_are_killed_once_it_is_gone(tmp_path):
    """A stall: the stalled rank gets SIGKILL at once; the others, whose collectives wait for it (SIGTERM ignored, as
    a rank waiting in NCCL never runs its handler), get SIGKILL 2 s after its exit, not at the end of the 60 s grace
    period."""
    r = run(tmp_path, "--gpus", "0,1,2", "--grace-period", "60", "--hang-timeout", "1", "--startup-timeout", "10",
            timeout=50, entry_args=("--fail", "hang", "--fail-rank", "1", "--on-term", "ignore"), env=FAKE)
    assert r.returncode == 124, r.stderr[-3000:]
    assert HELD in r.stderr, r.stderr[-3000:]
    assert survivors(r.pids(), timeout=1.0) == []


def test_silence_before_the_first_step_gets_the_startup_allowance(tmp_path):
    """A slow start (no step for longer than --hang-timeout) is not a hang; only --startup-timeout applies."""
    r = run(tmp_path, "--nproc", "1", "--hang-timeout", "0.3", "--startup-timeout", "30",
            entry_args=("--steps", "3", "--startup-time", "1.0"))
    assert r.returncode == 0, r.stderr


def test_failing_rank_wins_over_the_ranks_it_brings_down(tmp_path):
    """Real gloo: rank 1 exits 3 in the middle of all-reduces; rank 0 then errors out of its collective.
    The run still exits 3, and rank 0 is not blamed."""
    r = run(tmp_path, "--nproc", "2", entry_args=("--gloo", "--fail", "exit", "--fail-step", "5"), timeout=120)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "CPU1 (rank 1) failed: exit 3" in r.stderr
    assert survivors(r.pids(), timeout=1.0) == []


@pytest.mark.parametrize("failure", ["reported", "hard"])
def test_the_rank_that_failed_first_is_blamed_not_the_first_to_exit(tmp_path, failure):
    """Rank 1 fails first, rank 0's error is its fallout (tests/rank_scripts/announcer.py). `reported`: both say
    ``failing``, rank 1 first, and rank 0 exits first; rank 1 is left to exit on its own (a SIGTERM would make it
    143). `hard`: rank 1 exits without a word, and rank 0's report, written after rank 1's end, does not count (rank 0
    exits once stopped). Either
    way the headline, the exit code and the console's lines are rank 1's."""
    r = run(tmp_path, "--nproc", "2", "--grace-period", "20", entry=ANNOUNCER, entry_args=(str(tmp_path), failure))
    assert r.returncode == 7, r.stderr[-3000:]
    report = r.stderr[r.stderr.index("supervisor: run failed"):]
    assert "CPU1 (rank 1) failed: exit 7" in report
    assert re.search(r"supervisor:\s+CPU1\s+1\s+\d+\s+exit 7\s+failed first", report), report
    fallout = "failed after the first failure" if failure == "reported" else "stopped by the supervisor"
    assert re.search(rf"supervisor:\s+CPU0\s+0\s+\d+\s+exit 1\s+{fallout}", report), report
    assert "exit code 7; logs in" in report
    first_error = "RuntimeError: the first error" if failure == "reported" else "the first error, unreported"
    assert f"supervisor:   | {first_error}" in report
    assert f"CPU1:{first_error}" in r.stderr
    assert "Connection closed by peer" not in r.stderr  # rank 0's fallout: its log only
    assert "Connection closed by peer" in (r.run_dir() / "cpu0.log").read_text()
