"""``python -m supervisor``: see supervisor/launch/cli.py."""

from supervisor.launch.cli import console_script

# Every rank, pipe, log and helper is closed by the time it exits.
console_script()
