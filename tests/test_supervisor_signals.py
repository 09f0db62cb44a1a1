"""Signals to the supervisor: Ctrl-C, SIGTERM, SIGHUP, a second Ctrl-C, SIGKILL, Ctrl-C again and again while the
dataset is built. Nothing may survive any of them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from process_tree import watching
from rank_scripts.harness import clean_env, start, survivors
from trainer.data.staging import BUILD_PREFIX

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


def test_ctrl_c_again_and_again_while_the_dataset_is_built(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) every 2 ms from the start of tokenizing until the supervisor
    is gone: the first interrupts the build, the others must not cut its clean-up short (it waits for the batch being
    encoded, then dismisses the sentinel): exit 130, one line saying so, no traceback, nothing left behind."""
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "--debug", "--no-footer", "--log-dir", str(tmp_path / "logs"),
         "--set", f"data.cache_dir={cache}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    with watching(proc) as tree:
        seen = b""
        while b"tokenizing" not in seen and (chunk := os.read(proc.stdout.fileno(), 4096)):
            seen += chunk
        assert b"tokenizing" in seen, seen.decode()
        interrupts = 0
        while proc.poll() is None and interrupts < 10_000:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            interrupts += 1
            time.sleep(0.002)
        out = (seen + proc.stdout.read()).decode(errors="replace")
        code = proc.wait(timeout=10)
        tree.stop()
        assert tree.survivors(timeout=2.0) == []
    assert interrupts > 1, out  # the clean-up took longer than one interval: later Ctrl-Cs arrived during it
    assert code == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.count("interrupted during dataset preparation; no rank was started") == 1, out
    assert not list(cache.rglob(f"{BUILD_PREFIX}*")), "a cache build was left half-way"


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM])
def test_a_stop_signal_to_the_supervisor_alone_stops_its_dataset_build_at_once(tmp_path, sig):
    """`kill -INT` or `kill -TERM` to the supervisor's pid (not the terminal's process group: the build child does not
    get it) one moment into tokenizing: the build stops now, not after the whole corpus; one line, the signal's code,
    no half-built cache left, nothing running. SIGINT in the slow tier: the default suite stops a build on SIGTERM and
    on the terminal's Ctrl-C."""
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "--debug", "--no-footer", "--log-dir", str(tmp_path / "logs"),
         "--set", f"data.cache_dir={cache}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    with watching(proc) as tree:
        seen = b""
        while b"tokenizing" not in seen and (chunk := os.read(proc.stdout.fileno(), 4096)):
            seen += chunk
        assert b"tokenizing" in seen, seen.decode()
        os.kill(proc.pid, sig)
        sent = time.monotonic()
        out = (seen + proc.stdout.read()).decode(errors="replace")
        code = proc.wait(timeout=30)
        took = time.monotonic() - sent
        tree.stop()
        assert tree.survivors(timeout=2.0) == []
    assert code == 128 + sig, out
    assert f"{sig.name}: interrupted during dataset preparation; no rank was started" in out, out
    assert "Traceback" not in out and "dataset built" not in out, out
    assert took < 10, f"the build ran on for {took:.1f} s"
    assert not list(cache.rglob(f"{BUILD_PREFIX}*")), "a cache build was left half-way"


def test_a_stop_signal_sent_to_one_rank_is_a_stop_not_a_finish(tmp_path, token_cache_dir):
    """`kill -TERM <rank 1>` (a scheduler's preemption aimed at one process): both ranks agree to stop, save a
    checkpoint and exit 0, and the supervisor says the run stopped, naming the rank, the signal and the checkpoint, with
    the signal's exit code; `final/` is not written."""
    ckpt = tmp_path / "ckpt"
    r = start(tmp_path, "--debug", "--nproc", "2", "--max-steps", "400", "--set", "system.device=cpu",
              "--set", f"data.cache_dir={json.dumps(str(token_cache_dir))}", "--set", "data.max_samples=40",
              "--set", f"checkpoint.dir={json.dumps(str(ckpt))}", "--set", "training.eval_interval=0",
              entry=None)
    deadline = time.monotonic() + 120
    while "Step [3/" not in r.out_path.read_text(errors="replace"):
        assert time.monotonic() < deadline and r.proc.poll() is None, r.err_path.read_text()[-3000:]
        time.sleep(0.1)
    ranks = {int(p.environ()["RANK"]): p.pid for p in psutil.Process(r.proc.pid).children()
             if "pretrain_main.py" in " ".join(p.cmdline())}
    os.kill(ranks[1], signal.SIGTERM)
    r.wait()
    assert r.returncode == 143, r.stderr[-3000:]
    saved = sorted(p for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert saved and not (ckpt / "final").exists()
    assert re.search(r"run stopped after .*: CPU1 \(rank 1\) received SIGTERM: every rank stopped after step \d+ of "
                     rf"400 and saved a checkpoint \(--resume auto continues from it\): {re.escape(str(saved[-1]))}",
                     r.stderr), r.stderr[-3000:]
    assert "stopped early (SIGTERM received)" in r.stderr and "stopped early, as agreed" in r.stderr
    assert "run finished" not in r.stderr
