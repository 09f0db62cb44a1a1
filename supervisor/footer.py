"""The live footer (terminal mode only): one row per rank under the scrolling lines.

It reads the watcher's state each time rich refreshes (4 times a second); nothing pushes updates to it.
"""

from __future__ import annotations

from typing import Callable

from rich.table import Table

from supervisor.liveness import RankState
from supervisor.report import duration
from supervisor.worker import Worker

Rows = Callable[[], list[tuple[Worker, RankState, str]]]


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
