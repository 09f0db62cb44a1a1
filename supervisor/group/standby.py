"""The standby: one process per run and node that imports what a rank needs once, while the first group trains, and
forks each restart's ranks, so that a restart pays no import (the rank's side: `trainer.standby`).

It is spawned as a rank is (its own session, the parent-death signal, from the main thread), with the environment the
ranks share (`Plan.rank_env` of every rank of the next group, less what differs between them, between groups or is
learnt when a group starts: `PER_RANK`), stdout and stderr to /dev/null, and one more descriptor: its end of a socket
pair (SOCK_SEQPACKET: one message each way per request). It says ``ready <seconds>`` once imported. At a restart,
`fork` creates the rank's pipes as `Worker.spawn` does, sends the rank's environment and command line with the pipes'
write ends attached, and gets the pid of the rank, which is by then the supervisor's own child (the standby forks
twice); the Worker it returns is watched, signalled and reaped as a spawned one. A request whose environment differs
from the standby's beyond `PER_RANK` (what the imports may have read) is not sent: that rank is spawned as ever.

The sentinel knows the standby's process group (`Reaper.watch`), a group's final sweep spares it (`Reaper.kept`), and
`close` at the run's end closes its socket (it exits), then kills its group and reaps it. A thread reads its
``ready`` line while the first group trains, for supervisor.log and the restart's line.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

from supervisor.console import Console
from supervisor.group.reaper import TOKEN_ENV, Reaper
from supervisor.group.worker import Worker, die_with_parent, rank_pipes
from supervisor.plan.spec import ERROR_FILE_ENV, RUN_CONFIG_ENV, Plan, RankSpec
from trainer.diagnosis.flight_recorder import PIPE_ENV as FLIGHT_RECORDER_PIPE_ENV
from trainer.progress import PROGRESS_FD_ENV, RESTART_COUNT_ENV
from trainer.standby import STANDBY_FD_ENV

# what a rank's environment may hold that the standby's does not: who the rank is, which group and rendezvous it is in
# (read by the rank once started, never by an import)
PER_RANK = frozenset({"RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                      RESTART_COUNT_ENV, RUN_CONFIG_ENV, ERROR_FILE_ENV, FLIGHT_RECORDER_PIPE_ENV,
                      "CUDA_VISIBLE_DEVICES", "GPU_RANK", "OMP_NUM_THREADS", PROGRESS_FD_ENV})
# of those, what an import reads: the standby imports with the ranks' value, and a forked rank sets its own
IMPORTED = frozenset({"OMP_NUM_THREADS"})
# the standby's own: should an import ask whether CUDA is available, torch answers from NVML instead of initialising
# the driver (PyTorch's check that does not poison a fork); a forked rank takes its own environment, without it
FORK_SAFE_CUDA_CHECK = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
REPLY_TIMEOUT_S = 120.0  # a fork request sent while the standby still imports waits for the imports


@dataclass
class Readiness:
    ready_at: float | None = None  # monotonic, once it said its imports were done
    import_s: float | None = None  # how long they took, as it said
    unfit: str = ""  # why it cannot fork ranks (it has exited)


def stdin_open() -> bool:
    try:
        os.fstat(0)
        return True
    except OSError:
        return False


def standby_env(plan: Plan, restart: int, reaper: Reaper) -> dict[str, str]:
    """What every rank of group `restart` on this node has alike, less `PER_RANK`."""
    envs = [plan.rank_env(spec, 0, None, restart) for spec in plan.ranks]
    common = {k: v for k, v in envs[0].items() if k not in PER_RANK - IMPORTED and all(e.get(k) == v for e in envs[1:])}
    return {**common, TOKEN_ENV: reaper.token}


class Standby:
    """The node's standby process and its socket."""

    def __init__(self, plan: Plan, reaper: Reaper, console: Console) -> None:
        """Spawn it (from the main thread: the parent-death signal follows the thread that forks)."""
        self.reaper, self.console = reaper, console
        self.env = standby_env(plan, 1, reaper)
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [plan.python, "-m", "trainer.standby"],
                env={**self.env, STANDBY_FD_ENV: str(theirs.fileno()), **FORK_SAFE_CUDA_CHECK},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
        except BaseException:
            self.channel.close()
            raise
        finally:
            theirs.close()
        reaper.watch(self.process.pid)
        reaper.kept.add(self.process.pid)
        self.started = time.monotonic()
        self.readiness = Readiness()
        self.stop_reading, self.wake = os.pipe()
        self.reader = threading.Thread(target=self.read_ready, name="standby", daemon=True)
        self.reader.start()

    def read_ready(self) -> None:
        """Until the standby says it is ready (or unfit, or `fork` wants the socket): note it, and say so in
        supervisor.log."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.stop_reading, selectors.EVENT_READ)
            selector.register(self.channel, selectors.EVENT_READ)
            for key, _ in selector.select():
                if key.fileobj == self.stop_reading:
                    return
        self.heard(self.channel.recv(256).decode(errors="replace"))

    def heard(self, line: str) -> None:
        if line.startswith("ready "):
            self.readiness.ready_at, self.readiness.import_s = time.monotonic(), float(line.split()[1])
            self.console.log(f"the standby ready: {self.readiness.import_s:.1f} s to import what a rank needs, once "
                             f"for every restart of this run")
        else:
            self.readiness.unfit = line or f"it exited ({self.process.poll()}) before it was ready"
            self.console.log(f"the standby cannot fork ranks ({self.readiness.unfit}): restarts spawn their ranks")

    def stop_reader(self) -> None:
        if self.reader.is_alive():
            os.write(self.wake, b"x")
            self.reader.join()

    def usable(self) -> bool:
        return not self.readiness.unfit and self.process.poll() is None

    def fork(self, spec: RankSpec, env: dict[str, str], argv: list[str]) -> Worker | None:
        """The rank `spec`, forked by the standby with `env` (without the progress descriptor, which the rank gets
        with its pipe) and `argv`; None where the standby cannot give it (its rank is then spawned as ever)."""
        self.stop_reader()
        if not self.usable() or any(env.get(k) != v for k, v in self.env.items() if k not in PER_RANK):
            return None
        if self.readiness.ready_at is None:  # still importing: the fork's reply follows its `ready`
            self.channel.settimeout(REPLY_TIMEOUT_S)
            try:
                self.heard(self.channel.recv(256).decode(errors="replace"))
            except OSError:
                self.readiness.unfit = f"not ready within {REPLY_TIMEOUT_S:.0f} s"
            if not self.usable():
                return None
        pipes = rank_pipes()
        attached = [*pipes.write_ends(), *([0] if spec.rank == 0 and stdin_open() else [])]
        request = {"env": env, "argv": argv, "supervisor": os.getpid()}
        try:
            self.channel.settimeout(REPLY_TIMEOUT_S)
            socket.send_fds(self.channel, [json.dumps(request).encode()], attached)
            reply = json.loads(self.channel.recv(4096) or b"{}")
        except (OSError, ValueError) as e:
            reply = {"error": str(e)}
        finally:
            pipes.close_write_ends()
        if "pid" not in reply:
            pipes.close_read_ends()
            self.readiness.unfit = reply.get("error", "no answer")
            self.console.log(f"the standby could not fork {spec.label} ({self.readiness.unfit}): restarts spawn "
                             f"their ranks")
            return None
        return Worker.adopt(spec, int(reply["pid"]), pipes)

    def summary(self, fault_at: float) -> str:
        """What the restart's line says of the standby: whether its imports were done before the fault (`fault_at`,
        monotonic)."""
        if not self.usable():
            return ""
        ready = self.readiness.ready_at
        return ("; forked from the standby, whose imports were done before the fault" if ready is not None and
                ready <= fault_at else "; forked from the standby, still importing at the fault")

    def close(self) -> None:
        """End it: its socket closed (it exits), then its group killed and reaped."""
        self.stop_reader()
        self.channel.close()
        for fd in (self.stop_reading, self.wake):
            os.close(fd)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.reaper.forget(self.process.pid)
        self.reaper.kept.discard(self.process.pid)
