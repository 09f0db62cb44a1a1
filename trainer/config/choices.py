"""What the `auto` settings resolve to on a device type, torch-free: the rank (trainer.model.optim, trainer.model.build,
trainer.model.loss) and the memory estimate (trainer.model.estimate, called by the supervisor) resolve the precision and
the fast path the same way, and the supervisor and a rank started by hand refuse the same configs when
`system.device=auto` finds no GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.config.sizes import human, parameter_count

if TYPE_CHECKING:
    from trainer.config import Config

CPU_MAX_PARAMETERS = 1_000_000_000  # beyond this a CPU run is not training, it is waiting
NCCL_ON_CPU = "system.backend 'nccl' needs CUDA GPUs; use gloo (or auto) on CPUs"
LIGER_ON_CPU = "training.loss liger needs a CUDA GPU (Triton kernels); use chunked or auto on CPUs"

# Logits per chunk of the chunked loss: 128M (512 MiB in fp32), 4,096 tokens of a 32k vocabulary. Small enough to be
# a minor share of a GPU's memory, large enough that each chunk's matmul keeps the GPU busy.
CHUNK_ELEMENTS = 2**27


def traces_modules(cfg: Config) -> bool:
    """NaN localisation or injection hook individual modules: the `auto` choices then keep every module eager and
    called (no compiled graphs, no lm_head skipped by a fused loss)."""
    return cfg.debug.nan_localize or cfg.debug.inject_nan_module is not None


def half_precision(cfg: Config, cuda: bool) -> bool:
    """Whether the step computes in 16 bits (autocast, bf16 or fp16): on CUDA with AMP on and fp32 not asked for. CPU
    ranks always compute in fp32 (CPU autocast is slow and the fp16 scaler is CUDA's)."""
    t = cfg.training
    return cuda and t.use_amp and t.precision != "fp32"


def compile_enabled(cfg: Config, cuda: bool) -> bool:
    """`system.compile`: auto compiles on CUDA only (on CPUs it costs start-up and buys little), and not while NaN
    localisation or injection hooks trace every module (they would be traced into the graphs)."""
    setting = cfg.system.compile
    if setting != "auto":
        return bool(setting)
    return cuda and not traces_modules(cfg)


def auto_loss(cfg: Config, cuda: bool, liger_installed: bool) -> str:
    """`training.loss = auto` for a model whose logits are hidden × lm_head: liger on CUDA when installed, else
    chunked on CUDA; full on CPUs (unchanged CPU runs) and while modules are traced (lm_head must be called)."""
    if not cuda or traces_modules(cfg):
        return "full"
    return "liger" if liger_installed else "chunked"


def needs_gpus(cfg: Config) -> str | None:
    """Why `cfg` should not run on CPU ranks when `system.device=auto` found no GPU (None: it may). A model beyond
    CPU_MAX_PARAMETERS, or bf16 FSDP, is a GPU run: on CPUs it would not train, only fill the host's memory for
    minutes first. `system.device=cpu` is the user saying so on purpose, and is never refused here. What to do instead
    depends on the machine's memory: `trainer.preflight.cpu_refusal` says it."""
    params, t = parameter_count(cfg), cfg.training
    if cfg.system.device == "cpu" or (params <= CPU_MAX_PARAMETERS and not (t.strategy == "fsdp" and
                                                                           t.precision == "bf16")):
        return None
    return (f"preset '{cfg.preset}' ({human(params)} parameters, {t.strategy}, {t.precision}) needs GPUs and none was "
            f"found")


def cpu_rank_refusal(cfg: Config) -> str | None:
    """Why CPU ranks cannot run `cfg` at all (None: they can): settings that only exist on CUDA. The rank refuses them
    when it meets them; the supervisor, knowing its ranks will be CPU ranks, refuses them before the token cache."""
    if cfg.system.backend == "nccl":
        return NCCL_ON_CPU
    if cfg.training.loss == "liger":
        return LIGER_ON_CPU
    return None
