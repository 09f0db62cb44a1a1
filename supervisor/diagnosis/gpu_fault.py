"""After a failure: was it the GPU, or the program?

A restart on a broken GPU fails again, so the supervisor must tell the two apart before it restarts. Evidence of a
GPU fault, per GPU of the failed group:

* NVML, asked again after the failure and compared with the preflight's answers (`preflight.check`): the GPU is
  lost (fell off the bus: NVML answers GPU_IS_LOST), its uncorrectable ECC count has risen, retired pages have become
  pending, or a clock-throttle reason that only hardware asserts has come into force (`HARDWARE_THROTTLE`). What was
  already so at the preflight explains nothing about this failure (the preflight warned about it then).
* The failing rank's last stderr lines: a CUDA error that means the device itself is gone or its memory broken
  (`DEVICE_GONE`), as opposed to the errors a program causes (an illegal address, a device-side assert); or the
  trainer's verdict on a non-finite step that did not reproduce when the rank recomputed it (`NOT_REPRODUCED`,
  `trainer.diagnosis.nan_verdict`): the device computed a wrong result once.

Anything else is a program fault: a Python exception, a NaN the guard gave up on, an out-of-memory exit (99, always a
program fault: the GPU did what it was asked), a user error, a signal. Without NVML (nvidia-smi only) only the error
text can speak; on CPU ranks there is no GPU to blame and no diagnosis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from supervisor.gpus.preflight import Health
from trainer.diagnosis.nan_verdict import NOT_REPRODUCED
from trainer.diagnosis.oom_report import OOM_EXIT_CODE
from trainer.errors import USER_ERROR_EXIT_CODE

# The CUDA runtime's and driver's messages (cudaGetErrorString) for a device that is gone or broken; a GPU that fell
# off the bus makes every later call fail with one of them. Matched case-insensitively in the failing rank's stderr.
DEVICE_GONE = (
    "uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable
    "uncorrectable NVLink error detected",  # cudaErrorNvlinkUncorrectable
    "hardware stack error",  # cudaErrorHardwareStackError
    "CUDA-capable device(s) is/are busy or unavailable",  # cudaErrorDevicesUnavailable, after it was in use
    "GPU is lost",  # NVML's and NCCL's wording for Xid 79
    "fallen off the bus",  # the driver's
)
# NVML's clocks-event reasons asserted by the board itself: an external slowdown signal (power supply, a failing
# component) or the power brake. A thermal software slowdown is the driver being careful, not a fault.
HARDWARE_THROTTLE = ("HW_SLOWDOWN", "HW_POWER_BRAKE_SLOWDOWN")
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # what torch.distributed puts before a rank's traceback lines


@dataclass(frozen=True)
class Verdict:
    """What the evidence says: the GPUs at fault (each with its evidence), else a program fault and why."""

    faulty: dict[int, list[str]] = field(default_factory=dict)  # GPU id → evidence
    program: str = ""  # why it is a program fault (empty when a GPU is at fault)

    @property
    def gpu_fault(self) -> bool:
        return bool(self.faulty)

    def line(self) -> str:
        """One line for the console, supervisor.log and the report."""
        if not self.faulty:
            return f"program fault, not a GPU's: {self.program}"
        return "GPU fault: " + "; ".join(f"GPU {gpu} ({', '.join(evidence)})" for gpu, evidence in self.faulty.items())


def nvml_evidence(before: Health | None, after: Health) -> list[str]:
    """What NVML says now that it did not say at the preflight (nothing `before`: a healthy GPU)."""
    before = before or Health(after.index)
    found = []
    if after.lost and not before.lost:
        found.append("NVML: lost")
    if after.ecc_uncorrectable > before.ecc_uncorrectable:
        found.append(f"NVML: uncorrectable ECC errors {before.ecc_uncorrectable} → {after.ecc_uncorrectable}")
    if after.retired_pages_pending and not before.retired_pages_pending:
        found.append("NVML: retired pages pending")
    new_throttle = [t for t in after.throttle if t in HARDWARE_THROTTLE and t not in before.throttle]
    if new_throttle:
        found.append(f"NVML: throttled by the hardware ({', '.join(new_throttle)})")
    return found


def text_evidence(stderr_tail: str) -> str | None:
    """The failing rank's line naming a device-gone CUDA error or a step that did not reproduce, if any (its last
    such line)."""
    for line in reversed(stderr_tail.splitlines()):
        if any(message.lower() in line.lower() for message in (*DEVICE_GONE, NOT_REPRODUCED)):
            return f"its error: {RANK_PREFIX.sub('', line).strip()[:160]}"
    return None


def diagnose(exit_code: int, failing_gpu: int | None, stderr_tail: str, preflight: dict[int, Health],
             now: dict[int, Health]) -> Verdict:
    """The verdict on a failed group: `preflight` is NVML's answer before the run, `now` after the failure (either
    empty where NVML cannot answer), `failing_gpu` the GPU of the rank that failed first (None: a stall with no
    single culprit)."""
    if exit_code == OOM_EXIT_CODE:
        return Verdict(program="the rank ran out of device memory")
    if exit_code == USER_ERROR_EXIT_CODE:
        return Verdict(program="a user error")
    faulty: dict[int, list[str]] = {}
    for gpu, health in now.items():
        if found := nvml_evidence(preflight.get(gpu), health):
            faulty[gpu] = found
    if failing_gpu is not None and (said := text_evidence(stderr_tail)):
        faulty.setdefault(failing_gpu, []).append(said)
    if faulty:
        return Verdict(faulty=dict(sorted(faulty.items())))
    checked = "NVML finds the GPUs as they were at the start" if now else "NVML is not available"
    where = f"GPU {failing_gpu}'s rank" if failing_gpu is not None else "the failing rank"
    return Verdict(program=f"{checked}, and {where} reports no CUDA error that means a device is gone")
