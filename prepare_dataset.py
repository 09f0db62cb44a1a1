"""Build or reuse the token cache for a config (step 2 of a run, on its own). See trainer/data/prepare_cli.py."""

import sys

from trainer.data.prepare_cli import main

if __name__ == "__main__":
    sys.exit(main())
