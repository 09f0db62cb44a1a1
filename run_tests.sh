#!/usr/bin/env bash
# The test suite (slow and GPU tests excluded; `-m slow` or `-m gpu` runs those: pytest takes the last -m).
# Extra arguments go to pytest.
exec python3 "$(dirname "$0")/supervisor/bootstrap.py" -m pytest -m "not slow and not gpu" "$@"
