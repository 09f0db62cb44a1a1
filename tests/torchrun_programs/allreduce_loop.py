"""A program written for torchrun: it joins the gloo process group from torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and all-reduces a tensor in a loop, as data-parallel training does its gradients.

    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port PORT --nproc-per-node 8 allreduce_loop.py
        [--step-time S] [--ready DIR] [--save-on-term]

``--ready DIR``: each rank writes ``DIR/rank<RANK>.pids`` (its pid) once its first all-reduce is done, the moment the
whole world has formed. ``--save-on-term``: SIGTERM sets a flag the loop reads between steps (where a training
script saves its checkpoint before leaving), as many training scripts answer it; without it SIGTERM ends the process
as Python's default does. It never reports progress to a supervisor.
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
    parser.add_argument("--ready", help="a folder where each rank writes rank<RANK>.pids after its first all-reduce")
    parser.add_argument("--save-on-term", action="store_true", help="SIGTERM: leave after the step, saying so")
    args = parser.parse_args()
    stop = []
    if args.save_on_term:
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step = 0
    while not stop:
        dist.all_reduce(torch.ones(1))
        step += 1
        if step == 1 and args.ready:
            path = Path(args.ready) / f"rank{rank}.pids"
            path.with_suffix(".tmp").write_text(str(os.getpid()))
            path.with_suffix(".tmp").replace(path)
        time.sleep(args.step_time)
    print(f"rank {rank}: SIGTERM after step {step}; saving, then leaving", flush=True)
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may still hold the tensor: leave without the interpreter's finalisation


if __name__ == "__main__":
    main()
