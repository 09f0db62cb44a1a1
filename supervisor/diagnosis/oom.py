"""An out-of-memory failure made plain: which GPU, which step, the figures, and the fixes in the order to try them.

The rank that ran out of memory exits with `trainer.diagnosis.oom_report.OOM_EXIT_CODE` after writing its report file; the
watcher calls `headline` with it and uses the result as the failure's one-line reason.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainer.diagnosis.oom_report import OomReport

GIB = 1 << 30
HOST_REQUEST = re.compile(r"tried to allocate (\d+) bytes")  # torch's CPU allocator names the request it refused

SMALLER_BATCH = "lower --batch-size and raise training.grad_accum_nums by the same factor (same tokens per step)"
MORE_CHECKPOINTING = {  # the policy in force → the next one to try
    "none": "turn on gradient checkpointing (--set model.gradient_checkpointing=selective, then =full)",
    "selective": "checkpoint every layer (--set model.gradient_checkpointing=full)",
}
SHARD = "shard the model with FSDP (--set training.strategy=fsdp)"


def fixes(report: OomReport) -> list[str]:
    """What to try, cheapest first, leaving out what the run already does."""
    found = [SMALLER_BATCH]
    if report.checkpointing in MORE_CHECKPOINTING:
        found.append(MORE_CHECKPOINTING[report.checkpointing])
    if report.strategy != "fsdp":
        found.append(SHARD)
    return found


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def headline(report: OomReport) -> str:
    when = "before the first step" if report.step is None else f"at step {report.step}"
    if report.allocated is None:
        asked = HOST_REQUEST.search(report.message)
        figures = (f"host memory, {gib(int(asked[1]))} asked for at once" if asked
                   else "no allocator figures (not a CUDA device)")
    else:
        figures = (f"{gib(report.allocated)} allocated, {gib(report.reserved)} reserved, peak {gib(report.peak)} "
                   f"of {gib(report.total)}")
    estimate = "" if report.estimate is None else f"; the dry run estimated {gib(report.estimate)} per GPU"
    steps = "; ".join(f"{n}) {fix}" for n, fix in enumerate(fixes(report), 1))
    return (f"{report.label} (rank {report.rank}) ran out of memory {when}: {figures}{estimate}. Fixes, in order: "
            f"{steps}")


def describe(run_dir: Path, label: str, rank: int) -> str:
    """The headline for a rank that exited with the out-of-memory code (a short one when its report is missing)."""
    report = OomReport.load(run_dir, label)
    if report is None:
        return f"{label} (rank {rank}) ran out of memory (no report file: {run_dir}/oom-{label.lower()}.json)"
    return headline(report)
