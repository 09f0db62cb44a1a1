"""The training objective: next-token cross-entropy, computed without materialising the full logits where possible.

The logits of a 32k vocabulary are the largest activation of a 1B model (16k tokens × 32k × fp32 = 2 GiB, several
copies of it between the upcast, the log-softmax and its gradient). Three ways to compute the same loss:

* `full`: the model's own forward returns the logits, upcast to fp32 for the softmax (what every tutorial does).
* `chunked`: the final hidden states are split into chunks of CHUNK_ELEMENTS // vocabulary tokens; each chunk's
  logits (hidden × lm_head weightᵀ) and fp32 log-softmax are computed under activation checkpointing, so autograd keeps
  only the hidden states and one chunk's logits exist at a time (recomputed in backward: one extra lm_head matmul).
  Pure PyTorch, runs everywhere.
* `liger`: liger-kernel's fused Triton kernel (`LigerFusedLinearCrossEntropyLoss`), which computes the gradients in
  forward chunk by chunk (no recomputation). CUDA only; the optional extra `[liger]`.

`auto` picks liger on CUDA when it is installed, else chunked on CUDA, and full on CPUs (where the logits are small and
the unchanged path keeps CPU runs exactly as they were). NaN localisation and NaN injection trace the model module by
module, lm_head included, so with either of them on `auto` picks full.

Under FSDP2 the root module's weights (embeddings, final norm, lm_head) are gathered only for the root's forward, so
the loss must be computed inside a forward of the wrapped root: `CausalLMLoss` is that root. It holds the transformers
model as `.model`; the checkpoint, the NaN guard, fault injection and `save_pretrained` keep using that inner model
and see the same module and parameter names as before.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.config import Config
from trainer.config.choices import CHUNK_ELEMENTS, LIGER_ON_CPU, auto_loss
from trainer.errors import UserError

LIGER_MODULE = "liger_kernel"


@dataclass(frozen=True)
class LossChoice:
    kind: str  # "full" | "chunked" | "liger"
    note: str | None = None  # why `auto` or a fallback picked it, for the log


def liger_installed() -> bool:
    return importlib.util.find_spec(LIGER_MODULE) is not None


def fusable(model: torch.nn.Module) -> bool:
    """Whether the logits are exactly hidden × lm_head weightᵀ (no bias, no soft-capping, no scaling), which the
    chunked and fused paths compute by hand."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    return (isinstance(head, torch.nn.Linear) and head.bias is None and hasattr(model, "base_model")
            and not getattr(config, "final_logit_softcapping", None) and getattr(config, "logit_scale", None) is None)


def choose_loss(cfg: Config, model: torch.nn.Module, device: torch.device) -> LossChoice:
    """The loss path this rank computes (the same on every rank of a job: ranks share the device type and packages).

    An explicit `liger` without the package on CUDA falls back to chunked with a note (the result is the same loss);
    `liger` on a CPU rank, or `chunked`/`liger` for a model whose logits are not a plain linear map, is an error.
    """
    want = cfg.training.loss
    if want == "full":
        return LossChoice("full")
    if not fusable(model):
        if want == "auto":
            return LossChoice("full", "the model's logits are not a plain linear map")
        raise UserError(f"training.loss {want}: this model's logits are not hidden × lm_head (a bias, soft-capping "
                        f"or scaling); use --set training.loss=full")
    if want == "auto":
        kind = auto_loss(cfg, device.type == "cuda", liger_installed())
        return LossChoice(kind, "NaN localisation or injection traces lm_head" if kind == "full" and
                          device.type == "cuda" else None)
    if want == "liger":
        if device.type != "cuda":
            raise UserError(LIGER_ON_CPU)
        if not liger_installed():
            return LossChoice("chunked", "liger-kernel is not installed (pip install '.[liger]'); using chunked")
    return LossChoice(want)


def full_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1], from the model's own logits (upcast to fp32
    for the softmax)."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk: logits in the compute dtype, the log-softmax in fp32."""
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `hidden` [N, h] × `weight` [V, h]ᵀ against `targets` [N], one checkpointed chunk of
    tokens at a time: the full [N, V] logits never exist, in forward or backward."""
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(hidden.split(chunk), targets.split(chunk)):
        total = total + checkpoint(chunk_loss_sum, h, weight, t, use_reentrant=False)
    return total / targets.numel()


class CausalLMLoss(torch.nn.Module):
    """The module the data-parallel wrapper wraps: forward takes a batch of token windows [B, T+1] and returns the
    mean next-token loss, so the lm_head weight is used inside the root's forward (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kind: str) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        self.fused = None
        if kind == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.fused = LigerFusedLinearCrossEntropyLoss()

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.kind == "full":
            return full_loss(self.model, batch)
        hidden = self.model.base_model(input_ids=batch[:, :-1]).last_hidden_state.flatten(0, 1)
        weight = self.model.get_output_embeddings().weight
        targets = batch[:, 1:].flatten()
        if self.fused is not None:  # the kernel takes both operands in one dtype: the one autocast computes in
            device = hidden.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
            return self.fused(weight.to(dtype), hidden.to(dtype), targets)
        return chunked_cross_entropy(hidden, weight, targets)
