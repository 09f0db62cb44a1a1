"""What a rank trains on: one token cache, or the caches of a weighted mixture, opened from the path `prepare`
returned (a cache folder, or a mixture's record), with the samplers, banner lines and history entries they need.

A mixture's sources must share one tokenizer (`prepare` encodes them all with the first source's); that is checked
here, where a record written by hand or a cache swapped underneath would otherwise mix two vocabularies silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import Config
from trainer.data.batches import BatchSampler, MixtureSampler
from trainer.data.cache import TokenCache
from trainer.data.mixture import is_mixture, read_mixture
from trainer.errors import UserError


@dataclass
class Part:
    """One source: its name as the config gives it, its weight, its cache."""

    name: str
    weight: float
    cache: TokenCache


@dataclass
class TrainingData:
    key: str  # the cache's key, or the mixture's: what a checkpoint records as its data
    path: Path
    parts: list[Part]
    mixture: bool
    repeated: set[int] = field(default_factory=set)  # the sources whose repetition was announced

    @classmethod
    def open(cls, path: Path) -> "TrainingData":
        path = Path(path)
        if not is_mixture(path):
            cache = TokenCache.open(path)
            return cls(cache.key, path, [Part(cache.manifest["description"]["source"], 1.0, cache)], mixture=False)
        key, sources = read_mixture(path)
        parts = [Part(s.source, s.weight, TokenCache.open(path.parent.parent / s.key)) for s in sources]
        tokenizers = {repr(p.cache.manifest["key_material"]["tokenizer"]) for p in parts}
        if len(tokenizers) > 1:
            raise UserError(f"the caches of mixture {path} were encoded with different tokenizers; prepare the data "
                            f"again with prepare_dataset.py")
        return cls(key, path, parts, mixture=True)

    @property
    def vocab_size(self) -> int:
        return self.parts[0].cache.vocab_size

    @property
    def eos_id(self) -> int:
        return self.parts[0].cache.eos_id

    @property
    def tokenizer_path(self) -> Path:
        return self.parts[0].cache.tokenizer_path

    def sampler(self, cfg: Config, world_size: int, rank: int) -> BatchSampler:
        """The training batches: the cache's, or the mixture's (`MixtureSampler`)."""
        t, d = cfg.training, cfg.data
        args = (d.context_length, t.batch_size, t.grad_accum_nums, world_size, rank, cfg.system.seed,
                self.vocab_size, str(self.path))
        if not self.mixture:
            return BatchSampler(self.parts[0].cache.train, *args)
        return MixtureSampler([p.cache.train for p in self.parts], [p.weight for p in self.parts], *args)

    def val_samplers(self, cfg: Config, world_size: int, rank: int) -> dict[str, BatchSampler]:
        """Per source with a validation split longer than a window: its validation batches (one micro-batch a step).
        Asked for (training.eval_interval), validation would otherwise go without the sources that have none, or
        be off altogether, silently: rank 0 warns, naming them."""
        d = cfg.data
        short = [p for p in self.parts if len(p.cache.val) <= d.context_length + 1]
        if short and rank == 0:
            # trainer.metrics's logger, by its name: the data room sits below metrics
            logging.getLogger("trainer").warning(self.no_validation(cfg, short))
        return {p.name: BatchSampler(p.cache.val, d.context_length, cfg.training.batch_size, 1, world_size, rank,
                                     cfg.system.seed, self.vocab_size, str(p.cache.path))
                for p in self.parts if len(p.cache.val) > d.context_length + 1}

    def no_validation(self, cfg: Config, parts: list[Part]) -> str:
        """Why `parts` are not evaluated, and how to give them a validation split."""
        held = [f"{len(p.cache.val):,} validation tokens" for p in parts]
        what = (", ".join(f"source {p.name} ({n})" for p, n in zip(parts, held)) if self.mixture
                else f"the corpus ({held[0]})")
        them = "it" if len(parts) == 1 else "them"
        off = "validation is off" if len(parts) == len(self.parts) else f"the validation leaves {them} out"
        return (f"training.eval_interval is {cfg.training.eval_interval:,}, but no validation window of "
                f"{cfg.data.context_length + 1:,} tokens fits in {what}: {off}; cut {them} into more documents "
                f"(data.sample_by, for a .txt file) or raise data.val_fraction")

    def val_weight(self, name: str) -> float:
        return next(p.weight for p in self.parts if p.name == name)

    def banner(self, sampler: BatchSampler, steps: int) -> list[str]:
        """Rank 0's dataset lines: the cache, or each source with its weight, tokens and the epochs the run takes."""
        train = sum(len(p.cache.train) for p in self.parts)
        val = sum(len(p.cache.val) for p in self.parts)
        if not isinstance(sampler, MixtureSampler):
            return [f"dataset: cache {self.key} | {train:,} training tokens, {val:,} validation tokens | vocabulary "
                    f"{self.vocab_size:,}"]
        lines = [f"dataset: mixture {self.key} of {len(self.parts)} sources | {train:,} training tokens, {val:,} "
                 f"validation tokens | vocabulary {self.vocab_size:,}"]
        total = sum(p.weight for p in self.parts)
        for part, drawn in zip(self.parts, sampler.tokens_trained(steps)):
            lines.append(f"  source {part.name}: weight {part.weight:g} ({part.weight / total:.1%}) | cache "
                         f"{part.cache.key} | {len(part.cache.train):,} training tokens | {drawn:,} tokens in "
                         f"{steps:,} steps = {drawn / max(1, len(part.cache.train)):.2f} epochs")
        return lines

    def repeats(self, sampler: BatchSampler, steps: int) -> list[str]:
        """A line for each source that, within the first `steps` steps, ran out and began again for the first time."""
        if not isinstance(sampler, MixtureSampler):
            return []
        lines = []
        for i, epochs in enumerate(sampler.epochs(steps)):
            if epochs > 1 and i not in self.repeated:
                self.repeated.add(i)
                part = self.parts[i]
                lines.append(f"source {part.name} ran out after {len(part.cache.train):,} tokens: repeating it "
                             f"(epoch {epochs} of that source by step {steps})")
        return lines

    def history(self, sampler: BatchSampler, steps: int) -> list[dict[str, Any]]:
        """training_history.json's sources: weight, cache, tokens trained and epochs after `steps` steps."""
        if not isinstance(sampler, MixtureSampler):
            return [{"source": self.parts[0].name, "weight": 1.0, "cache_key": self.key,
                     "tokens_trained": steps * sampler.global_batch * sampler.context_length}]
        return [{"source": p.name, "weight": p.weight, "cache_key": p.cache.key, "tokens_trained": drawn,
                 "epochs": drawn / max(1, len(p.cache.train))}
                for p, drawn in zip(self.parts, sampler.tokens_trained(steps))]
