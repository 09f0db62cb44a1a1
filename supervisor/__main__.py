"""``python -m supervisor``: see supervisor/cli.py."""

import os
import sys

from supervisor.cli import main

code = main()
# Every rank, pipe, log and helper is closed by now. Skipping the interpreter's teardown (module and object
# finalisation, some 20 ms) lets a failed run hand its exit code back that much sooner.
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except (BrokenPipeError, OSError):
        pass
os._exit(code)
