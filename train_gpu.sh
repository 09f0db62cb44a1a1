#!/usr/bin/env bash
# Train on one chosen GPU: ./train_gpu.sh 3 [flags]
exec python3 "$(dirname "$0")/supervisor/bootstrap.py" -m supervisor --gpus "$@"
