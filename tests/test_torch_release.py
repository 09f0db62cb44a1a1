"""The trainer's torch floor: a torch older than the trainer runs on is one line before anything starts, from the
supervisor and from `pretrain_main.py` alike, while a torchrun program of the user's own runs under the supervisor
with it. The older torch is the installed one's metadata shadowed by a `torch-2.8.0.dist-info` first on PYTHONPATH,
what `importlib.metadata` (hence `trainer.torch_release`) reads; the torch imported is still the real one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rank_scripts.harness import ROOT, clean_env, project_pythonpath, run
from trainer import torch_release
from trainer.errors import UserError

PROGRAMS = Path(__file__).resolve().parent / "torchrun_programs"
REFUSAL = "error: the trainer needs torch 2.9 or later, and this environment has torch 2.8.0"


def test_the_installed_release_is_read_from_its_metadata():
    assert torch_release.torch_release() == tuple(int(n) for n in torch.__version__.split(".")[:2])


@pytest.mark.parametrize("release", [(2, 8), (2, 0), (1, 13)])
def test_a_release_below_the_floor_is_refused(monkeypatch, release):
    monkeypatch.setattr(torch_release, "torch_release", lambda: release)
    with pytest.raises(UserError, match=r"the trainer needs torch 2\.9 or later"):
        torch_release.check_torch_release()


@pytest.mark.parametrize("release", [(2, 9), (2, 13), (2, 15), (3, 0)])
def test_a_release_at_or_above_the_floor_passes(monkeypatch, release):
    monkeypatch.setattr(torch_release, "torch_release", lambda: release)
    torch_release.check_torch_release()


@pytest.fixture
def older_torch(tmp_path: Path) -> dict[str, str]:
    """An environment whose torch metadata says 2.8.0."""
    shadow = tmp_path / "shadow"
    info = shadow / "torch-2.8.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.8.0\n")
    return clean_env(PYTHONPATH=project_pythonpath(str(shadow)))


def test_the_supervisor_refuses_the_trainer_with_an_older_torch(tmp_path, older_torch):
    result = run(tmp_path, "--debug", "--nproc", "1", "--set", "system.device=cpu", "--max-steps", "1", entry=None,
                 env=older_torch)
    assert result.returncode == 2, result.stderr[-2000:]
    assert REFUSAL in result.stderr and "Traceback" not in result.stderr
    assert "starting" not in result.stderr and not list(result.log_dir.glob("*/cpu0.log"))  # no rank, no dataset


def test_a_rank_by_hand_refuses_an_older_torch(tmp_path, older_torch):
    result = subprocess.run([sys.executable, str(ROOT / "pretrain_main.py"), "--debug", "--max-steps", "1", "--set",
                             "system.device=cpu"], cwd=tmp_path, env=older_torch, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert REFUSAL in result.stderr and "Traceback" not in result.stderr


def test_a_torchrun_program_runs_under_the_supervisor_with_an_older_torch(tmp_path, older_torch):
    result = run(tmp_path, "--nproc-per-node", "1", str(PROGRAMS / "whoami.py"), str(tmp_path), entry=None,
                 env=older_torch, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "rank0.json").exists() and "torch 2.9 or later" not in result.stderr
