"""What the `auto` settings of the fast path resolve to on a device type, torch-free: the rank (trainer.model,
trainer.loss) and the memory estimate (trainer.estimate, called by the supervisor) resolve them the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import Config

# Logits per chunk of the chunked loss: 128M (512 MiB in fp32), 4,096 tokens of a 32k vocabulary. Small enough to be
# a minor share of a GPU's memory, large enough that each chunk's matmul keeps the GPU busy.
CHUNK_ELEMENTS = 2**27


def traces_modules(cfg: Config) -> bool:
    """NaN localisation or injection hook individual modules: the `auto` choices then keep every module eager and
    called (no compiled graphs, no lm_head skipped by a fused loss)."""
    return cfg.debug.nan_localize or cfg.debug.inject_nan_module is not None


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
