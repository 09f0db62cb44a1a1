"""Losing a GPU and going on: the restart without the GPUs a fault took, with the same training where it can be.

After a GPU fault (`supervisor.diagnosis.gpu_fault`), a restart (``--max-restarts``) leaves the faulty GPUs out and
starts on the others, unless ``--no-gpu-exclusion``. It keeps the global batch (micro-batch × accumulation × world
size) by raising the accumulation where the numbers divide; where they do not, it takes the largest accumulation that
does not exceed the global batch and says so in one line. The ranks then resume the run's latest checkpoint whatever
the world size (`trainer.checkpoint.store`), and since a step's samples depend only on the step and the global batch
(`trainer.data.batches`), the training continues as it would have without the fault.

Fewer GPUs than the minimum (``--min-gpus``, default half the run's GPUs, rounded up) is not worth going on with: the
run stops, saying why. Every exclusion is kept in ``<run>/exclusions.json`` (`Exclusion`), for the final report.

A run that ends on a GPU fault (no restart left, exclusion off, too few GPUs left, or a multi-node run, which never
restarts) leaves ``<run>/gpu_fault.json`` (`NodeFault`): which node's GPUs failed, so that a job script can leave the
node out of the job's next allocation (`supervisor.slurm.job`). Likewise a run that stopped because another node
was lost (it stopped answering, died, or never joined) leaves ``<run>/node_lost.json`` (`LostNode`) on each node that
stopped for it: the job's exit code is then the lost node's (125), not the code of the task the scheduler killed on
that node.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import Config

EXCLUSIONS_FILE = "exclusions.json"
GPU_FAULT_FILE = "gpu_fault.json"
LOST_NODE_FILE = "node_lost.json"


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """This machine as the scheduler names it (Slurm's node name, what a job's excluded nodes list), else its host
    name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


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
    host: str = field(default_factory=node_name)  # where the GPU is

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
    """Write every exclusion so far to <run>/exclusions.json."""
    write_json(run_dir / EXCLUSIONS_FILE, {"excluded": [asdict(e) for e in exclusions]})


@dataclass(frozen=True)
class NodeFault:
    """The GPU fault that ended a run, as gpu_fault.json records it. The Slurm job and allocation it happened in let
    the job script tell this allocation's record from those of earlier runs in the same log folder."""

    node: str  # `node_name`: what the job's next allocation leaves out
    gpus: dict[str, list[str]]  # GPU id → evidence (`gpu_fault.Verdict.faulty`)
    time: str
    slurm_job_id: str | None  # SLURM_JOB_ID; None outside Slurm
    slurm_restart_count: int  # SLURM_RESTART_COUNT: which allocation of the job (0: the first)

    @classmethod
    def here(cls, faulty: Mapping[int, list[str]], environ: Mapping[str, str] = os.environ) -> NodeFault:
        return cls(node_name(environ), {str(gpu): list(evidence) for gpu, evidence in faulty.items()}, now(),
                   *slurm_allocation(environ))

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / GPU_FAULT_FILE, asdict(self))

    def line(self) -> str:
        return f"node {self.node}: " + "; ".join(f"GPU {gpu} ({', '.join(evidence)})"
                                                for gpu, evidence in self.gpus.items())


@dataclass(frozen=True)
class LostNode:
    """Another node of the run that was lost, as node_lost.json records it on a node that stopped for it; the Slurm
    job and allocation, as for `NodeFault`."""

    node: int  # the lost node's rank (SLURM_NODEID under Slurm)
    why: str  # the headline that named it
    seen_by: str  # `node_name` of the node that recorded it
    # to the millisecond: which of two nodes that name each other did so first tells the frozen one (`job.lost_nodes`),
    # and the second record can follow the first within the same second
    time: str
    slurm_job_id: str | None
    slurm_restart_count: int

    @classmethod
    def here(cls, node: int, why: str, environ: Mapping[str, str] = os.environ) -> LostNode:
        at = datetime.datetime.now().isoformat(timespec="milliseconds")
        return cls(node, why, node_name(environ), at, *slurm_allocation(environ))

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / LOST_NODE_FILE, asdict(self))


def slurm_allocation(environ: Mapping[str, str]) -> tuple[str | None, int]:
    """SLURM_JOB_ID (None outside Slurm) and SLURM_RESTART_COUNT (0: the job's first allocation)."""
    return environ.get("SLURM_JOB_ID"), int(environ.get("SLURM_RESTART_COUNT") or 0)


def write_json(path: Path, content: Any) -> None:
    """Replaced atomically: a job script or a report may read it at any moment."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(content, indent=1) + "\n")
    tmp.replace(path)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def restart_config(cfg: Config, new_world_size: int, world_size: int) -> tuple[Config, Regroup]:
    """`cfg` with the accumulation for the smaller world (a copy: the original stays as the run first started)."""
    change = regroup(cfg.training.batch_size, cfg.training.grad_accum_nums, world_size, new_world_size)
    out = copy.deepcopy(cfg)
    out.training.grad_accum_nums = change.grad_accum
    return out, change
