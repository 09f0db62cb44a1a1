"""The node's standby: one process that imports what a rank needs once per run and forks every group's ranks
(the module run as `python -m trainer.standby` would be, from the entry script's folder; the supervisor's side is
`supervisor.group.standby`).

Importing torch and transformers takes a rank seconds of CPU; a restart that spawned its ranks then would pay them
after every fault, and a standby started beside a training group would pay them on the cores the training ranks use.
So, in a run with restarts, the supervisor starts this one process before the first group (its own session, the
parent-death signal, the ranks' common environment), which imports, says ``ready <seconds>`` on its socket and waits.
Every group, the first included, asks it for all its ranks in one message: each rank's environment and command
line, with its stdout, stderr and progress pipes (and, for rank 0, the supervisor's stdin) attached as descriptors.
The standby forks one child, which forks every rank and exits, so the ranks are re-parented to the supervisor (a
child subreaper) and are its children as spawned ranks are: reaped, signalled and killed by pid and process group as
ever. (A fork of a process that holds torch copies its page tables, and that child's exit frees them: about 10 and
20 ms, paid once per group rather than once per rank.) Each rank then closes the other ranks' descriptors, makes its
own session, sets the parent-death signal, takes its pipes as 0, 1 and 2 and its environment, and runs
`pretrain_main.py` as ``python pretrain_main.py ...`` would, in that process. The standby answers with the pids.

Forking needs a process that has not initialised CUDA (a CUDA context does not survive a fork): the imports do not
touch the GPU (the standby runs with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, so an import that asks whether CUDA is
available is answered from NVML), and if one ever did (the driver library is loaded), the standby says ``unfit`` and
exits, and the ranks are spawned. A socket closed without a word (the run ended) ends the standby quietly.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
from pathlib import Path

from trainer.progress import PROGRESS_FD_ENV

STANDBY_FD_ENV = "SUPERVISOR_STANDBY_FD"  # the standby's end of its socket to the supervisor
# what a rank imports before its first step (the trainer, torch, DCP, transformers' Llama and its attention), so that
# a forked rank imports nothing more
RANK_MODULES = ("trainer.rank_cli", "trainer.loop", "transformers.models.llama.modeling_llama",
                "transformers.integrations.sdpa_attention")
MESSAGE_LIMIT = 1 << 20  # one request: every rank's environment and command line
MAX_FDS = 253  # descriptors one message carries (the kernel's SCM_MAX_FD): 3 per rank, and rank 0's stdin
REPARENT_WAIT_S = 5.0
PR_SET_PDEATHSIG = 1


def cuda_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether the CUDA driver library is mapped into this process (what a CUDA call loads; a fork after it would
    give the rank a GPU it cannot use)."""
    try:
        return any("libcuda.so" in line for line in maps.read_text().splitlines())
    except OSError:
        return False


def become_rank(rank: dict, fds: list[int], supervisor: int, channel: socket.socket) -> None:
    """In the forked rank, once re-parented to the supervisor: its session, parent-death signal, descriptors (`fds`,
    its own) and environment, then `pretrain_main.py`; never returns."""
    code = 1
    try:
        os.setsid()  # its own session and process group: signalled and killed as a group, as a spawned rank is
        deadline = time.monotonic() + REPARENT_WAIT_S
        while os.getppid() != supervisor and time.monotonic() < deadline:
            time.sleep(0.0005)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != supervisor:  # the supervisor died meanwhile (or is not our subreaper): no rank to be
            os._exit(1)
        channel.close()
        stdout, stderr, progress, *stdin = fds
        os.dup2(stdin[0] if stdin else os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        for fd in (*stdin, stdout, stderr):
            os.close(fd)
        os.set_inheritable(progress, True)  # as a spawned rank's: its DataLoader workers' children report too
        os.environ.clear()
        os.environ.update(rank["env"])
        os.environ[PROGRESS_FD_ENV] = str(progress)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # torch sized its thread pool from the standby's, at import
            import torch

            torch.set_num_threads(int(threads))
        script, *args = rank["argv"][1:]
        sys.argv = [script, *args]
        if not getattr(sys.flags, "safe_path", False):  # (PYTHONSAFEPATH, 3.11: no script folder on the path)
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # never back into the standby's loop


def fork_ranks(request: dict, fds: list[int], channel: socket.socket) -> list[int]:
    """Fork every rank of `request` (from one child, which exits so that they are re-parented to the supervisor
    before their pids are answered); their pids. `fds`: every rank's descriptors in turn, as many as its entry says."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the first child: fork the ranks, say their pids, exit so that the supervisor adopts them
        said = b"[]"
        pids: list[int] = []
        try:
            os.close(read_end)
            start = 0
            for rank in request["ranks"]:
                own = fds[start:start + rank["fds"]]
                start += rank["fds"]
                pid = os.fork()
                if pid == 0:
                    os.close(write_end)
                    for fd in fds:
                        if fd not in own:
                            os.close(fd)
                    become_rank(rank, own, int(request["supervisor"]), channel)
                pids.append(pid)
            said = json.dumps(pids).encode()
        except OSError:  # a fork refused (no memory, no process left): none of the group is started
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        finally:
            try:
                os.write(write_end, said)
            finally:
                os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as f:
            said = f.read()
    finally:
        os.waitpid(child, 0)  # once it is reaped, the ranks' parent is the supervisor
    pids = json.loads(said)
    if len(pids) != len(request["ranks"]):
        raise OSError("a fork was refused")
    return pids


def serve(channel: socket.socket) -> None:
    """Answer fork requests until the supervisor closes its end."""
    while True:
        message, fds, _, _ = socket.recv_fds(channel, MESSAGE_LIMIT, MAX_FDS)
        if not message:
            return
        try:
            reply = {"pids": fork_ranks(json.loads(message), fds, channel)}
        except (OSError, ValueError) as e:
            reply = {"error": str(e)}
        finally:
            for fd in fds:
                os.close(fd)
        channel.sendall(json.dumps(reply).encode())


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # as pretrain_main.py: a stack dump on request
    channel = socket.socket(fileno=int(os.environ.pop(STANDBY_FD_ENV)))
    started = time.perf_counter()
    for module in RANK_MODULES:
        importlib.import_module(module)
    if cuda_loaded():
        channel.sendall(b"unfit: CUDA was initialised while importing")
        return 0
    try:
        channel.sendall(f"ready {time.perf_counter() - started:.2f}".encode())
        serve(channel)
    except (BrokenPipeError, ConnectionResetError):  # the supervisor is gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
