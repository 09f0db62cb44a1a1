"""What the watcher knows of each rank's life between its start and its exit, and when it calls it stalled.

The project's trainer reports on the progress channel: a rank is alive while it does, and may stay silent for its
allowance (`--hang-timeout` after a step, `--startup-timeout` before the first one and during a phase).

A program written for torchrun reports nothing, so its life is observed from outside instead, with no cooperation:
a rank is active while it writes output (its log file grows) or uses CPU time (its process and every descendant:
DataLoader workers compute for it), sampled every few seconds (`sample_interval`). Its group is stalled when no rank
has been active for `--hang-timeout`: a rank blocked in a collective uses no CPU while it waits, and a frozen rank
(SIGSTOP, a deadlock) none at all; a rank that computes alone for a long time (preprocessing while the others wait in
a barrier) keeps the whole group alive. No timeout runs from the start: a healthy program may run for weeks. On
several nodes the group is every node's ranks: each node tells the others when its ranks last showed a sign of life
(`OtherNodes`), and a node whose own ranks are silent while another node's work waits with them.

Either way, time the console spent blocked (a paused pager) is not silence: a rank waiting to write its output is
not stalled.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from supervisor.diagnosis import stacks
from supervisor.diagnosis.culprit import Frame
from trainer.progress import RENDEZVOUS_PHASE, Progress

CPU_FLOOR_S = 0.05  # CPU seconds between two samples that count as activity: idle threads use far less
SAMPLE_INTERVAL_MAX = 5.0  # seconds between samples of a program that reports nothing


@dataclass
class RankState:
    """What a rank last said on the progress channel, or, for a program that reports nothing, when it last showed a
    sign of life."""

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
    signal: str | None = None  # a ``stopped`` record: the stop signal this rank received, if it was the one
    pending: bytes = b""
    cpu_seconds: float = 0.0  # a rank that reports nothing: its process tree's CPU time at the last sample
    output_bytes: int = 0  # … and its log file's size then

    def update(self, record: Progress, console_mark: float) -> None:
        self.last_seen, self.last_seen_wall, self.console_mark = time.monotonic(), time.time(), console_mark
        self.event = record.event
        if record.event == "phase":
            self.phase = record.phase
        else:
            self.signal = record.signal
            self.step, self.total = record.step, record.total or self.total
            self.loss = record.loss if record.loss is not None else self.loss
            self.tok_s, self.eta_s = record.tok_s, record.eta_s

    def feed(self, data: bytes, console_mark: float) -> list[Progress]:
        """The records completed by `data`, read off the rank's progress pipe (a partial line waits for the rest);
        each one updates this state. A malformed record says nothing about progress and is passed over."""
        *lines, self.pending = (self.pending + data).split(b"\n")
        records = []
        for line in lines:
            try:
                record = Progress.decode(line)
                self.update(record, console_mark)
            except (ValueError, TypeError):
                continue
            records.append(record)
        return records

    def allowance(self, hang_timeout: float, startup_timeout: float) -> float:
        return hang_timeout if self.event == "step" else startup_timeout

    def silence(self, now: float, console_time: float) -> float:
        """Seconds without progress, not counting those the console held the rank's output back."""
        return now - self.last_seen - (console_time - self.console_mark)


    def observe(self, cpu_seconds: float, output_bytes: int, console_mark: float) -> None:
        """A sample of a rank that reports nothing: output or CPU time since the last sample is a sign of life."""
        if cpu_seconds - self.cpu_seconds >= CPU_FLOOR_S or output_bytes != self.output_bytes:
            self.last_seen, self.last_seen_wall, self.console_mark = time.monotonic(), time.time(), console_mark
        self.cpu_seconds, self.output_bytes = cpu_seconds, output_bytes


@dataclass
class OwnClock:
    """This supervisor's own sleep, on several nodes: a wait that ends later than it was asked to by more than `limit`
    (the node timeout) means the supervisor did not run at all meanwhile (SIGSTOP, its host suspended), and the other
    nodes, which heard nothing from it, have taken this node for lost. Resumed, it says so, instead of blaming the
    silence of the nodes it was not listening to, or the fallout its ranks met while it was away. The watcher's waits
    last at most `PROBE` seconds, so that one frozen in any of them is noticed."""

    PROBE = 1.0

    limit: float

    def frozen(self, asked_until: float, now: float) -> float | None:
        """Seconds a wait asked to end at `asked_until` overran, when more than `limit`; else None."""
        late = now - asked_until
        return late if late > self.limit else None


@dataclass
class OtherNodes:
    """When the other nodes' ranks last showed a sign of life, as each said over the control channel: an age heard at
    a moment of this node's clock (the nodes' clocks differ, their ages do not). A node not heard from yet counts for
    nothing: this node's own ranks, silent since the group started, keep the group's silence from running ahead."""

    last: dict[int, float] = field(default_factory=dict)  # node → monotonic time its ranks last showed a sign of life

    def hear(self, progress: dict[int, tuple[float, float]]) -> None:
        """Each node's latest message: when it was heard, and how many seconds before that its ranks last made
        progress."""
        for node, (heard, age) in progress.items():
            self.last[node] = max(self.last.get(node, -math.inf), heard - age)

    def silence(self, now: float) -> float:
        """Seconds since any other node's ranks last made progress (infinite when none has said)."""
        return now - max(self.last.values(), default=-math.inf)


def sample_interval(hang_timeout: float) -> float:
    """Often enough to see a stall within a fraction of the timeout, rarely enough to cost nothing."""
    return max(0.2, min(SAMPLE_INTERVAL_MAX, hang_timeout / 5))


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and of every descendant alive now (user + system); 0 for one already gone."""
    total = 0.0
    try:
        process = psutil.Process(pid)
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        return total
    for member in family:
        try:
            times = member.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def output_size(log: Path) -> int:
    try:
        return os.stat(log).st_size
    except OSError:
        return 0


@dataclass
class Blocked:
    """Live ranks that have nothing to save, or cannot reach a save, by pid, each with the frame it waits in where its
    stack was read from outside (`blocked`)."""

    joining: dict[int, Frame | None]  # still joining their process group
    held: dict[int, Frame | None]  # training while what its collectives wait for is gone (`blocked`)


def blocked(ranks: dict[int, RankState], held_back: bool) -> Blocked:
    """Of the live ranks given (pid → state), those still joining their process group and, while what their
    collectives wait for is gone (`held_back`: another node lost, the failed rank exited), those that cannot reach a
    checkpoint. A rank that reports progress says where it is: its phase (`RENDEZVOUS_PHASE`, before any step), or
    training (a step, the training or evaluation phase; its checkpoint phase is neither). One that has reported
    nothing has its stack read, once: its main thread in the rendezvous store or ``init_process_group``, or in a
    collective."""
    silent = [pid for pid, state in ranks.items() if state.event is None]
    read = stacks.waits(silent) if silent else {}
    joining: dict[int, Frame | None] = {pid: joins for pid, (joins, _) in read.items() if joins is not None}
    joining.update({pid: None for pid, state in ranks.items() if says_joining(state)})
    held: dict[int, Frame | None] = {}
    if held_back:
        held = {pid: waits for pid, (_, waits) in read.items() if waits is not None}
        held.update({pid: None for pid, state in ranks.items() if says_training(state)})
    return Blocked(joining, held)


def may_be_joining(state: RankState) -> bool:
    """Whether a rank may still be joining its process group: it said so, or it has said nothing (its stack tells)."""
    return state.event is None or says_joining(state)


def may_be_held(state: RankState) -> bool:
    """Whether a rank may be one a lost node holds up: it says it is training, or it has said nothing."""
    return state.event is None or says_training(state)


def says_training(state: RankState) -> bool:
    return state.event == "step" or (state.event == "phase" and state.phase in ("training", "evaluation"))


def says_joining(state: RankState) -> bool:
    return state.event == "phase" and state.phase == RENDEZVOUS_PHASE
