"""A rank for the GPU tier: joins an NCCL group on the one GPU it sees, all-reduces on it, and records what it saw in
``<out>/rank<RANK>.json`` (its CUDA_VISIBLE_DEVICES, GPU_RANK, visible device count and name, backend)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", 0)  # under the supervisor the rank's GPU is always cuda:0
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        record = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "GPU_RANK": os.environ.get("GPU_RANK"), "device_count": torch.cuda.device_count(),
                  "name": torch.cuda.get_device_name(device), "backend": dist.get_backend(),
                  "world_size": dist.get_world_size(), "all_reduce": value.item()}
    finally:
        dist.destroy_process_group()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))
    print(f"cuda rank {rank}: {record['device_count']} visible device(s), {record['name']}, {record['backend']}",
          flush=True)


if __name__ == "__main__":
    main()
