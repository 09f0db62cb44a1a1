"""A run of this trainer checked before anything starts: what a rank would otherwise refuse only once the token cache
is built and every rank has started (minutes in, on every rank at once), refused as one line by the supervisor.

The one call the supervisor makes into the trainer before a run of it (`supervisor.launch.cli`), and what a rank
started by hand would also find, in this order: a torch older than the trainer runs on; the W&B run's console line (or a missing wandb); the checkpoint to
resume from (a ``--resume`` without one, an earlier unfinished run in the checkpoint folder, a folder the run cannot
write); on CPU ranks, a config meant for GPUs (a model too large to train on CPUs, NCCL, liger-kernel's loss); the
model's source and vocabulary; fault injection aimed at a rank the run does not have.
"""

from __future__ import annotations

from trainer.checkpoint.layout import check_checkpoint_dir, earlier_run, find_resume
from trainer.config import Config, check_world_size
from trainer.config.choices import cpu_rank_refusal, cpu_refusal
from trainer.errors import UserError
from trainer.model.source import check_model_source
from trainer.torch_release import check_torch_release
from trainer.wandb_run import check_wandb


def check_run(cfg: Config, world_size: int, on_gpus: bool, notes: list[str]) -> None:
    """Raise `UserError` for the first thing the run would refuse; lines the console shows go into `notes`.
    `on_gpus`: the ranks compute on GPUs (fake ones included); when not, `cfg.system.device` is still what the config
    asked for."""
    check_torch_release()
    if wandb_note := check_wandb(cfg):
        notes.append(wandb_note)
    find_resume(cfg, notes)
    earlier_run(cfg)
    check_checkpoint_dir(cfg)
    if not on_gpus:
        if cfg.system.device == "cuda":
            raise UserError("system.device=cuda but no GPU was found (NVML and nvidia-smi found none)")
        if refusal := cpu_refusal(cfg) or cpu_rank_refusal(cfg):
            raise UserError(refusal)
    check_model_source(cfg)
    check_world_size(cfg, world_size)
