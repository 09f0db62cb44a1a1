"""After a failure: the root cause a rank wrote into its ``TORCHELASTIC_ERROR_FILE``.

A program written for torchrun decorates its entry point with torch's ``@record``
(``torch.distributed.elastic.multiprocessing.errors.record``); on an uncaught exception it writes
``{"message": {"message": "<Type>: <text>", "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<epoch s>"}}}``
into the file the launcher named, then exits 1. torchrun's ``ProcessFailure`` reads that file to name the root cause;
so does the failure report here. torch also accepts a newer shape, ``{"message": "<text>", "timestamp": <epoch s>}``,
read alike. The file is written by the failing program, so anything in it may be missing or malformed: what cannot be
read is said as such, never a new failure of the supervisor.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_BYTES = 1 << 20  # a traceback is a few KiB; a file larger than this is not one @record wrote
TRACEBACK_LINES = 40  # the end of a long traceback: where the exception was raised


@dataclass(frozen=True)
class RootCause:
    """What a rank's error file says: the exception, its traceback, and when it was raised."""

    path: Path
    message: str
    traceback: str = ""
    timestamp: int | None = None

    def lines(self) -> list[str]:
        """The report's paragraph: a headline, then the traceback's last lines, indented."""
        when = "" if self.timestamp is None else \
            f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.timestamp))}"
        lines = [f"root cause (from {self.path}){when}: {self.message}"]
        trace = self.traceback.rstrip("\n").splitlines()
        if len(trace) > TRACEBACK_LINES:
            lines.append(f"  | ... ({len(trace) - TRACEBACK_LINES} earlier traceback lines in the file)")
            trace = trace[-TRACEBACK_LINES:]
        return lines + [f"  | {line}" for line in trace]


def read(path: Path) -> RootCause | None:
    """The root cause in `path`; None when the rank wrote none (it did not use @record, or died without an
    exception: a signal, ``os._exit``); a file that is there but unreadable is a root cause saying so."""
    try:
        if path.stat().st_size > MAX_BYTES:
            return RootCause(path, f"the error file is {path.stat().st_size:,} bytes, too large to be @record's")
        data = json.loads(path.read_text(errors="replace"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        return RootCause(path, f"the error file cannot be read ({e})")
    return parse(path, data)


def parse(path: Path, data: Any) -> RootCause:
    """Either shape torch writes; whatever else, the text it holds."""
    if not isinstance(data, dict) or "message" not in data:
        return RootCause(path, f"the error file holds no message: {json.dumps(data)[:200]}")
    message = data["message"]
    if isinstance(message, dict):
        extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
        return RootCause(path, str(message.get("message", "")), str(extra.get("py_callstack", "")),
                         timestamp(extra.get("timestamp")))
    return RootCause(path, str(message), "", timestamp(data.get("timestamp")))


def timestamp(value: Any) -> int | None:
    """Seconds since the epoch, written as a number or a string of one."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None
