"""Where the model comes from, checked without torch: a `model.name_or_path` that can be read, and a vocabulary that
covers the tokenizer's. The rank (trainer.model.build) and the supervisor, which runs the same checks before the token
cache is built so that a bad setting costs no build, say the same lines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.config import Config
from trainer.errors import UserError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def pretrained_config(name_or_path: str) -> PretrainedConfig:
    """The architecture of a hub model or local folder (its `config.json`)."""
    from transformers import AutoConfig  # only for a run that names one: transformers takes seconds to import

    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise UserError(f"model.name_or_path '{name_or_path}': cannot read a model config there ({e})") from None


def check_vocabulary(model_vocab: int, tokenizer_vocab: int) -> None:
    if model_vocab < tokenizer_vocab:
        raise UserError(
            f"the model's vocabulary ({model_vocab}) is smaller than the tokenizer's ({tokenizer_vocab}); "
            f"use the model's own tokenizer (data.tokenizer) or a larger model.vocab_size"
        )


def check_model_source(cfg: Config) -> None:
    """Before the token cache is built: the model's config can be read, and its vocabulary covers the trained BPE's
    (data.vocab_size, what the build aims for; another tokenizer's size is known once it is loaded, by the rank)."""
    model_vocab = pretrained_config(cfg.model.name_or_path).vocab_size if cfg.model.name_or_path else \
        cfg.model.vocab_size
    if model_vocab is not None and cfg.data.tokenizer == "bpe":
        check_vocabulary(model_vocab, cfg.data.vocab_size)
