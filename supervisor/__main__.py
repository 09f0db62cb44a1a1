"""``python -m supervisor``: see supervisor/cli.py."""

from supervisor.cli import main
from trainer.errors import exit_without_teardown

# Every rank, pipe, log and helper is closed by now.
exit_without_teardown(main())
