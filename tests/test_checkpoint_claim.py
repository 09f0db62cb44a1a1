"""One run at a time in a checkpoint folder (`trainer.checkpoint.claim`): a second run given the folder a running one
holds (here with `--resume auto`, which an unfinished run's checkpoints do not refuse) is refused in one line naming
the holder, before any rank starts, and leaves the folder to the first; the claim ends with its holder, a SIGKILL
included; by hand, rank 0 claims the folder as the supervisor does."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rank_scripts.harness import clean_env, start
from rank_support import TINY, merged, set_flags

from trainer.checkpoint.claim import OWNER_FILE, FolderClaim
from trainer.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def run_flags(token_cache_dir: Path, checkpoints: Path, **debug: object) -> list[str]:
    """Flags of a tiny run of 200 steps with a checkpoint every 2 steps; `debug`: its fault injection."""
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "training": {"max_steps": 200},
                          "checkpoint": {"dir": str(checkpoints), "interval": 2, "keep": 2}, "debug": debug})
    return ["--no-footer", "--nproc", "1", *set_flags(layer)]


SLOW = {"inject_fault": "slow", "inject_fault_step": 1, "inject_fault_delay_s": 0.3}  # 0.3 s a step from step 1


def wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


def test_a_second_run_in_a_held_checkpoint_folder_is_refused_and_the_claim_ends_with_its_holder(
        tmp_path: Path, token_cache_dir: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    first = start(tmp_path, *run_flags(token_cache_dir, checkpoints, **SLOW), entry=None, tag="1")
    try:
        wait_for(lambda: (checkpoints / "step_000002").is_dir(), "saved a checkpoint")
        # `--resume auto` passes the check that refuses to start over an unfinished run: it would resume the
        # running one's checkpoint and write over its next ones
        second = start(tmp_path, *run_flags(token_cache_dir, checkpoints, **SLOW), "--set", 'checkpoint.resume="auto"',
                       entry=None, tag="2").wait(120)
        assert second.returncode == 2, second.stderr
        owner = json.loads((checkpoints / OWNER_FILE).read_text())
        assert owner["pid"] == first.proc.pid  # the first run's claim, left as it was
        assert second.stderr.strip().splitlines()[-1] == (
            f"error: checkpoint.dir {checkpoints} is in use by another run (pid {first.proc.pid} on "
            f"{socket.gethostname()} since {owner['since']}, run folder {first.run_dir()}); wait for it to end, or "
            f"give this run a folder of its own with --set checkpoint.dir=DIR")
        assert "CPU0:" not in second.stdout + second.stderr  # no rank started,
        assert not list(second.log_dir.glob("*/"))  # and no run folder left behind
        # without --resume: the live run's checkpoints are not taken for an unfinished earlier run's
        fresh = start(tmp_path, *run_flags(token_cache_dir, checkpoints, **SLOW), entry=None, tag="fresh").wait(120)
        assert fresh.returncode == 2, fresh.stderr
        assert fresh.stderr.strip().splitlines()[-1].startswith(
            f"error: checkpoint.dir {checkpoints} is in use by another run (pid {first.proc.pid} on "), fresh.stderr
        assert first.proc.poll() is None  # the first run trains on, the folder still its own
        first.proc.send_signal(signal.SIGKILL)  # its ranks die with it (the sentinel); the OS drops the lock
        first.proc.wait(30)
        wait_for(lambda: not held(checkpoints), "let go of the folder", timeout=10)
        third = start(tmp_path, *run_flags(token_cache_dir, checkpoints), "--set", 'checkpoint.resume="auto"',
                      entry=None, tag="3").wait(180)
        assert third.returncode == 0, third.stderr[-3000:]
        assert f"resumed from {checkpoints}" in third.stdout and "step 200/200" in third.stderr
        assert not list(checkpoints.glob(".run*"))  # the killed holder's lock and note, taken over and let go
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
            first.proc.wait()


def held(folder: Path) -> bool:
    """Whether another process holds `folder`'s claim (tried here, and let go at once)."""
    try:
        FolderClaim.take(folder, None).release()
        return False
    except UserError:
        return True


def test_by_hand_rank_0_claims_the_folder_as_the_supervisor_does(tmp_path: Path, token_cache_dir: Path) -> None:
    """`python pretrain_main.py` given a folder this process holds: one line, exit 2, nothing trained; once let go,
    the same command trains."""
    checkpoints = tmp_path / "ckpt"
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "training": {"max_steps": 2},
                          "checkpoint": {"dir": str(checkpoints)}, "logging": {"run_dir": str(tmp_path / "run")}})
    command = [sys.executable, str(ROOT / "pretrain_main.py"), *set_flags(layer)]
    claim = FolderClaim.take(checkpoints, tmp_path / "mine")
    since = json.loads((checkpoints / OWNER_FILE).read_text())["since"]
    try:
        refused = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    finally:
        claim.release()
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"error: checkpoint.dir {checkpoints} is in use by another run (pid {os.getpid()} on {socket.gethostname()} "
        f"since {since}, run folder {tmp_path / 'mine'}); wait for it to "
        f"end, or give this run a folder of its own with --set checkpoint.dir=DIR"]
    assert not (tmp_path / "run").exists()
    trained = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [p.name for p in checkpoints.iterdir()] == ["step_000002"]  # the claim's files gone with it
