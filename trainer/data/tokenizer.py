"""Tokenizers for the token cache: a byte-level BPE trained on the source itself, or any AutoTokenizer name or path.

Whatever its origin, a tokenizer reaches the cache as a folder holding `tokenizer.json` (the `tokenizers` format:
encoded in parallel in Rust, loadable with `PreTrainedTokenizerFast(tokenizer_file=...)`) and `tokenizer_config.json`
(so `AutoTokenizer.from_pretrained(folder)` works too). Its place in the cache key is a digest of those files'
content: a changed tokenizer can never reuse a stale cache.

This module only trains, locates, loads and exports; caching the trained BPE (lock, temporary folder, rename) is the
cache's job. `tokenizers` and `transformers` are imported inside functions: the cache-hit path needs neither.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import DataConfig
from trainer.data.corpus import HUB_ID, HUB_TIMEOUT_S, first_line
from trainer.data.digests import fingerprint
from trainer.errors import UserError

BPE = "bpe"
BPE_FORMAT_VERSION = 1  # bump when the training recipe below changes
EOS_TOKEN = "<|endoftext|>"
KNOWN_EOS_TOKENS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
MAX_VOCAB = 2**32  # ids are stored as uint32 at most
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The files that define a tokenizer (hashed for its identity, downloaded for a hub name). Model weights are not.
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer ready for the build: the folder with its files and what it contributes to the cache key."""

    folder: Path
    identity: dict[str, Any]  # key material: kind + content digest
    eos_token: str
    description: str  # for humans: "bpe 8,192" or the name given
    train_seconds: float = 0.0  # for a trained BPE: how long training took (reported apart from tokenizing)


def check_vocab_size(size: int, origin: str) -> None:
    if size > MAX_VOCAB:
        raise UserError(f"{origin}: a vocabulary of {size:,} tokens does not fit 32-bit token ids "
                        f"(at most {MAX_VOCAB:,}); use a smaller vocabulary")


# ---------------------------------------------------------------------------------------------------------------------
# The trained byte-level BPE


def bpe_recipe(data: DataConfig, source_identity: dict[str, Any]) -> dict[str, Any]:
    """What the trained BPE depends on: the documents it sees and its size. The cache stores it under this recipe."""
    check_vocab_size(data.vocab_size, "data.vocab_size")
    return {"kind": BPE, "version": BPE_FORMAT_VERSION, "source": source_identity, "vocab_size": data.vocab_size,
            "max_samples": data.max_samples, "val_fraction": data.val_fraction, "eos": EOS_TOKEN}


def train_bpe(documents: Iterable[str], vocab_size: int, folder: Path, length: int | None = None) -> None:
    """Train a byte-level BPE (every byte in the alphabet, so nothing is ever unknown) and save it into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer, length=length)
    tokenizer.save(str(folder / TOKENIZER_JSON))
    write_tokenizer_config(folder, EOS_TOKEN)


def write_tokenizer_config(folder: Path, eos_token: str) -> None:
    """What AutoTokenizer needs beside tokenizer.json to load the folder as a PreTrainedTokenizerFast."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": None,
              "unk_token": None, "pad_token": None, "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------------
# Pretrained tokenizers: a local folder (or its tokenizer.json) or a hub name


def locate_pretrained(name: str) -> Path:
    """The local folder holding the tokenizer's files; a hub name is fetched into (or found in) the hub's cache."""
    path = Path(name).expanduser()
    if path.is_file():
        path = path.parent
    if path.is_dir():
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise UserError(f"data.tokenizer folder {name} holds no tokenizer files ({TOKENIZER_JSON}, "
                            f"{TOKENIZER_CONFIG}, vocab files); point it at a tokenizer folder or use 'bpe'")
        return path
    if HUB_ID.fullmatch(name) is None or name.startswith((".", "/", "~")):
        raise UserError(f"data.tokenizer {name} does not exist; give 'bpe', a tokenizer folder or a hub name")
    from huggingface_hub import snapshot_download

    try:  # config.json too: AutoTokenizer reads the model type from it when converting a slow tokenizer
        return Path(snapshot_download(name, allow_patterns=[*TOKENIZER_FILES, "config.json"],
                                      etag_timeout=HUB_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001 - unknown repo, offline, unreachable: the same fix for the user
        raise UserError(f"unknown tokenizer '{name}': not 'bpe', not a local folder, and not found on the Hugging Face "
                        f"hub ({first_line(e)}); use 'bpe' or a local tokenizer folder") from None


def tokenizer_files(folder: Path) -> list[Path]:
    return [folder / f for f in sorted(TOKENIZER_FILES) if (folder / f).is_file()]


def tokenizer_digest(folder: Path) -> str:
    """Content digest of the files that define the tokenizer in `folder`."""
    return fingerprint(tokenizer_files(folder), folder)


def eos_token_of(folder: Path) -> str:
    """The end-of-document token: the tokenizer's declared eos_token, else a well-known one it contains."""
    for name in (TOKENIZER_CONFIG, "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            token = json.loads(path.read_text()).get("eos_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and token:
                return token
    if (folder / TOKENIZER_JSON).is_file():
        added = {t.get("content") for t in json.loads((folder / TOKENIZER_JSON).read_text()).get("added_tokens", [])}
        for token in KNOWN_EOS_TOKENS:
            if token in added:
                return token
    raise UserError(f"tokenizer in {folder} declares no eos_token to separate documents; add \"eos_token\" to its "
                    f"{TOKENIZER_CONFIG} or use data.tokenizer 'bpe'")


# ---------------------------------------------------------------------------------------------------------------------
# Loading and exporting for the build


def load_fast(folder: Path) -> Any:
    """A `tokenizers.Tokenizer`: from tokenizer.json directly, or converted by transformers from slow-tokenizer files."""
    from tokenizers import Tokenizer

    if (folder / TOKENIZER_JSON).is_file():
        return Tokenizer.from_file(str(folder / TOKENIZER_JSON))
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - a folder transformers cannot read
        raise UserError(f"cannot load the tokenizer in {folder} ({first_line(e)}); use a folder with "
                        f"{TOKENIZER_JSON} or data.tokenizer 'bpe'") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"the tokenizer in {folder} has no fast (Rust) version; convert it to {TOKENIZER_JSON} first")
    return backend


def eos_id_of(tokenizer: Any, eos_token: str, folder: Path) -> int:
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise UserError(f"the tokenizer in {folder} declares eos_token {eos_token!r} but has no id for it")
    return int(eos_id)


def export(tokenizer: Any, source_folder: Path, destination: Path, eos_token: str) -> None:
    """Write tokenizer.json and a tokenizer_config.json into the cache folder, keeping the source's config if any."""
    tokenizer.save(str(destination / TOKENIZER_JSON))
    for name in (TOKENIZER_CONFIG, "special_tokens_map.json"):
        if (source_folder / name).is_file():
            shutil.copyfile(source_folder / name, destination / name)
    if not (destination / TOKENIZER_CONFIG).is_file():
        write_tokenizer_config(destination, eos_token)
