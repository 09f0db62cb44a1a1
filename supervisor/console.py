"""Where everything the supervisor shows goes: the console (plain or a terminal with a live footer) and supervisor.log.

Plain mode (a pipe or a file: ``| grep GPU2:``, ``| tee training.log``): rank stdout goes to our stdout, rank
stderr to our stderr, each as whole prefixed lines written with one ``writev`` under a lock, so no two writers
ever interleave inside a line. The supervisor's own messages go to stderr as ``supervisor: ...`` lines.
Terminal mode (stdout and stderr both a terminal, footer not disabled): everything goes through one rich console
on stdout with a live footer under the scrolling lines; rich is imported only then.

A line may be left open on the console: a prompt of the rank that reads the terminal (`supervisor.group.pump`), which
what the user types follows. Its owner's next write continues it; any other write (another rank's lines, a
supervisor message) ends it first, so no two writers share a line. In terminal mode the live footer gives way at the
first prompt, for the rest of the run: redrawn under a line being typed, it would overwrite it.

If the reader of our output goes away (``| head``), console output stops quietly; log files keep being written.
If the reader stalls (a paused pager), the writes block, and so in turn do the ranks on their full pipes; the
console counts the time spent inside its writes so that the hang watchdog does not take that for a stalled rank.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

Buffer = bytes | bytearray | memoryview
SAY_PREFIX = "supervisor: "
SAY_WAIT = 0.05  # how long a supervisor message waits for the console lock before it is queued instead
LABEL_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")


def write_all(fd: int, buffers: Sequence[Buffer]) -> None:
    """One writev; only a partial write (a signal, a full non-blocking pipe) needs a second call."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class Console:
    def __init__(self, terminal: bool | None = None, footer: bool = True) -> None:
        if terminal is None:
            terminal = footer and sys.stdout.isatty() and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
        self.terminal = terminal
        self.lock = threading.Lock()
        self.console_ok = True
        self.log_fd: int | None = None
        self.rich: Any = None  # rich.console.Console in terminal mode
        self.live: Any = None
        self.footer_allowed = True  # until a rank's prompt waits for what is typed on the terminal
        self.open_line: tuple[object, int] | None = None  # the owner and fd of a line left open (a prompt)
        self.styles: dict[str, str] = {}
        self._writing_time = 0.0  # seconds spent in finished console writes
        self._writing_since: float | None = None  # start of the write in progress
        self._pending: list[Callable[[], None]] = []  # supervisor messages waiting for the console
        if terminal:
            from rich.console import Console as RichConsole

            self.rich = RichConsole(file=sys.stdout, highlight=False, soft_wrap=True)

    # -- supervisor.log -------------------------------------------------------------------------------------------

    def open_log(self, path: Path) -> None:
        self.log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def log(self, message: str) -> None:
        """supervisor.log only (with a time stamp)."""
        if self.log_fd is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            text = "".join(f"{stamp} {line}\n" for line in message.splitlines() or [""])
            try:
                os.write(self.log_fd, text.encode())
            except OSError:
                self.log_fd = None

    # -- the supervisor's own messages ----------------------------------------------------------------------------

    def say(self, message: str, style: str = "bold") -> None:
        """A supervisor message: console (stderr, or the terminal) and supervisor.log.

        Never blocks for long: the watcher's loop calls this, and it must go on stopping ranks even while a paused
        reader holds the console. If the pump is stuck in a console write, the message waits in `_pending` and
        goes out before the pump's next write (or at `close`)."""
        self.log(message)
        if self.rich is not None:
            from rich.text import Text

            rendered = Text(SAY_PREFIX + message, style=style)
            self._pending.append(lambda: self.rich.print(rendered))
        else:
            data = "".join(f"{SAY_PREFIX}{line}\n" for line in message.splitlines()).encode()
            self._pending.append(lambda: write_all(2, [data]))
        if self.lock.acquire(timeout=SAY_WAIT):
            try:
                self._flush_pending()
            finally:
                self.lock.release()

    # -- rank output ----------------------------------------------------------------------------------------------

    def write_lines(self, fd: int, prefix: Buffer, buffers: Sequence[Buffer], owner: object = None,
                    unfinished: bool = False) -> None:
        """Plain mode: whole lines written as one unit, the first after `prefix` (left out where it continues the line
        `owner` left open), the others prefixed already; `unfinished`: the last one stays open for `owner`."""
        with self.lock:
            self._flush_pending()
            start = [] if self._continues(owner) else [prefix]
            self._timed(lambda: write_all(fd, [*start, *buffers]))
            self.open_line = (owner, fd) if unfinished else None

    def print_lines(self, prefix: bytes, block: bytes, owner: object = None, unfinished: bool = False) -> None:
        """Terminal mode: unprefixed lines from one rank, printed above the footer with a coloured label (left out
        on the first where it continues the line `owner` left open). The block ends with its last newline, or, with
        `unfinished`, with a line that stays open for `owner` (the footer then gives way for good)."""
        from rich.text import Text

        label = prefix.decode(errors="replace")
        style = self.styles.setdefault(label, LABEL_STYLES[len(self.styles) % len(LABEL_STYLES)])
        body = block.decode(errors="replace")
        first, *others = (body if unfinished else body[:-1]).split("\n")
        rest = Text(first)
        for line in others:
            rest.append("\n")
            rest.append(label, style=style)
            rest.append(line)
        if unfinished and self.footer_allowed:
            self.footer_allowed = False
            self.stop_footer()
        with self.lock:
            self._flush_pending()
            text = rest if self._continues(owner) else Text.assemble((label, style), rest)
            self._timed(lambda: self.rich.print(text, end="" if unfinished else "\n"))
            self.open_line = (owner, 1) if unfinished else None

    # -- under the lock ---------------------------------------------------------------------------------------------

    def _flush_pending(self) -> None:
        if self._pending:
            self._end_line()
        while self._pending:
            self._timed(self._pending.pop(0))

    def _continues(self, owner: object) -> bool:
        """Whether this write of `owner`'s continues the line it left open; any other open line is ended first."""
        if self.open_line is not None and owner is not None and self.open_line[0] is owner:
            return True
        self._end_line()
        return False

    def _end_line(self) -> None:
        if self.open_line is not None:
            fd = self.open_line[1]
            self.open_line = None
            self._timed(lambda: self.rich.print() if self.rich is not None else write_all(fd, [b"\n"]))

    def _timed(self, write: Callable[[], None]) -> None:
        if not self.console_ok:
            return
        self._writing_since = started = time.monotonic()
        try:
            write()
        except OSError:  # BrokenPipeError: the reader left (| head); keep the run and the log files going
            self.console_ok = False
        finally:
            self._writing_since = None
            self._writing_time += time.monotonic() - started

    def writing_time(self) -> float:
        """Seconds spent inside console writes so far, the one in progress included: time in which a slow reader
        held every rank's output back."""
        since = self._writing_since
        return self._writing_time + (time.monotonic() - since if since is not None else 0.0)

    # -- the live footer ------------------------------------------------------------------------------------------

    def start_footer(self, render: Callable[[], Any]) -> None:
        if self.rich is None or self.live is not None or not self.footer_allowed:
            return
        from rich.live import Live

        self.live = Live(get_renderable=render, console=self.rich, refresh_per_second=4, transient=True,
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def stop_footer(self) -> None:
        live, self.live = self.live, None  # the pump's thread may stop it too (`print_lines`): once is enough
        if live is not None:
            live.stop()

    def close(self) -> None:
        """Deliver what is pending (this may wait for a slow reader), end a line left open, stop the footer, close
        supervisor.log."""
        with self.lock:
            self._flush_pending()
            self._end_line()
        self.stop_footer()
        if self.log_fd is not None:
            os.close(self.log_fd)
            self.log_fd = None
