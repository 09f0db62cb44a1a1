"""The fake NVML state file (``SUPERVISOR_FAKE_GPU_STATE``): the test seam that stands for the GPUs' hardware.

The supervisor reads it instead of NVML (`supervisor.gpus.preflight`: before the run, and again after a failure
to tell a GPU fault from a program fault); the ``gpu_lost`` fault injection writes it, so the GPU a rank "loses" reads
as lost from then on, as NVML would report a GPU that fell off the bus. JSON, keyed by GPU id:
``{"1": {"lost": true, "ecc_uncorrectable": 3, "retired_pages_pending": true, "throttle": ["HW_SLOWDOWN"],
"processes": [...]}}``; a GPU it does not name is healthy. No torch import: the supervisor reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FAKE_STATE_ENV = "SUPERVISOR_FAKE_GPU_STATE"


def read_state(path: str | Path) -> dict[str, Any]:
    """The whole state; a file not written yet is every GPU healthy."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def mark(path: str | Path, gpu: int, **changes: Any) -> None:
    """Change one GPU's entries, replacing the file atomically (the supervisor may read it at any moment)."""
    path = Path(path)
    state = read_state(path)
    state.setdefault(str(gpu), {}).update(changes)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(path)
