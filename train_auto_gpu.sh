#!/usr/bin/env bash
# Train on the least busy GPU (most free memory, then least utilisation): ./train_auto_gpu.sh [flags]
exec python3 "$(dirname "$0")/supervisor/bootstrap.py" -m supervisor --gpus auto "$@"
