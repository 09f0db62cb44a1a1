"""The hang watchdog: when a group is stalled, and which rank holds the others up.

Two rules, for the two kinds of rank program (`supervisor.group.liveness` says what a sign of life is for each):

* **The project's trainer** reports progress: a rank silent for its allowance is stalled. Every rank then gets SIGUSR1
  (faulthandler, registered by the trainer, prints all Python thread stacks into its log) and a flight-recorder dump
  request; after a short pause (`DUMP_WAIT`) `supervisor.diagnosis.culprit` reads both and names the culprit.
* **A program written for torchrun** reports nothing (until one of its ranks sends a progress record, as the
  project's test programs do: then the first rule applies). When no rank of any node has written output or used CPU
  time for `--hang-timeout` (each node tells the others when its ranks last did, `OtherNodes`), every rank's stacks
  are read from outside (`supervisor.diagnosis.stacks`, py-spy): it installed no SIGUSR1 handler, and the signal
  would kill it; a frozen (SIGSTOPped) rank gives its stack too. Quiet is not hung (`supervisor.diagnosis.quiet`): a
  rank asleep or waiting for its own input in its own code, while the others wait for it, is said in one line and the
  watch goes on, looking again one hang timeout later; the group is stalled when a rank is frozen or stuck, or every
  rank waits for another (on several nodes: every node's finding, `supervisor.diagnosis.verdicts.NodeFindings`).

Either way the stop that follows SIGKILLs at once the ranks that can no longer checkpoint (silent for half their
allowance or more: a stalled rank, or one waiting for it); a rank still making progress gets SIGTERM and the grace
period.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from supervisor.console import Console
from supervisor.diagnosis import culprit, quiet, stacks
from supervisor.diagnosis.verdicts import NodeFindings
from supervisor.group.liveness import OtherNodes, RankState, output_size, sample_interval, tree_cpu_seconds
from supervisor.group.pump import Stream
from supervisor.group.worker import Worker
from supervisor.plan.spec import Plan

if TYPE_CHECKING:
    from supervisor.control.channel import ControlChannel, NodeFinding

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
    named: bool = False  # the evidence names a rank of this node (not merely the one that tripped the watchdog)


@dataclass
class Look:
    """This node's read of its ranks once the whole group was silent for the hang timeout, kept while the other nodes'
    findings are awaited."""

    at: float
    silence: float
    ranks: list[stacks.RankRead]
    finding: quiet.Finding
    due: float  # when a node not heard from no longer holds the decision up


class HangWatchdog:
    """Owned by the watcher: it reads the ranks' states the watcher keeps, and never stops anything itself."""

    def __init__(self, plan: Plan, workers: list[Worker], states: dict[int, RankState], console: Console,
                 tails: dict[int, Stream], control: ControlChannel | None = None) -> None:
        self.plan, self.workers, self.states, self.console, self.tails = plan, workers, states, console, tails
        self.control = control  # several nodes: their ranks' progress and findings cross it
        self.next_sample = time.monotonic()  # a program that reports nothing: when its ranks are sampled next
        self.others = OtherNodes()
        self.findings = NodeFindings(plan.nnodes)
        self.look: Look | None = None
        self.quiet_until = -math.inf  # after a look that found no stall: the next one comes a hang timeout later
        self.progressed = time.monotonic()  # when this node's ranks last showed a sign of life, at the last sample
        self.said = ""  # the quiet line last said on the console: said again only when it changes

    def deadline(self) -> float | None:
        """When `check` must run next; None with the watchdog off."""
        if self.plan.hang_timeout <= 0:
            return None
        if not self.reporting():
            return self.next_sample if self.look is None else min(self.next_sample, self.look.due)
        now, console_time = time.monotonic(), self.console.writing_time()
        return min((now + self.allowance(w) - self.states[w.spec.rank].silence(now, console_time)
                    for w in self.workers if w.alive), default=None)

    def reporting(self) -> bool:
        """The trainer reports progress from its start; another program once any of its ranks has sent a record."""
        return self.plan.trainer_entry or any(st.event is not None for st in self.states.values())

    def allowance(self, w: Worker) -> float:
        if not self.reporting():
            return self.plan.hang_timeout
        return self.states[w.spec.rank].allowance(self.plan.hang_timeout, self.plan.startup_timeout)

    def hear(self, progress: dict[int, tuple[float, float]], findings: list[NodeFinding]) -> None:
        """What the other nodes said of their ranks (supervisor/control/channel.py `read_reports`)."""
        self.others.hear(progress)
        now = time.monotonic()
        for node, kind, text in findings:
            self.findings.add(node, kind, text, now)

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
            look, self.look = self.look, None
            if look is not None:  # read already, while no rank of any node made progress: before any rank was stopped
                stall = self.read_from_outside(look.ranks, look.silence + time.monotonic() - look.at, whole_group=False)
            else:
                silence = self.sample(time.monotonic()) or 0.0
                stall = self.spare_the_busy(self.read_from_outside(stacks.read(self.pids(live)), silence,
                                                                   whole_group=False), time.monotonic())
            stall.forced = True
            stall.kill_now = set(stall.culprits)
            return stall
        for w in live:
            w.signal(signal.SIGUSR1)
            culprit.request_dump(culprit.recorder_pipe(self.plan.run_dir, w.label))
        now, console_time = time.monotonic(), self.console.writing_time()
        silence = min((self.states[w.spec.rank].silence(now, console_time) for w in live), default=0.0)
        return Stall(why, None, silence, pause=DUMP_WAIT, forced=True)

    def spare_the_busy(self, stall: Stall, now: float) -> Stall:
        """A forced stall names only this node's ranks that were silent for half their allowance: one still making
        progress a moment ago is not what the other nodes wait for. A node with no rank silent that long says so; one
        whose silent ranks merely wait keeps its verdict (they name nobody)."""
        console_time = self.console.writing_time()
        by_rank = {w.spec.rank: w for w in self.workers}
        silent = {w.spec.rank for w in self.workers
                  if w.alive and self.states[w.spec.rank].silence(now, console_time) >= self.allowance(w) / 2}
        named, stall.culprits = stall.culprits, [r for r in stall.culprits if r in silent]
        stall.worker = by_rank[stall.culprits[0]] if len(stall.culprits) == 1 else None
        stall.named = stall.named and bool(stall.culprits)
        if not silent:
            stall.detail = NOTHING_STALLED
        elif named and not stall.culprits:
            stall.detail = culprit.Verdict([], method="the ranks it named were making progress").headline(stall.silence)
        return stall

    def check_silent_group(self, now: float) -> Stall | None:
        """A program that reports nothing: every live rank sampled; when no rank of any node showed a sign of life for
        `--hang-timeout`, this node's ranks are read (a `Look`) and the findings of every node decide."""
        sampled = now >= self.next_sample
        if sampled:
            self.next_sample = now + sample_interval(self.plan.hang_timeout)
            self.sample(now)
        if self.look is not None:
            return self.settle(now)
        if not sampled or not any(w.alive for w in self.workers):
            return None
        silence = self.silence(now)
        if silence < self.plan.hang_timeout:
            self.said = ""  # progress again: a later quiet rank is news
            return None
        if now < self.quiet_until:
            return None
        ranks = stacks.read(self.pids([w for w in self.workers if w.alive]))
        finding = quiet.find(ranks, self.plan.node_rank if self.control is not None else None)
        if finding.kind == quiet.STALLED:
            return self.declare(ranks, silence)
        # the other nodes look within two samples of this one (their ages lag a sample at most), and py-spy's time
        wait = 2 * sample_interval(self.plan.hang_timeout) + stacks.DUMP_TIMEOUT
        self.look = Look(now, silence, ranks, finding, now + wait)
        self.findings.open(now - wait)
        self.findings.add(self.plan.node_rank, finding.kind, finding.text, now)
        if self.control is not None:
            self.control.finding(self.plan.node_rank, finding.kind, finding.text)
        return self.settle(now)

    def sample(self, now: float) -> float | None:
        """Every live rank's CPU time and output read; this node's silence (None with no rank alive), which the other
        nodes hear."""
        console_time = self.console.writing_time()
        live = [w for w in self.workers if w.alive]
        for w in live:
            self.states[w.spec.rank].observe(tree_cpu_seconds(w.pid), output_size(self.plan.run_dir / w.spec.log_name),
                                             console_time)
        if not live:
            return None
        own = min(self.states[w.spec.rank].silence(now, console_time) for w in live)
        self.progressed = now - own
        if self.control is not None:
            self.control.progress(self.plan.node_rank, own)
        return own

    def silence(self, now: float) -> float:
        """Seconds since a rank of any node last showed a sign of life, as this node knows."""
        return min(now - self.progressed, self.others.silence(now))

    def settle(self, now: float) -> Stall | None:
        """The look's outcome, once every node's finding is in (or it is due): a stall, or the watch goes on (a quiet
        rank said in one line) and looks again a hang timeout later. Progress heard from another node meanwhile ends
        the look as well."""
        look = self.look
        assert look is not None
        outcome = self.findings.outcome(now >= look.due)
        if outcome is None and self.silence(now) >= self.plan.hang_timeout:
            return None
        self.look = None
        line = self.findings.quiet_line(look.finding.waiting) if outcome == quiet.QUIET else None
        self.findings.close(now)
        if outcome == quiet.STALLED:
            return self.declare(look.ranks, look.silence + now - look.at)
        self.quiet_until = now + self.plan.hang_timeout
        if line is not None:
            if line == self.said:
                self.console.log(line)
            else:
                self.console.say(line, style="bold yellow")
            self.said = line
        return None

    def declare(self, ranks: list[stacks.RankRead], silence: float) -> Stall:
        """A stall, from the ranks' stacks read from outside: printed, with the headline. On several nodes the stop
        waits `DUMP_WAIT` first, so that a node that has not read its ranks yet reads them before any rank is stopped
        (a rank whose peer is killed leaves its collective with an error, in its own code)."""
        self.console.say(f"no rank has written output or used CPU time for {silence:.1f} s and the stacks read from "
                         f"outside (py-spy) show a stall; stopping", style="bold red")
        stall = self.read_from_outside(ranks, silence, whole_group=self.control is None)
        stall.pause = 0.0 if self.control is None else DUMP_WAIT
        self.console.say(stall.detail, style="bold red")
        return stall

    @staticmethod
    def pids(live: list[Worker]) -> dict[int, tuple[str, int]]:
        return {w.spec.rank: (w.label, w.pid) for w in live}

    def read_from_outside(self, ranks: list[stacks.RankRead], silence: float, whole_group: bool) -> Stall:
        """Every live rank's stacks, read with py-spy, printed, and the verdict on them."""
        verdict = stacks.verdict_on(ranks, whole_group)
        for r in ranks:
            self.console.say(f"{r.label} (rank {r.rank}, pid {r.pid}) Python stacks:")
            for line in r.stacks.text():
                self.console.say(f"  {line}")
        by_rank = {w.spec.rank: w for w in self.workers}
        named = [c.rank for c in verdict.culprits]
        return Stall(verdict.headline(silence), by_rank[named[0]] if len(named) == 1 else None, silence,
                     culprits=named, evidence=verdict.lines, kill_now={r.rank for r in ranks}, from_outside=True,
                     named=bool(named))

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
        stall.named = bool(verdict.culprits)
        by_rank = {w.spec.rank: w for w in self.workers}
        stall.worker = by_rank[verdict.culprits[0].rank] if len(verdict.culprits) == 1 else stall.worker
        stall.culprits = [c.rank for c in verdict.culprits] or ([] if stall.worker is None else [stall.worker.spec.rank])
        if stall.forced:
            stall = self.spare_the_busy(stall, now)
        self.console.say(stall.detail, style="bold red")
        for line in verdict.lines:
            self.console.log(f"stall evidence: {line}")
        return stall
