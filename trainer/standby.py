"""The node's standby: one process that imports what a rank needs once per run and forks every group's ranks
(`python -m trainer.standby`; the supervisor's side is `supervisor.group.standby`).

Importing torch and transformers takes a rank seconds of CPU; a restart that spawned its ranks then would pay them
after every fault, and a standby started beside a training group would pay them on the cores the training ranks use.
So, in a run with restarts, the supervisor starts this one process before the first group (its own session, the
parent-death signal, the ranks' common environment), which imports, says ``ready <seconds>`` on its socket and waits.
Every group, the first included, asks it for each rank: one message holding the rank's environment and command line, with the rank's
stdout, stderr and progress pipes (and, for rank 0, the supervisor's stdin) attached as descriptors. The standby
forks twice; the first child exits at once, so the rank is re-parented to the supervisor (a child subreaper) and is
its child as a spawned rank is: reaped, signalled and killed by pid and process group as ever. The rank then makes
its own session, sets the parent-death signal, takes its pipes as 0, 1 and 2 and its environment, and runs
`pretrain_main.py` as ``python pretrain_main.py ...`` would, in that process. The standby answers with the rank's pid.

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
MESSAGE_LIMIT = 1 << 20  # one request: a rank's environment and command line
REPARENT_WAIT_S = 5.0
PR_SET_PDEATHSIG = 1


def cuda_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether the CUDA driver library is mapped into this process (what a CUDA call loads; a fork after it would
    give the rank a GPU it cannot use)."""
    try:
        return any("libcuda.so" in line for line in maps.read_text().splitlines())
    except OSError:
        return False


def become_rank(request: dict, fds: list[int], channel: socket.socket) -> None:
    """In the forked rank, once re-parented to the supervisor: its session, parent-death signal, descriptors and
    environment, then `pretrain_main.py`; never returns."""
    code = 1
    try:
        os.setsid()  # its own session and process group: signalled and killed as a group, as a spawned rank is
        supervisor = int(request["supervisor"])
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
        os.environ.update(request["env"])
        os.environ[PROGRESS_FD_ENV] = str(progress)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # torch sized its thread pool from the standby's, at import
            import torch

            torch.set_num_threads(int(threads))
        script, *args = request["argv"][1:]
        sys.argv = [script, *args]
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


def fork_rank(request: dict, fds: list[int], channel: socket.socket) -> int:
    """Fork the rank of `request` (twice: the rank is re-parented to the supervisor before its pid is answered);
    its pid."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the first child: fork the rank, say its pid, exit so that the supervisor adopts it
        try:
            os.close(read_end)
            rank = os.fork()
            if rank == 0:
                os.close(write_end)
                become_rank(request, fds, channel)
            os.write(write_end, str(rank).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as f:
            said = f.read()
    finally:
        os.waitpid(child, 0)  # once it is reaped, the rank's parent is the supervisor
    return int(said)


def serve(channel: socket.socket) -> None:
    """Answer fork requests until the supervisor closes its end."""
    while True:
        message, fds, _, _ = socket.recv_fds(channel, MESSAGE_LIMIT, 4)
        if not message:
            return
        try:
            reply = {"pid": fork_rank(json.loads(message), fds, channel)}
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
