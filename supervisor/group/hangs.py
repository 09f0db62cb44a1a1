"""The hang watchdog: when a group is stalled, and which rank holds the others up.

Two rules, for the two kinds of rank program (`supervisor.group.liveness` says what a sign of life is for each):

* **The project's trainer** reports progress: a rank silent for its allowance is stalled. Every rank then gets SIGUSR1
  (faulthandler, registered by the trainer, prints all Python thread stacks into its log) and a flight-recorder dump
  request; after a short pause (`DUMP_WAIT`) `supervisor.diagnosis.culprit` reads both and names the culprit.
* **A program written for torchrun** reports nothing (until one of its ranks sends a progress record, as the
  project's test programs do: then the first rule applies): its group is stalled when no rank has written output or used
  CPU time for `--hang-timeout`. Its stacks are read from outside at once (`supervisor.diagnosis.stacks`, py-spy): it
  installed no SIGUSR1 handler, and the signal would kill it. A frozen (SIGSTOPped) rank gives its stack too.

Either way the stop that follows SIGKILLs at once the ranks that can no longer checkpoint (silent for half their
allowance or more: a stalled rank, or one waiting for it); a rank still making progress gets SIGTERM and the grace
period.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from supervisor.console import Console
from supervisor.diagnosis import culprit, stacks
from supervisor.group.liveness import RankState, output_size, sample_interval, tree_cpu_seconds
from supervisor.group.pump import Stream
from supervisor.group.worker import Worker
from supervisor.plan.spec import Plan

DUMP_WAIT = 1.0  # after SIGUSR1: time for faulthandler to write every thread's stack before the stop begins
NOTHING_STALLED = "no rank of this node had stalled: each was making progress until the stop"


@dataclass
class Stall:
    """A stalled group: what the headline says, whom it names, and how long to wait for the ranks' own dumps."""

    detail: str
    worker: Worker | None  # the rank that tripped the watchdog, or the one culprit once known
    silence: float
    pause: float = 0.0
    culprits: list[int] = field(default_factory=list)  # ranks named stalled (known at once for a silent group)
    evidence: list[str] = field(default_factory=list)  # each rank's evidence, for the report
    kill_now: set[int] = field(default_factory=set)  # ranks to SIGKILL when the stop begins (after the pause)
    from_outside: bool = False  # a silent group, diagnosed at once from its stacks read from outside
    forced: bool = False  # not this node's watchdog: another node's stall, which this node's evidence must explain


class HangWatchdog:
    """Owned by the watcher: it reads the ranks' states the watcher keeps, and never stops anything itself."""

    def __init__(self, plan: Plan, workers: list[Worker], states: dict[int, RankState], console: Console,
                 tails: dict[int, Stream]) -> None:
        self.plan, self.workers, self.states, self.console, self.tails = plan, workers, states, console, tails
        self.next_sample = time.monotonic()  # a program that reports nothing: when its ranks are sampled next

    def deadline(self) -> float | None:
        """When `check` must run next; None with the watchdog off."""
        if self.plan.hang_timeout <= 0:
            return None
        if not self.reporting():
            return self.next_sample
        now, console_time = time.monotonic(), self.console.writing_time()
        return min((now + self.allowance(w) - self.states[w.spec.rank].silence(now, console_time)
                    for w in self.workers if w.alive), default=None)

    def reporting(self) -> bool:
        """The trainer reports progress from its start; another program once any of its ranks has sent a record."""
        return self.plan.trainer_entry or any(st.event is not None for st in self.states.values())

    def allowance(self, w: Worker) -> float:
        return self.states[w.spec.rank].allowance(self.plan.hang_timeout, self.plan.startup_timeout)

    def check(self, now: float) -> Stall | None:
        if self.plan.hang_timeout <= 0:
            return None
        return self.check_reporting(now) if self.reporting() else self.check_silent_group(now)

    def check_reporting(self, now: float) -> Stall | None:
        """The trainer: the first rank past its allowance; every rank is asked for its stacks and flight records."""
        console_time = self.console.writing_time()
        for w in self.workers:
            st = self.states[w.spec.rank]
            silence = st.silence(now, console_time)
            if not w.alive or silence < self.allowance(w):
                continue
            since = time.strftime("%H:%M:%S", time.localtime(st.last_seen_wall))
            last = "no step yet" if st.step == 0 else f"last step {st.step}" + (f"/{st.total}" if st.total else "")
            if st.event == "phase" and st.phase:
                last += f", last phase '{st.phase}'"
            detail = f"{w.label} (rank {w.spec.rank}) stalled: no progress for {silence:.1f} s (since {since}; {last})"
            self.console.say(f"{detail}; dumping every rank's Python stacks (SIGUSR1) and flight records, then "
                             f"stopping", style="bold red")
            for other in self.workers:
                other.signal(signal.SIGUSR1)
                culprit.request_dump(culprit.recorder_pipe(self.plan.run_dir, other.label))
            return Stall(detail, w, silence, pause=DUMP_WAIT)
        return None

    def dump_all(self, why: str) -> Stall:
        """Another node stalled: this node's ranks are asked for their evidence as if its own watchdog had tripped
        (the verdicts of every node together name the culprit, supervisor/diagnosis/verdicts.py)."""
        live = [w for w in self.workers if w.alive]
        if not self.reporting():
            stall = self.read_from_outside(live, 0.0)
            stall.forced = True
            stall = self.spare_the_busy(stall, time.monotonic())
            stall.kill_now = set(stall.culprits)
            return stall
        for w in live:
            w.signal(signal.SIGUSR1)
            culprit.request_dump(culprit.recorder_pipe(self.plan.run_dir, w.label))
        return Stall(why, None, 0.0, pause=DUMP_WAIT, forced=True)

    def spare_the_busy(self, stall: Stall, now: float) -> Stall:
        """A forced stall names only this node's ranks that were silent for half their allowance: one still making
        progress a moment ago is not what the other nodes wait for."""
        console_time = self.console.writing_time()
        by_rank = {w.spec.rank: w for w in self.workers}
        stall.culprits = [r for r in stall.culprits
                          if self.states[r].silence(now, console_time) >= self.allowance(by_rank[r]) / 2]
        stall.worker = by_rank[stall.culprits[0]] if len(stall.culprits) == 1 else None
        if not stall.culprits:
            stall.detail = NOTHING_STALLED
        return stall

    def check_silent_group(self, now: float) -> Stall | None:
        """A program that reports nothing: every live rank sampled; stalled when none showed a sign of life for
        `--hang-timeout`. Diagnosed at once: the stacks are read from outside."""
        if now < self.next_sample:
            return None
        self.next_sample = now + sample_interval(self.plan.hang_timeout)
        console_time = self.console.writing_time()
        live = [w for w in self.workers if w.alive]
        for w in live:
            self.states[w.spec.rank].observe(tree_cpu_seconds(w.pid), output_size(self.plan.run_dir / w.spec.log_name),
                                             console_time)
        silence = min((self.states[w.spec.rank].silence(now, console_time) for w in live), default=0.0)
        if not live or silence < self.plan.hang_timeout:
            return None
        self.console.say(f"no rank has written output or used CPU time for {silence:.1f} s; reading every rank's "
                         f"Python stacks from outside (py-spy), then stopping", style="bold red")
        stall = self.read_from_outside(live, silence)
        self.console.say(stall.detail, style="bold red")
        return stall

    def read_from_outside(self, live: list[Worker], silence: float) -> Stall:
        """Every live rank's stacks read with py-spy, printed, and the verdict on them."""
        verdict, dumps = stacks.read_stalled({w.spec.rank: (w.label, w.pid) for w in live})
        for w in live:
            self.console.say(f"{w.label} (rank {w.spec.rank}, pid {w.pid}) Python stacks:")
            for line in dumps[w.spec.rank]:
                self.console.say(f"  {line}")
        by_rank = {w.spec.rank: w for w in live}
        named = [c.rank for c in verdict.culprits]
        return Stall(verdict.headline(silence), by_rank[named[0]] if len(named) == 1 else None, silence,
                     culprits=named, evidence=verdict.lines, kill_now={w.spec.rank for w in live}, from_outside=True)

    def diagnose(self, stall: Stall, now: float) -> Stall:
        """When the stop begins: the trainer's stall after the dump pause, named from the stacks and flight records
        the ranks wrote (headline, culprits, the ranks to SIGKILL); a silent group's was diagnosed already."""
        if stall.from_outside:
            return stall
        console_time = self.console.writing_time()
        evidence = []
        for w in self.workers:
            st = self.states[w.spec.rank]
            if st.silence(now, console_time) >= self.allowance(w) / 2 and w.alive:
                stall.kill_now.add(w.spec.rank)
            when = f"in phase '{st.phase}' after step {st.step}" if st.event == "phase" else f"at step {st.step}"
            tail = self.tails.get(w.spec.rank)
            evidence.append(culprit.RankEvidence(
                w.spec.rank, w.label, when, culprit.main_stack(tail.tail.decode(errors="replace")) if tail else None,
                culprit.load_recorder(culprit.recorder_pipe(self.plan.run_dir, w.label).with_suffix(".json"))))
        verdict = culprit.find_culprit(evidence)
        stall.detail, stall.evidence = verdict.headline(stall.silence), verdict.lines
        by_rank = {w.spec.rank: w for w in self.workers}
        stall.worker = by_rank[verdict.culprits[0].rank] if len(verdict.culprits) == 1 else stall.worker
        stall.culprits = [c.rank for c in verdict.culprits] or ([] if stall.worker is None else [stall.worker.spec.rank])
        if stall.forced:
            stall = self.spare_the_busy(stall, now)
        self.console.say(stall.detail, style="bold red")
        for line in verdict.lines:
            self.console.log(f"stall evidence: {line}")
        return stall
