"""One training rank. See trainer/rank_cli.py for the ways to start it and ARCHITECTURE.md for the contracts."""

import faulthandler
import os
import signal
import sys

# Before anything else (importing torch takes seconds): a stalled rank must answer SIGUSR1 with every thread's stack.
faulthandler.register(signal.SIGUSR1, all_threads=True)

if __name__ == "__main__":
    from trainer.rank_cli import main

    code = main()
    # Everything the run owns (process groups, workers, files) is closed by now. Skipping the interpreter's teardown
    # keeps C++ destructors of torch.distributed objects from running during finalisation, where they can abort a
    # run that already finished (std::terminate, exit 134).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError):
            pass
    os._exit(code)
