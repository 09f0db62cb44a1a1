"""GPU tier: a real out-of-memory error (a batch that cannot fit), and a stall diagnosed on NCCL: the rank dumps its
NCCL flight records and its stack, the headline names it, and every rank is gone within seconds.

A culprit among several NCCL ranks needs one GPU per rank (NCCL refuses two ranks on one device); with a single GPU
the tier checks the NCCL dump and the lone rank's verdict, and the two-rank case where the machine has two GPUs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_support import Machine, Outcome, compute_processes, gpu_layer, released, supervise
from trainer.diagnosis.oom_report import OOM_EXIT_CODE, OomReport

pytestmark = pytest.mark.gpu

# Activations of 8 M tokens × hidden 4096 in bf16 are 64 GiB per tensor: the first layer's forward cannot fit on any
# GPU of today. The weights (about 0.5 B parameters) and the token batch (70 MB) fit easily.
TOO_BIG = {"model": {"hidden_size": 4096, "num_layers": 2, "num_heads": 32, "num_kv_heads": 8,
                     "ffn_hidden_size": 16384},
           "training": {"batch_size": 262_144, "max_steps": 2}}
STALL_TO_GONE = 3.0
TOTAL_MEMORY = "import json, torch; print(json.dumps(torch.cuda.get_device_properties(0).total_memory))"


def test_a_batch_that_cannot_fit_is_reported_plainly(machine: Machine, tmp_path: Path,
                                                      token_cache_dir: Path) -> None:
    before = compute_processes(machine.id)
    run = supervise(machine, tmp_path, gpu_layer(tmp_path, token_cache_dir, **TOO_BIG))
    out = run.output
    assert run.code == OOM_EXIT_CODE, out[-4000:]
    assert re.search(rf"{machine.label} \(rank 0\) ran out of memory at step 0: [\d.]+ GiB allocated, [\d.]+ GiB "
                     r"reserved, peak [\d.]+ GiB of [\d.]+ GiB; the dry run estimated [\d.]+ GiB per GPU\. Fixes, in "
                     r"order: 1\) lower --batch-size", out), out[-4000:]
    assert not re.search(rf"^{machine.label}:.*Traceback", out, re.M), "the traceback belongs in the report file"
    report = OomReport.load(run.run_dir(), machine.label)
    assert report is not None and report.step == 0 and "OutOfMemoryError" in report.traceback
    total = subprocess.run([sys.executable, "-c", TOTAL_MEMORY], env=machine.env, capture_output=True, text=True,
                           timeout=120)
    assert total.returncode == 0, total.stderr[-2000:]
    assert report.total == json.loads(total.stdout) and report.peak is not None and report.peak <= report.total
    assert run.survivors == [] and released(machine.id, before) == set()


def stalled_run(machine: Machine, tmp_path: Path, cache_dir: Path, gpus: list[int]) -> tuple[Outcome, float | None]:
    """A run on `gpus` whose last rank hangs at step 3; returns the outcome and seconds from the stall's first console
    line to the supervisor's exit."""
    seen: list[float] = []

    def mark(text: str, proc: subprocess.Popen) -> None:
        if not seen and "stalled" in text:
            seen.append(time.monotonic())

    layer = gpu_layer(tmp_path, cache_dir, training={"max_steps": 12},
                      debug={"inject_fault": "hang", "inject_fault_rank": len(gpus) - 1, "inject_fault_step": 3})
    command = [sys.executable, "-m", "supervisor", "--gpus", ",".join(map(str, gpus))]
    run = supervise(machine, tmp_path, layer, "--hang-timeout", "5", "--startup-timeout", "120", command=command,
                    on_output=mark)
    return run, (time.monotonic() - seen[0]) if seen else None


def test_a_stall_on_nccl_is_dumped_and_named(machine: Machine, tmp_path: Path, token_cache_dir: Path) -> None:
    run, stall_to_gone = stalled_run(machine, tmp_path, token_cache_dir, [machine.id])
    out = run.output
    assert run.code == 124, out[-4000:]
    assert re.search(rf"{machine.label} \(rank 0\) stalled at step 3 in _fire_if_due \(trainer/diagnosis/faults\.py:"
                     r"\d+\) \(no progress for [\d.]+ s; by stack\)", out), out[-4000:]
    dump = json.loads((run.run_dir() / "flight_recorder" / f"{machine.label.lower()}.json").read_text())
    nccl = [pg for pg in dump["pg_status"] if pg.startswith("nccl:")]
    assert nccl, f"no NCCL group in the flight records: {sorted(dump['pg_status'])}"
    assert any(e["profiling_name"].startswith("nccl:") for e in dump["entries"])
    assert stall_to_gone is not None and stall_to_gone <= STALL_TO_GONE, stall_to_gone
    assert run.survivors == []


def test_nccl_hang_names_the_stalled_rank(machine: Machine, tmp_path: Path, token_cache_dir: Path) -> None:
    if len(machine.inventory.usable) < 2:
        pytest.skip("needs two CUDA GPUs: NCCL runs one rank per GPU")
    two = [g.index for g in machine.inventory.usable[:2]]
    run, stall_to_gone = stalled_run(machine, tmp_path, token_cache_dir, two)
    out = run.output
    assert run.code == 124, out[-4000:]
    assert re.search(r"GPU\d+ \(rank 1\) stalled at step 3 in .*; GPU\d+ \(rank 0\) waits for it in nccl:.*by flight "
                     r"recorder\)", out), out[-4000:]
    assert stall_to_gone is not None and stall_to_gone <= STALL_TO_GONE, stall_to_gone
