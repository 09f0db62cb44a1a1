"""Standby ranks: one process per rank of the next group, started while a group trains, that has imported what a rank
needs before any fault, so that a restart pays no import (the rank's side: `trainer.standby`).

Each is spawned as its rank would be (`Worker.spawn`: its own session, the parent-death signal, its stdout, stderr
and progress pipes, rank 0's stdin), with the environment its rank will have in the next group (`Plan.rank_env` for
that restart: only the rendezvous port, chosen when the group starts, is not known yet), and one more descriptor, its
end of a socket pair: it says ``ready <seconds>`` there once imported, and waits. At the restart, `take` hands a
standby its rank's environment and command line, and it becomes that rank: the same Worker, whose pipes the group's
pump and watcher read from then on. A standby whose environment would differ in more than the port (a restart without
a faulty GPU renumbers the ranks) is dismissed and its rank spawned as ever.

The sentinel knows each standby's process group (`Reaper.watch`), a group's final sweep spares them (`Reaper.kept`),
and the standbys never used are dismissed at the run's end (their socket closed, SIGKILL to their group, reaped). A
thread reads their ``ready`` lines while the group trains, for supervisor.log and the restart's line.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.console import Console
from supervisor.group.reaper import TOKEN_ENV, Reaper
from supervisor.group.worker import Worker
from supervisor.plan.spec import Plan, RankSpec
from trainer.progress import PROGRESS_FD_ENV
from trainer.standby import STANDBY_FD_ENV

PER_GROUP = frozenset({"MASTER_PORT"})  # what a standby's environment learns only when its group starts
UNKNOWN_PORT = "0"


@dataclass
class Standby:
    worker: Worker
    channel: socket.socket  # the supervisor's end
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # monotonic, once it said its imports were done
    import_s: float | None = None  # how long they took, as it said


class Standbys:
    """The standby ranks of one coming group (`restart`), by the spec of the rank each will become."""

    def __init__(self, plan: Plan, restart: int, config: Path | None, reaper: Reaper, console: Console) -> None:
        """Spawn them (from the main thread: the parent-death signal follows the thread that forks)."""
        self.restart, self.reaper, self.console = restart, reaper, console
        self.waiting: dict[RankSpec, Standby] = {}
        self.stop_reading, self.wake = os.pipe()
        for spec in plan.ranks:
            ours, theirs = socket.socketpair()
            env = {**plan.rank_env(spec, 0, config, restart), TOKEN_ENV: reaper.token, "MASTER_PORT": UNKNOWN_PORT,
                   STANDBY_FD_ENV: str(theirs.fileno())}
            try:
                worker = Worker.spawn(spec, [plan.python, "-m", "trainer.standby"], env, stdin=spec.rank == 0,
                                      keep_fds=(theirs.fileno(),))
            except OSError:
                ours.close()
                continue  # the rank is spawned as ever at the restart
            finally:
                theirs.close()
            reaper.watch(worker.pid)
            reaper.kept.add(worker.pid)
            self.waiting[spec] = Standby(worker, ours)
        self.reader = threading.Thread(target=self.read_ready, name="standby ranks", daemon=True)
        self.reader.start()

    def read_ready(self) -> None:
        """Until every standby has said it is ready (or `take` wants the sockets): note each one's readiness, and
        say in supervisor.log when all are."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.stop_reading, selectors.EVENT_READ)
            for standby in self.waiting.values():
                selector.register(standby.channel, selectors.EVENT_READ, standby)
            pending = len(self.waiting)
            while pending:
                for key, _ in selector.select():
                    if key.data is None:
                        return
                    standby = key.data
                    selector.unregister(standby.channel)
                    pending -= 1
                    line = standby.channel.recv(64).decode(errors="replace").split()
                    if line[:1] == ["ready"] and len(line) == 2:
                        standby.ready_at, standby.import_s = time.monotonic(), float(line[1])
        imports = ", ".join(f"{s.import_s:.1f} s" for s in self.waiting.values() if s.import_s is not None)
        if imports:
            self.console.log(f"standby ranks for restart {self.restart} ready: {imports} to import what a rank needs")

    def take(self, spec: RankSpec, env: dict[str, str], argv: list[str]) -> Worker | None:
        """The standby of `spec` become that rank, with `env` (without its progress descriptor, which the standby has)
        and `argv`; None where there is none alive whose environment fits (its rank is then spawned as ever)."""
        self.stop_reader()
        standby = self.waiting.pop(spec, None)
        if standby is None:
            return None
        mine = {**env, PROGRESS_FD_ENV: standby.worker.env[PROGRESS_FD_ENV]}
        known = {k: v for k, v in standby.worker.env.items() if k != STANDBY_FD_ENV}
        if standby.worker.has_exited() or {k: v for k, v in mine.items() if k not in PER_GROUP} != \
                {k: v for k, v in known.items() if k not in PER_GROUP}:
            self.dismiss(standby)
            return None
        try:
            standby.channel.sendall(json.dumps({"env": mine, "argv": argv}).encode() + b"\n")
        except OSError:
            self.dismiss(standby)
            return None
        standby.channel.close()
        self.reaper.kept.discard(standby.worker.pid)
        standby.worker.env, standby.worker.started = mine, time.monotonic()
        return standby.worker

    def summary(self, fault_at: float) -> str:
        """What the restart's line says of the standbys: how many there are, and whether their imports were done
        before the fault (`fault_at`, monotonic)."""
        alive = [s for s in self.waiting.values() if not s.worker.has_exited()]
        if not alive:
            return ""
        late = sum(s.ready_at is None or s.ready_at > fault_at for s in alive)
        what = f"{len(alive)} standby rank{'s' * (len(alive) != 1)}"
        return (f"; on {what}, whose imports were done before the fault" if not late else
                f"; on {what}, {late} of them still importing at the fault")

    def stop_reader(self) -> None:
        if self.reader.is_alive():
            os.write(self.wake, b"x")
            self.reader.join()

    def dismiss(self, standby: Standby) -> None:
        standby.channel.close()
        worker = standby.worker
        worker.kill_group()
        worker.reap()
        for fd in (worker.stdout_fd, worker.stderr_fd, worker.progress_fd):
            os.close(fd)
        self.reaper.forget(worker.pid)
        self.reaper.kept.discard(worker.pid)

    def close(self) -> None:
        """Dismiss the standbys not taken (the run ends, or the next group starts without them)."""
        self.stop_reader()
        for standby in self.waiting.values():
            self.dismiss(standby)
        self.waiting.clear()
        for fd in (self.stop_reading, self.wake):
            os.close(fd)
