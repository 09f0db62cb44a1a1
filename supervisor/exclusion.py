"""Losing a GPU and going on: the restart without the GPUs a fault took, with the same training where it can be.

After a GPU fault (`supervisor.diagnosis.gpu_fault`), a restart (``--max-restarts``) leaves the faulty GPUs out and
starts on the others, unless ``--no-gpu-exclusion``. It keeps the global batch (micro-batch × accumulation × world
size) by raising the accumulation where the numbers divide; where they do not, it takes the largest accumulation that
does not exceed the global batch and says so in one line. The ranks then resume the run's latest checkpoint whatever
the world size (`trainer.checkpoint`), and since a step's samples depend only on the step and the global batch
(`trainer.data.batches`), the training continues as it would have without the fault.

Fewer GPUs than the minimum (``--min-gpus``, default half the run's GPUs, rounded up) is not worth going on with: the
run stops, saying why. Every exclusion is kept in ``<run>/exclusions.json`` (`Exclusion`), for the final report and
for a job script that wants to leave the node or the GPU out of its next allocation.
"""

from __future__ import annotations

import copy
import json
import math
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.config import Config

EXCLUSIONS_FILE = "exclusions.json"


def default_min_gpus(gpus: int) -> int:
    return max(1, math.ceil(gpus / 2))


@dataclass(frozen=True)
class Regroup:
    """The accumulation for a new world size, and the line that says what changed when the global batch could not
    stay (None when it did)."""

    grad_accum: int
    note: str | None

    @property
    def kept(self) -> bool:
        return self.note is None


def regroup(micro_batch: int, grad_accum: int, world_size: int, new_world_size: int) -> Regroup:
    """The same global batch on `new_world_size` ranks, by the accumulation alone (the micro-batch is what fits in
    memory: it never grows)."""
    per_micro = grad_accum * world_size  # micro-batches per step, across the ranks
    if per_micro % new_world_size == 0:
        return Regroup(per_micro // new_world_size, None)
    accum = max(1, per_micro // new_world_size)
    before, after = micro_batch * per_micro, micro_batch * accum * new_world_size
    return Regroup(accum, f"the global batch changes from {before} to {after} sequences: {per_micro} micro-batches "
                          f"per step do not divide among {new_world_size} ranks (accumulation {accum}); the "
                          f"batches from here on are not those of the run without the fault")


@dataclass(frozen=True)
class Exclusion:
    """One GPU left out, as exclusions.json records it."""

    gpu: int
    time: str  # local time, ISO 8601
    restart: int  # the restart that started without it
    failed_rank: int | None
    evidence: list[str]
    gpus_after: list[int]  # the new layout: rank i on gpus_after[i]
    grad_accum_after: int
    global_batch_after: int
    host: str = field(default_factory=socket.gethostname)  # where the GPU is: what a job script leaves out next time

    def line(self) -> str:
        return (f"GPU {self.gpu} excluded at {self.time} ({', '.join(self.evidence)}); restart {self.restart} on "
                f"{gpus_phrase(self.gpus_after)}: accumulation {self.grad_accum_after}, global batch "
                f"{self.global_batch_after}")

    def short(self) -> str:
        """For the live footer's title: which GPU, when, the first piece of evidence."""
        return f"GPU {self.gpu} excluded at {self.time.split('T')[-1]} ({self.evidence[0]})"


def gpus_phrase(gpus: list[int]) -> str:
    """'GPU 0' or 'GPUs 0, 2, 3': a layout, one rank per GPU in this order."""
    return f"GPU{'s' * (len(gpus) != 1)} {', '.join(map(str, gpus))}"


def record(run_dir: Path, exclusions: list[Exclusion]) -> None:
    """Write every exclusion so far to <run>/exclusions.json (replaced atomically)."""
    path = run_dir / EXCLUSIONS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"excluded": [asdict(e) for e in exclusions]}, indent=1) + "\n")
    tmp.replace(path)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def restart_config(cfg: Config, new_world_size: int, world_size: int) -> tuple[Config, Regroup]:
    """`cfg` with the accumulation for the smaller world (a copy: the original stays as the run first started)."""
    change = regroup(cfg.training.batch_size, cfg.training.grad_accum_nums, world_size, new_world_size)
    out = copy.deepcopy(cfg)
    out.training.grad_accum_nums = change.grad_accum
    return out, change
