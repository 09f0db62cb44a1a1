"""What a dataset build shows while it runs: a rich bar on a terminal, a plain line every few seconds when piped (a
log file, the supervisor's `GPUn:` prefixing), or nothing; plus heartbeats on the supervisor's progress channel. Every
summary line says the process's peak RSS so far: a build's memory is bounded, and this shows it."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from trainer.progress import ProgressReporter

GB = 1e9


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM of its own image (ru_maxrss would carry a forking parent's peak over
    into a child), ru_maxrss where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class BuildProgress:
    """Build progress on stderr: a rich bar on a terminal, a plain line every few seconds when piped, or nothing.
    It also sends phase events on the supervisor's progress channel (a no-op outside it), so a long build is not
    mistaken for a hang. rich is imported only when a build starts."""

    PLAIN_INTERVAL_S = 5.0

    def __init__(self, mode: str) -> None:
        self.mode = mode  # "rich" | "plain" | "off"
        self.reporter = ProgressReporter()
        self.phase_documents = 0
        self.phase_tokens = 0
        self._name = ""
        self._started = self._last_line = 0.0
        self._bar: Any = None
        self._task: Any = None

    @classmethod
    def create(cls, show_progress: bool | None) -> "BuildProgress":
        if show_progress is False:
            return cls("off")
        return cls("rich" if show_progress or sys.stderr.isatty() else "plain")

    def phase(self, name: str, total: int | None = None) -> None:
        self.end_phase()
        self._name, self._started = name, time.perf_counter()
        self._last_line = self._started
        self.phase_documents = self.phase_tokens = 0
        self.reporter.phase(f"prepare: {name}"[:200])
        if self.mode == "rich":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("documents{task.fields[tokens]}"), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task(name, total=total, tokens="")
            self._bar.start()
        elif self.mode == "plain":
            self.message(f"{name} ...")

    def advance(self, documents: int, tokens: int = 0) -> None:
        self.phase_documents += documents
        self.phase_tokens += tokens
        if self._bar is not None:
            self._bar.update(self._task, advance=documents,
                             tokens=f" · {self.phase_tokens:,} tokens" if self.phase_tokens else "")
        elif self.mode == "plain" and time.perf_counter() - self._last_line >= self.PLAIN_INTERVAL_S:
            self._last_line = time.perf_counter()
            self.reporter.phase(f"prepare: {self._name}"[:200])
            self.message(f"  {self.summary()}")

    def counted(self, pieces: Iterable[tuple[str, bool]]) -> Iterator[tuple[str, bool]]:
        """Pieces passed through, counting the documents they end."""
        for piece in pieces:
            if piece[1]:
                self.advance(1)
            yield piece

    def summary(self) -> str:
        seconds = time.perf_counter() - self._started
        rate = f", {self.phase_tokens / seconds / 1e6:.2f} M tokens/s" if self.phase_tokens and seconds > 0 else ""
        tokens = f", {self.phase_tokens:,} tokens" if self.phase_tokens else ""
        return (f"{self.phase_documents:,} documents{tokens} in {seconds:.1f} s{rate}, "
                f"peak RSS {peak_rss_bytes() / GB:.2f} GB")

    def end_phase(self) -> None:
        if not self._name:
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.mode == "plain":
            self.message(f"  done: {self.summary()}")
        self._name = ""

    def message(self, text: str) -> None:
        if self.mode != "off":
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self._name = ""
