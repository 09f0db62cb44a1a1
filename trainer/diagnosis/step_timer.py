"""`StepTimer`: the two per-step times a rank sends the supervisor's straggler detector.

In synchronous data parallelism every rank's step lasts as long as the slowest rank's, so the step time alone cannot
name a straggler. What differs is *when* each rank is ready to join the step's gradient collectives: the slowest rank
arrives last and waits least. The timer measures, per step, ``ready_s`` (step start → the last micro-batch's forward
pass done, just before the backward that launches the gradient all-reduce) and ``step_s`` (step start → step end);
`supervisor.diagnosis.stragglers` turns them into each rank's own busy time.

On CPUs the host clock is the device clock. On GPUs the host runs ahead of the device, so the timer records CUDA
events instead and reads a step's times only once its last event has completed (``Event.query()``, which never
blocks): the figures arrive a step or two late, and the step itself gets no host synchronisation.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, Any] = {}
        self.pending: deque[tuple[Any, Any, Any]] = deque()  # CUDA: (start, ready, end) events not yet read
        self.latest: tuple[float, float] | None = None  # (ready_s, step_s) of the newest step measured

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks = {"start": self._mark()}

    def ready(self) -> None:
        self.marks["ready"] = self._mark()

    def end(self) -> None:
        start, ready, end = self.marks["start"], self.marks.get("ready"), self._mark()
        if not self.cuda:
            self.latest = ((ready if ready is not None else end) - start, end - start)
            return
        self.pending.append((start, ready or end, end))
        while self.pending and self.pending[0][2].query():
            s, r, e = self.pending.popleft()
            self.latest = (s.elapsed_time(r) / 1000.0, s.elapsed_time(e) / 1000.0)

    def take(self) -> tuple[float | None, float | None]:
        """The newest (ready_s, step_s) not yet taken, else (None, None)."""
        latest, self.latest = self.latest, None
        return latest if latest is not None else (None, None)
