"""--max-restarts: the group starts again after a failure, resuming from the run's latest checkpoint (before it has
one, as it first started); user errors do not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rank_scripts.harness import clean_env, run, survivors
from rank_support import TINY, merged, set_flags


def test_restart_resumes_and_succeeds(tmp_path):
    r = run(tmp_path, "--nproc", "2", "--max-restarts", "2",
            entry_args=("--steps", "4", "--fail-unless-resumed", "5", "--children", "1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restart 1 of 2 after CPU" in r.stderr
    assert "1 of 2 restarts used" in r.stderr
    run_dir = r.run_dir()
    assert json.loads((run_dir / "config.json").read_text())["checkpoint"]["resume"] is None
    assert json.loads((run_dir / "config.restart1.json").read_text())["checkpoint"]["resume"] == "auto"
    log = (run_dir / "cpu0.log").read_text()
    assert "resumed=False" in log and "----- restart 1 of 2 -----" in log and "resumed=True" in log
    assert survivors(r.pids(), timeout=0.5) == []


def test_restarts_run_out(tmp_path):
    r = run(tmp_path, "--nproc", "2", "--max-restarts", "2", entry_args=("--fail", "exit", "--code", "4"))
    assert r.returncode == 4
    assert "restart 2 of 2" in r.stderr and "restart 3" not in r.stderr
    assert "restarts: 2 of 2 used" in r.stderr


def test_user_error_is_not_restarted(tmp_path):
    r = run(tmp_path, "--nproc", "2", "--max-restarts", "3", entry_args=("--fail", "exit", "--code", "2"))
    assert r.returncode == 2
    assert "restart 1" not in r.stderr
    assert "restarts: 0 of 3 used" in r.stderr


@pytest.mark.parametrize("fault_step, resumes", [
    pytest.param(0, None, id="before-a-checkpoint", marks=pytest.mark.slow),  # the variant: in the slow tier
    pytest.param(3, "auto", id="after-one"),
])
def test_a_trainer_restart_resumes_only_this_runs_checkpoints(tmp_path: Path, token_cache_dir: Path,
                                                              fault_step: int, resumes: str | None) -> None:
    """The folder holds a finished earlier run (planted). A restart after this run's first checkpoint resumes it (the
    state after step 3 in the node's memory first); one before any restarts as the run first started: the earlier
    run's step_000010 is not this run's to resume."""
    planted = tmp_path / "ckpt" / "step_000010"
    planted.mkdir(parents=True)
    (planted / "meta.json").write_text(json.dumps({"config": {"training": {"max_steps": 10}}}))
    layer = merged(TINY, {"data": {"cache_dir": str(token_cache_dir)}, "training": {"max_steps": 6},
                          "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 2,
                                         "async_save": False},  # step 2's checkpoint complete before the fault
                          "debug": {"inject_fault": "exit", "inject_fault_step": fault_step,
                                    "inject_fault_code": 3}})
    proc = subprocess.run([sys.executable, "-m", "supervisor", "--debug", "--nproc", "1", "--no-footer",
                           "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), *set_flags(layer)],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 3, proc.stderr[-3000:]  # the fault fires again after the restart
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert json.loads((run_dir / "config.restart1.json").read_text())["checkpoint"]["resume"] == resumes
    said = ("the ranks resume from step 3 in this node's memory (from this run's latest checkpoint if that copy fails "
            "their checks)" if resumes else "no checkpoint of this run yet: the ranks start again as the first time")
    assert f"restart 1 of 1 after CPU0 (rank 0) failed: exit 3; {said}" in proc.stdout + proc.stderr
    assert planted.exists() == (resumes is None)  # superseded at this run's first save
