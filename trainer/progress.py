"""The progress channel from a rank to the supervisor's watchdog, and the rank's device label.

A rank writes one JSON object per line to the pipe whose write end the supervisor passed in
``SUPERVISOR_PROGRESS_FD``. Each record stays under PIPE_BUF (4096 bytes), so one ``os.write`` is atomic and the
supervisor never sees a torn record. The watchdog reads only this channel, never the log text. No torch import.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

PROGRESS_FD_ENV = "SUPERVISOR_PROGRESS_FD"
RESTART_COUNT_ENV = "SUPERVISOR_RESTART_COUNT"  # every rank: 0 for the first group, n for the n-th restart
MAX_RECORD_BYTES = 512
# The phase a rank reports while it joins its process group: every rank of the world must come, so a rank in it may
# wait for a node that never does, and has nothing to save yet (the supervisor stops it without the grace period)
RENDEZVOUS_PHASE = "distributed"


@dataclass
class Progress:
    # "phase" (start-up stages) | "step" | "done" | "failing" (about to exit with an error) | "stopped" (every rank
    # agreed to stop early and saved a checkpoint: a stop signal reached one of them)
    event: str
    step: int = 0
    total: int = 0
    loss: float | None = None
    tok_s: float | None = None
    eta_s: float | None = None
    phase: str | None = None
    time: float = 0.0
    ready_s: float | None = None  # this step: start → forward done (trainer.diagnosis.step_timer), for stragglers
    step_s: float | None = None  # this step: start → end
    signal: str | None = None  # "stopped": the signal this rank itself received (None: it stopped with the others)

    def encode(self) -> bytes:
        line = json.dumps(asdict(self), separators=(",", ":"), allow_nan=True).encode() + b"\n"
        if len(line) > MAX_RECORD_BYTES:
            raise ValueError(f"progress record over {MAX_RECORD_BYTES} bytes: {line[:80]!r}")
        return line

    @classmethod
    def decode(cls, line: bytes) -> "Progress":
        return cls(**json.loads(line))


class ProgressReporter:
    """Writes `Progress` records to the supervisor; a no-op when the rank was not started by one."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None and os.environ.get(PROGRESS_FD_ENV):
            fd = int(os.environ[PROGRESS_FD_ENV])
        self.fd = fd
        # a supervisor reads this channel: what it checked and said before starting the ranks (a damaged checkpoint
        # passed over, `supervisor.launch.cli.make_plan`) is not said again by every group it starts
        self.supervised = fd is not None
        self.said_failing = False

    def send(self, progress: Progress) -> None:
        if self.fd is None:
            return
        progress.time = progress.time or time.time()
        try:
            os.write(self.fd, progress.encode())
        except (BrokenPipeError, OSError):
            self.fd = None  # the supervisor is gone; PDEATHSIG will follow

    def phase(self, name: str) -> None:
        self.send(Progress(event="phase", phase=name))

    def step(self, step: int, total: int, loss: float | None = None, tok_s: float | None = None,
             eta_s: float | None = None, ready_s: float | None = None, step_s: float | None = None) -> None:
        self.send(Progress(event="step", step=step, total=total, loss=loss, tok_s=tok_s, eta_s=eta_s,
                           ready_s=ready_s, step_s=step_s))

    def done(self, step: int, total: int, loss: float | None = None) -> None:
        self.send(Progress(event="done", step=step, total=total, loss=loss))

    def stopped(self, step: int, total: int, signal: str | None) -> None:
        """The rank stops at `step` of `total`, its checkpoint saved, because a rank received a stop signal (`signal`:
        this one did). The supervisor reports a run that ends so as stopped, not finished."""
        self.send(Progress(event="stopped", step=step, total=total, signal=signal))

    def failing(self) -> None:
        """Sent before the rank leaves its process group on an error: the supervisor learns which rank failed first
        while the other ranks are still inside their collectives, before their own errors (the fallout) begin. Said
        once: the loop says it before it waits for a checkpoint write, the rank's handler again for any failure."""
        if not self.said_failing:
            self.said_failing = True
            self.send(Progress(event="failing"))


def gpu_id() -> str | None:
    """The physical GPU id this rank owns (``GPU_RANK``), None for CPU ranks and unlabelled runs."""
    return os.environ.get("GPU_RANK")


def restart_count() -> int:
    """Which group of the run this rank belongs to: 0 for the first, n after the n-th restart (0 outside the
    supervisor)."""
    return int(os.environ.get(RESTART_COUNT_ENV) or 0)


def restart_may_follow() -> bool:
    """Whether a failure of this group may be followed by a restart: the launcher (the supervisor, or torchrun) has
    restarts left (`TORCHELASTIC_RESTART_COUNT` below `TORCHELASTIC_MAX_RESTARTS`)."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    return restarts < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)


def device_label(uses_cuda: bool) -> str:
    """``GPU3`` for the rank on physical GPU 3; ``CPU<local rank>`` for a CPU rank."""
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if gpu_id() is not None:
        return f"GPU{gpu_id()}"
    return f"GPU{local_rank}" if uses_cuda else f"CPU{local_rank}"
