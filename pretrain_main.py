"""One training rank. See trainer/rank_cli.py for the ways to start it and ARCHITECTURE.md for the contracts."""

import faulthandler
import signal

# Before anything else (importing torch takes seconds): a stalled rank must answer SIGUSR1 with every thread's stack.
faulthandler.register(signal.SIGUSR1, all_threads=True)

if __name__ == "__main__":
    from trainer.errors import exit_without_teardown
    from trainer.rank_cli import main

    exit_without_teardown(main())  # everything the run owns (process groups, workers, files) is closed by now
