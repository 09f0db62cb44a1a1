"""A DDP program in the style of PyTorch's tutorial series (multigpu_torchrun.py), written for torchrun.

    torchrun --nproc-per-node 2 ddp_tutorial.py 2 4 --out DIR [--bar-wait FILE]

Every rank joins the process group from torchrun's environment, picks ``cuda:LOCAL_RANK`` as its device (on a machine
without CUDA it trains on the CPU, and records which physical GPU ``cuda:LOCAL_RANK`` would have been through
``CUDA_VISIBLE_DEVICES``), trains a tiny model with DDP for a few epochs from a fixed seed, prints its losses, draws a
tqdm bar on rank 0, and writes ``DIR/rank<RANK>.json``: its losses, its environment, the GPU it would use.
``--bar-wait FILE``: rank 0 holds its bar half-way through the first epoch until FILE exists.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


class MyTrainDataset(Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(1234)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend="nccl")
    else:
        dist.init_process_group(backend="gloo")


def physical_gpu(local_rank):
    """The GPU that cuda:<local_rank> names for this process: the local_rank-th entry of CUDA_VISIBLE_DEVICES."""
    visible = [item for item in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if item]
    return visible[local_rank] if local_rank < len(visible) else None


class Trainer:
    def __init__(self, model, train_data, optimizer, bar_wait):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu")
        self.model = DDP(model.to(self.device), device_ids=[self.local_rank] if torch.cuda.is_available() else None)
        self.train_data = train_data
        self.optimizer = optimizer
        self.bar_wait = bar_wait
        self.losses = []

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        batches = tqdm(self.train_data, desc=f"epoch {epoch}", mininterval=0, disable=self.global_rank != 0)
        for step, (source, targets) in enumerate(batches):
            if self.bar_wait and epoch == 0 and step == len(self.train_data) // 2:
                deadline = time.monotonic() + 60
                while not os.path.exists(self.bar_wait) and time.monotonic() < deadline:
                    time.sleep(0.05)
            loss = self._run_batch(source.to(self.device), targets.to(self.device))
            self.losses.append(loss)
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Steps: {len(self.train_data)} | Loss {loss:.6f}", flush=True)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


@record
def main(total_epochs, batch_size, out, bar_wait):
    ddp_setup()
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset, seed=7))
    model = torch.nn.Linear(20, 1)
    trainer = Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=1e-2), bar_wait)
    trainer.train(total_epochs)
    local_rank = int(os.environ["LOCAL_RANK"])
    record_file = {"losses": trainer.losses, "env": {k: os.environ.get(k) for k in TORCHRUN_ENV},
                   "device": str(trainer.device), "would_use_gpu": physical_gpu(local_rank)}
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(record_file))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("batch_size", type=int, help="Input batch size on each device")
    parser.add_argument("--out", required=True, help="where each rank writes what it saw")
    parser.add_argument("--bar-wait", help="rank 0 holds its bar half-way through epoch 0 until this file exists")
    args = parser.parse_args()
    main(args.total_epochs, args.batch_size, args.out, args.bar_wait)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch can abort in the interpreter's finalisation while gloo's threads still hold tensors: leave without it
