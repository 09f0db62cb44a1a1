"""The out-of-memory report: what a rank that ran out of memory tells the supervisor, in one file of the run folder.

A ``torch.OutOfMemoryError`` (or an allocation failure outside the caching allocator, `is_out_of_memory`) ends the
rank with `OOM_EXIT_CODE`, after it wrote ``oom-<label>.json`` beside its log:
the step, the allocator's figures where the device has them (``torch.cuda.memory_allocated`` / ``_reserved`` /
``max_memory_allocated`` and the GPU's total), the dry run's per-GPU estimate (`trainer.model.estimate`) and the full
traceback. The rank prints one line on stderr; the supervisor's headline is built from this file
(`supervisor.diagnosis.oom`), so the console never shows the allocator's multi-page traceback.

The record and its file name are torch-free (the supervisor reads them); only `collect` and `is_out_of_memory`
import torch, when called.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OOM_EXIT_CODE = 99  # a rank that ran out of device memory (documented in docs/diagnosis.md, "Exit codes")


@dataclass
class OomReport:
    label: str  # "GPU3"
    rank: int
    step: int | None  # the step that ran out of memory; None before the first one
    allocated: int | None  # bytes held by tensors when it failed (CUDA only)
    reserved: int | None  # bytes the caching allocator held
    peak: int | None  # the most bytes tensors held at once in this run
    total: int | None  # the GPU's memory
    estimate: int | None  # the dry run's per-GPU estimate for this config
    strategy: str
    message: str  # the error's first line
    traceback: str
    checkpointing: str = "none"  # model.gradient_checkpointing's policy (none | selective | full)

    def save(self, run_dir: Path) -> Path:
        path = report_path(run_dir, self.label)
        path.write_text(json.dumps(asdict(self), indent=2))  # read only after this rank has exited
        return path

    @classmethod
    def load(cls, run_dir: Path, label: str) -> "OomReport | None":
        try:
            return cls(**json.loads(report_path(run_dir, label).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def report_path(run_dir: Path, label: str) -> Path:
    return run_dir / f"oom-{label.lower()}.json"


OOM_MARKERS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDA out of memory", "CUDA error: out of memory",
               "DefaultCPUAllocator: can't allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    """`torch.OutOfMemoryError`; an allocation failing outside the caching allocator (cuBLAS's workspace, a CUDA
    call) or in host memory (a CPU rank's tensors: torch's CPU allocator), which reach Python as a plain RuntimeError
    naming it; or Python's own MemoryError (numpy's arrays)."""
    import torch

    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and any(marker in str(error) for marker in OOM_MARKERS))


def collect(error: BaseException, cfg: Any, label: str, rank: int, world_size: int, step: int | None) -> OomReport:
    """The report for `error`, with the figures the device can give (none on a CPU)."""
    import torch

    from trainer.config import checkpointing_policy
    from trainer.model.estimate import estimate

    allocated = reserved = peak = total = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_allocated()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        planned: int | None = estimate(cfg, world_size, total).selected.total
    except Exception:  # a model folder that cannot be sized again must not hide the report itself
        planned = None
    text = "".join(traceback.format_exception(error))
    return OomReport(label=label, rank=rank, step=step, allocated=allocated, reserved=reserved, peak=peak,
                     total=total, estimate=planned, strategy=cfg.training.strategy,
                     message=(str(error).strip().splitlines() or ["out of memory"])[0], traceback=text,
                     checkpointing=checkpointing_policy(cfg.model.gradient_checkpointing))
