"""The supervisor with the project's real trainer (pretrain_main.py): the debug preset, shrunk to a few steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from rank_scripts.harness import ROOT, run, survivors

pytestmark = pytest.mark.skipif(not (ROOT / "pretrain_main.py").exists(), reason="pretrain_main.py is not there")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One token cache for the module: the first run builds it, the second finds it."""
    return tmp_path_factory.mktemp("cache")


def tiny(tmp_path: Path, cache_dir: Path, *extra: str) -> tuple[str, ...]:
    return ("--debug", "--nproc", "2", "--max-steps", "3", "--set", "data.max_samples=40",
            "--set", f"data.cache_dir={cache_dir}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
            "--set", "training.eval_interval=0", "--set", "checkpoint.interval=0", *extra)


def test_trainer_run(tmp_path, cache_dir):
    r = run(tmp_path, *tiny(tmp_path, cache_dir), entry=None, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "supervisor: dataset " in r.stderr
    assert "step 3/3, final loss" in r.stderr
    run_dir = r.run_dir()
    assert (run_dir / "config.json").exists()
    assert "Step [" in (run_dir / "cpu0.log").read_text()
    assert any(line.startswith("CPU1:") for line in (r.stdout + r.stderr).splitlines())


def test_trainer_fault_stops_the_group(tmp_path, cache_dir):
    r = run(tmp_path, *tiny(tmp_path, cache_dir, "--set", "debug.inject_fault=exit", "--set",
                            "debug.inject_fault_step=2", "--set", "debug.inject_fault_rank=1",
                            "--set", "debug.inject_fault_code=3", "--grace-period", "5"), entry=None, timeout=240)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "CPU1 (rank 1) failed: exit 3" in r.stderr
    pids = [int(line.split()[3]) for line in r.stderr.splitlines() if line.startswith("supervisor:   CPU")]
    assert len(pids) == 2 and survivors(pids, timeout=0.5) == []


def test_a_trial_run_shorter_than_the_preset_warmup_trains(tmp_path, cache_dir):
    """`--debug --max-steps 2`: the preset's 2 warm-up steps do not fit; they shrink, and both banners say so."""
    r = run(tmp_path, *tiny(tmp_path, cache_dir, "--max-steps", "2"), entry=None, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    note = ("training.warmup_steps 2 (preset 'debug') does not fit a 2-step run: shortened to 0 (10 % of the run); "
            "set training.warmup_steps to choose")
    assert f"supervisor: {note}" in r.stderr
    assert f"CPU0:INFO | {note}" in r.stdout
    assert "step 2/2, final loss" in r.stderr
