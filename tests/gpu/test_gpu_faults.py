"""How a GPU run ends badly: a rank killed by SIGKILL, the supervisor stopped by SIGTERM, a rank that hangs. Each
ends with its exit code, leaves no process behind, and leaves no process holding memory on the GPU (NVML's list of
compute processes is back to what it was before the run)."""

from __future__ import annotations

import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_support import Machine, compute_processes, gpu_layer, released, supervise

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Fault:
    name: str
    code: int
    steps: int
    debug: dict[str, object]
    timeouts: tuple[str, ...] = ()

    def report(self, machine: Machine) -> str:
        if self.name == "SIGTERM":
            return r"run interrupted after .*: interrupted by SIGTERM"
        if self.name == "hang":
            return rf"{machine.label} \(rank 0\) stalled at step 2 in _fire_if_due \(trainer/diagnosis/faults\.py:\d+\)"
        return rf"{machine.label} \(rank 0\) failed: SIGKILL \(137\)"


FAULTS = [
    Fault("sigkill", 128 + signal.SIGKILL, 6, {"inject_fault": "sigkill", "inject_fault_step": 2}),
    Fault("SIGTERM", 128 + signal.SIGTERM, 5000, {}),  # the supervisor's signal arrives after step 2's line
    Fault("hang", 124, 6, {"inject_fault": "hang", "inject_fault_step": 2},
          ("--hang-timeout", "5", "--startup-timeout", "120")),
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_frees_the_gpu(fault: Fault, machine: Machine, tmp_path: Path, token_cache_dir: Path) -> None:
    before = compute_processes(machine.id)
    cue = re.compile(rf"^{machine.label}:INFO \| \[GPU {machine.id}\] Step \[2/", re.M)
    sent: list[bool] = []

    def terminate_after_step_2(text: str, proc: subprocess.Popen) -> None:
        if fault.name == "SIGTERM" and not sent and cue.search(text):
            proc.send_signal(signal.SIGTERM)
            sent.append(True)

    layer = gpu_layer(tmp_path, token_cache_dir, training={"max_steps": fault.steps}, debug=fault.debug)
    run = supervise(machine, tmp_path, layer, *fault.timeouts, on_output=terminate_after_step_2)
    assert run.code == fault.code, run.output[-4000:]
    assert re.search(fault.report(machine), run.output), run.output[-4000:]
    assert run.survivors == [], f"left running: {[(p.pid, p.cmdline()) for p in run.survivors]}"
    assert released(machine.id, before) == set(), "processes still hold memory on the GPU"
    if fault.name == "SIGTERM":  # a graceful stop: every rank finished its step and the group checkpointed
        assert sent and re.search(rf"^{machine.label}:INFO \| checkpoint saved: ", run.output, re.M)
