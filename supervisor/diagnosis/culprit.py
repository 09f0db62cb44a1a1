"""Which rank stalled the group, and where the others wait for it.

Evidence, strongest first:

1. **The flight recorder** (`trainer.diagnosis.flight_recorder`): per process group, the last collective each rank enqueued.
   A rank whose ``last_enqueued_collective`` on some group is below the others' never joined the collective they are
   in: it is the culprit, unless it is itself blocked ahead of others on another group (collectives issued in
   different orders: nobody is singled out).
2. **The Python stacks** faulthandler wrote on SIGUSR1: a main thread inside torch.distributed (a collective, a
   ``wait()``, a barrier), in the project's own agreements (``trainer/model/distributed.py``: the stop vote and friends) or
   in autograd's ``_engine_run_backward`` (DDP's reducer waits for the gradient all-reduce there) is waiting; any
   other main thread is not. The ranks that are not waiting, when some others are, are the culprits.

3. **Silence**: a rank that answers neither the stack request nor the flight recorder (SIGSTOPped, in a debugger,
   swapped out, stuck in a driver call with the interpreter's lock held) while every rank that did answer waits for
   others is the culprit: a rank that runs Python answers SIGUSR1, one that waits answers both.

Where none singles anyone out (everybody waits, nobody waits, or no evidence arrived), `Verdict.culprits` is empty
and the headline says so instead of guessing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ ")
FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
WAITING_FILES = ("torch/distributed/", "trainer/model/distributed.py")
WAITING_FUNCS = ("_engine_run_backward",)
INNERMOST_WAITING_FILES = ("torch/nn/parallel/distributed.py",)
# joining a process group: the rendezvous store (every rank of the world must connect) and the group's creation
RENDEZVOUS_FILES = ("torch/distributed/rendezvous.py", "torch/distributed/elastic/rendezvous/")
RENDEZVOUS_FUNCS = ("init_process_group", "new_group")
PROJECT_PACKAGES = ("trainer", "supervisor")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        """``func (trainer/diagnosis/faults.py:160)`` for the project's files, the last two parts for others."""
        parts = Path(self.file).parts
        ours = [i for i, part in enumerate(parts[:-1]) if part in PROJECT_PACKAGES]
        shown = parts[ours[-1]:] if ours else parts[-2:]
        return f"{self.func} ({'/'.join(shown)}:{self.line})"


def parse_stacks(text: str) -> list[list[Frame]]:
    """Every thread block faulthandler wrote in `text`; frames innermost first, as it prints them."""
    threads: list[list[Frame]] = []
    current: list[Frame] | None = None
    for line in text.splitlines():
        if THREAD.match(line):
            current = []
            threads.append(current)
        elif current is not None and (m := FRAME.match(line)):
            current.append(Frame(m["file"], int(m["line"]), m["func"]))
        elif current is not None and line.strip():
            current = None  # the dump ended: any other output
    return [t for t in threads if t]


def main_stack(text: str) -> list[Frame] | None:
    """The main thread's frames of the last dump in `text` (its outermost frame is a script's ``<module>``)."""
    mains = [t for t in parse_stacks(text) if t[-1].func == "<module>"]
    return mains[-1] if mains else None


def waiting_in(stack: list[Frame]) -> Frame | None:
    """The outermost frame that shows the thread waits for other ranks, or None when it does not. DDP's own code as
    the innermost Python frame is a collective it issues before the forward (buffers, bucket rebuild): waiting too
    (a rank computing inside DDP's forward has the model's frames innermost)."""
    found = stack[0] if stack and any(part in stack[0].file for part in INNERMOST_WAITING_FILES) else None
    for frame in stack:
        if any(part in frame.file for part in WAITING_FILES) or frame.func in WAITING_FUNCS:
            found = frame
    return found


def joining(stack: list[Frame]) -> Frame | None:
    """The frame where a thread waits to join a process group (torch's rendezvous store, ``init_process_group``,
    ``new_group``: every rank of the world must come), or None when it is past that."""
    return next((frame for frame in stack if any(part in frame.file for part in RENDEZVOUS_FILES)
                 or (frame.func in RENDEZVOUS_FUNCS and "torch/distributed/" in frame.file)), None)


def own_frame(stack: list[Frame]) -> Frame:
    """Where a stalled main thread is: its innermost frame."""
    return stack[0]


# ---------------------------------------------------------------------------------------------------------------------
# The flight recorder


@dataclass(frozen=True)
class GroupStatus:
    enqueued: int
    completed: int
    collective: str  # the profiling name of the last enqueued collective, e.g. "gloo:all_reduce"
    group: str  # the group's name, e.g. "default_pg"


def read_recorder(dump: dict[str, Any]) -> dict[str, GroupStatus]:
    """pg id → this rank's status, from one rank's flight-recorder JSON (``pg_status`` and ``entries``)."""
    names = {}
    for entry in dump.get("entries", []):
        names[(str(entry.get("pg_id")), int(entry.get("collective_seq_id", -1)))] = (
            entry.get("profiling_name", "?"), (entry.get("process_group") or ["?", "?"])[1])
    out = {}
    for pg, status in dump.get("pg_status", {}).items():
        enqueued = int(status.get("last_enqueued_collective", -1))
        name, group = names.get((str(pg), enqueued), ("?", f"group {pg}"))
        out[str(pg)] = GroupStatus(enqueued, int(status.get("last_completed_collective", -1)), name,
                                   group if group != "undefined" else f"group {pg}")
    return out


def load_recorder(path: Path) -> dict[str, GroupStatus] | None:
    try:
        return read_recorder(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------------------------------
# The verdict


@dataclass
class RankEvidence:
    rank: int
    label: str
    when: str  # "at step 3", or "in phase 'checkpoint' after step 4"
    stack: list[Frame] | None = None  # main thread, innermost first
    recorder: dict[str, GroupStatus] | None = None

    @property
    def name(self) -> str:
        return f"{self.label} (rank {self.rank})"

    @property
    def silent(self) -> bool:
        return not self.stack and not self.recorder

    def waits(self) -> str | None:
        """Where this rank waits for others, by its stack, else by a collective its flight record has not completed;
        None when its evidence does not show it waiting."""
        if self.stack and (frame := waiting_in(self.stack)):
            return frame.short()
        pending = [s for s in (self.recorder or {}).values() if s.completed < s.enqueued]
        return f"{pending[0].collective} #{pending[0].enqueued} on {pending[0].group}" if pending else None


SILENT = "answered neither the stack request nor the flight recorder (stopped, or stuck outside Python)"


@dataclass
class Verdict:
    culprits: list[RankEvidence]
    waits: dict[int, str] = field(default_factory=dict)  # rank → where it waits
    method: str = "none"  # "flight recorder" | "stacks" | "none"
    lines: list[str] = field(default_factory=list)  # per-rank evidence for the report

    def headline(self, silence: float) -> str:
        quiet = f"no progress for {silence:.1f} s"
        if not self.culprits:
            return f"stalled ({quiet}); the evidence singles out no rank ({self.method or 'none'})"
        where = " and ".join(f"{c.name} stalled {c.when}" + (f" in {own_frame(c.stack).short()}" if c.stack else
                                                              f" and {SILENT}" if c.silent else "")
                             for c in self.culprits)
        waiting = [f"{label} waits for it in {text}" for label, text in self.waits.items()]
        return f"{where}" + (f"; {'; '.join(waiting)}" if waiting else "") + f" ({quiet}; by {self.method})"


def by_recorder(ranks: list[RankEvidence]) -> Verdict | None:
    """The ranks behind on some group, not themselves blocked ahead on another; None when the records do not
    diverge (or fewer than two ranks recorded anything)."""
    recorded = [r for r in ranks if r.recorder]
    if len(recorded) < 2:
        return None
    behind: set[int] = set()
    ahead: dict[int, tuple[str, GroupStatus]] = {}
    for pg in set().union(*(r.recorder or {} for r in recorded)):
        statuses = {r.rank: r.recorder[pg] for r in recorded if r.recorder and pg in r.recorder}
        top = max(s.enqueued for s in statuses.values())
        if len(statuses) < 2 or min(s.enqueued for s in statuses.values()) == top:
            continue
        for rank, s in statuses.items():
            if s.enqueued < top:
                behind.add(rank)
            elif s.completed < s.enqueued:
                ahead[rank] = (pg, s)
    if not behind:
        return None
    culprits = [r for r in recorded if r.rank in behind and r.rank not in ahead]
    verdict = Verdict(culprits, method="flight recorder")
    if culprits:
        for r in recorded:
            if r.rank in ahead:
                _, s = ahead[r.rank]
                verdict.waits[r.name] = f"{s.collective} #{s.enqueued} on {s.group}" + (
                    f" at {waiting_in(r.stack).short()}" if r.stack and waiting_in(r.stack) else "")
    return verdict


def by_stacks(ranks: list[RankEvidence]) -> Verdict | None:
    """The ranks stalled in their own code while others wait in a collective. A group of one rank on this node
    decides alone: stalled in its own code, it is the culprit; waiting in a collective, it waits for another node."""
    stacked = [r for r in ranks if r.stack]
    if len(ranks) == 1 and stacked:
        return Verdict(stacked, method="stack") if not waiting_in(stacked[0].stack or []) else None
    if len(stacked) < 2:
        return None
    waiting = {r.rank: waiting_in(r.stack) for r in stacked if r.stack and waiting_in(r.stack)}
    idle = [r for r in stacked if r.rank not in waiting]
    if not waiting or not idle:
        return Verdict([], method="stacks")
    verdict = Verdict(idle, method="stacks")
    for r in stacked:
        if r.rank in waiting:
            verdict.waits[r.name] = waiting[r.rank].short()  # type: ignore[union-attr]
    return verdict


def by_silence(ranks: list[RankEvidence]) -> Verdict | None:
    """The ranks that gave no evidence at all, when every rank that did waits for others: a frozen rank cannot run
    the handler that prints its stack, nor the thread that dumps its flight record."""
    silent = [r for r in ranks if r.silent]
    answered = {r.name: r.waits() for r in ranks if not r.silent}
    if not silent or not answered or None in answered.values():
        return None
    return Verdict(silent, waits={name: where for name, where in answered.items() if where}, method="silence")


def find_culprit(ranks: list[RankEvidence]) -> Verdict:
    """The verdict from the strongest evidence that decides, with every rank's evidence for the report."""
    arrived = any(r.stack or r.recorder for r in ranks)
    verdict = by_recorder(ranks) or by_silence(ranks) or by_stacks(ranks) or Verdict(
        [], method="the flight records and stacks do not decide" if arrived else "no stacks or flight records arrived")
    for r in ranks:
        stack = "no stack" if not r.stack else (
            f"waits in {waiting_in(r.stack).short()}" if waiting_in(r.stack) else f"in {own_frame(r.stack).short()}")
        groups = "no flight record" if not r.recorder else ", ".join(
            f"{s.group}: enqueued #{s.enqueued}, completed #{s.completed}" for s in r.recorder.values())
        verdict.lines.append(f"{r.name} {r.when}: {stack}; {groups}")
    return verdict


# ---------------------------------------------------------------------------------------------------------------------
# Asking the ranks for their flight records

RECORDER_DIR = "flight_recorder"


def recorder_pipe(run_dir: Path, label: str) -> Path:
    """The FIFO a rank's dump thread listens on (``SUPERVISOR_FR_PIPE``); its dump lands beside it as ``.json``."""
    return run_dir / RECORDER_DIR / f"{label.lower()}.pipe"


def make_pipe(pipe: Path) -> None:
    """A fresh FIFO for a group about to start, and no dump left from an earlier group."""
    import os

    pipe.parent.mkdir(exist_ok=True)
    pipe.with_suffix(".json").unlink(missing_ok=True)
    if not pipe.exists():
        os.mkfifo(pipe, 0o600)


def request_dump(pipe: Path) -> None:
    """One byte into the rank's FIFO; nothing when no thread listens (another entry script, or a rank not up yet)."""
    import os

    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # ENXIO: no reader
    try:
        os.write(fd, b"d")
    except OSError:
        pass
    finally:
        os.close(fd)
