"""The GPU tier's skip condition and fixtures: every test under tests/gpu/ is skipped, with the reason, unless this
machine has a CUDA GPU that this interpreter's torch can use.

The pytest process itself keeps the GPUs hidden (tests/conftest.py); the tests start their processes with
`Machine.env`, the machine's own CUDA_VISIBLE_DEVICES restored, and check through the real entry points.
"""

from __future__ import annotations

import pytest

from gpu_support import Machine, probe


@pytest.fixture(scope="session")
def machine() -> Machine:
    found = probe()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(autouse=True)
def needs_gpu(machine: Machine) -> None:
    """Requested by every test of the tier, so each is skipped with the probe's reason where there is no GPU."""
