"""A run of this trainer checked before anything starts: what a rank would otherwise refuse only once the token cache
is built and every rank has started (minutes in, on every rank at once), refused as one line by the supervisor.

The one call the supervisor makes into the trainer before a run of it (`supervisor.launch.cli`), and what a rank
started by hand would also find, in this order: a torch older than the trainer runs on; the W&B run's console line
(or a missing wandb); the checkpoint to resume from (a ``--resume`` without one, an earlier unfinished run in the
checkpoint folder, a folder the run cannot write); the model's source and vocabulary; on CPU ranks, a config meant
for GPUs (a model too large to train on CPUs, NCCL, liger-kernel's loss) or one whose estimate is well beyond the
host's memory (the kernel would kill a rank part-way); the data source; fault injection aimed at a rank the run does
not have.

`--dry-run` (the supervisor's and a rank's by hand) checks the data source as the run does, and sizes the run for the
devices it would get (`dry_run`).
"""

from __future__ import annotations

from dataclasses import replace

from trainer.checkpoint.layout import check_checkpoint_dir, earlier_run, find_resume
from trainer.config import Config, check_world_size
from trainer.config.choices import cpu_rank_refusal, needs_gpus
from trainer.config.resolve import preset_config
from trainer.data.corpus import open_corpus
from trainer.errors import UserError
from trainer.model.estimate import (
    HOST_MEMORY_MARGIN,
    SHRINK_ADVICE,
    DetectedGpus,
    HostMemory,
    dry_run_report,
    estimate,
    host_memory,
    size,
)
from trainer.model.source import check_model_source
from trainer.torch_release import check_torch_release
from trainer.wandb_run import check_wandb

CPU_PRESETS = {"debug": "--debug", "small": "--preset small"}  # the presets that train on CPU ranks too, smallest first


def check_run(cfg: Config, world_size: int, local_ranks: int, on_gpus: bool, notes: list[str]) -> None:
    """Raise `UserError` for the first thing the run would refuse; lines the console shows go into `notes`.
    `local_ranks`: the run's ranks on this machine; `on_gpus`: they compute on GPUs (fake ones included); when not,
    `cfg.system.device` is still what the config asked for."""
    check_torch_release()
    if wandb_note := check_wandb(cfg):
        notes.append(wandb_note)
    find_resume(cfg, notes)
    earlier_run(cfg)
    check_checkpoint_dir(cfg)
    check_model_source(cfg)  # first: sizing a model from a folder reads its config
    if not on_gpus:
        if cfg.system.device == "cuda":
            raise UserError("system.device=cuda but no GPU was found (NVML and nvidia-smi found none)")
        if refusal := cpu_refusal(cfg, world_size, local_ranks):
            raise UserError(refusal)
    check_data_source(cfg)
    check_world_size(cfg, world_size)


def cpu_refusal(cfg: Config, world_size: int, local_ranks: int) -> str | None:
    """Why CPU ranks, `local_ranks` of the run's `world_size` on this machine, should not start `cfg` (None: they may):
    a config meant for GPUs, a setting only CUDA has, or an estimate well beyond the host's memory, where the kernel
    would kill a rank part-way and the run end as a bare SIGKILL."""
    if why := needs_gpus(cfg):
        return f"{why}; {cpu_advice(cfg, world_size, local_ranks)}"
    if refusal := cpu_rank_refusal(cfg):
        return refusal
    host = cpu_host_memory(cfg, world_size, local_ranks)
    if not host.refused:
        return None
    each = f" ({size(host.per_rank)} each)" if host.ranks > 1 else ""
    return (f"{host.ranks} CPU rank{'s' * (host.ranks > 1)} would need about {size(host.needed)} of host memory{each} "
            f"by the estimate, more than {HOST_MEMORY_MARGIN:g} times the {size(host.available)} this machine has "
            f"available (RAM and swap): the kernel would kill a rank part-way; {SHRINK_ADVICE}; --dry-run shows the "
            f"estimate (--set system.host_memory_check=false starts them anyway)")


def cpu_host_memory(cfg: Config, world_size: int, local_ranks: int) -> HostMemory:
    return host_memory(estimate(cfg, world_size, None, cuda=False), local_ranks, cfg.system.host_memory_check)


def cpu_advice(cfg: Config, world_size: int, local_ranks: int) -> str:
    """What to run on this machine's CPU ranks instead of a config meant for GPUs: the CPU presets whose estimate fits
    its memory, and `cfg` itself forced onto them where it would fit, else the memory that would take."""
    fitting = [flag for name, flag in CPU_PRESETS.items()
               if cpu_host_memory(preset_config(name), world_size, local_ranks).fits]
    use = f"use {' or '.join(fitting)} on this CPU" if fitting else "no preset fits this machine's memory on CPU ranks"
    forced = cpu_host_memory(cfg, world_size, local_ranks)
    if forced.fits:
        return f"{use}, or force it with --set system.device=cpu"
    return (f"{use}; forced onto CPU ranks (--set system.device=cpu) it would need about {size(forced.needed)} of "
            f"host memory, {size(forced.available)} available")


def check_data_source(cfg: Config) -> None:
    """Every source the token cache would read opened as its build opens it (`open_corpus`): a local path that does not
    exist, a glob matching nothing, a file of no known format are the build's own line, before it starts."""
    for source in cfg.data.mixture or (cfg.data.source,):
        open_corpus(replace(cfg.data, source=source, mixture=None))


def dry_run(cfg: Config, gpus: DetectedGpus, world_size: int, local_ranks: int) -> str:
    """`--dry-run`'s report for the run that would start here, on `gpus` (none: CPU ranks), `local_ranks` of its
    `world_size` ranks on this machine; its data source is checked first, as the run checks it. A config CPU ranks
    would refuse as meant for GPUs is sized for GPUs, the run it is meant for."""
    check_data_source(cfg)
    return dry_run_report(cfg, gpus, world_size, local_ranks, None if gpus.count else needs_gpus(cfg))
