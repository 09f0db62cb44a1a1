"""Numerics or hardware: the verdict on a non-finite step that the run recomputed (`trainer.diagnosis.recompute`), in
the words the log, the supervisor and the job script read. No torch import: the supervisor reads `NOT_REPRODUCED`.

A step whose recompute, from the same parameters and the same batch, gives the same non-finite result is the
model's own numerics: the run goes on (the step was skipped) and says how to replay it with the NaN diagnostics on.
A step that comes out finite the second time was computed wrongly once: the rank's device is suspected, the rank
writes ``<run>/gpu_fault.json`` (its GPU, in `supervisor.gpus.exclusion.NodeFault`'s format, which a job script
reads to leave the node out) when it has a GPU, and stops with `SuspectDevice`, whose line on stderr is the evidence
`supervisor.diagnosis.gpu_fault` takes for a GPU fault: a restart (``--max-restarts``) leaves that GPU out.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

NOT_REPRODUCED = "did not reproduce: suspect"  # the start of a suspect device's line, matched by the supervisor
GPU_FAULT_FILE = "gpu_fault.json"  # `supervisor.gpus.exclusion.GPU_FAULT_FILE`; the trainer does not import it


class SuspectDevice(RuntimeError):
    """A non-finite step that did not reproduce: the rank's device computed it wrongly once. Ends the rank."""


@dataclass(frozen=True)
class Verdict:
    """What recomputing one non-finite step said, on the rank that says it."""

    step: int
    label: str  # the device it ran on: "GPU3", "CPU1"
    reproduced: bool
    loss: float  # the recomputed local loss
    grad_norm: float  # the recomputed (all-reduced) gradient norm
    named: bool = True  # False: only the all-reduced gradient norm was non-finite, which names no rank

    def line(self, run_dir: Path) -> str:
        """The log's line; `run_dir`: the run's folder, as the replay command names it."""
        again = f"recomputed from the parameters before it: loss {self.loss:.4f}, gradient norm {self.grad_norm:.4f}"
        if self.reproduced:
            return f"reproducible: the model's numerics at step {self.step} ({again}); replay it with the NaN " \
                   f"diagnostics on: {replay_command(run_dir, self.step)}"
        if not self.named:
            return f"did not reproduce on any rank: step {self.step}'s gradient norm was non-finite once ({again}); " \
                   f"one of the devices computed it wrongly, and no rank's own loss says which"
        return (f"{NOT_REPRODUCED} {self.label}: step {self.step}'s non-finite loss came out finite recomputed (loss "
                f"{self.loss:.4f}, gradient norm {self.grad_norm:.4f})")


def replay_command(run_dir: Path, step: int) -> str:
    """The command that replays `step` of the run in `run_dir` (`trainer.replay`)."""
    return f"bash run_training.sh --replay {run_dir} --step {step}"


@dataclass(frozen=True)
class GpuFaultRecord:
    """`supervisor.gpus.exclusion.NodeFault`'s fields, as gpu_fault.json holds them."""

    node: str
    gpus: dict[str, list[str]]
    time: str
    slurm_job_id: str | None
    slurm_restart_count: int


def record_gpu_fault(run_dir: Path, gpu: str, evidence: str) -> Path:
    """`<run_dir>/gpu_fault.json` naming this node and `gpu` (written atomically: a job script may read it at any
    moment)."""
    record = GpuFaultRecord(node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(), gpus={gpu: [evidence]},
                            time=time.strftime("%Y-%m-%dT%H:%M:%S"), slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                            slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0))
    path = run_dir / GPU_FAULT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=1) + "\n")
    tmp.replace(path)
    return path
