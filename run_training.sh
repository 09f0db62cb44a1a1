#!/usr/bin/env bash
# Train on every GPU (CPU ranks where there is none). `bash run_training.sh --debug` for the NaN-hunting preset.
exec python3 "$(dirname "$0")/supervisor/bootstrap.py" -m supervisor "$@"
