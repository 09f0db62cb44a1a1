"""``python -m supervisor``: see supervisor/cli.py."""

from supervisor.cli import console_script

# Every rank, pipe, log and helper is closed by the time it exits.
console_script()
