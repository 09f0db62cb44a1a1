"""``python -m supervisor``: see supervisor/cli.py."""

import sys

from supervisor.cli import main

sys.exit(main())
