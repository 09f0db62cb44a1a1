"""The watcher: one group of ranks, from start to the last exit, in one ``select`` loop on the main thread.

What wakes the loop: a rank's pidfd (it exited; epoll hands them over in the order they fired, so the first
rank to die is the first we see), a signal (SIGCHLD, or a stop request), a progress record, a message from the
multi-node control channel, or the next deadline (a hang allowance running out, the end of the stack-dump pause,
the end of the grace period). There is no polling interval.

Which rank's failure is the run's, when several fail one after another, is `supervisor.group.failure`'s rule; how
the others are then stopped (SIGTERM, the short kill for ranks in a rendezvous or held by a lost node, SIGKILL after
the grace period, what is left behind) is `supervisor.group.stop`'s ladder. The moment a rank exits, its group is
SIGKILLed, so nothing it started outlives it. After the last exit, a sweep (`Reaper.sweep`) kills any descendant that
left the ranks' groups (the supervisor is a child subreaper, so orphans come to it rather than to init).

Hang watchdog: `supervisor.group.hangs` says when a group is stalled and which rank holds it up (the headline).

Length: one state machine, the group's, and its reaction to each kind of event (an exit, the clock, a signal, the
control channel, a progress record), which share the stop under way; the rules they apply live in `supervisor.group.failure`,
`supervisor.group.hangs`, `supervisor.group.liveness` and `supervisor.diagnosis.verdicts`.
"""

from __future__ import annotations

import math
import os
import selectors
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from supervisor.console import Console
from supervisor.control.wire import HANG_CODE, LOST_CODE
from supervisor.diagnosis import stragglers
from supervisor.diagnosis.verdicts import NodeVerdicts
from supervisor.group.failure import PEER_EXIT_WAIT, FailureRule, FalloutGate, Suspect
from supervisor.group.hangs import HangWatchdog
from supervisor.group.liveness import OwnClock, RankState
from supervisor.group.pump import Pump, Stream
from supervisor.group.reaper import Reaper
from supervisor.group.signals import STOP_SIGNALS, SignalInbox
from supervisor.group.stop import KILL_WAIT, Stop, StopLadder, rank_stop
from supervisor.group.worker import Worker, describe_exit
from supervisor.plan.spec import Plan
from trainer.errors import USER_ERROR_EXIT_CODE

if TYPE_CHECKING:
    from supervisor.control.channel import ControlChannel, Event

PUMP_WAIT = 2.0  # after the last exit: time for the pump to reach end-of-file on every pipe
EXIT_HANG = HANG_CODE

FINISHED = "finished"
FAILED_FIRST = "failed first"
FAILED_AFTER = "failed after the first failure"
STALLED = "stalled"
STOPPED = "stopped by the supervisor"
KILLED = "killed (SIGKILL)"
STUCK = "did not die (left behind)"



@dataclass
class GroupResult:
    workers: list[Worker]
    states: dict[int, RankState]  # by global rank
    endings: dict[int, str]
    tails: dict[int, Stream]  # stderr streams by global rank
    stop: Stop | None

    @property
    def exit_code(self) -> int:
        return 0 if self.stop is None else self.stop.exit_code

    @property
    def restartable(self) -> bool:
        """A failure or a hang, unless it is a user error (exit 2): the same input would fail again."""
        return self.stop is not None and self.stop.reason in ("failure", "hang") and self.stop.exit_code != 2


class Watch:
    def __init__(self, plan: Plan, workers: list[Worker], pump: Pump, tails: dict[int, Stream], console: Console,
                 signals: SignalInbox, reaper: Reaper, control: ControlChannel | None = None,
                 restart_follows: bool = False) -> None:
        """`restart_follows`: the run has a restart left after this group (the stop ladder's rung for ranks held by a
        rank that is gone then comes at once)."""
        self.plan, self.workers, self.pump, self.tails = plan, workers, pump, tails
        self.console, self.signals, self.reaper, self.control = console, signals, reaper, control
        now, wall = time.monotonic(), time.time()
        self.states = {w.spec.rank: RankState(now, wall, console.writing_time()) for w in workers}
        self.endings: dict[int, str] = {}
        self.stop: Stop | None = None
        self.selector = selectors.DefaultSelector()
        self.failures, self.gate = FailureRule(plan.run_dir, tails), FalloutGate(workers)
        self.suspect: Suspect | None = None  # a first error exit on a lost peer, waiting for the peer's own
        self.signalled = False  # a stop signal reached the supervisor: the next one kills at once
        self.hangs = HangWatchdog(plan, workers, self.states, console, tails, control)
        self.ladder = StopLadder(workers, self.states, plan.grace_period, console, restart_follows, plan.trainer_entry)
        self.stragglers = stragglers.StragglerDetector({w.spec.rank: w.label for w in workers})
        self.straggler_history: list[stragglers.Straggler] = []
        self.verdicts = NodeVerdicts(plan.nnodes) if control is not None else None  # a stall's, across the nodes
        self.clock = OwnClock(plan.node_timing.node_timeout) if control is not None else None

    # -- the loop --------------------------------------------------------------------------------------------------

    def run(self) -> GroupResult:
        self.selector.register(self.signals.fd, selectors.EVENT_READ, "signals")
        if self.control is not None:
            self.selector.register(self.control.fd, selectors.EVENT_READ, "control")
        for w in self.workers:
            self.selector.register(w.progress_fd, selectors.EVENT_READ, ("progress", w))
            if w.pidfd is not None:
                self.selector.register(w.pidfd, selectors.EVENT_READ, ("exit", w))
        self.pump.gate = self.gate.wait
        try:
            while any(w.alive for w in self.workers) or self.awaiting_verdicts():
                timeout = self.timeout()
                asked_until = time.monotonic() + (timeout if timeout is not None else math.inf)
                events = self.selector.select(timeout)
                with self.gate:  # no rank's stderr reaches the console while events before it are being handled
                    self.check_own_clock(asked_until)  # first: what came while this node was frozen is its fallout
                    for key, _ in events:
                        self.dispatch(key.data)
                    self.check_exits()
                    self.check_clock()
            self.settle_verdicts()
            for w in self.workers:  # what a rank wrote just before its exit, if its exit was handled first
                self.on_progress(w)
        finally:
            self.pump.gate = None
            self.gate.close_records()
            self.selector.close()
        self.reaper.sweep(KILL_WAIT)
        self.pump.finish(PUMP_WAIT)
        return GroupResult(self.workers, self.states, self.endings, self.tails,
                           self.stop or rank_stop(self.workers, self.states, self.endings))

    def dispatch(self, data: Any) -> None:
        if data == "signals":
            self.on_signals(self.signals.read())
        elif data == "control":
            assert self.control is not None and self.verdicts is not None
            events, verdicts = self.control.read_events()
            for event in events:
                self.on_remote(event)
            for verdict in verdicts:
                self.verdicts.add(*verdict)
            self.hangs.hear(*self.control.read_reports())
        elif data[0] == "exit":
            if data[1].alive:
                self.on_exit(data[1])
        else:
            self.on_progress(data[1])

    def timeout(self) -> float | None:
        deadlines = []
        stop = self.stop
        if stop is None and self.suspect is not None:
            deadlines.append(self.suspect.until)
        elif stop is None:
            if (deadline := self.hangs.deadline()) is not None:
                deadlines.append(deadline)
        else:
            deadlines.append(stop.deadline())
        if self.awaiting_verdicts():
            assert self.verdicts is not None
            deadlines.append(self.verdicts.deadline)
        if self.clock is not None:
            deadlines.append(time.monotonic() + OwnClock.PROBE)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def check_own_clock(self, asked_until: float) -> None:
        if self.stop is None and self.clock is not None and \
                (frozen := self.clock.frozen(asked_until, time.monotonic())) is not None:
            timeout = self.plan.node_timing.node_timeout
            why = (f"this node's supervisor did not run for {frozen:.1f} s or more (frozen: SIGSTOP, or its host "
                   f"suspended), longer than --node-timeout {timeout:g} s: the other nodes have taken node "
                   f"{self.plan.node_rank} for lost")
            self.console.say(f"{why}; stopping this node's ranks", style="bold red")
            self.failures.quiet_fallout(None)
            self.begin_stop(Stop("remote", LOST_CODE, why, lost_node=self.plan.node_rank))

    # -- exits -----------------------------------------------------------------------------------------------------

    def check_exits(self) -> None:
        """Catch exits the pidfds did not report (no pidfd support, or an exit right after the select)."""
        for w in self.workers:
            if w.alive and w.has_exited():
                self.on_exit(w)

    def on_exit(self, w: Worker) -> None:
        if w.pidfd is not None:
            self.selector.unregister(w.pidfd)
        code = w.reap()
        self.reaper.forget(w.pid)
        rank = w.spec.rank
        if self.stop is None:
            if code == 0:
                self.endings[rank] = FINISHED
            else:
                self.on_failure(w, code)
            if self.suspect is not None and not any(o.alive for o in self.workers):
                self.blame_suspect()  # no peer is left to be the failure
        elif self.stop.awaiting and self.stop.worker is w:
            self.endings[rank] = FAILED_FIRST
            self.settle_failure(w, code)
        elif rank not in self.endings:
            if w.killed:
                self.endings[rank] = KILLED
            elif w.term_sent_at is not None or self.stop.reason == "hang":  # SIGTERM, or SIGUSR1 with no handler
                self.endings[rank] = STOPPED
            else:
                self.endings[rank] = FINISHED if code == 0 else FAILED_AFTER
        stop = self.stop
        if stop is not None and stop.worker is w and stop.terminated and not stop.killed:
            self.ladder.hold(stop, time.monotonic())  # the others' collectives wait for it now, wherever SIGTERM was

    def on_failure(self, w: Worker, code: int) -> None:
        """The first exit with an error. Every record already in the pipes is read first: announcements written
        before this exit count, whichever order the wake-up (or `check_exits`) handed them and the exit over in."""
        for other in self.workers:
            if other.progress_fd >= 0:
                self.on_progress(other)
        culprit = self.failures.culprit(w, self.workers)
        if culprit is w:
            lost = self.failures.lost_a_peer(w, self.gate) if any(o.alive for o in self.workers) else None
            if lost is not None and self.suspect is None:
                self.suspect = Suspect(w, code, time.monotonic() + PEER_EXIT_WAIT)
                self.console.say(f"{w.label} (rank {w.spec.rank}, pid {w.pid}) ended with {describe_exit(code)} "
                                 f"after losing a peer; waiting up to {PEER_EXIT_WAIT:g} s for the rank that left",
                                 style="bold red")
                return
            if lost is not None:  # it lost the same peer as the suspect
                self.endings[w.spec.rank] = FAILED_AFTER
                return
            if self.suspect is not None:  # the peer the suspect lost: the failure is this one's
                self.endings[self.suspect.worker.spec.rank] = FAILED_AFTER
                self.suspect = None
            self.fail(w, code)
            return
        self.endings[w.spec.rank] = FAILED_AFTER
        # until the culprit exits, the code is this one's: never 0, so the run cannot pass for finished
        self.begin_stop(Stop("failure", code, f"{culprit.label} (rank {culprit.spec.rank}) failed", worker=culprit,
                             awaiting=True))
        self.console.say(f"{culprit.label} (rank {culprit.spec.rank}, pid {culprit.pid}) reported an error, and "
                         f"{w.label} (rank {w.spec.rank}) exited after it with {describe_exit(code)}; stopping the "
                         f"other ranks", style="bold red")

    def fail(self, w: Worker, code: int) -> None:
        """`w`'s error exit is the run's failure: stop the others."""
        self.endings[w.spec.rank] = FAILED_FIRST
        if code != USER_ERROR_EXIT_CODE:  # a bad input fails every rank alike: their lines are no fallout
            self.failures.quiet_fallout(w.spec.rank)
        self.begin_stop(Stop("failure", code, self.failures.detail(w, code, self.gate), worker=w))
        self.console.say(f"{w.label} (rank {w.spec.rank}, pid {w.pid}) failed with {describe_exit(code)}; "
                         f"stopping the other ranks", style="bold red")

    def blame_suspect(self) -> None:
        """No peer's own error exit came (in time, or at all): the lost-peer exit is the failure after all."""
        suspect, self.suspect = self.suspect, None
        assert suspect is not None
        self.fail(suspect.worker, suspect.code)

    def settle_failure(self, w: Worker, code: int) -> None:
        """The culprit that announced its error has exited: its code and headline are the run's."""
        stop = self.stop
        assert stop is not None
        stop.awaiting, stop.exit_code, stop.detail = False, code, self.failures.detail(w, code, self.gate)
        self.console.say(f"{w.label} (rank {w.spec.rank}, pid {w.pid}) failed with {describe_exit(code)}",
                         style="bold red")
        self.abort_other_nodes(stop)

    # -- stopping --------------------------------------------------------------------------------------------------

    def begin_stop(self, stop: Stop, pause: float = 0.0, tell_others: bool = True) -> None:
        if self.stop is not None:
            return
        if self.suspect is not None:  # another cause came first (another node's failure, an announced one)
            self.endings[self.suspect.worker.spec.rank] = FAILED_AFTER
            self.suspect = None
        self.stop = stop
        stop.term_at = stop.at + pause
        if stop.stall is not None and self.verdicts is not None:
            self.verdicts.expect(stop.term_at)
        if tell_others and not stop.awaiting:  # else once the culprit's exit gives the code (`settle_failure`)
            self.abort_other_nodes(stop)
        self.check_clock()

    def abort_other_nodes(self, stop: Stop) -> None:
        if self.control is not None:
            label = stop.worker.label if stop.worker else "supervisor"
            self.control.abort(self.plan.node_rank, label, stop.exit_code)

    def check_clock(self) -> None:
        now = time.monotonic()
        stop = self.stop
        if stop is None and self.suspect is not None:
            if now >= self.suspect.until:
                self.blame_suspect()
            return
        if stop is None:
            if (stall := self.hangs.check(now)) is not None:
                for rank in stall.culprits:
                    self.endings[rank] = STALLED
                self.begin_stop(Stop("hang", EXIT_HANG, stall.detail, worker=stall.worker, silence=stall.silence,
                                     evidence=stall.evidence, stall=stall), pause=stall.pause)
            return
        if not stop.terminated and now >= stop.term_at:
            stalled: set[int] = set()
            if stop.stall is not None:
                stall = self.hangs.diagnose(stop.stall, now)
                stop.detail, stop.evidence, stop.worker = stall.detail, stall.evidence, stall.worker
                for rank in stall.culprits:
                    self.endings[rank] = STALLED
                stalled = stall.kill_now
                if self.control is not None and self.verdicts is not None:  # for the headline on every node
                    self.control.verdict(self.plan.node_rank, stall.named, stall.detail)
                    self.verdicts.add(self.plan.node_rank, stall.named, stall.detail)
            self.ladder.terminate(stop, now, stalled)
        for w in self.ladder.climb(stop, now):
            self.endings[w.spec.rank] = STUCK
            if stop.awaiting and stop.worker is w:
                self.settle_failure(w, w.exit_code)

    def awaiting_verdicts(self) -> bool:
        return self.verdicts is not None and self.verdicts.waiting(time.monotonic())

    def settle_verdicts(self) -> None:
        """A stall on several nodes: the headline every node's verdicts agree on replaces this node's own, and the
        report lists what each node said."""
        stop = self.stop
        if stop is None or stop.stall is None or self.verdicts is None:
            return
        stop.node_verdicts = self.verdicts.lines(self.plan.node_rank)
        headline = self.verdicts.headline()
        if headline is not None and headline != stop.detail:
            stop.detail = headline
            self.console.say(f"across the nodes: {headline}", style="bold red")

    # -- signals and the control channel --------------------------------------------------------------------------

    def on_signals(self, signums: list[int]) -> None:
        for signum in signums:
            if signum not in STOP_SIGNALS:
                continue  # SIGCHLD: check_exits runs after every wake-up
            if self.suspect is not None:  # a failure came before the signal: it stays the run's
                self.blame_suspect()
            name = signal.Signals(signum).name
            first, self.signalled = not self.signalled, True
            if self.stop is None:
                self.console.say(f"{name}: stopping every rank (SIGTERM, then SIGKILL after "
                                 f"{self.plan.grace_period:g} s; {name} again to kill at once)", style="bold yellow")
                self.begin_stop(Stop("interrupt", 128 + signum, f"interrupted by {name}"))
            elif first and not self.stop.killed:
                # the stop under way has another cause (a failure, another node: with Slurm's USR1 every node gets
                # the signal and one may hear of the other first); this signal is the first, not "again"
                self.console.say(f"{name}: already stopping ({self.stop.detail}); {name} again to kill at once",
                                 style="bold yellow")
            elif not self.stop.killed:
                self.console.say(f"{name} again: killing every rank now", style="bold yellow")
                self.ladder.kill_all(self.stop)

    def on_remote(self, event: Event) -> None:
        code, why = event.code, event.why
        if self.stop is None and code == EXIT_HANG:  # another node stalled: this node's evidence is asked for too
            self.console.say(f"{why}; reading this node's ranks' evidence too, then stopping", style="bold red")
            stall = self.hangs.dump_all(why)
            self.begin_stop(Stop("hang", EXIT_HANG, why, worker=stall.worker, stall=stall), pause=stall.pause,
                            tell_others=False)
        elif self.stop is None:
            self.console.say(f"{why}; stopping this node's ranks", style="bold red")
            self.failures.quiet_fallout(None)
            # an abort always says how a rank failed; were it to say 0, the run must still not look finished
            # a rank there failed: its node tells the others once it has exited, and every collective waits for it
            gone = f"{event.label} of node {event.node}" if event.label != "supervisor" and not event.lost else None
            self.begin_stop(Stop("remote", code or LOST_CODE, why, lost_node=event.node if event.lost else None,
                                 gone=gone))

    # -- progress and hangs ----------------------------------------------------------------------------------------

    def on_progress(self, w: Worker) -> None:
        if w.progress_fd < 0:  # read to its end and closed earlier in this batch of events (a failure's drain)
            return
        try:
            data = os.read(w.progress_fd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self.selector.unregister(w.progress_fd)
            os.close(w.progress_fd)
            w.progress_fd = -1
            return
        for record in self.states[w.spec.rank].feed(data, self.console.writing_time()):
            if record.event == "failing":
                if self.stop is None:  # before the stop: the earliest one names the failure (`on_failure`)
                    self.failures.announce(w.spec.rank, record.time)
            elif record.event == "step" and (found := self.stragglers.add(w.spec.rank, record.step, record.ready_s,
                                                                        record.step_s)):
                self.console.say(found.message(), style="bold yellow")
                self.straggler_history.append(found)
                if failure := stragglers.record(self.plan.run_dir, self.straggler_history):
                    self.console.say(failure, style="yellow")
