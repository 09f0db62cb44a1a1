"""Session set-up shared by every test: the default tier runs on CPUs even on a machine with GPUs.

This pytest process and everything it starts inherit `CUDA_VISIBLE_DEVICES=""` (see `tests/gpu_visibility.py`); the
GPU tier (`tests/gpu/`, marker `gpu`) gives its own processes the machine's GPUs back explicitly.
"""

from __future__ import annotations

import pytest

import gpu_visibility

# The shared fixtures, for every test module: the tiny token cache and one-thread torch (rank_support), and the
# reaping of supervisors a failing test left behind (rank_scripts/harness.py). The harness first: rank_support imports
# it, and pytest rewrites the asserts of a plugin only if it is the first to import it.
pytest_plugins = ["rank_scripts.harness", "rank_support"]


def pytest_configure(config: pytest.Config) -> None:
    gpu_visibility.hide_gpus()  # before any test can initialise CUDA in this process
