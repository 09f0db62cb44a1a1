"""Which GPUs the processes a test starts may see.

The default tier means CPU ranks, so on a machine with GPUs it hides them (`CUDA_VISIBLE_DEVICES=""`, which CUDA,
NVML-based discovery in `supervisor/gpus/discovery.py` and this project all read as "no GPU"): the suite then behaves and takes
as long as on a machine without any. The GPU tier (`tests/gpu/`) starts its processes with the machine's own value,
captured here before `tests/conftest.py` hides the GPUs.
"""

from __future__ import annotations

import os

VARIABLE = "CUDA_VISIBLE_DEVICES"
MACHINE_VALUE = os.environ.get(VARIABLE)  # None: unset, every GPU visible
HIDDEN = ""


def hide_gpus(environ: dict[str, str] | os._Environ = os.environ) -> None:
    environ[VARIABLE] = HIDDEN


def machine_gpus(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with the machine's own CUDA_VISIBLE_DEVICES back in place (or unset, as it was)."""
    env = dict(environ)
    if MACHINE_VALUE is None:
        env.pop(VARIABLE, None)
    else:
        env[VARIABLE] = MACHINE_VALUE
    return env
