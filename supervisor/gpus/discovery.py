"""Which GPUs exist, which are usable, and which ones a run gets.

Discovery, first that answers: the test seam ``SUPERVISOR_FAKE_GPUS``, then NVML (``nvidia-ml-py``), then
``nvidia-smi``, else none. An existing ``CUDA_VISIBLE_DEVICES`` limits the choice to the GPUs it names (indices or
UUIDs), the way CUDA itself would. GPU ids are NVML's (PCI bus order); ranks get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so
``CUDA_VISIBLE_DEVICES=<id>`` means the same card for CUDA as for ``nvidia-smi``.

Test seam: ``SUPERVISOR_FAKE_GPUS=0,1,2,3`` makes the supervisor believe those GPUs exist: prefixes, per-rank
``CUDA_VISIBLE_DEVICES`` and ``GPU_RANK``, selection and its errors all behave as on a GPU machine, while the resolved
config gets ``system.device=cpu`` so the ranks compute on the CPU. An entry may carry its load for ``--gpus auto``
tests as ``ID:FREE_MIB:UTIL_PERCENT`` (``0:1000:90,1:80000:5``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass

from trainer.errors import UserError
from trainer.model.estimate import DetectedGpus

FAKE_GPUS_ENV = "SUPERVISOR_FAKE_GPUS"
MIB = 1 << 20
FAKE_MEMORY_MIB = 81920


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML / nvidia-smi index: the physical id
    name: str
    memory_free: int  # bytes
    memory_total: int  # bytes
    utilization: int | None  # percent, None when the driver does not say
    uuid: str = ""

    def describe(self) -> str:
        busy = "?" if self.utilization is None else f"{self.utilization}%"
        return f"GPU {self.index} ({self.name}, {self.memory_free / (1 << 30):.1f} GiB free, {busy} busy)"


@dataclass(frozen=True)
class Inventory:
    """What discovery found: every GPU on the machine, and the ones CUDA_VISIBLE_DEVICES lets us use."""

    gpus: tuple[Gpu, ...]
    usable: tuple[Gpu, ...]
    fake: bool = False
    visible: str | None = None  # CUDA_VISIBLE_DEVICES as found, for the error messages

    def by_index(self) -> dict[int, Gpu]:
        return {g.index: g for g in self.usable}


# ---------------------------------------------------------------------------------------------------------------------
# Discovery


def fake_gpus(spec: str) -> list[Gpu]:
    """The test seam's GPUs: ``0,1,2`` or ``ID:FREE_MIB:UTIL`` entries, each id once (two ranks would share a log)."""
    gpus = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) > 3 or not all(is_number(p) for p in parts) or int(parts[2] if len(parts) > 2 else 0) > 100:
            raise UserError(f"{FAKE_GPUS_ENV}={spec}: expected ids such as 0,1,2 or ID:FREE_MIB:UTIL entries "
                            f"(whole numbers, utilisation at most 100)")
        index = int(parts[0])
        free_mib = int(parts[1]) if len(parts) > 1 else FAKE_MEMORY_MIB
        util = int(parts[2]) if len(parts) > 2 else 0
        if any(g.index == index for g in gpus):
            raise UserError(f"{FAKE_GPUS_ENV}={spec}: GPU {index} is listed twice; each id once")
        gpus.append(Gpu(index, "fake", free_mib * MIB, FAKE_MEMORY_MIB * MIB, util, f"GPU-fake-{index}"))
    return gpus


def is_number(text: str) -> bool:
    """A whole number written in ASCII digits (``str.isdigit`` also takes '²', which `int` refuses)."""
    return text.isascii() and text.isdigit()


def nvml_gpus() -> list[Gpu] | None:
    """All GPUs NVML sees, or None when NVML is not there (no driver, no library)."""
    try:  # a cheap probe first: without the driver's library, importing pynvml (a large module) is wasted time
        ctypes.CDLL("libnvidia-ml.so.1")
        import pynvml
    except (OSError, ImportError):
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util: int | None = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:
                util = None  # MIG instances and some vGPUs do not report it
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(Gpu(index, name.decode() if isinstance(name, bytes) else name, int(memory.free),
                            int(memory.total), util, uuid.decode() if isinstance(uuid, bytes) else uuid))
        return gpus
    except pynvml.NVMLError:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def smi_gpus() -> list[Gpu] | None:
    """All GPUs ``nvidia-smi`` lists, or None when it is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = "index,name,memory.free,memory.total,utilization.gpu,uuid"
    try:
        out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6:
            continue
        index, name, free, total, util, uuid = fields
        try:
            gpus.append(Gpu(int(index), name, int(float(free)) * MIB, int(float(total)) * MIB,
                            int(util) if util.isdigit() else None, uuid))
        except ValueError:
            continue
    return gpus


def visible_filter(gpus: list[Gpu], visible: str | None) -> list[Gpu]:
    """The GPUs that ``CUDA_VISIBLE_DEVICES`` lets a process use (unset: all; empty or -1: none).

    CUDA stops at the first entry it cannot parse, and so do we.
    """
    if visible is None:
        return list(gpus)
    by_index = {g.index: g for g in gpus}
    chosen: list[Gpu] = []
    for item in (s.strip() for s in visible.split(",")):
        if item.lstrip("-").isdigit():
            gpu = by_index.get(int(item))
        elif item.startswith("GPU-"):  # a UUID, or a unique prefix of one
            gpu = next((g for g in gpus if g.uuid and g.uuid.startswith(item)), None)
        else:
            gpu = None
        if gpu is None:
            break
        if gpu not in chosen:
            chosen.append(gpu)
    return chosen


def discover(environ: dict[str, str] | None = None) -> Inventory:
    environ = dict(os.environ) if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if environ.get(FAKE_GPUS_ENV):
        gpus = fake_gpus(environ[FAKE_GPUS_ENV])
        return Inventory(tuple(gpus), tuple(visible_filter(gpus, visible)), fake=True, visible=visible)
    for probe in (nvml_gpus, smi_gpus):
        found = probe()
        if found:
            return Inventory(tuple(found), tuple(visible_filter(found, visible)), visible=visible)
    return Inventory((), (), visible=visible)


# ---------------------------------------------------------------------------------------------------------------------
# Selection


def id_ranges(ids: list[int]) -> str:
    """[0,1,2,3,5] → '0-3, 5' (how the error messages name a machine's GPUs)."""
    ids = sorted(ids)
    parts: list[str] = []
    start = prev = None
    for i in ids + [None]:  # type: ignore[list-item]
        if start is not None and (i is None or i != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(parts)


def machine_phrase(inventory: Inventory) -> str:
    ids = [g.index for g in inventory.gpus]
    if not ids:
        return "this machine has no GPU"
    noun = "GPU" if len(ids) == 1 else "GPUs"
    return f"this machine has {noun} {id_ranges(ids)}"


def parse_ids(spec: str) -> list[int]:
    ids = []
    for item in (s.strip() for s in spec.split(",")):
        if not is_number(item):
            raise UserError(f"--gpus {spec}: expected GPU ids such as 0,3,5 or 'auto'")
        ids.append(int(item))
    if len(set(ids)) != len(ids):
        raise UserError(f"--gpus {spec}: a GPU is listed twice; one rank per GPU")
    return ids


def least_busy(gpus: list[Gpu] | tuple[Gpu, ...]) -> list[Gpu]:
    """Most free memory first, then least utilisation, then the lower id."""
    return sorted(gpus, key=lambda g: (-g.memory_free, g.utilization if g.utilization is not None else 101, g.index))


def select(inventory: Inventory, gpus_flag: str | None, nproc: int | None) -> list[Gpu]:
    """The GPUs a run uses, in rank order; an empty list means CPU ranks. Raises UserError on impossible requests."""
    usable = list(inventory.usable)
    if gpus_flag is None:
        if not usable:
            return []
        if nproc is None:
            return usable
        if nproc > len(usable):
            raise UserError(f"--nproc {nproc}: only {len(usable)} usable GPU{'s' if len(usable) != 1 else ''} "
                            f"({id_ranges([g.index for g in usable])})")
        return usable[:nproc]
    if not inventory.gpus:
        raise UserError(f"--gpus {gpus_flag}: no GPU found on this machine (NVML and nvidia-smi found none); "
                        f"drop --gpus to train on CPU ranks")
    if gpus_flag.strip() == "auto":
        count = nproc or 1
        if count > len(usable):
            raise UserError(f"--gpus auto --nproc {count}: only {len(usable)} usable GPU"
                            f"{'s' if len(usable) != 1 else ''} ({id_ranges([g.index for g in usable])})")
        return least_busy(usable)[:count]
    ids = parse_ids(gpus_flag)
    by_index = inventory.by_index()
    all_ids = {g.index for g in inventory.gpus}
    for i in ids:
        if i not in all_ids:
            raise UserError(f"GPU {i} does not exist; {machine_phrase(inventory)}")
        if i not in by_index:
            raise UserError(f"GPU {i} is hidden by CUDA_VISIBLE_DEVICES={inventory.visible}; usable GPUs: "
                            f"{id_ranges(list(by_index)) or 'none'}")
    if nproc is not None and nproc != len(ids):
        raise UserError(f"--gpus {gpus_flag} names {len(ids)} GPU{'s' if len(ids) != 1 else ''} but --nproc is "
                        f"{nproc}; give one or the other")
    return [by_index[i] for i in ids]


def detected(chosen: list[Gpu]) -> DetectedGpus:
    """The GPUs a run chose (one at least), as `--dry-run` sizes them: how many, the smallest one's memory, its name."""
    smallest = min(chosen, key=lambda g: g.memory_total)
    return DetectedGpus(len(chosen), smallest.memory_total, smallest.name)
