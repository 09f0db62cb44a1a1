"""Lose a GPU, keep training: a GPU fault is told from a program fault, the restart leaves the faulty GPU out, keeps
the global batch and resumes the same training on the others.

CPU only: ``SUPERVISOR_FAKE_GPUS`` makes the supervisor believe in GPUs, ``SUPERVISOR_FAKE_GPU_STATE`` stands for
NVML, and the ``gpu_lost`` fault marks the failing rank's GPU lost there as it dies with CUDA's error. The supervisor's
decisions (a second exclusion, the minimum, a program fault, exclusion turned off) run on the torch-free rank program
of tests/rank_scripts; the equal-loss runs train the real model: one GPU of 2 lost in the default tier, one of 4 with
DDP and FSDP2 in the slow tier.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rank_scripts.harness import Run, clean_env, run
from rank_support import TINY, history_losses, merged, set_flags, tiny_config
from supervisor.diagnosis.gpu_fault import diagnose
from supervisor.gpus.preflight import Health, check
from supervisor.gpus.exclusion import Exclusion, gpus_phrase, regroup
from trainer import loop
from trainer.checkpoint.store import sample_order

CUDA_ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"


# ---------------------------------------------------------------------------------------------------------------------
# The diagnosis and the new layout, as functions


def test_a_gpu_fault_is_what_nvml_says_changed_or_a_device_gone_error() -> None:
    before = {0: Health(0), 1: Health(1, ecc_uncorrectable=2, throttle=("HW_SLOWDOWN",)), 2: Health(2)}
    after = {0: Health(0, lost=True), 1: Health(1, ecc_uncorrectable=2, throttle=("HW_SLOWDOWN",)),
             2: Health(2, ecc_uncorrectable=1, retired_pages_pending=True, throttle=("HW_POWER_BRAKE_SLOWDOWN",))}
    verdict = diagnose(1, 0, f"[rank0]: Traceback\n[rank0]: {CUDA_ECC}\n", before, after)
    assert verdict.faulty == {0: ["NVML: lost", f"its error: {CUDA_ECC}"],
                              2: ["NVML: uncorrectable ECC errors 0 → 1", "NVML: retired pages pending",
                                  "NVML: throttled by the hardware (HW_POWER_BRAKE_SLOWDOWN)"]}
    assert verdict.line().startswith("GPU fault: GPU 0 (NVML: lost, its error: ")
    # GPU 1's ECC errors and slowdown were there at the preflight already: they explain nothing about this failure
    assert diagnose(1, 1, "", before, {1: before[1]}).faulty == {}
    # without NVML, the error text alone
    assert diagnose(1, 3, CUDA_ECC, {}, {}).faulty == {3: [f"its error: {CUDA_ECC}"]}


@pytest.mark.parametrize("code, tail, why", [
    (1, "RuntimeError: injected fault", "NVML finds the GPUs as they were at the start, and GPU 0's rank reports no "
                                        "CUDA error that means a device is gone"),
    (1, "NonFiniteError: 3 consecutive steps", "NVML finds the GPUs"),
    (99, CUDA_ECC, "the rank ran out of device memory"),  # an out-of-memory exit is the program's, whatever it says
    (2, "error: bad input", "a user error"),
])
def test_a_program_fault_never_blames_a_gpu(code: int, tail: str, why: str) -> None:
    verdict = diagnose(code, 0, tail, {0: Health(0)}, {0: Health(0), 1: Health(1)})
    assert not verdict.gpu_fault
    assert verdict.line().startswith(f"program fault, not a GPU's: {why}")


def test_the_fake_state_reads_a_lost_gpu(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"1": {"lost": True}}))
    health = check([0, 1], fake=True, environ={"SUPERVISOR_FAKE_GPU_STATE": str(state)})
    assert not health[0].lost and health[1].lost
    assert health[1].warnings() == ["GPU 1: lost (NVML cannot reach it; a GPU reset or a reboot brings it back)"]


def test_regroup_keeps_the_global_batch_where_the_numbers_divide() -> None:
    assert regroup(2, 3, 4, 3).grad_accum == 4 and regroup(2, 3, 4, 3).kept  # 2 × 3 × 4 = 2 × 4 × 3
    assert regroup(8, 1, 8, 4).grad_accum == 2 and regroup(8, 1, 8, 4).kept
    changed = regroup(2, 1, 4, 3)
    assert changed.grad_accum == 1
    assert changed.note == ("the global batch changes from 8 to 6 sequences: 4 micro-batches per step do not divide "
                            "among 3 ranks (accumulation 1); the batches from here on are not those of the run "
                            "without the fault")



def test_a_checkpoint_continues_the_same_order_on_another_split_of_its_global_batch() -> None:
    def data(world_size: int, grad_accum: int, micro_batch_size: int = 2) -> dict[str, int]:
        return {"seed": 7, "context_length": 32, "world_size": world_size, "grad_accum": grad_accum,
                "micro_batch_size": micro_batch_size}

    assert sample_order(data(4, 3)) == sample_order(data(3, 4)) == sample_order(data(1, 6, 4))
    assert sample_order(data(4, 1)) != sample_order(data(3, 1))

# ---------------------------------------------------------------------------------------------------------------------
# The supervisor's decisions, on the torch-free rank program


def fake_gpus_run(tmp_path: Path, gpus: str, *args: str, fail: str = "gpu_lost") -> Run:
    state = tmp_path / "gpu_state.json"
    state.write_text("{}")
    env = clean_env(SUPERVISOR_FAKE_GPUS=gpus, SUPERVISOR_FAKE_GPU_STATE=str(state))
    return run(tmp_path, "--no-footer", "--grace-period", "2", *args, env=env,
               entry_args=("--steps", "5", "--fail", fail, "--fail-rank", "1"))


def test_each_gpu_fault_excludes_its_gpu_until_the_minimum_stops_the_run(tmp_path: Path) -> None:
    """The fault strikes rank 1 in every group: GPU 1, then GPU 2 (rank 1 after the first restart) are left out; the
    third would leave one GPU, below the default minimum of half the 4: the run stops, saying so in one line."""
    r = fake_gpus_run(tmp_path, "0,1,2,3", "--max-restarts", "5")
    assert r.returncode == 1, r.stderr[-3000:]
    said = r.stderr
    assert "restart 1 of 5 after GPU1 (rank 1) failed: exit 1; the ranks resume from this run's latest checkpoint; " \
           "on GPUs 0, 2, 3" in said
    assert "restart 2 of 5 after GPU2 (rank 1) failed: exit 1; the ranks resume from this run's latest checkpoint; " \
           "on GPUs 0, 3" in said
    stop = [line for line in said.splitlines() if "not restarting" in line]
    assert stop == ["supervisor: not restarting: without GPU 3 the run would have 1 GPU, fewer than the minimum of 2 "
                    "(--min-gpus)"]
    assert "restart 3" not in said
    record = json.loads((r.run_dir() / "exclusions.json").read_text())["excluded"]
    assert [(e["gpu"], e["restart"], e["gpus_after"], e["evidence"][0]) for e in record] == [
        (1, 1, [0, 2, 3], "NVML: lost"), (2, 2, [0, 3], "NVML: lost")]
    assert record[0]["evidence"][1] == f"its error: {CUDA_ECC}"
    assert record[0]["host"] == socket.gethostname()
    assert Exclusion(**record[1]).short() == f"GPU 2 excluded at {record[1]['time'][11:]} (NVML: lost)"  # the footer's
    report = said[said.index("run failed after"):]
    assert "GPU fault: GPU 3 (NVML: lost" in report and "restarts: 2 of 5 used" in report
    assert re.search(r"GPU exclusions \(also in .*exclusions\.json\):\n.*  GPU 1 excluded at .*\n.*  GPU 2 excluded",
                     report)
    log = (r.run_dir() / "supervisor.log").read_text()
    assert "GPU 2 excluded at" in log and "not restarting: without GPU 3" in log
    # the fault that ended the run, for a job script that leaves this node out of its next allocation
    ended = json.loads((r.run_dir() / "gpu_fault.json").read_text())
    assert (ended["node"], list(ended["gpus"]), ended["slurm_job_id"]) == (socket.gethostname(), ["3"], None)
    assert ended["gpus"]["3"][0] == "NVML: lost"


def test_a_program_fault_restarts_on_the_same_gpus(tmp_path: Path) -> None:
    r = fake_gpus_run(tmp_path, "0,1", "--max-restarts", "1", fail="raise")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "program fault, not a GPU's: NVML finds the GPUs as they were at the start" in r.stderr
    assert "restart 1 of 1 after GPU1 (rank 1) failed: exit 1; the ranks resume from this run's latest checkpoint\n" \
           in r.stderr
    assert r.stderr.count("GPU1 (rank 1") >= 2  # the restarted group had GPU 1 again
    assert not (r.run_dir() / "exclusions.json").exists() and not (r.run_dir() / "gpu_fault.json").exists()


def test_exclusion_turned_off_restarts_on_the_same_gpus(tmp_path: Path) -> None:
    r = fake_gpus_run(tmp_path, "0,1", "--max-restarts", "1", "--no-gpu-exclusion")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "GPU exclusion is off (--no-gpu-exclusion): on the same GPUs" in r.stderr
    assert not (r.run_dir() / "exclusions.json").exists()


def test_min_gpus_is_checked_before_anything_starts(tmp_path: Path) -> None:
    r = fake_gpus_run(tmp_path, "0,1", "--min-gpus", "3")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --min-gpus must be within 1-2 (the run's GPUs), got 3"
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------------------------------------
# The same training on fewer GPUs

# DDP resumes at step 3 from the node's memory; FSDP2 from step_000002, the fault's step run again
MICRO_BATCH, STEPS, FAULT_STEP, INTERVAL = 2, 6, 3, 2
# Losses agree to float summation order only: the gradients of the same 12 (or 4) micro-batches are summed in another
# order (a gloo all-reduce over 4 or 3 ranks after 3 or 4 local accumulations, against one process accumulating them
# all), which moves float32 sums by about 1e-7 relative per step; AdamW and 6 steps keep that far below 1e-5. Measured:
# 2 → 1 ranks bit-identical, 4 → 3 (DDP and FSDP2) at most 1.7e-7 relative.
REL_TOL = 1e-5


def reference_losses(tmp_path: Path, cache_dir: Path, global_accum: int,
                     data: dict[str, Any] | None = None) -> dict[int, float]:
    """The uninterrupted run with the same global batch: one process accumulating every micro-batch of a step."""
    cfg = tiny_config(tmp_path / "reference", cache_dir, data=data or {}, training={
        "max_steps": STEPS, "batch_size": MICRO_BATCH, "grad_accum_nums": global_accum})
    assert loop.train(cfg) == 0
    return history_losses(Path(cfg.logging.run_dir))


def losing_run(tmp_path: Path, cache_dir: Path, gpus: int, accum: int, strategy: str,
               data: dict[str, Any] | None = None) -> subprocess.CompletedProcess:
    """`gpus` fake GPUs, GPU 1 lost at the start of step FAULT_STEP (first group only), one restart allowed."""
    state = tmp_path / "gpu_state.json"
    state.write_text("{}")
    layer = merged(TINY, {"system": {"device": "auto"}, "data": {"cache_dir": str(cache_dir), **(data or {})},
                          "training": {"max_steps": STEPS, "batch_size": MICRO_BATCH, "grad_accum_nums": accum,
                                       "strategy": strategy},
                          "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": INTERVAL},
                          "debug": {"inject_fault": "gpu_lost", "inject_fault_step": FAULT_STEP,
                                    "inject_fault_rank": 1, "inject_fault_restart": 0}})
    return subprocess.run([sys.executable, "-m", "supervisor", "--debug", "--no-footer", "--max-restarts", "1",
                           "--grace-period", "2", "--log-dir", str(tmp_path / "logs"), *set_flags(layer)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=clean_env(SUPERVISOR_FAKE_GPUS=",".join(map(str, range(gpus))),
                                        SUPERVISOR_FAKE_GPU_STATE=str(state)))


@pytest.mark.parametrize("gpus, accum, strategy", [
    pytest.param(2, 1, "ddp", id="2to1-ddp"),
    pytest.param(4, 3, "ddp", id="4to3-ddp", marks=pytest.mark.slow),
    pytest.param(4, 3, "fsdp", id="4to3-fsdp", marks=pytest.mark.slow),
])
def test_a_lost_gpu_is_left_out_and_training_goes_on_the_same(tmp_path: Path, token_cache_dir: Path,
                                                              one_thread: None, gpus: int, accum: int,
                                                              strategy: str) -> None:
    """GPU 1 of `gpus` is lost at step 3; the run restarts without it, with the accumulation raised so the global batch
    stays, resumes (DDP: the state three steps in from the node's memory, which holds it whole; FSDP2: step_000002's
    shards resharded by DCP) and finishes with the losses of the uninterrupted run, step for step
    (training_history.json keeps the first group's steps across the restart)."""
    global_accum = gpus * accum
    expected = reference_losses(tmp_path, token_cache_dir, global_accum)
    proc = losing_run(tmp_path, token_cache_dir, gpus, accum, strategy)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    left, new_accum = [g for g in range(gpus) if g != 1], global_accum // (gpus - 1)
    ranks = "1 rank" if gpus == 2 else f"{gpus - 1} ranks"
    assert "GPU fault: GPU 1 (NVML: lost, its error: RuntimeError: CUDA error: uncorrectable ECC error" in out
    assert f"the global batch stays {global_accum * MICRO_BATCH} sequences: accumulation {new_accum} on {ranks}" in out
    # DDP's state is whole in the node's memory, whatever the ranks; FSDP2's shards there are of 4 ranks, not 3
    memory = "step 3 in this node's memory (from this run's latest checkpoint if that copy fails their checks)"
    resumes = memory if strategy == "ddp" else "this run's latest checkpoint"
    assert f"the ranks resume from {resumes}; on {gpus_phrase(left)}" in out
    assert f"resumed on {gpus - 1} × {new_accum}: the same global batch, the same batches" in out
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert json.loads((run_dir / "config.restart1.json").read_text())["training"]["grad_accum_nums"] == new_accum
    losses = history_losses(run_dir)  # steps 0-1 of the first group, 2-5 of the restarted one
    assert sorted(losses) == list(range(STEPS))
    for step, loss in losses.items():
        assert math.isclose(loss, expected[step], rel_tol=REL_TOL), (step, loss, expected[step])
    assert "GPU exclusions (also in" in out and "GPU 1 excluded at" in out


@pytest.mark.slow
def test_a_mixture_keeps_its_batches_on_fewer_gpus(tmp_path: Path, token_cache_dir: Path, one_thread: None) -> None:
    """A 3-source mixture (stdlib, .jsonl.zst, Parquet): 2 GPUs, one lost at step 3, the restart on 1 with twice the
    accumulation trains the uninterrupted run's batches (losses bit-identical, as 2 → 1 ranks are for one source)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rows = "".join(json.dumps({"text": f"row {i}: " + "lorem ipsum dolor " * (i % 20 + 5)}) + "\n" for i in range(60))
    (tmp_path / "rows.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    pq.write_table(pa.table({"text": [f"parquet document {i} " * 30 for i in range(20)]}), tmp_path / "p.parquet")
    data = {"mixture": {"stdlib": 0.5, str(tmp_path / "rows.jsonl.zst"): 0.3, str(tmp_path / "p.parquet"): 0.2}}
    expected = reference_losses(tmp_path, token_cache_dir, 2, data)
    proc = losing_run(tmp_path, token_cache_dir, 2, 1, "ddp", data)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "resumed on 1 × 2: the same global batch, the same batches" in proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "logs").iterdir()
    losses = history_losses(run_dir)
    assert sorted(losses) == list(range(STEPS)) and all(losses[s] == expected[s] for s in losses)
