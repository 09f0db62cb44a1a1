"""The run folder: where a rank's history, plots, reports and (by default) checkpoints go.

The supervisor makes it and passes it in; a rank started by hand or under torchrun agrees on one with the others.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from trainer.config import RUNS_DIR, Config
from trainer.errors import UserError
from trainer.model.distributed import DistContext, broadcast_object


def new_run_dir(cfg: Config) -> Path:
    """logs/<date>-<time>-<preset>[-n]/ under the working directory, for a run started by hand."""
    stem = f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{cfg.preset}"
    for n in range(1, 1000):
        path = RUNS_DIR / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise UserError(f"cannot create a run folder under {RUNS_DIR}")


def agree_run_dir(cfg: Config, ctx: DistContext, given: Path | None) -> Path:
    """The run folder: the supervisor's (`given`), else logging.run_dir, else a new logs/<run-id>/ that rank 0
    picks for every rank. Outside the supervisor rank 0 also records the resolved config there."""
    if given is not None:
        return given
    path = (Path(cfg.logging.run_dir) if cfg.logging.run_dir else new_run_dir(cfg)) if ctx.is_main else None
    path = broadcast_object(path, ctx)
    if ctx.is_main:
        cfg.save(path / "config.json")  # what the run actually used, as the supervisor would have written it
    return path
