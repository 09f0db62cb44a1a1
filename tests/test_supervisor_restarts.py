"""--max-restarts: the group starts again after a failure, resuming from the latest checkpoint; user errors do not."""

from __future__ import annotations

import json

from rank_scripts.harness import run, survivors


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
