#!/usr/bin/env bash
# The GPU checks, one step per command on a GPU machine (tests, presets, ablation); see bench/gpu_session.py.
# The GPU image's python3 holds torch: it runs the step, and the step hands it to everything it starts as PYTHON.
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_session.py" "$@"
