"""The supervisor on a real GPU: NVML discovery, NCCL with world size 1, the rank's one visible GPU, `--gpus auto`,
`./train_gpu.sh <id>`, and the error for a GPU that does not exist."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_support import Machine, banner, gpu_layer, supervise
from rank_scripts.harness import ROOT
from supervisor.gpus import discovery as gpus

pytestmark = pytest.mark.gpu

CUDA_RANK = ROOT / "tests" / "rank_scripts" / "cuda_rank.py"


def cuda_rank(machine: Machine, tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m supervisor FLAGS --entry cuda_rank.py` and what its one rank recorded."""
    out = tmp_path / "ranks"
    out.mkdir()
    cmd = [sys.executable, "-m", "supervisor", "--no-footer", "--log-dir", str(tmp_path / "logs"), *flags,
           "--entry", str(CUDA_RANK), "--", "--out", str(out)]
    done = subprocess.run(cmd, cwd=tmp_path, env=machine.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads((out / "rank0.json").read_text())


def test_nvml_discovery_and_one_nccl_rank_on_its_own_gpu(machine: Machine, tmp_path: Path) -> None:
    assert not machine.inventory.fake and machine.gpu.memory_total > 0 and machine.gpu.uuid.startswith("GPU-")
    done, rank = cuda_rank(machine, tmp_path, "--gpus", str(machine.id))
    assert rank["CUDA_VISIBLE_DEVICES"] == str(machine.id) and rank["GPU_RANK"] == str(machine.id)
    assert rank["device_count"] == 1, "the rank sees its own GPU and no other"
    assert rank["name"] == machine.gpu.name, "NVML and CUDA name the same card"
    assert (rank["backend"], rank["world_size"], rank["all_reduce"]) == ("nccl", 1, 1.0)
    assert f"{machine.label}:cuda rank 0: 1 visible device(s), {machine.gpu.name}, nccl" in done.stdout
    assert f"1 rank ({machine.label}) of 1" in done.stderr
    assert list((tmp_path / "logs").glob(f"*/{machine.label.lower()}.log"))


def test_gpus_auto_picks_the_least_busy(machine: Machine, tmp_path: Path) -> None:
    chosen = gpus.least_busy(machine.inventory.usable)[0]
    done, rank = cuda_rank(machine, tmp_path, "--gpus", "auto")
    assert re.search(rf"--gpus auto chose GPU {chosen.index} \({re.escape(chosen.name)}, ", done.stderr), done.stderr
    assert rank["CUDA_VISIBLE_DEVICES"] == str(chosen.index) and rank["device_count"] == 1


def test_train_gpu_sh_trains_on_the_chosen_gpu(machine: Machine, tmp_path: Path, token_cache_dir: Path) -> None:
    layer = gpu_layer(tmp_path, token_cache_dir, training={"max_steps": 3})
    run = supervise(machine, tmp_path, layer, command=["bash", str(ROOT / "train_gpu.sh"), str(machine.id)])
    assert run.code == 0, run.output[-3000:]
    assert run.survivors == []
    assert banner(run, machine, "world size") == f"world size: 1 (nccl) | devices: {machine.label} ({machine.gpu.name})"
    assert re.search(rf"^{machine.label}:INFO \| \[GPU {machine.id}\] Step \[2/3\] \| Loss: \d+\.\d{{4}}", run.output,
                     re.M), run.output[-3000:]
    assert "run finished in" in run.output


def test_a_gpu_that_does_not_exist(machine: Machine, tmp_path: Path) -> None:
    missing = max(g.index for g in machine.inventory.gpus) + 1
    done = subprocess.run([sys.executable, "-m", "supervisor", "--debug", "--gpus", str(missing), "--log-dir",
                           str(tmp_path / "logs")], cwd=tmp_path, env=machine.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"error: GPU {missing} does not exist; {gpus.machine_phrase(machine.inventory)}\n"
    assert not (tmp_path / "logs").exists()
