"""The causal language model: a transformers model built from the config, or started from a hub name / local folder.

The rank trains a stock `transformers` model so that the final checkpoint is an ordinary `save_pretrained` folder
anyone can load with `AutoModelForCausalLM`. Building on the meta device gives exact sizes without allocating weights
(what `--dry-run` and the memory estimate use for an 8B-parameter preset).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from trainer.config import Config
from trainer.config.sizes import model_vocab_size
from trainer.errors import UserError
from trainer.model.source import check_vocabulary, pretrained_config

ATTENTION = "sdpa"  # PyTorch's fused attention: flash / memory-efficient kernels on GPUs, a fused kernel on CPUs
MASKLESS_ATTENTION = "sdpa_causal_no_mask"  # the same kernel, registered under a name no mask builder knows
WEIGHT_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


def llama_config(cfg: Config, vocab_size: int, eos_id: int | None = None) -> LlamaConfig:
    """The transformers config for `model.architecture = llama` (the only architecture built from fields)."""
    m = cfg.model
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        initializer_range=m.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=m.tie_word_embeddings,
        # The trained tokenizer has one special token (end of document); it doubles as BOS and padding for generation.
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=False,  # training never reuses keys/values; generation turns it back on
        attn_implementation=ATTENTION,
    )


def has_weights(folder: Path) -> bool:
    return any(any(folder.glob(pattern)) for pattern in WEIGHT_FILE_PATTERNS)


def model_config(cfg: Config, vocab_size: int | None = None, eos_id: int | None = None) -> PretrainedConfig:
    """The transformers config this run trains: from `model.name_or_path` when set, else from the config's fields."""
    if cfg.model.name_or_path:
        config = pretrained_config(cfg.model.name_or_path)
        config.use_cache = False
        return config
    return llama_config(cfg, cfg.model.vocab_size or vocab_size or model_vocab_size(cfg), eos_id)


def build_model(cfg: Config, vocab_size: int, eos_id: int | None, device: torch.device) -> PreTrainedModel:
    """The model to train, in fp32 on `device` (the optimizer keeps fp32 master weights; autocast does the rest).

    `vocab_size` is the tokenizer's; a model started from a folder must cover it. The caller seeds the RNG first so
    that every rank builds the same initial weights.
    """
    name = cfg.model.name_or_path
    config = model_config(cfg, vocab_size, eos_id)
    check_vocabulary(config.vocab_size, vocab_size)
    if name and (not Path(name).is_dir() or has_weights(Path(name))):
        try:
            model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=torch.float32,
                                                         attn_implementation=ATTENTION)
        except OSError as e:
            if Path(name).is_dir():
                raise UserError(f"model.name_or_path '{name}': cannot load its weights ({e})") from None
            model = None  # a hub repository with only an architecture: start from fresh weights below
        if model is not None:
            model.to(device)
            model.config.use_cache = False
            return model
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
    return model


def use_maskless_causal_attention(model: PreTrainedModel) -> None:
    """Train with SDPA's built-in causal masking and no mask builder.

    transformers builds a mask before every forward and, with no attention mask given, first checks whether the
    position ids describe packed sequences — a device-to-host read that stalls the GPU queue once per micro-batch.
    Training windows are never packed or padded (one causal sequence per row), so the check is pointless: the same
    SDPA function, registered under a name that has no mask builder, gets `attention_mask=None` and uses
    `is_causal=True` (identical outputs, no host read). The name is not written by `save_pretrained`, so a saved
    model loads with plain "sdpa" anywhere.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(MASKLESS_ATTENTION, sdpa_attention_forward)
    model.set_attn_implementation(MASKLESS_ATTENTION)


def enable_gradient_checkpointing(model: PreTrainedModel, policy: str = "full") -> None:
    """Recompute decoder layers in backward instead of keeping their activations.

    `full`: every layer keeps only its input (the least memory, one extra forward). `selective`: every other layer
    (0, 2, 4, …) is recomputed and the rest keep their activations: about half the saving for half the recomputation,
    for a model that almost fits. Layer-granular rather than op-level (saving chosen matmul outputs) so that the memory
    estimate can say exactly what is kept. (transformers 5 renamed the switch; older releases only have
    gradient_checkpointing_enable.)"""
    if policy == "none":
        return
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if policy == "selective":
        for index, layer in enumerate(decoder_layers(model)):
            layer.gradient_checkpointing = index % 2 == 0


def compile_layers(model: torch.nn.Module) -> None:
    """`torch.compile` each decoder layer in place (`nn.Module.compile`), as torchtitan does: one small graph compiled
    once and reused by every layer keeps start-up short, and the module and parameter names do not change (no
    `_orig_mod`), so checkpoints, hooks and `save_pretrained` see the same model. Called before DDP/FSDP wrapping;
    FSDP2's hooks stay outside the graphs (dynamo skips them)."""
    for layer in decoder_layers(model):
        layer.compile()


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def attention_backend(cfg: Config, device: torch.device) -> tuple[str, Callable[[], AbstractContextManager[Any]]]:
    """(the effective `model.attention_backend`, a context factory pinning SDPA to it around forward and backward).

    `auto` lets PyTorch choose (flash, then cuDNN or memory-efficient kernels on GPUs). The named kernels are CUDA
    kernels: a CPU rank asked for one of them uses auto instead (math is kept: it exists everywhere)."""
    want = cfg.model.attention_backend
    if want == "auto" or (device.type != "cuda" and want != "math"):
        return ("auto" if want == "auto" else f"auto ({want} needs CUDA)"), nullcontext
    return want, lambda: sdpa_kernel(SDPA_BACKENDS[want])


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (the unit FSDP shards and gathers one at a time)."""
    base = model  # a causal LM (.model.layers), its base model (.layers), or the loss module around it
    while not hasattr(base, "layers") and isinstance(getattr(base, "model", None), torch.nn.Module):
        base = base.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UserError(f"{type(model).__name__}: no `.model.layers`; sharded training needs a decoder-layer list")
    return list(layers)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def shape_signature(model: torch.nn.Module) -> dict[str, list[int]]:
    """Parameter name → shape, the fingerprint a checkpoint must match to be loaded into this model.

    For a sharded model the global shapes are used, so the signature does not depend on the number of ranks.
    """
    return {name: list(p.shape) for name, p in model.named_parameters()}
