"""The live footer (terminal mode only): one row per rank under the scrolling lines.

It reads the watcher's state each time rich refreshes (4 times a second); nothing pushes updates to it.
"""

from __future__ import annotations

from typing import Callable

from rich.table import Table

from supervisor.group.liveness import RankState
from supervisor.group.watch import Watch
from supervisor.group.worker import Worker, describe_exit
from supervisor.report.summary import duration

Rows = Callable[[], list[tuple[Worker, RankState, str]]]


def group_rows(watch: Watch) -> list[tuple[Worker, RankState, str]]:
    """Each rank of the group being watched, with what it last reported and its state in words."""
    rows = []
    for w in watch.workers:
        if w.alive:
            status = "finishing" if watch.states[w.spec.rank].event == "done" else "running"
            if (found := watch.stragglers.named.get(w.spec.rank)) is not None:
                status += f" · straggler +{found.percent:.0f} %"
        else:
            status = watch.endings.get(w.spec.rank, describe_exit(w.exit_code or 0))
        rows.append((w, watch.states[w.spec.rank], status))
    return rows


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class Footer:
    def __init__(self, title: str) -> None:
        self.title = title
        self.rows: Rows = lambda: []

    def __rich__(self) -> Table:
        table = Table(title=self.title, title_justify="left", expand=False, box=None, padding=(0, 2),
                      header_style="bold")
        for column in ("device", "step", "loss", "tokens/s", "ETA", "state"):
            table.add_column(column, justify="left" if column in ("device", "state") else "right")
        for worker, state, status in self.rows():
            step = f"{state.step}/{state.total}" if state.total else (state.phase or "starting")
            eta = "-" if state.eta_s is None else duration(state.eta_s)
            table.add_row(worker.label, step, fmt(state.loss, ".4f"), fmt(state.tok_s, ",.0f"), eta, status)
        return table
