"""Preflight: what NVML says about each chosen GPU before any rank starts (and, after a failure, again: the
comparison `gpu_fault` draws its evidence from).

Per GPU: whether NVML can still reach it (a GPU that fell off the bus is *lost*), the compute processes already on it
(pid, name, memory), uncorrectable ECC errors since the driver loaded, retired pages waiting for a reboot, and a
clock-throttle reason in force (thermal or power slowdown). A GPU another
process uses is *busy*: the run refuses it (``error:``, exit 2) unless ``--allow-busy-gpus``, and ``--gpus auto``
skips it. The other findings are warnings: the run goes on, and the operator knows which GPU to suspect.

Test seam: ``SUPERVISOR_FAKE_GPU_STATE=<file.json>`` (with ``SUPERVISOR_FAKE_GPUS``) replaces NVML's answers:
``{"1": {"processes": [{"pid": 4242, "name": "python", "used_mib": 2048}], "ecc_uncorrectable": 3,
"retired_pages_pending": true, "throttle": ["HW_SLOWDOWN"], "lost": false}}``; GPUs it does not name are healthy
(`trainer.diagnosis.fake_gpu_state`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainer.diagnosis.fake_gpu_state import FAKE_STATE_ENV, read_state
from trainer.errors import UserError

MIB = 1 << 20
THROTTLE_REASONS = {  # NVML's clocks-event bits that mean the GPU runs slower than it should
    0x8: "HW_SLOWDOWN", 0x20: "SW_THERMAL_SLOWDOWN", 0x40: "HW_THERMAL_SLOWDOWN", 0x80: "HW_POWER_BRAKE_SLOWDOWN",
}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None


@dataclass(frozen=True)
class Health:
    index: int
    processes: tuple[GpuProcess, ...] = ()
    ecc_uncorrectable: int = 0
    retired_pages_pending: bool = False
    throttle: tuple[str, ...] = field(default_factory=tuple)
    lost: bool = False  # NVML answers GPU_IS_LOST: the GPU fell off the bus and nothing else about it can be read

    @property
    def busy(self) -> bool:
        return bool(self.processes)

    def warnings(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"GPU {self.index}: lost (NVML cannot reach it; a GPU reset or a reboot brings it back)")
        if self.ecc_uncorrectable:
            out.append(f"GPU {self.index}: {self.ecc_uncorrectable} uncorrectable ECC errors since the driver loaded")
        if self.retired_pages_pending:
            out.append(f"GPU {self.index}: retired memory pages pending (a reboot or GPU reset retires them)")
        if self.throttle:
            out.append(f"GPU {self.index}: clocks throttled ({', '.join(self.throttle)})")
        return out

    def users(self) -> str:
        return ", ".join(f"pid {p.pid} ({p.name}" + (f", {p.used_bytes / MIB:,.0f} MiB" if p.used_bytes else "") + ")"
                         for p in self.processes)


def fake_health(path: str, indices: list[int]) -> dict[int, Health]:
    try:
        data = read_state(path)
        out = {}
        for index in indices:
            g = data.get(str(index), {})
            procs = tuple(GpuProcess(int(p["pid"]), str(p.get("name", "?")),
                                     int(p["used_mib"]) * MIB if p.get("used_mib") is not None else None)
                          for p in g.get("processes", []))
            out[index] = Health(index, procs, int(g.get("ecc_uncorrectable", 0)),
                                bool(g.get("retired_pages_pending", False)), tuple(g.get("throttle", ())),
                                bool(g.get("lost", False)))
        return out
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise UserError(f"{FAKE_STATE_ENV}={path}: {e}") from None


def process_name(pid: int) -> str:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # gone, or another user's (and psutil not allowed to look)
        return "?"


def nvml_health(indices: list[int]) -> dict[int, Health]:
    """NVML's answers; a query a GPU does not support (no ECC, no retirement, MIG) counts as nothing found."""
    import pynvml

    def ask(call, *args, default=None):  # type: ignore[no-untyped-def]
        try:
            return call(*args)
        except pynvml.NVMLError:
            return default

    out: dict[int, Health] = {}
    pynvml.nvmlInit()
    try:
        for index in indices:
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(index)
                pynvml.nvmlDeviceGetMemoryInfo(h)  # the cheapest query that reaches the GPU itself
            except pynvml.NVMLError_GpuIsLost:
                out[index] = Health(index, lost=True)
                continue
            procs = tuple(GpuProcess(p.pid, process_name(p.pid), p.usedGpuMemory)
                          for p in ask(pynvml.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []
                          if p.pid != os.getpid())
            ecc = ask(pynvml.nvmlDeviceGetTotalEccErrors, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                      pynvml.NVML_VOLATILE_ECC, default=0) or 0
            pending = ask(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h, default=0) or 0
            reasons = ask(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, h, default=0) or 0
            throttle = tuple(name for bit, name in THROTTLE_REASONS.items() if reasons & bit)
            out[index] = Health(index, procs, int(ecc), bool(pending), throttle)
    finally:
        pynvml.nvmlShutdown()
    return out


def check(indices: list[int], fake: bool, environ: dict[str, str] | None = None) -> dict[int, Health]:
    """Each GPU's health; empty where nobody can say (a fake GPU without the seam, or no NVML)."""
    environ = dict(os.environ) if environ is None else environ
    if environ.get(FAKE_STATE_ENV):
        return fake_health(environ[FAKE_STATE_ENV], indices)
    if fake:
        return {}
    try:
        return nvml_health(indices)
    except Exception:  # no NVML (nvidia-smi only): no preflight, as before
        return {}


def refuse_busy(health: dict[int, Health], allow_busy: bool) -> list[str]:
    """Warnings for the run's GPUs; raises UserError for a busy one unless `allow_busy`."""
    busy = [h for h in health.values() if h.busy]
    if busy and not allow_busy:
        raise UserError("; ".join(f"GPU {h.index} is in use by {h.users()}" for h in busy) +
                        "; choose other GPUs with --gpus (or --gpus auto), or pass --allow-busy-gpus to share them")
    notes = [f"GPU {h.index} is in use by {h.users()}; sharing it (--allow-busy-gpus)" for h in busy]
    return notes + [w for h in health.values() for w in h.warnings()]
