"""The installed torch's release, read from its metadata (importing torch takes seconds), and the oldest one the
trainer runs on.

The floor is the oldest release the trainer has been run on: its background checkpoint keeps DCP's
`StateDictStager` for the run (torch 2.8 on; 2.8's cannot be closed), and its FSDP path is FSDP2's public
`fully_shard` (2.6 on). A program of the user's own that the supervisor runs as torchrun would is not the trainer:
it runs with any torch.
"""

from __future__ import annotations

import functools
import re
import sys
from importlib import metadata

from trainer.errors import UserError

TRAINER_TORCH_FLOOR = (2, 9)


@functools.cache
def torch_release() -> tuple[int, int]:
    """The installed torch's major and minor version; the newest behaviour where it cannot be read."""
    try:
        found = re.match(r"(\d+)\.(\d+)", metadata.version("torch"))
    except metadata.PackageNotFoundError:
        found = None
    return (int(found[1]), int(found[2])) if found else (sys.maxsize, 0)


def check_torch_release() -> None:
    """Refuse, in one line, a torch older than the trainer runs on (before it fails on an import or a missing call)."""
    if torch_release() < TRAINER_TORCH_FLOOR:
        floor = ".".join(map(str, TRAINER_TORCH_FLOOR))
        raise UserError(f"the trainer needs torch {floor} or later, and this environment has torch "
                        f"{metadata.version('torch')}: install a newer one (pip install 'torch>={floor}'), or run with "
                        f"another Python (PYTHON=...)")
