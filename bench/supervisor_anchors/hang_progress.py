# The hang anchor (hang.py) plus the project's progress channel: rank 1 stalls at step 20 and says when.
import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the rank contract: stacks on SIGUSR1
import sys
import time

import torch
import torch.distributed as dist

from trainer.progress import ProgressReporter

reporter = ProgressReporter()
dist.init_process_group("gloo")
r = dist.get_rank()
x = torch.ones(4)
for step in range(100000):
    if r == 1 and step == 20:
        with open(sys.argv[1], "w") as f: f.write(repr(time.time()))
        time.sleep(3600)   # stalled rank: never exits
    dist.all_reduce(x)
    reporter.step(step + 1, 100000)
    time.sleep(0.01)
