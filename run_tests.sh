#!/usr/bin/env bash
# The test suite (slow, GPU and Slurm tests excluded; `-m slow`, `-m gpu` or `-m slurm` runs those: pytest takes the
# last -m).
# Extra arguments go to pytest.
exec python3 "$(dirname "$0")/supervisor/bootstrap.py" -m pytest -m "not slow and not gpu and not slurm" "$@"
