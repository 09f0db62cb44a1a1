"""A program under torch's @record whose rank 1 raises at step 3: torchrun's way of naming a root cause.

    torchrun --nproc-per-node 2 raises.py
"""

import os

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def load_batch(step: int) -> list[int]:
    if int(os.environ["RANK"]) == 1 and step == 3:
        raise ValueError(f"corrupt batch at step {step} on rank 1")
    return [step]


@record
def main() -> None:
    dist.init_process_group("gloo")
    for step in range(6):
        load_batch(step)
        dist.barrier()
        print(f"rank {os.environ['RANK']} step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
