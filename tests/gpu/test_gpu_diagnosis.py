"""GPU tier: a real out-of-memory error (a batch that cannot fit) and a hang diagnosed through NCCL's flight records.

Runs only with ``bash run_tests.sh -m gpu`` on a machine with a CUDA GPU; skipped elsewhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.diagnosis.oom_report import OOM_EXIT_CODE, OomReport

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def clean_env() -> dict[str, str]:
    """This environment without the test seams and launcher variables a rank would otherwise inherit."""
    drop = ("SUPERVISOR_FAKE_GPUS", "SUPERVISOR_FAKE_GPU_STATE", "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK",
            "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": str(ROOT)}


def supervise(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "--debug", "--no-footer", "--nproc", "1",
                           "--log-dir", str(tmp_path / "logs"), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=clean_env())


def test_a_batch_that_cannot_fit_is_reported_plainly(tmp_path: Path) -> None:
    run = supervise(tmp_path, "--set", "training.batch_size=65536", "--set", "data.context_length=1024",
                    "--set", "model.max_position_embeddings=1024", "--set", "training.max_steps=2")
    out = run.stdout + run.stderr
    assert run.returncode == OOM_EXIT_CODE, out[-4000:]
    assert re.search(r"GPU0 \(rank 0\) ran out of memory at step 0: [\d.]+ GiB allocated, [\d.]+ GiB reserved, peak "
                     r"[\d.]+ GiB of [\d.]+ GiB; the dry run estimated [\d.]+ GiB per GPU", out), out[-4000:]
    assert "Traceback" not in out
    report = OomReport.load(next((tmp_path / "logs").iterdir()), "GPU0")
    assert report is not None and report.total == torch.cuda.get_device_properties(0).total_memory


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs for an NCCL group")
def test_nccl_hang_names_the_stalled_rank(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "supervisor", "--debug", "--no-footer", "--nproc", "2",
                          "--log-dir", str(tmp_path / "logs"), "--hang-timeout", "10",
                          "--set", "debug.inject_fault=hang", "--set", "debug.inject_fault_rank=1",
                          "--set", "debug.inject_fault_step=3", "--set", "training.max_steps=8"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=clean_env())
    out = run.stdout + run.stderr
    assert run.returncode == 124, out[-4000:]
    assert re.search(r"GPU\d \(rank 1\) stalled at step 3 in .*; GPU\d \(rank 0\) waits for it in nccl:.*by flight "
                     r"recorder\)", out), out[-4000:]
