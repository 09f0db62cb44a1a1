"""A program written for torchrun, as people write them: the process group from the environment, a DDP model
trained on random data, nothing reported to any supervisor, no signal handlers, and no output until it ends.

    quiet_ddp.py --seconds S [--pid-dir DIR]

Trains for `S` seconds of wall time (each rank stops at the same step: rank 0 decides and broadcasts), so a test can
make it outlast any start-up timeout. With `--pid-dir`, each rank writes `rank<r>.pid` once it has trained a step,
so a test knows when to freeze it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--pid-dir")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                                        torch.nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start, step, go_on = time.monotonic(), 0, torch.ones(1)
    while go_on.item():
        batch = torch.randn(512, 256)
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # DDP's all-reduce of the gradients
        optimizer.step()
        step += 1
        if step == 1 and args.pid_dir:
            Path(args.pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
        go_on.fill_(float(time.monotonic() - start < args.seconds))
        dist.broadcast(go_on, src=0)
    print(f"rank {rank}: {step} steps, loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch can abort in the interpreter's finalisation while gloo's threads still hold tensors: leave without it
