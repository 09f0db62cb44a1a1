"""The operator's diagnoses end to end, through ``python -m supervisor`` on 2 CPU ranks that pretend to be GPUs 0 and 1.

* a hang on rank 1: the headline names GPU1 and says GPU0 waits for it (flight recorder), and every rank is gone
  within 3 s of the stall being detected (stalled ranks are SIGKILLed, not given the grace period);
* an out-of-memory error on rank 1: one headline with the GPU, the step and the fixes, exit code 99, no traceback on
  the console (it is in the rank's report file); a plain CPU rank refused host memory, the same;
* a rank slowed down from step 5 is named as a straggler, and a normal run names none.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from process_tree import watching
from rank_scripts.harness import clean_env
from rank_support import TINY, merged, set_flags
from trainer.diagnosis.oom_report import OOM_EXIT_CODE, OomReport

RUN_TIMEOUT = 150.0
STALL_TO_GONE = 3.0
STALL_CUE = b"stalled: no progress"
PACED_MAIN = Path(__file__).resolve().parent / "rank_scripts" / "paced" / "pretrain_main.py"


@dataclass
class Outcome:
    code: int
    output: str
    run_dir: Path
    stall_to_exit: float | None  # seconds from the stall's first console line to the supervisor's exit


def supervise(tmp_path: Path, cache_dir: Path, debug: dict[str, object], steps: int, *extra: str,
              env: dict[str, str] | None = None, fake_gpus: str = "0,1") -> Outcome:
    layer = merged(TINY, {"system": {"device": "auto"}, "data": {"cache_dir": str(cache_dir)},
                          "training": {"max_steps": steps}, "checkpoint": {"dir": str(tmp_path / "ckpt")},
                          "debug": debug})
    log = tmp_path / "run.txt"
    args = ["--debug", "--no-footer", "--nproc", "2", "--log-dir", str(tmp_path / "logs"), "--grace-period", "30",
            *set_flags(layer), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor", *args], cwd=tmp_path,
                                env=clean_env(SUPERVISOR_FAKE_GPUS=fake_gpus, **(env or {})), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    with watching(proc) as tree:
        deadline, detected = time.monotonic() + RUN_TIMEOUT, None
        while proc.poll() is None and time.monotonic() < deadline:
            if detected is None and STALL_CUE in log.read_bytes():
                detected = time.monotonic()
            time.sleep(0.02)
        code = proc.wait(1.0)
        ended = time.monotonic()
        tree.stop()
        assert tree.survivors(timeout=5.0) == []
    runs = list((tmp_path / "logs").iterdir())
    return Outcome(code, log.read_text(errors="replace"), runs[0] if runs else tmp_path,
                   None if detected is None else ended - detected)


def test_hang_names_the_stalled_rank_and_ends_fast(tmp_path: Path, token_cache_dir: Path) -> None:
    run = supervise(tmp_path, token_cache_dir, {"inject_fault": "hang", "inject_fault_rank": 1,
                                                "inject_fault_step": 3}, 12,
                    "--hang-timeout", "4", "--startup-timeout", "60")
    out = run.output
    assert run.code == 124, out[-4000:]
    headline = re.search(r"^supervisor: (GPU1 \(rank 1\) stalled at step 3 in \S+ \(trainer/diagnosis/faults\.py:\d+\); "
                         r"GPU0 \(rank 0\) waits for it in .*\(no progress for .* by flight recorder\))$", out, re.M)
    assert headline, out[-4000:]
    assert "run failed after" in out and "stall evidence" in out
    # detection → every rank gone (the supervisor exits after its last rank, and after writing its report)
    assert run.stall_to_exit is not None and run.stall_to_exit <= STALL_TO_GONE, run.stall_to_exit
    assert re.search(r"^supervisor:\s+GPU1\s+1\s+\d+\s+SIGKILL \(137\)\s+stalled", out, re.M), out[-3000:]


def test_oom_headline_and_exit_code(tmp_path: Path, token_cache_dir: Path) -> None:
    run = supervise(tmp_path, token_cache_dir, {"inject_fault": "oom", "inject_fault_rank": 1,
                                                "inject_fault_step": 2}, 6)
    out = run.output
    assert run.code == OOM_EXIT_CODE, out[-4000:]
    assert re.search(r"run failed after .*: GPU1 \(rank 1\) ran out of memory at step 2: .*the dry run estimated "
                     r"[\d.]+ GiB per GPU\. Fixes, in order: 1\) lower --batch-size", out), out[-4000:]
    # the traceback is in the report file only, and GPU0's lines after the failure are fallout: never on the console
    assert not re.search(r"^GPU[01]:.*Traceback", out, re.M), out[-4000:]
    assert re.search(r"^supervisor:\s+GPU1\s+1\s+\d+\s+exit 99\s+failed first", out, re.M), out[-4000:]
    # GPU0 either fails as fallout (its all-reduce cut short by GPU1's exit) or is stopped by the supervisor's SIGTERM
    # before its collective fails: which comes first is a race. Either way, what it wrote after the failure is in its
    # log file only, and the report says so.
    assert re.search(r"^supervisor:\s+GPU0\s+0\s+\d+\s+.*\s(stopped by the supervisor|failed after the first "
                     r"failure)\s", out, re.M), out[-4000:]
    fallout = re.search(r"^supervisor: GPU0 \(rank 0\): (\d+) more stderr lines? after the failure, in (\S+) only$",
                        out, re.M)
    gpu0_log = (run.run_dir / "gpu0.log").read_text()
    if "Traceback" in gpu0_log:
        assert fallout and Path(fallout[2]) == run.run_dir / "gpu0.log", out[-4000:]
    report = OomReport.load(run.run_dir, "GPU1")
    assert report is not None and report.step == 2 and "OutOfMemoryError" in report.traceback
    assert f"exit code {OOM_EXIT_CODE}; logs in" in out


@pytest.mark.slow
def test_a_cpu_rank_out_of_host_memory_is_an_oom(tmp_path: Path, token_cache_dir: Path) -> None:
    """A real allocation failure on a plain CPU rank: a feed-forward layer as wide as the config allows (2^31 - 1)
    on a hidden size of 256 asks torch's CPU allocator for 2 TiB at once (refused at once, nothing touched). The
    supervisor refuses such a run before it starts unless told to start it anyway (system.host_memory_check)."""
    run = supervise(tmp_path, token_cache_dir, {}, 2, "--nproc", "1", "--set", "system.device=cpu",
                    "--set", "system.host_memory_check=false",
                    "--set", "model.hidden_size=256", "--set", f"model.ffn_hidden_size={2**31 - 1}", fake_gpus="")
    out = run.output
    assert run.code == OOM_EXIT_CODE, out[-4000:]
    assert re.search(r"run failed after .*: CPU0 \(rank 0\) ran out of memory before the first step: host memory, "
                     r"2048\.00 GiB asked for at once; the dry run estimated [\d.]+ GiB per GPU\. Fixes, in order: "
                     r"1\) lower --batch-size", out), out[-4000:]
    assert "Traceback" not in out
    report = OomReport.load(run.run_dir, "CPU0")
    assert report is not None and "DefaultCPUAllocator: can't allocate memory" in report.message


def test_straggler_named(tmp_path: Path, token_cache_dir: Path) -> None:
    run = supervise(tmp_path, token_cache_dir, {"inject_fault": "slow", "inject_fault_rank": 1,
                                                "inject_fault_step": 5, "inject_fault_delay_s": 0.15}, 30)
    out = run.output
    assert run.code == 0, out[-4000:]
    found = re.findall(r"^supervisor: straggler: (GPU\d) is (\d+) % slower than the median over the last 20 steps "
                       r"\(at step (\d+)\)$", out, re.M)
    assert len(found) == 1 and found[0][0] == "GPU1", out[-4000:]
    assert int(found[0][2]) <= 5 + 25  # within the window's persistence after the slowdown began
    history = json.loads((run.run_dir / "stragglers.json").read_text())["stragglers"]
    assert [(s["label"], s["rank"]) for s in history] == [("GPU1", 1)]
    assert "straggler: GPU1" in (run.run_dir / "supervisor.log").read_text()


@pytest.mark.slow
def test_no_straggler_on_a_normal_run(tmp_path: Path, token_cache_dir: Path) -> None:
    """Two ranks doing the same work, each step padded by the same 0.15 s (rank_scripts/paced): on a loaded machine
    one CPU rank's ~10 ms of compute can be stretched more than the other's, which is a real straggler; with the pad,
    a rank would have to be ~4 times slower than the other all along to reach the 25 % threshold."""
    run = supervise(tmp_path, token_cache_dir, {}, 28, "--entry", str(PACED_MAIN), env={"PACED_STEP_S": "0.15"})
    assert run.code == 0, run.output[-4000:]
    assert re.search(r"run finished in .*: step 28/28", run.output), run.output[-4000:]  # the detector judged 7 windows
    assert "straggler:" not in run.output
    assert not (run.run_dir / "stragglers.json").exists()


BUSY_STATE = {"1": {"processes": [{"pid": 4242, "name": "other-job", "used_mib": 2048}]},
              "2": {"ecc_uncorrectable": 3, "throttle": ["HW_SLOWDOWN"]}}


def preflight_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    state = tmp_path / "gpu_state.json"
    state.write_text(json.dumps(BUSY_STATE))
    return subprocess.run(["bash", str(Path(__file__).resolve().parents[1] / "run_training.sh"), "--debug",
                           "--no-footer", "--log-dir", str(tmp_path / "logs"), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          env=clean_env(SUPERVISOR_FAKE_GPUS="0,1,2", SUPERVISOR_FAKE_GPU_STATE=str(state),
                                        PYTHON=sys.executable))


def test_preflight_refuses_a_busy_gpu(tmp_path: Path) -> None:
    run = preflight_run(tmp_path, "--gpus", "0,1")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: GPU 1 is in use by pid 4242 (other-job, 2,048 MiB); choose other GPUs with --gpus (or --gpus auto), "
        "or pass --allow-busy-gpus to share them"]
    assert not (tmp_path / "logs").exists()  # refused before a run folder or a rank existed


def test_preflight_auto_skips_and_allow_busy_shares(tmp_path: Path) -> None:
    noop = tmp_path / "noop.py"  # a rank program that does nothing: only the device choice is under test
    noop.write_text("")
    auto = preflight_run(tmp_path, "--gpus", "auto", "--nproc", "2", "--entry", str(noop), "--hang-timeout", "0")
    assert auto.returncode == 0, auto.stderr
    said = auto.stderr  # the supervisor's own lines
    assert "--gpus auto skips GPU 1: in use by pid 4242 (other-job, 2,048 MiB)" in said, said
    assert "GPU 2: 3 uncorrectable ECC errors since the driver loaded" in said
    assert "GPU 2: clocks throttled (HW_SLOWDOWN)" in said
    assert re.search(r"2 ranks \((GPU0, GPU2|GPU2, GPU0)\)", said), said
    shared = preflight_run(tmp_path, "--gpus", "1", "--allow-busy-gpus", "--entry", str(noop))
    assert shared.returncode == 0, shared.stderr
    assert "GPU 1 is in use by pid 4242 (other-job, 2,048 MiB); sharing it (--allow-busy-gpus)" in shared.stderr
