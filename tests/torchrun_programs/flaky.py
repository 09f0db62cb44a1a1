"""A program that fails on its first attempt and succeeds once torchrun (or the supervisor) restarted it.

    torchrun --nproc-per-node 2 --max-restarts 1 flaky.py DIR

Rank 1 exits 2 while TORCHELASTIC_RESTART_COUNT is 0 (to torchrun, 2 is any failure); every rank of every attempt
appends ``attempt <restart count> rank <RANK>`` to DIR/attempts.txt.
"""

import os
import sys
import time
from pathlib import Path

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
with open(Path(sys.argv[1]) / "attempts.txt", "a") as log:
    log.write(f"attempt {restart} of {os.environ['TORCHELASTIC_MAX_RESTARTS']} rank {rank}\n")
if restart == 0 and rank == 1:
    attempts = Path(sys.argv[1]) / "attempts.txt"
    deadline = time.monotonic() + 60
    while f"attempt 0 of {os.environ['TORCHELASTIC_MAX_RESTARTS']} rank 0" not in attempts.read_text():
        if time.monotonic() > deadline:  # (rank 0 never started: fail all the same)
            break
        time.sleep(0.01)  # fail once rank 0 has said it started: every launcher then sees the same attempts
    print("rank 1: the first attempt fails", file=sys.stderr, flush=True)
    sys.exit(2)
if restart == 0:
    time.sleep(60)  # rank 0 of the first attempt: stopped when rank 1 fails
print(f"rank {rank}: attempt {restart} succeeded", flush=True)
