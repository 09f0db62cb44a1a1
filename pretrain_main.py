"""One training rank. See trainer/rank_cli.py for the ways to start it and ARCHITECTURE.md for the contracts."""

import faulthandler
import signal

# Before anything else (importing torch takes seconds): a stalled rank must answer SIGUSR1 with every thread's stack.
faulthandler.register(signal.SIGUSR1, all_threads=True)

if __name__ == "__main__":
    import sys

    from trainer.errors import exit_without_teardown
    from trainer.rank_cli import main

    try:
        code = main()
    except Exception:
        # An uncaught error: its traceback as the interpreter prints it (through torch.distributed's "[rank<n>]:" hook)
        # and its exit code 1, but without the interpreter's finalisation, which takes seconds with torch loaded: the
        # supervisor sees the failure (a lost GPU's among them) that much sooner, and restarts that much sooner.
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_without_teardown(code)  # everything the run owns (process groups, workers, files) is closed by now
