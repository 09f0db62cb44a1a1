"""A program whose rank 1 ends the way a rank that leaves its process group alive can: its work done, the process
aborted in the interpreter's exit by libstdc++, with its one line on stderr.

    torchrun --nproc-per-node 2 teardown_abort.py

That abort comes from a C++ thread object destroyed while its thread runs (gloo's worker threads at finalization),
a race no test can call up on demand; rank 1 prints the line libstdc++ prints and aborts itself, as that process
does (a real SIGABRT). Rank 0 ends cleanly.
"""

import os
import sys

rank = int(os.environ["RANK"])
print(f"rank {rank}: done", flush=True)
if rank == 1:
    print("terminate called without an active exception", file=sys.stderr, flush=True)
    os.abort()
