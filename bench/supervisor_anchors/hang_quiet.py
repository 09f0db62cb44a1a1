# The hang anchor (hang.py) as a torchrun program is written: no progress channel, no signal handler. Rank 1 stalls
# at step 20 and writes when to argv[1]; rank 0 waits for it in the all-reduce.
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r = dist.get_rank()
x = torch.ones(4)
for step in range(100000):
    if r == 1 and step == 20:
        with open(sys.argv[1], "w") as f: f.write(repr(time.time()))
        time.sleep(3600)   # stalled rank: never exits
    dist.all_reduce(x)
