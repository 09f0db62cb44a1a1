"""The standby: one process per run and node that imports what a rank needs once and forks every group's ranks, so
that neither the start nor a restart pays an import per rank (the rank's side: `trainer.standby`).

It is spawned as a rank is (its own session, the parent-death signal, from the main thread), before the dataset is
looked up, so that its imports overlap that; with the environment the ranks share (`Plan.rank_env` of every rank of
a group, less what differs between them, between groups or is learnt before a group starts: `PER_RANK`), importing
from the entry script's folder as a spawned rank does (never the working folder first, as `-m` would), stdout to
/dev/null, stderr to an unnamed file (its last line is the log's reason when it fails before it is ready), and one
more descriptor: its end of a socket pair (SOCK_SEQPACKET: one message each way per group). It says ``ready <seconds>`` once imported, and the first group waits for that (`wait_ready`): one process
importing takes the cores for as long as every rank importing at once did, and none is left to slow the training
later. `fork` creates each rank's pipes as `Worker.spawn` does, sends every rank's environment and command line with
the pipes' write ends attached, in one request, and gets the ranks' pids, each by then the supervisor's own child
(the standby forks one child, which forks the ranks and exits); the Workers it returns are watched, signalled and
reaped as spawned ones. A group with a rank whose environment differs from the standby's beyond `PER_RANK` (what the
imports may have read) is not sent, nor is any once the standby is unfit (not ready in time, an import that loaded
CUDA, gone): its ranks are spawned as ever.

The sentinel knows the standby's process group (`Reaper.watch`), a group's final sweep spares it (`Reaper.kept`), and
`close` at the run's end closes its socket (it exits), then kills its group and reaps it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass

from supervisor.console import Console
from supervisor.group.reaper import TOKEN_ENV, Reaper
from supervisor.group.worker import Worker, die_with_parent, rank_pipes
from supervisor.plan.spec import ERROR_FILE_ENV, RUN_CONFIG_ENV, Plan, RankSpec
from trainer.data import TOKEN_CACHE_ENV
from trainer.diagnosis.flight_recorder import PIPE_ENV as FLIGHT_RECORDER_PIPE_ENV
from trainer.progress import PROGRESS_FD_ENV, RESTART_COUNT_ENV
from trainer.standby import MAX_FDS, STANDBY_FD_ENV

# what a rank's environment may hold that the standby's does not: who the rank is, which group and rendezvous it is in,
# the token cache the supervisor finds while the standby imports (read by the rank once started, never by an import)
PER_RANK = frozenset({"RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                      RESTART_COUNT_ENV, RUN_CONFIG_ENV, ERROR_FILE_ENV, FLIGHT_RECORDER_PIPE_ENV,
                      "CUDA_VISIBLE_DEVICES", "GPU_RANK", "OMP_NUM_THREADS", PROGRESS_FD_ENV, TOKEN_CACHE_ENV})
# of those, what an import reads: the standby imports with the ranks' value, and a forked rank sets its own
IMPORTED = frozenset({"OMP_NUM_THREADS"})
# the standby's own: should an import ask whether CUDA is available, torch answers from NVML instead of initialising
# the driver (PyTorch's check that does not poison a fork); a forked rank takes its own environment, without it
FORK_SAFE_CUDA_CHECK = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
# `python -m trainer.standby` would import from the supervisor's working folder first (`-m` puts it at the head of
# sys.path), where a user's `transformers.py` or `trainer/` would then be what every forked rank runs; a spawned rank
# (`python pretrain_main.py`) imports from the entry script's folder instead, and so does the standby: `python -c
# RUN_FROM FOLDER MODULE` puts FOLDER in place of the working one (under PYTHONSAFEPATH neither is on the path), then
# runs MODULE as `-m` does
RUN_FROM = ("import runpy, sys\n"
            "if not getattr(sys.flags, 'safe_path', False):\n"
            "    sys.path[0] = sys.argv[1]\n"
            "runpy.run_module(sys.argv[2], run_name='__main__', alter_sys=True)\n")
EXITED_WAIT_S = 5.0  # a standby that closed its socket before it was ready: its exit, for the log line
READY_TIMEOUT_S = 120.0  # the first group waits this long for the imports; then its ranks are spawned
REPLY_TIMEOUT_S = 10.0  # a fork's answer (a fork per rank and one more, and a re-parenting)


@dataclass
class Readiness:
    import_s: float | None = None  # how long its imports took, as it said once they were done (None: not yet)
    unfit: str = ""  # why it cannot fork ranks (it has exited)


def stdin_open() -> bool:
    try:
        os.fstat(0)
        return True
    except OSError:
        return False


def standby_env(plan: Plan, reaper: Reaper) -> dict[str, str]:
    """What every rank of a group on this node has alike, less `PER_RANK`."""
    envs = [plan.rank_env(spec, 0, None, 0) for spec in plan.ranks]
    common = {k: v for k, v in envs[0].items() if k not in PER_RANK - IMPORTED and all(e.get(k) == v for e in envs[1:])}
    return {**common, TOKEN_ENV: reaper.token}


class Standby:
    """The node's standby process and its socket."""

    def __init__(self, plan: Plan, reaper: Reaper, console: Console) -> None:
        """Spawn it (from the main thread: the parent-death signal follows the thread that forks)."""
        self.reaper, self.console = reaper, console
        self.env = standby_env(plan, reaper)
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.stderr = tempfile.TemporaryFile()  # what it says if it fails before it is ready (no file left behind)
        try:
            self.process = subprocess.Popen(
                [plan.python, "-c", RUN_FROM, os.path.dirname(os.path.abspath(plan.entry)), "trainer.standby"],
                env={**self.env, STANDBY_FD_ENV: str(theirs.fileno()), **FORK_SAFE_CUDA_CHECK},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr,
                pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
        except BaseException:
            self.channel.close()
            self.stderr.close()
            raise
        finally:
            theirs.close()
        reaper.watch(self.process.pid)
        reaper.kept.add(self.process.pid)
        self.readiness = Readiness()

    def heard(self, line: str) -> None:
        if line.startswith("ready "):
            self.readiness.import_s = float(line.split()[1])
            self.console.log(f"the standby ready: {self.readiness.import_s:.1f} s to import what a rank needs, once "
                             f"for every group of this run")
        elif line:
            self.unfit(line)
        else:
            try:
                code = self.process.wait(EXITED_WAIT_S)
            except subprocess.TimeoutExpired:
                code = None
            self.unfit(f"it {'closed its socket' if code is None else f'exited ({code})'} before it was ready"
                       f"{f': {said}' if (said := self.last_words()) else ''}")

    def last_words(self) -> str:
        """The last line the standby wrote to its stderr (an import's error), shortened for a log line."""
        self.stderr.seek(0)
        lines = [line for line in self.stderr.read()[-4096:].decode(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else ""

    def unfit(self, why: str) -> None:
        self.readiness.unfit = why
        self.console.log(f"the standby cannot fork ranks ({why}): the ranks are spawned")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Wait for its imports to end (a stop signal meanwhile raises, under `interruptible`) and say how in
        supervisor.log: ready, or unfit (its word, or its exit); one silent for `timeout` is unfit, and stopped.
        Whether it can fork ranks."""
        readable, _, _ = select.select([self.channel], [], [], timeout)
        if readable:
            self.heard(self.channel.recv(256).decode(errors="replace"))
        else:
            self.unfit(f"not ready within {timeout:.0f} s")
            self.kill()
        return self.usable()

    def usable(self) -> bool:
        return self.readiness.import_s is not None and not self.readiness.unfit and self.process.poll() is None

    def fork(self, ranks: list[tuple[RankSpec, dict[str, str], list[str]]]) -> list[Worker] | None:
        """A group's ranks, each given as its spec, environment (without the progress descriptor, which the rank gets
        with its pipe) and command line, forked by the standby in one request once it is ready (`wait_ready`); None
        where the standby cannot give them (the group's ranks are then spawned as ever)."""
        if not self.usable() or any(env.get(k) != v for _, env, _ in ranks for k, v in self.env.items()
                                    if k not in PER_RANK):
            return None
        pipes = [rank_pipes() for _ in ranks]
        attached: list[int] = []
        entries = []
        for (spec, env, argv), rank_pipe in zip(ranks, pipes):
            fds = [*rank_pipe.write_ends(), *([0] if spec.rank == 0 and stdin_open() else [])]
            entries.append({"env": env, "argv": argv, "fds": len(fds)})
            attached += fds
        try:
            if len(attached) > MAX_FDS:
                raise OSError(f"{len(ranks)} ranks' pipes are more descriptors than one message carries")
            self.channel.settimeout(REPLY_TIMEOUT_S)
            socket.send_fds(self.channel, [json.dumps({"ranks": entries, "supervisor": os.getpid()}).encode()],
                            attached)
            reply = json.loads(self.channel.recv(65536) or b"{}")
        except (OSError, ValueError) as e:
            reply = {"error": str(e)}
        finally:
            for rank_pipe in pipes:
                rank_pipe.close_write_ends()
        if len(reply.get("pids", ())) != len(ranks):
            for rank_pipe in pipes:
                rank_pipe.close_read_ends()
            self.unfit(f"the group not forked: {reply.get('error', 'no answer')}")
            return None
        return [Worker.adopt(spec, pid, rank_pipe) for (spec, _, _), pid, rank_pipe in zip(ranks, reply["pids"], pipes)]

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        """End it: its socket closed (it exits), then its group killed and reaped."""
        self.channel.close()
        self.kill()
        self.process.wait()
        self.stderr.close()
        self.reaper.forget(self.process.pid)
        self.reaper.kept.discard(self.process.pid)
