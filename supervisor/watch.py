"""The watcher: one group of ranks, from start to the last exit, in one ``select`` loop on the main thread.

What wakes the loop: a rank's pidfd (it exited; epoll hands them over in the order they fired, so the first
rank to die is the first we see), a signal (SIGCHLD, or a stop request), a progress record, a message from the
multi-node control channel, or the next deadline (a hang allowance running out, the end of the stack-dump pause,
the end of the grace period). There is no polling interval.

Which rank's failure is the run's, when several fail one after another, is `supervisor.failure`'s rule. Stopping the others: SIGTERM to each rank process,
then SIGKILL to its whole process group once the grace period ends. SIGTERM goes to the rank alone, not its group,
so its DataLoader workers keep serving it while it finishes its step and checkpoints; the moment a rank exits, its
group is SIGKILLed, so nothing it started outlives it. After the last exit, a sweep kills any descendant that left
the ranks' groups (the supervisor is a child subreaper, so orphans come to it rather than to init).

Hang watchdog: a rank that reports nothing for its allowance is stalled. The allowance depends on what it said
last: after a ``step`` record, ``--hang-timeout``; before its first step, or after a ``phase`` (start-up,
evaluation, checkpoint) or ``done`` record, ``--startup-timeout``. Time the console spent blocked (a paused pager)
does not count: a rank waiting to write its output is not stalled. A stalled group first gets SIGUSR1 on every
rank (faulthandler prints all Python thread stacks into each log) and a flight-recorder dump request, a short pause,
then `supervisor.diagnosis.culprit` names the rank that holds the others up (the headline). The stop that follows
SIGKILLs at once every rank that has been silent for half its allowance or more (a stalled rank, or one waiting for
it, can no longer checkpoint); a rank still making progress gets the normal SIGTERM and grace period.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from supervisor.console import Console
from supervisor.control.wire import LOST_CODE
from supervisor.diagnosis import culprit, stragglers
from supervisor.failure import FailureRule, FalloutGate
from supervisor.liveness import RankState
from supervisor.plan import Plan
from supervisor.pump import Pump, Stream
from supervisor.reaper import Reaper
from supervisor.signals import STOP_SIGNALS, SignalInbox
from supervisor.worker import Worker, describe_exit
from trainer.errors import USER_ERROR_EXIT_CODE
from trainer.progress import Progress

if TYPE_CHECKING:
    from supervisor.control.channel import ControlChannel

DUMP_WAIT = 1.0  # after SIGUSR1: time for faulthandler to write every thread's stack before the stop begins
KILL_WAIT = 10.0  # after SIGKILL: a process still there by then is stuck in the kernel; stop waiting for it
PUMP_WAIT = 2.0  # after the last exit: time for the pump to reach end-of-file on every pipe
EXIT_HANG = 124  # a stalled group, as timeout(1) reports a command that ran out of time

FINISHED = "finished"
FAILED_FIRST = "failed first"
FAILED_AFTER = "failed after the first failure"
STALLED = "stalled"
STOPPED = "stopped by the supervisor"
KILLED = "killed (SIGKILL)"
STUCK = "did not die (left behind)"



@dataclass
class Stop:
    """Why a group is being stopped, and the exit code that reason gives the supervisor."""

    reason: str  # "failure" | "hang" | "interrupt" | "remote"
    exit_code: int
    detail: str
    worker: Worker | None = None
    at: float = field(default_factory=time.monotonic)
    term_at: float = 0.0  # when SIGTERM goes out (later than `at` only for a hang: the stack-dump pause)
    kill_at: float = float("inf")
    terminated: bool = False
    killed: bool = False
    awaiting: bool = False  # a failure: `worker` said ``failing`` and has not exited yet; its exit sets the code
    silence: float = 0.0  # a hang: how long the rank that tripped the watchdog had been silent
    evidence: list[str] = field(default_factory=list)  # a hang: each rank's evidence, for the report


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
                 signals: SignalInbox, reaper: Reaper, control: ControlChannel | None = None) -> None:
        self.plan, self.workers, self.pump, self.tails = plan, workers, pump, tails
        self.console, self.signals, self.reaper, self.control = console, signals, reaper, control
        now, wall = time.monotonic(), time.time()
        self.states = {w.spec.rank: RankState(now, wall, console.writing_time()) for w in workers}
        self.endings: dict[int, str] = {}
        self.stop: Stop | None = None
        self.selector = selectors.DefaultSelector()
        self.failures, self.gate = FailureRule(plan.run_dir, tails), FalloutGate(workers)
        self.signalled = False  # a stop signal reached the supervisor: the next one kills at once
        self.stragglers = stragglers.StragglerDetector({w.spec.rank: w.label for w in workers})
        self.straggler_history: list[stragglers.Straggler] = []

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
            while any(w.alive for w in self.workers):
                events = self.selector.select(self.timeout())
                with self.gate:  # no rank's stderr reaches the console while events before it are being handled
                    for key, _ in events:
                        self.dispatch(key.data)
                    self.check_exits()
                    self.check_clock()
        finally:
            self.pump.gate = None
            self.gate.close_records()
            self.selector.close()
        self.sweep()
        self.pump.finish(PUMP_WAIT)
        return GroupResult(self.workers, self.states, self.endings, self.tails, self.stop)

    def dispatch(self, data: Any) -> None:
        if data == "signals":
            self.on_signals(self.signals.read())
        elif data == "control":
            assert self.control is not None
            for event in self.control.read_events():
                self.on_remote(event)
        elif data[0] == "exit":
            if data[1].alive:
                self.on_exit(data[1])
        else:
            self.on_progress(data[1])

    def timeout(self) -> float | None:
        deadlines = []
        stop = self.stop
        if stop is None:
            if self.plan.hang_timeout > 0:
                now, console_time = time.monotonic(), self.console.writing_time()
                for w in self.workers:
                    if w.alive:
                        st = self.states[w.spec.rank]
                        allowance = st.allowance(self.plan.hang_timeout, self.plan.startup_timeout)
                        deadlines.append(now + allowance - st.silence(now, console_time))
        elif not stop.terminated:
            deadlines.append(stop.term_at)
        elif not stop.killed:
            deadlines.append(stop.kill_at)
        else:
            deadlines.append(stop.kill_at + KILL_WAIT)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

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

    def on_failure(self, w: Worker, code: int) -> None:
        """The first exit with an error. Every record already in the pipes is read first: announcements written
        before this exit count, whichever order the wake-up (or `check_exits`) handed them and the exit over in."""
        for other in self.workers:
            if other.progress_fd >= 0:
                self.on_progress(other)
        culprit = self.failures.culprit(w, self.workers)
        if culprit is w:
            self.endings[w.spec.rank] = FAILED_FIRST
            if code != USER_ERROR_EXIT_CODE:  # a bad input fails every rank alike: their lines are no fallout
                self.failures.quiet_fallout(w.spec.rank)
            self.begin_stop(Stop("failure", code, self.failures.detail(w, code), worker=w))
            self.console.say(f"{w.label} (rank {w.spec.rank}, pid {w.pid}) failed with {describe_exit(code)}; "
                             f"stopping the other ranks", style="bold red")
            return
        self.endings[w.spec.rank] = FAILED_AFTER
        # until the culprit exits, the code is this one's: never 0, so the run cannot pass for finished
        self.begin_stop(Stop("failure", code, f"{culprit.label} (rank {culprit.spec.rank}) failed", worker=culprit,
                             awaiting=True))
        self.console.say(f"{culprit.label} (rank {culprit.spec.rank}, pid {culprit.pid}) reported an error, and "
                         f"{w.label} (rank {w.spec.rank}) exited after it with {describe_exit(code)}; stopping the "
                         f"other ranks", style="bold red")

    def settle_failure(self, w: Worker, code: int) -> None:
        """The culprit that announced its error has exited: its code and headline are the run's."""
        stop = self.stop
        assert stop is not None
        stop.awaiting, stop.exit_code, stop.detail = False, code, self.failures.detail(w, code)
        self.console.say(f"{w.label} (rank {w.spec.rank}, pid {w.pid}) failed with {describe_exit(code)}",
                         style="bold red")
        self.abort_other_nodes(stop)

    # -- stopping --------------------------------------------------------------------------------------------------

    def begin_stop(self, stop: Stop, pause: float = 0.0) -> None:
        if self.stop is not None:
            return
        self.stop = stop
        stop.term_at = stop.at + pause
        if not stop.awaiting:  # else once the culprit's exit gives the code (`settle_failure`)
            self.abort_other_nodes(stop)
        self.check_clock()

    def abort_other_nodes(self, stop: Stop) -> None:
        if self.control is not None:
            label = stop.worker.label if stop.worker else "supervisor"
            self.control.abort(self.plan.node_rank, label, stop.exit_code)

    def check_clock(self) -> None:
        now = time.monotonic()
        stop = self.stop
        if stop is None:
            self.check_hangs(now)
            return
        if not stop.terminated and now >= stop.term_at:
            stop.terminated = True
            stop.kill_at = now + self.plan.grace_period
            stalled = self.diagnose_stall(now) if stop.reason == "hang" else set()
            for w in self.workers:
                if w.spec.rank in stalled:
                    w.kill_group()
                elif not (stop.awaiting and w is stop.worker):
                    # (an announced culprit is on its way out; a SIGTERM after it has left its stop handler would
                    # make its exit code 143)
                    w.terminate()
        if stop.terminated and not stop.killed and now >= stop.kill_at:
            self.kill_all()
        if stop.killed and now >= stop.kill_at + KILL_WAIT:
            for w in self.workers:
                if w.alive:
                    self.console.say(f"{w.label} (pid {w.pid}) did not die after SIGKILL; leaving it behind",
                                     style="bold red")
                    self.endings[w.spec.rank] = STUCK
                    w.exit_code, w.ended = 128 + signal.SIGKILL, now
                    if stop.awaiting and stop.worker is w:
                        self.settle_failure(w, w.exit_code)

    def kill_all(self) -> None:
        stop = self.stop
        assert stop is not None
        stop.terminated = stop.killed = True
        stop.kill_at = min(stop.kill_at, time.monotonic())
        for w in self.workers:
            if w.alive:
                w.kill_group()

    # -- signals and the control channel --------------------------------------------------------------------------

    def on_signals(self, signums: list[int]) -> None:
        for signum in signums:
            if signum not in STOP_SIGNALS:
                continue  # SIGCHLD: check_exits runs after every wake-up
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
                self.kill_all()

    def on_remote(self, event: tuple[int, str, int, str]) -> None:
        node, label, code, why = event
        if self.stop is None:
            self.console.say(f"node {node}: {why}; stopping this node's ranks", style="bold red")
            self.failures.quiet_fallout(None)
            # an abort always says how a rank failed; were it to say 0, the run must still not look finished
            self.begin_stop(Stop("remote", code or LOST_CODE, f"node {node}: {why}"))

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
        state = self.states[w.spec.rank]
        *lines, state.pending = (state.pending + data).split(b"\n")
        for line in lines:
            try:
                record = Progress.decode(line)
                state.update(record, self.console.writing_time())
            except (ValueError, TypeError):
                continue  # a malformed record says nothing about progress
            if record.event == "failing":
                if self.stop is None:  # before the stop: the earliest one names the failure (`on_failure`)
                    self.failures.announce(w.spec.rank, record.time)
            elif record.event == "step" and (found := self.stragglers.add(w.spec.rank, record.step, record.ready_s,
                                                                        record.step_s)):
                self.console.say(found.message(), style="bold yellow")
                self.straggler_history.append(found)
                if failure := stragglers.record(self.plan.run_dir, self.straggler_history):
                    self.console.say(failure, style="yellow")

    def check_hangs(self, now: float) -> None:
        if self.plan.hang_timeout <= 0:
            return
        console_time = self.console.writing_time()
        for w in self.workers:
            if not w.alive:
                continue
            st = self.states[w.spec.rank]
            allowance = st.allowance(self.plan.hang_timeout, self.plan.startup_timeout)
            silence = st.silence(now, console_time)
            if silence < allowance:
                continue
            since = time.strftime("%H:%M:%S", time.localtime(st.last_seen_wall))
            last = "no step yet" if st.step == 0 else f"last step {st.step}" + (f"/{st.total}" if st.total else "")
            if st.event == "phase" and st.phase:
                last += f", last phase '{st.phase}'"
            detail = f"{w.label} (rank {w.spec.rank}) stalled: no progress for {silence:.1f} s " \
                     f"(since {since}; {last})"
            self.console.say(f"{detail}; dumping every rank's Python stacks (SIGUSR1) and flight records, then "
                             f"stopping", style="bold red")
            for other in self.workers:
                other.signal(signal.SIGUSR1)
                culprit.request_dump(culprit.recorder_pipe(self.plan.run_dir, other.label))
            self.begin_stop(Stop("hang", EXIT_HANG, detail, worker=w, silence=silence), pause=DUMP_WAIT)
            return

    def diagnose_stall(self, now: float) -> set[int]:
        """After the dump pause: name the culprit (headline and report), and return the ranks to SIGKILL now."""
        stop = self.stop
        assert stop is not None
        console_time = self.console.writing_time()
        evidence, stalled = [], set()
        for w in self.workers:
            st = self.states[w.spec.rank]
            if st.silence(now, console_time) >= st.allowance(self.plan.hang_timeout, self.plan.startup_timeout) / 2:
                stalled.add(w.spec.rank)
            when = f"in phase '{st.phase}' after step {st.step}" if st.event == "phase" else f"at step {st.step}"
            tail = self.tails.get(w.spec.rank)
            evidence.append(culprit.RankEvidence(
                w.spec.rank, w.label, when, culprit.main_stack(tail.tail.decode(errors="replace")) if tail else None,
                culprit.load_recorder(culprit.recorder_pipe(self.plan.run_dir, w.label).with_suffix(".json"))))
        verdict = culprit.find_culprit(evidence)
        stop.detail, stop.evidence = verdict.headline(stop.silence), verdict.lines
        by_rank = {w.spec.rank: w for w in self.workers}
        stop.worker = by_rank[verdict.culprits[0].rank] if len(verdict.culprits) == 1 else stop.worker
        for c in verdict.culprits or ([] if stop.worker is None else [evidence[self.workers.index(stop.worker)]]):
            self.endings[c.rank] = STALLED
        self.console.say(stop.detail, style="bold red")
        for line in verdict.lines:
            self.console.log(f"stall evidence: {line}")
        return {rank for rank in stalled if by_rank[rank].alive}

    # -- the sweep -------------------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Kill every process we still have below us except the sentinel: children that left their rank's process
        group, and orphans re-parented to us. Then reap them, so none is left even as a zombie."""
        if direct_children() == {self.reaper.pid}:
            return  # the common case, known without walking the process table
        import psutil

        try:
            leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid != self.reaper.pid]
        except psutil.Error:
            return
        for p in leftovers:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(leftovers, timeout=KILL_WAIT)

    def footer_rows(self) -> list[tuple[Worker, RankState, str]]:
        rows = []
        for w in self.workers:
            if w.alive:
                status = "finishing" if self.states[w.spec.rank].event == "done" else "running"
                if (found := self.stragglers.named.get(w.spec.rank)) is not None:
                    status += f" · straggler +{found.percent:.0f} %"
            else:
                status = self.endings.get(w.spec.rank, describe_exit(w.exit_code or 0))
            rows.append((w, self.states[w.spec.rank], status))
        return rows



def direct_children() -> set[int] | None:
    """Our child pids from /proc (every thread's list), or None where the kernel does not publish them.

    Anything below us hangs from a child of ours: ranks are reaped by now, and orphans come to us (subreaper)."""
    children: set[int] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
    except OSError:
        return None
    return children
