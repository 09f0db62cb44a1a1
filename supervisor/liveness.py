"""What the watcher knows of each rank's life between its start and its exit: what it last said on the progress
channel, when, and how long it may stay silent before the watchdog calls it stalled (its allowance: `--hang-timeout`
after a step, `--startup-timeout` before the first one and during a phase). Time the console spent blocked (a paused
pager) is not silence: a rank waiting to write its output is not stalled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from trainer.progress import Progress


@dataclass
class RankState:
    """What a rank last said on the progress channel."""

    last_seen: float  # monotonic
    last_seen_wall: float
    console_mark: float = 0.0  # Console.writing_time() when last seen
    event: str | None = None
    phase: str | None = None
    step: int = 0
    total: int = 0
    loss: float | None = None
    tok_s: float | None = None
    eta_s: float | None = None
    pending: bytes = b""

    def update(self, record: Progress, console_mark: float) -> None:
        self.last_seen, self.last_seen_wall, self.console_mark = time.monotonic(), time.time(), console_mark
        self.event = record.event
        if record.event == "phase":
            self.phase = record.phase
        else:
            self.step, self.total = record.step, record.total or self.total
            self.loss = record.loss if record.loss is not None else self.loss
            self.tok_s, self.eta_s = record.tok_s, record.eta_s

    def allowance(self, hang_timeout: float, startup_timeout: float) -> float:
        return hang_timeout if self.event == "step" else startup_timeout

    def silence(self, now: float, console_time: float) -> float:
        """Seconds without progress, not counting those the console held the rank's output back."""
        return now - self.last_seen - (console_time - self.console_mark)
