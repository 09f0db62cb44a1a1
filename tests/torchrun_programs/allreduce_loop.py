"""A program written for torchrun: it joins the gloo process group from torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and all-reduces a tensor in a loop, as data-parallel training does its gradients.

    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port PORT --nproc-per-node 8 allreduce_loop.py
        [--step-time S] [--steps N] [--ready DIR] [--save-on-term] [--leave RANK:STEP:CODE [--linger S]]

``--steps N``: every rank leaves after N all-reduces, saying its rank, the world's size and the last sum (the world
size, when every rank took part). ``--ready DIR``: each rank writes ``DIR/rank<RANK>.pids`` (its pid) once its first
all-reduce is done, the moment the whole world has formed. ``--save-on-term``: SIGTERM sets a flag the loop reads
between steps (where a training script saves its checkpoint before leaving), as many training scripts answer it; without
it SIGTERM ends the process as Python's default does. ``--leave``: rank RANK leaves before its all-reduce of step STEP
as a program ending with `sys.exit(CODE)` does, its sockets closed first (the interpreter's teardown closes them) and
its process ending ``--linger`` seconds later (a teardown on a loaded machine). It never reports progress to a
supervisor.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds asleep between two all-reduces")
    parser.add_argument("--steps", type=int, help="leave after this many all-reduces (default: run until SIGTERM)")
    parser.add_argument("--ready", help="a folder where each rank writes rank<RANK>.pids after its first all-reduce")
    parser.add_argument("--save-on-term", action="store_true", help="SIGTERM: leave after the step, saying so")
    parser.add_argument("--leave", help="RANK:STEP:CODE: that rank closes its process group and exits with CODE")
    parser.add_argument("--linger", type=float, default=1.0, help="seconds between the close and the exit")
    args = parser.parse_args()
    leave_rank, leave_step, leave_code = map(int, args.leave.split(":")) if args.leave else (-1, -1, 0)
    stop = []
    if args.save_on_term:
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step, total = 0, torch.zeros(1)
    while not stop and step != args.steps:
        if (rank, step) == (leave_rank, leave_step):
            dist.destroy_process_group()
            time.sleep(args.linger)
            sys.exit(leave_code)
        total = torch.ones(1)
        dist.all_reduce(total)
        step += 1
        if step == 1 and args.ready:
            path = Path(args.ready) / f"rank{rank}.pids"
            path.with_suffix(".tmp").write_text(str(os.getpid()))
            path.with_suffix(".tmp").replace(path)
        time.sleep(args.step_time)
    if stop:
        print(f"rank {rank}: SIGTERM after step {step}; saving, then leaving", flush=True)
    else:
        print(f"rank {rank} of {dist.get_world_size()}: {step} all-reduces, the last summing to {total.item():g}",
              flush=True)
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may still hold the tensor: leave without the interpreter's finalisation


if __name__ == "__main__":
    main()
