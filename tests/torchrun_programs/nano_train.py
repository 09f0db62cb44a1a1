"""A training script in nanoGPT's style (train.py): globals overridden by ``--key=value`` arguments, DDP when torchrun
set RANK, the device ``cuda:<ddp_local_rank>`` on a GPU and the CPU otherwise, a few iterations of a tiny bigram
model, the losses printed by the master process and written to ``<out_dir>/losses<RANK>.json``.

    torchrun --standalone --nproc_per_node=2 nano_train.py --max_iters=6 --out_dir=DIR
"""

import json
import os
import sys
from ast import literal_eval

import torch
import torch.nn as nn
from torch.distributed import barrier, destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# default config values
out_dir = "out"
max_iters = 5
batch_size = 8
block_size = 16
vocab_size = 32
learning_rate = 1e-2
gradient_accumulation_steps = 2
backend = "gloo"
# -----------------------------------------------------------------------------
# poor man's configurator: --key=value overrides a global above
for arg in sys.argv[1:]:
    assert arg.startswith("--") and "=" in arg, f"expected --key=value, got {arg}"
    key, val = arg[2:].split("=", 1)
    assert key in globals(), f"Unknown config key: {key}"
    try:
        attempt = literal_eval(val)
    except (SyntaxError, ValueError):
        attempt = val
    globals()[key] = attempt
# -----------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}" if torch.cuda.is_available() else "cpu"
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    ddp_rank, master_process, seed_offset, ddp_world_size = 0, True, 0, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(1337 + seed_offset)
data = torch.randint(vocab_size, (4096,), generator=torch.Generator().manual_seed(42))


def get_batch():
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx, targets):
        logits = self.table(idx)
        return nn.functional.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))


torch.manual_seed(1337)  # the same initial weights on every rank
model = Bigram().to(device)
torch.manual_seed(1337 + seed_offset)  # a different data stream per rank
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
if ddp:
    model = DDP(model)

losses = []
for iter_num in range(max_iters):
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        X, Y = get_batch()
        loss = model(X, Y) / gradient_accumulation_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lossf = loss.item() * gradient_accumulation_steps
    losses.append(lossf)
    if master_process:
        print(f"iter {iter_num}: loss {lossf:.4f}", flush=True)

os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, f"losses{ddp_rank}.json"), "w") as f:
    json.dump({"losses": losses, "device": device, "world": ddp_world_size,
               "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}, f)
if ddp:
    barrier()
    destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # torch can abort in the interpreter's finalisation while gloo's threads still hold tensors: leave without it
