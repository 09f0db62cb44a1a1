"""A rank started before it is needed: the supervisor's standby for the next restart (`python -m trainer.standby`).

Importing torch and transformers takes a rank seconds of CPU; a restart that spawned its ranks then would pay them
after every fault. So while a group trains, the supervisor starts one standby per rank of the next group
(`supervisor.group.standby`), exactly as it starts a rank (its own session, the parent-death signal, the same pipes and
environment, the restart's), and each imports what a rank needs, says so on its socket (`ready <seconds>`), and waits.
It imports at the priority of a rank: at a lower one, a host whose cores the ranks keep busy (CPU ranks) would not
finish it before a fault, and a GPU node's idle cores finish it either way; on a busy host the group's steps are
slower for those seconds, once per group.
When the restart comes, the supervisor sends the rank's environment and command line as one JSON line: the standby
takes that environment as its own (the port of the group's rendezvous is all that differs), closes the socket and runs
`pretrain_main.py` as ``python pretrain_main.py ...`` would, in this process. A socket closed without a word (the
run ended without needing it) ends the standby quietly. Nothing here touches CUDA: the rank's device is chosen after
activation, as in any rank.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time

STANDBY_FD_ENV = "SUPERVISOR_STANDBY_FD"  # the standby's end of its socket to the supervisor
# what a rank imports before its first step (the trainer, torch, DCP, transformers' Llama and its attention), so that
# an activated standby imports nothing more
RANK_MODULES = ("trainer.rank_cli", "trainer.loop", "transformers.models.llama.modeling_llama",
                "transformers.integrations.sdpa_attention")


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # as pretrain_main.py: a stack dump on request
    channel = socket.socket(fileno=int(os.environ.pop(STANDBY_FD_ENV)))
    started = time.perf_counter()
    for module in RANK_MODULES:
        importlib.import_module(module)
    try:
        channel.sendall(f"ready {time.perf_counter() - started:.2f}\n".encode())
    except BrokenPipeError:  # activated while importing: the supervisor has sent its line and closed its end
        pass
    message = b""
    while not message.endswith(b"\n") and (chunk := channel.recv(1 << 16)):
        message += chunk
    channel.close()
    if not message.endswith(b"\n"):  # dismissed: the run needs no restart
        return 0
    activation = json.loads(message)
    os.environ.clear()
    os.environ.update(activation["env"])
    script, *args = activation["argv"][1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
