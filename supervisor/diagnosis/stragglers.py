"""Straggler detection: a rank persistently slower than the others, from the per-step times each rank reports.

In synchronous data parallelism a step lasts as long as its slowest rank, so step times are equal everywhere; what
differs is when each rank gets ready for the step's gradient collectives (`trainer.diagnosis.step_timer`: ``ready_s``). The
last rank to get ready waits for nobody; every other rank waits the difference. A rank's own busy time for the step
is therefore ``step_s - (latest ready_s - its ready_s)``.

A rank is named when, over the last `WINDOW` steps every rank reported, its busy time is at least `THRESHOLD` above
the median of the other ranks' (sums over the window, so one slow step is noise), and it was above that median by
half the threshold in at least `PERSISTENCE` of those steps. The first steps (warm-up) are left out. Each rank is
named once per group; `Straggler` records go to the console, ``supervisor.log``, the live footer and
``stragglers.json`` in the run folder.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

WINDOW = 20
THRESHOLD = 0.25
PERSISTENCE = 0.75
WARM_UP_STEPS = 2
HISTORY_FILE = "stragglers.json"


@dataclass(frozen=True)
class Straggler:
    label: str
    rank: int
    step: int  # the last step of the window
    percent: float  # how much slower than the others' median, over the window
    window: int
    time: float

    def message(self) -> str:
        return (f"straggler: {self.label} is {self.percent:.0f} % slower than the median over the last "
                f"{self.window} steps (at step {self.step})")


@dataclass
class StragglerDetector:
    labels: dict[int, str]  # rank → device label, every rank of the group
    window: int = WINDOW
    threshold: float = THRESHOLD
    pending: dict[int, dict[int, tuple[float, float]]] = field(default_factory=dict)  # step → rank → times
    busy: dict[int, deque[float]] = field(default_factory=dict)
    named: dict[int, Straggler] = field(default_factory=dict)

    def add(self, rank: int, step: int, ready_s: float | None, step_s: float | None) -> Straggler | None:
        """One rank's times for one step; a new `Straggler` when this completes a step that names one."""
        if ready_s is None or step_s is None or step <= WARM_UP_STEPS or len(self.labels) < 2:
            return None
        times = self.pending.setdefault(step, {})
        times[rank] = (ready_s, step_s)
        if len(times) < len(self.labels):
            return None
        del self.pending[step]
        for old in [s for s in self.pending if s < step]:  # a rank skipped that step's report: forget it
            del self.pending[old]
        latest = max(ready for ready, _ in times.values())
        for r, (ready, total) in times.items():
            self.busy.setdefault(r, deque(maxlen=self.window)).append(max(0.0, total - (latest - ready)))
        return self.judge(step)

    def judge(self, step: int) -> Straggler | None:
        if any(len(self.busy.get(r, ())) < self.window for r in self.labels):
            return None
        for rank in self.labels:
            if rank in self.named:
                continue
            others = [r for r in self.labels if r != rank]
            mine = sum(self.busy[rank])
            median = statistics.median(sum(self.busy[r]) for r in others)
            if median <= 0 or mine < median * (1 + self.threshold):
                continue
            per_step = [self.busy[rank][i] > statistics.median(self.busy[r][i] for r in others) *
                        (1 + self.threshold / 2) for i in range(self.window)]
            if sum(per_step) < PERSISTENCE * self.window:
                continue
            found = Straggler(self.labels[rank], rank, step, 100 * (mine / median - 1), self.window, time.time())
            self.named[rank] = found
            return found
        return None


def record(run_dir: Path, found: list[Straggler]) -> str | None:
    """Every straggler named so far in this run, as ``stragglers.json`` in the run folder; why it could not be
    written (a full disk), for a warning: the console and supervisor.log have said it already."""
    path = run_dir / HISTORY_FILE
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps({"stragglers": [asdict(s) for s in found]}, indent=2) + "\n")
        tmp.replace(path)
    except OSError as e:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        return f"cannot write {path} ({e.strerror or e})"
    return None
