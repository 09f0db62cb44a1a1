#!/usr/bin/env bash
# The test suite (slow tests excluded; add `-m slow` for those). Extra arguments go to pytest.
exec python3 "$(dirname "$0")/supervisor/bootstrap.py" -m pytest -m "not slow" "$@"
