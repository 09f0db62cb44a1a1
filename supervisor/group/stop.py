"""The stop ladder: how a group's ranks are ended once the watcher has decided to stop them, rung by rung.

1. SIGTERM to each rank process (not its group: its DataLoader workers keep serving it while it finishes its step
   and checkpoints); a rank the hang diagnosis found stalled gets SIGKILL to its group at once instead, and a rank
   that announced its own failure is left to exit (a SIGTERM after its stop handler would make its code 143).
2. `RENDEZVOUS_WAIT` seconds later, SIGKILL for a rank still joining its process group (waiting for a node that may
   never come: it has nothing to save, and a handler that only sets a flag is never reached there), and for one still
   training while another node is lost or the failed (or stalled) rank has exited (the trainer's by its records, a
   program that reports nothing by its stack: in a collective): its collectives wait for the ranks that are gone, so
   it can never reach its checkpoint (gloo ends such a collective on the ranks the gone one was paired with, not on
   the others of three or more; NCCL on none). The wait starts at SIGTERM, or at that rank's exit when it comes
   later. When a restart follows, a rank that says it is training gets no wait: what the restart resumes from was
   saved before the fault (the node's memory copy, the checkpoints on disk), nothing the rank could still write
   outlives it, and the time it takes to notice its lost peer (the rest of its step with gloo, for ever with NCCL)
   is time the fault costs the run. A rank in its checkpoint phase keeps the grace period.
3. At the end of the grace period, SIGKILL to every group still alive, saying where each rank was.
4. `KILL_WAIT` seconds after SIGKILL, a process still there is stuck in the kernel: it is left behind, and said so.

The watcher (`supervisor.group.watch`) decides when and why; this file only climbs. One stop needs no ladder: a stop
signal sent to a rank rather than to the supervisor (a scheduler's preemption, ``kill -TERM <rank>``): the project's
trainer ranks agree to stop, save a checkpoint and exit 0, each saying ``stopped`` on the progress channel first.
Such a group did not finish (`rank_stop`): its own headline, the signal's exit code.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from supervisor.console import Console
from supervisor.diagnosis.culprit import Frame
from supervisor.group.hangs import Stall
from supervisor.group.liveness import RankState, blocked, may_be_held, may_be_joining, says_joining, says_training
from supervisor.group.worker import Worker
from trainer.errors import USER_ERROR_EXIT_CODE

KILL_WAIT = 10.0  # after SIGKILL: a process still there by then is stuck in the kernel; stop waiting for it
RENDEZVOUS_WAIT = 2.0  # after SIGTERM: a rank still joining its process group, or held by a lost node, gets SIGKILL


@dataclass
class Stop:
    """Why a group is being stopped, the exit code that reason gives the supervisor, and the ladder's times."""

    reason: str  # "failure" | "hang" | "interrupt" | "remote" | "signal" (a rank received a stop signal: `rank_stop`)
    exit_code: int
    detail: str
    worker: Worker | None = None
    at: float = field(default_factory=time.monotonic)
    term_at: float = 0.0  # when SIGTERM goes out (later than `at` only for a hang: the stack-dump pause)
    kill_at: float = float("inf")
    rendezvous_at: float = float("inf")  # when the ranks still in the rendezvous get SIGKILL (`RENDEZVOUS_WAIT`)
    terminated: bool = False
    killed: bool = False
    awaiting: bool = False  # a failure: `worker` said ``failing`` and has not exited yet; its exit sets the code
    silence: float = 0.0  # a hang: how long the rank that tripped the watchdog had been silent
    evidence: list[str] = field(default_factory=list)  # a hang: each rank's evidence, for the report
    stall: Stall | None = None  # a hang: what the watchdog found
    node_verdicts: list[str] = field(default_factory=list)  # a hang on several nodes: what each node's evidence said
    lost_node: int | None = None  # another node was lost (stopped answering, died, never joined): which
    gone: str | None = None  # another node's rank failed and exited (its abort came after): "GPU3 of node 1"

    def held_by(self) -> tuple[str, str] | None:
        """What the ranks still training wait for in their collectives that will never come, as (while ..., whose
        ranks): another node lost, or the rank whose failure (or stall: killed at SIGTERM) this is, exited, here or on
        another node. None while nothing is gone for good."""
        if self.lost_node is not None:
            return f"node {self.lost_node} is lost", "that node's ranks"
        if self.gone is not None:
            return f"{self.gone} is gone", self.gone
        if self.reason in ("failure", "hang") and self.worker is not None and not self.worker.alive:
            return f"{self.worker.label} is gone", self.worker.label
        return None

    def deadline(self) -> float:
        """When the next rung is due."""
        if not self.terminated:
            return self.term_at
        if not self.killed:
            return min(self.kill_at, self.rendezvous_at)
        return self.kill_at + KILL_WAIT


def phase_of(state: RankState) -> str | None:
    """Where a rank's last record left it, when that was not a step."""
    if state.event == "phase" and state.phase and not says_joining(state):
        return f"in its {state.phase} phase"
    if state.event is None or says_joining(state):
        return "before the first step: in the rendezvous, or start-up"
    return None  # a step, the end of its steps, its failure


def rank_stop(workers: list[Worker], states: dict[int, RankState], endings: dict[int, str]) -> Stop | None:
    """A group whose ranks stopped early together, each with a ``stopped`` record, because one of them received a stop
    signal: a stop with that signal's code (128 + its number), naming the rank that received it, and each such rank's
    ending said so in `endings`; None when no rank said ``stopped``."""
    stopped = [w for w in workers if states[w.spec.rank].event == "stopped"]
    if not stopped:
        return None
    for w in stopped:
        received = states[w.spec.rank].signal
        endings[w.spec.rank] = f"stopped early ({received} received)" if received else "stopped early, as agreed"
    receivers = [w for w in stopped if states[w.spec.rank].signal]
    name = states[receivers[0].spec.rank].signal if receivers else "SIGTERM"
    state = states[stopped[0].spec.rank]
    who = f"{receivers[0].label} (rank {receivers[0].spec.rank}) received {name}" if receivers else \
        f"a rank received {name}"
    detail = (f"{who}: every rank stopped after step {state.step} of {state.total} and saved a checkpoint "
              f"(--resume auto continues from it)")
    return Stop("signal", 128 + signal.Signals[name].value, detail, worker=receivers[0] if receivers else None)


class StopLadder:
    """The rungs of one group's stop, over its workers and what each last reported."""

    def __init__(self, workers: list[Worker], states: dict[int, RankState], grace_period: float,
                 console: Console, restart_follows: bool = False, trainer: bool = True) -> None:
        """`restart_follows`: the run has a restart left, so ranks held by a rank that is gone get SIGKILL at once.
        `trainer`: the ranks report progress from their start (another program may report nothing at all)."""
        self.workers, self.states, self.grace_period, self.console = workers, states, grace_period, console
        self.restart_follows, self.trainer = restart_follows, trainer

    def terminate(self, stop: Stop, now: float, stalled: set[int]) -> None:
        """Rung 1: SIGTERM (SIGKILL for the `stalled` ranks), and when rung 2 comes."""
        stop.terminated = True
        stop.kill_at = now + self.grace_period
        for w in self.workers:
            if w.spec.rank in stalled:
                w.kill_group()
            elif not (stop.awaiting and w is stop.worker):
                w.terminate()
        alive = self.outliving()
        joining = any(may_be_joining(self.states[w.spec.rank]) for w in alive)
        held = self.hold(stop, now, kill=False)
        if not any(says_training(self.states[w.spec.rank]) for w in alive):
            held = None  # (a program that reports nothing: its stack tells at rung 2, and says so then)
        if joining:
            stop.rendezvous_at = now + RENDEZVOUS_WAIT
        if stop.reason != "interrupt" and any(w.alive for w in self.workers):  # (an interrupt said so)
            sooner = [f"one still in the rendezvous in {RENDEZVOUS_WAIT:g} s (it has nothing to save)"] * joining
            if held is not None and not self.restart_follows:
                sooner.append(f"one still training in {RENDEZVOUS_WAIT:g} s (it cannot reach a checkpoint while "
                              f"{held[0]})")
            self.console.say(f"SIGTERM sent; a rank still running in {self.grace_period:g} s "
                             f"(--grace-period) gets SIGKILL" + "".join(f", {s}" for s in sooner), style="yellow")
        if held is not None:
            self.kill_held_now(stop, held)

    def outliving(self) -> list[Worker]:
        """The ranks alive, when the grace period is longer than rung 2's wait (else rung 3 comes first)."""
        return [w for w in self.workers if w.alive] if self.grace_period > RENDEZVOUS_WAIT else []

    def hold(self, stop: Stop, now: float, kill: bool = True) -> tuple[str, str] | None:
        """When what the ranks wait for is gone for good (`Stop.held_by`) and one of them may be waiting for it, rung 2
        comes `RENDEZVOUS_WAIT` seconds from `now`: at SIGTERM, or when the failed or stalled rank exits after it (one
        that said ``failing`` before it left, a stalled one killed at SIGTERM); when a restart follows, the ranks that
        say they are training get SIGKILL now (`kill`; at SIGTERM, `terminate` does it once it has said SIGTERM).
        Returns what holds them, if rung 2 was set for it."""
        held = stop.held_by()
        if held is None or not any(may_be_held(self.states[w.spec.rank]) for w in self.outliving()):
            return None
        stop.rendezvous_at = min(stop.rendezvous_at, now + RENDEZVOUS_WAIT)
        if kill:
            self.kill_held_now(stop, held)
        return held

    def kill_held_now(self, stop: Stop, held: tuple[str, str]) -> None:
        """When a restart follows: SIGKILL for the ranks that say they are training while `held` (`Stop.held_by`). A
        user error is never restarted (the same input would fail again)."""
        if self.restart_follows and stop.exit_code != USER_ERROR_EXIT_CODE:
            training = {w.pid: None for w in self.workers
                        if w.alive and not w.killed and says_training(self.states[w.spec.rank])}
            self.kill_blocked(training, f"still training while {held[0]}, with a restart to follow",
                              f"its collectives wait for {held[1]}, so it cannot reach a checkpoint, and the restart "
                              f"resumes from what was saved before the fault")

    def climb(self, stop: Stop, now: float) -> list[Worker]:
        """Rungs 2 to 4, those that are due; returns the workers left behind now (rung 4)."""
        if stop.terminated and not stop.killed and now >= stop.rendezvous_at:
            stop.rendezvous_at = float("inf")
            self.kill_rendezvous(stop)
        if stop.terminated and not stop.killed and now >= stop.kill_at:
            self.say_unheeded()
            self.kill_all(stop)
        left: list[Worker] = []
        if stop.killed and now >= stop.kill_at + KILL_WAIT:
            for w in self.workers:
                if w.alive:
                    self.console.say(f"{w.label} (pid {w.pid}) did not die after SIGKILL; leaving it behind",
                                     style="bold red")
                    w.exit_code, w.ended = 128 + signal.SIGKILL, now
                    left.append(w)
        return left

    def say_unheeded(self) -> None:
        """The ranks that outlived SIGTERM by the whole grace period, and where they were: a rank still in the
        rendezvous (no step reported yet: waiting for a node, a collective's first connection) has nothing to save,
        and a signal handler that only sets a flag is never reached while it waits there; one in a phase (its
        checkpoint) says which. Of a program that reports nothing, where its ranks were is not known."""
        left = [w for w in self.workers if w.alive]
        if not left:
            return
        reporting = self.trainer or any(state.event is not None for state in self.states.values())
        places = [f"{w.label} {place}" for w in left
                  if reporting and (place := phase_of(self.states[w.spec.rank])) is not None]
        where = f" ({'; '.join(places)})" if places else ""
        self.console.say(f"{', '.join(w.label for w in left)} still running {self.grace_period:g} s after "
                         f"SIGTERM{where}; SIGKILL", style="bold yellow")

    def kill_rendezvous(self, stop: Stop) -> None:
        """Rung 2: SIGKILL for the ranks still joining their process group `RENDEZVOUS_WAIT` seconds after SIGTERM,
        and for those still training while what their collectives wait for is gone (`Stop.held_by`,
        `supervisor.group.liveness.blocked`)."""
        held = stop.held_by()
        found = blocked({w.pid: self.states[w.spec.rank] for w in self.workers if w.alive}, held is not None)
        self.kill_blocked(found.joining, f"still in the rendezvous {RENDEZVOUS_WAIT:g} s after SIGTERM",
                          "no process group yet, so nothing to save")
        if held is not None:
            self.kill_blocked(found.held, f"still training {RENDEZVOUS_WAIT:g} s after SIGTERM while {held[0]}",
                              f"its collectives wait for {held[1]}, so it cannot reach a checkpoint")

    def kill_blocked(self, frames: dict[int, Frame | None], state: str, why: str) -> None:
        """SIGKILL for the ranks among `frames` (pid → where it waits, where its stack was read), saying so."""
        ranks = [w for w in self.workers if w.alive and w.pid in frames]
        if not ranks:
            return
        where = "; ".join(f"{w.label} in {frame.short()}" for w in ranks if (frame := frames[w.pid]) is not None)
        self.console.say(f"{', '.join(w.label for w in ranks)} {state}{f' ({where})' if where else ''}: {why}; SIGKILL "
                         f"now rather than after the {self.grace_period:g} s grace period", style="bold yellow")
        for w in ranks:
            w.kill_group()

    def kill_all(self, stop: Stop) -> None:
        """Rung 3 (or a second Ctrl-C): SIGKILL to every group still alive."""
        stop.terminated = stop.killed = True
        stop.kill_at = min(stop.kill_at, time.monotonic())
        for w in self.workers:
            if w.alive:
                w.kill_group()
