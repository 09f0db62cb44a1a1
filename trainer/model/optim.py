"""How a step computes and updates: its precision (the autocast dtype), the optimizer, the learning-rate schedule."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from trainer.config import Config
from trainer.config.choices import half_precision
from trainer.errors import UserError


@dataclass(frozen=True)
class Precision:
    """How the step computes: `dtype` is the autocast (and FSDP gather) dtype, None for plain fp32."""

    name: str  # "bf16" | "fp16" | "fp32"
    dtype: torch.dtype | None

    def autocast(self, device: torch.device) -> Any:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)


def resolve_precision(cfg: Config, device: torch.device) -> Precision:
    """bf16 where the GPU has it, fp16 (with a loss scaler) where not, fp32 on CPUs or when AMP is off."""
    t = cfg.training
    if not half_precision(cfg, device.type == "cuda"):  # the memory estimate asks the same question
        return Precision("fp32", None)
    bf16_ok = torch.cuda.is_bf16_supported()
    if t.precision == "bf16" and not bf16_ok:
        raise UserError(f"training.precision bf16: {torch.cuda.get_device_name(device)} has no bf16 support; "
                        f"use --set training.precision=fp16 (or auto)")
    if t.precision == "bf16" or (t.precision == "auto" and bf16_ok):
        return Precision("bf16", torch.bfloat16)
    return Precision("fp16", torch.float16)


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases).

    The fused kernel exists on CPUs and GPUs and accepts a device-side `found_inf`, which is how the NaN guard skips a
    step without a host synchronisation.
    """
    t = cfg.training
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.beta1, t.beta2), fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to learning_rate · min_lr_ratio at max_steps."""
    t = cfg.training
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps, min_lr_rate=t.min_lr_ratio)
