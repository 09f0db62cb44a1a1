"""Weights & Biases (``logging.wandb``): rank 0 logs the scalars TensorBoard gets, and the resolved config.

``wandb`` is an optional extra (``pip install -e '.[wandb]'``). The supervisor calls `check_wandb` before it builds or
starts anything, so a missing package is one ``error:`` line, not a failure of rank 0 after the dataset build.

Mode: ``WANDB_MODE`` as the user set it (``online``, ``offline``, ``disabled``); unset, the run is **offline**, so
training never waits on, or fails for, a network service (compute nodes often have no way out). Offline files go into
the run folder (``logs/<run-id>/wandb/offline-run-*``) and ``wandb sync`` uploads them later; ``WANDB_MODE=online``
streams instead (after ``wandb login``, or with ``WANDB_API_KEY``).

Torch-free, and ``wandb`` itself is imported only by rank 0 when the run starts (it takes seconds).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from trainer.config import Config
from trainer.errors import UserError

MODE_ENV = "WANDB_MODE"
DEFAULT_MODE = "offline"
MISSING = ("logging.wandb is on but the wandb package is not installed: pip install -e '.[wandb]' "
           "(or pip install wandb), or drop logging.wandb")


def wandb_mode() -> str:
    """What this run does with W&B: the user's WANDB_MODE, else offline (the ranks inherit the same environment)."""
    return os.environ.get(MODE_ENV) or DEFAULT_MODE


def check_wandb(cfg: Config) -> str | None:
    """The console line saying where W&B logs go (None when it is off); raises `UserError` when wandb is missing."""
    if not cfg.logging.wandb:
        return None
    if importlib.util.find_spec("wandb") is None:
        raise UserError(MISSING)
    mode, given = wandb_mode(), MODE_ENV in os.environ and bool(os.environ[MODE_ENV])
    where = (f"{MODE_ENV}={mode}" if given
             else f"offline ({MODE_ENV} unset; files in the run folder's wandb/, `wandb sync` uploads them, "
                  f"{MODE_ENV}=online streams instead)")
    name = cfg.logging.wandb_run_name or "the run folder's name"
    return f"W&B: project '{cfg.logging.wandb_project}', run {name}, {where}"


def start_wandb(cfg: Config, run_dir: Path) -> Any:
    """Rank 0: open the W&B run (a `wandb.Run`: `.log(scalars, step=)`, `.finish(exit_code=)`) with the resolved
    config, writing under `run_dir`. The rank's console stays the supervisor's: W&B does not capture it."""
    try:
        import wandb
    except ImportError:
        raise UserError(MISSING) from None
    mode = wandb_mode()
    try:
        return wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_run_name or run_dir.name,
                          dir=str(run_dir), config=cfg.to_dict(), mode=mode,  # type: ignore[arg-type]
                          settings=wandb.Settings(console="off"))
    except (wandb.errors.Error, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"W&B ({MODE_ENV}={mode}) could not start: {first_line}; run `wandb login`, set "
                        f"WANDB_API_KEY, or use {MODE_ENV}=offline") from None
