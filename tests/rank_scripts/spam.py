"""A rank that floods stdout and stderr with checkable lines, for the pump's tests.

Each line names its rank, stream and number (``r2 out 17 xxxx``) so a test can verify that every line arrived
whole, once, under the right prefix. Extras: a line longer than the pump's read size, a carriage-return progress
line, and a last line with no newline at all.
"""

import os
import sys

rank = os.environ.get("RANK", "0")
lines = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
long_line = int(sys.argv[2]) if len(sys.argv) > 2 else 0
out, err = sys.stdout, sys.stderr
pad = "x" * (int(rank) * 7 + 20)
for i in range(lines):
    out.write(f"r{rank} out {i} {pad}\n")
    if i % 3 == 0:
        err.write(f"r{rank} err {i} {pad}\n")
    if i == lines // 2 and long_line:
        out.write(f"r{rank} long " + "y" * long_line + " end\n")
out.write(f"r{rank} progress 10%\rr{rank} progress 50%\rr{rank} progress 100%\n")
out.write(f"r{rank} partial-out")
err.write(f"r{rank} partial-err")
