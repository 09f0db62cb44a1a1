"""Size arithmetic from a config alone, no weights allocated: parameters, tokens per step, training FLOPs per token.

Used where torch must not be imported (the presets table, the supervisor's refusal of presets too big for a CPU)
and by the log line's MFU; tests check the parameter count against transformers' own model on the meta device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import Config


def model_vocab_size(cfg: Config) -> int:
    return cfg.model.vocab_size or cfg.data.vocab_size


def parameter_count(cfg: Config) -> int:
    """Parameters of the Llama architecture the config describes (exact for transformers' LlamaForCausalLM)."""
    m = cfg.model
    head_dim = m.hidden_size // m.num_heads
    attention = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * m.num_kv_heads * head_dim
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    layer = attention + mlp + 2 * m.hidden_size
    embeddings = model_vocab_size(cfg) * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_layers * layer + embeddings + m.hidden_size


def tokens_per_step(cfg: Config, world_size: int = 1) -> int:
    t = cfg.training
    return t.batch_size * t.grad_accum_nums * cfg.data.context_length * world_size


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token: 6·N for the matmuls plus the attention scores (PaLM appendix B)."""
    m = cfg.model
    non_embedding = parameter_count(cfg) - model_vocab_size(cfg) * m.hidden_size
    return 6 * non_embedding + 12 * m.num_layers * m.hidden_size * cfg.data.context_length


def human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))
