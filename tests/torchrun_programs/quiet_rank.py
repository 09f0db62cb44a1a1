"""A program written for torchrun in which one rank goes quiet in its own code while the others wait for it in a
collective: it joins the gloo group from torchrun's environment, all-reduces a tensor a few times, and before one
step the chosen rank spends a while on its own, printing nothing, then all finish and exit 0.

    quiet_rank.py --rank R --step S --seconds X --how sleep|thread|compute|cross [--steps N] [--ready DIR]

``--how sleep``: ``time.sleep(X)`` (no CPU time, no output: quiet, not hung). ``--how thread``: the same sleep in a
worker thread, which the main thread waits for (``Future.result()``, a lock). ``--how compute``: pure Python
arithmetic for X seconds (CPU time, no output). ``--how cross``: the rank all-reduces on a second group the others
never use, while they all-reduce on the default one: every rank waits in a collective for ever (a stall no rank's
own code holds). ``--ready DIR``: each rank writes ``DIR/rank<RANK>.pids`` (its pid) after its first all-reduce. It
never reports progress to a supervisor.
"""

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist


def quiet(how: str, seconds: float, other: dist.ProcessGroup) -> None:
    """The chosen rank's time on its own."""
    if how == "cross":
        dist.all_reduce(torch.ones(1), group=other)
    elif how == "sleep":
        time.sleep(seconds)
    elif how == "thread":
        with ThreadPoolExecutor(1) as pool:
            pool.submit(time.sleep, seconds).result()
    else:
        end, total = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            total += sum(i * i for i in range(10_000))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True, help="the rank that goes quiet")
    parser.add_argument("--step", type=int, default=2, help="before this step")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--how", choices=["sleep", "thread", "compute", "cross"], default="sleep")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ready", help="a folder where each rank writes rank<RANK>.pids after its first all-reduce")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, other = dist.get_rank(), dist.new_group()
    for step in range(args.steps):
        if (rank, step) == (args.rank, args.step):
            quiet(args.how, args.seconds, other)
        dist.all_reduce(torch.ones(1))  # the others wait here for the quiet rank
        if step == 0 and args.ready:
            path = Path(args.ready) / f"rank{rank}.pids"
            path.with_suffix(".tmp").write_text(str(os.getpid()))
            path.with_suffix(".tmp").replace(path)
    print(f"rank {rank}: {args.steps} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may still hold the tensor: leave without the interpreter's finalisation


if __name__ == "__main__":
    main()
