"""The supervisor with the project's real trainer (pretrain_main.py): the debug preset, shrunk to a few steps."""

from __future__ import annotations

from pathlib import Path

from rank_scripts.harness import run


def test_trainer_run(tmp_path: Path) -> None:
    """`--debug --max-steps 2`: prefixed output, a run folder, the result line; the preset's 2 warm-up steps do not fit
    a 2-step run, so they shrink and both banners say so. (The real trainer failing under the supervisor is the fault
    matrix's business: tests/test_fault_matrix.py.)"""
    r = run(tmp_path, "--debug", "--nproc", "2", "--max-steps", "2", "--set", "data.max_samples=40",
            "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
            "--set", "training.eval_interval=0", "--set", "checkpoint.interval=0", entry=None, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "supervisor: dataset " in r.stderr
    assert "step 2/2, final loss" in r.stderr
    run_dir = r.run_dir()
    assert (run_dir / "config.json").exists()
    assert "Step [" in (run_dir / "cpu0.log").read_text()
    assert any(line.startswith("CPU1:") for line in (r.stdout + r.stderr).splitlines())
    note = ("training.warmup_steps 2 (preset 'debug') does not fit a 2-step run: shortened to 0 (10 % of the run); "
            "set training.warmup_steps to choose")
    assert f"supervisor: {note}" in r.stderr
    assert f"CPU0:INFO | {note}" in r.stdout
