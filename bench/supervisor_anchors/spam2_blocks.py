# spam2.py writing its stdout in 8 KiB blocks whatever PYTHONUNBUFFERED says: how the anchor's direct run wrote.
import os
import sys

sys.stdout = open(sys.stdout.fileno(), "w", buffering=8192, closefd=False)
r = os.environ.get("RANK", "0")
w = sys.stdout.write
for i in range(3000000):
    w(f"INFO | [GPU {r}] Step [{i}/300000] | Loss: 12.2340 | LR: 1.00e-05 | Grad Norm: 2.7565 | ETA: 5:30\n")
sys.stdout.flush()
