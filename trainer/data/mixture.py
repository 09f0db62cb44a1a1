"""Weighted mixtures of sources (`data.mixture`): which source each training sample comes from, and the record that
names a mixture's caches.

Each source of a mixture is tokenized into a cache of its own, under the key a run of that source alone would use
(`trainer.data.cache`), so adding a source or changing a weight rebuilds nothing. The mixture itself is a small record,
`<cache_dir>/mixtures/<key>.json`: the sources in the order given, their weights and their caches' keys; its key, a
digest of that, is what a checkpoint remembers as its data.

Which source a sample comes from (`Schedule`). Global sample p (`trainer.data.batches`: step s holds samples
[s·G, (s+1)·G)) comes from source `source_at[p mod L]`, a fixed arrangement of a cycle of L = `CYCLE` samples in which
source i holds its quota Q_i ≈ w_i·L (largest remainders, at least one), each source's samples spread evenly (sorted
by their ideal places (j + ½)·L/Q_i). It is source i's sample number (p div L)·Q_i + (its rank within the cycle): a
closed form, so the step alone decides each sample, whatever the number of ranks, a resume or a restart. Over any n
consecutive samples each source's count stays within a few samples of w_i·n (the arrangement never lets one source
fall more than about one sample plus its share of the others' rounding behind), so over 100 steps of 16 samples the
share follows the weight to a fraction of a per cent. Within its source, sample k is window `order_e(k mod W)` of
epoch e = k div W, as for a single source: a source that runs out is repeated in a fresh order, epochs counted per
source.

No torch: the supervisor writes the record when it prepares the data.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer import durable
from trainer.data.digests import digest
from trainer.data.staging import ensure_writable
from trainer.errors import UserError

MIXTURES_DIR = "mixtures"
CYCLE = 1 << 16  # samples per arrangement: quotas within 1/65,536 of the weights, 0.4 MB of tables per rank


@dataclass(frozen=True)
class MixtureSource:
    source: str
    weight: float
    key: str  # its token cache's key


def mixture_key(sources: Sequence[MixtureSource]) -> str:
    return digest([[s.source, s.weight, s.key] for s in sources])


def write_mixture(root: Path, sources: Sequence[MixtureSource]) -> Path:
    """The mixture's record under `root`, written once (atomically); later runs of the same mixture only stat it (so
    a read-only cache folder serves a mixture once its record is there)."""
    key = mixture_key(sources)
    path = root / MIXTURES_DIR / f"{key}.json"
    if not path.is_file():
        ensure_writable(root)
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_json_durably(path, {"key": key, "sources": [vars(s) for s in sources]})
    return path


def read_mixture(path: Path) -> tuple[str, list[MixtureSource]]:
    """The record's key and sources, checked against its digest."""
    try:
        raw: Any = json.loads(path.read_text())
        sources = [MixtureSource(str(s["source"]), float(s["weight"]), str(s["key"])) for s in raw["sources"]]
        key = str(raw["key"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"mixture record {path} is unreadable ({type(e).__name__}: {e}); prepare the data again with "
                        f"prepare_dataset.py") from None
    if not sources or mixture_key(sources) != key:
        raise UserError(f"mixture record {path} does not match its key; prepare the data again with prepare_dataset.py")
    return key, sources


def refuse_unsampled(weights: dict[str, float], cycle: int = CYCLE) -> None:
    """A weight whose share of the cycle rounds to no sample (under half of one) cannot be followed: `quotas` would
    still give its source one sample a cycle, drawn far more often than asked (a weight of 1e-300 as often as one of
    1e-5) yet never within the first half cycle, so a short run trains none of it. Refused, naming the smallest
    weight that rounds to a sample of its own."""
    total = math.fsum(weights.values())
    for name, weight in weights.items():
        if weight / total * cycle < 0.5:
            smallest = rounded_up((total - weight) / (2 * cycle - 1))  # its share is then half a sample
            raise UserError(f"data.mixture weight {weight:g} of {name} is too small: it gets no sample of a cycle of "
                            f"{cycle:,}; give it at least {smallest:g} or leave the source out")


def rounded_up(value: float, digits: int = 3) -> float:
    """`value` (above 0) rounded up to `digits` significant digits: a bound that holds as printed."""
    scale = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return math.ceil(value / scale) * scale


def refuse_repeats(names: Sequence[str], identities: Sequence[dict[str, Any]]) -> None:
    """Two sources of a mixture that are one corpus under two spellings (`a.txt`, `./a.txt`, `x/../a.txt`, a link to
    it) would silently count it twice: refused, naming both. Their identities say so (`trainer.data.corpus`: the
    same files' names and content, the same hub commit)."""
    seen: dict[str, str] = {}
    for name, identity in zip(names, identities):
        first = seen.setdefault(digest(identity), name)
        if first != name:
            raise UserError(f"data.mixture lists {first!r} and {name!r}, which are the same files (or copies of them): "
                            f"the corpus would count twice; list it once, with the two weights added up")


def is_mixture(path: Path) -> bool:
    return path.suffix == ".json" and path.parent.name == MIXTURES_DIR


class Schedule:
    """Which source each global sample comes from and which of that source's samples it is (module docstring)."""

    def __init__(self, weights: Sequence[float], cycle: int = CYCLE) -> None:
        self.cycle = cycle
        self.quota = quotas(weights, cycle)
        ideal = np.concatenate([(np.arange(q) + 0.5) * (cycle / q) for q in self.quota])
        source = np.repeat(np.arange(len(self.quota)), self.quota)
        rank = np.concatenate([np.arange(q) for q in self.quota])
        order = np.lexsort((source, ideal))
        self.source_at = source[order].astype(np.int32)
        self.rank_at = rank[order].astype(np.int64)
        self.places = [np.flatnonzero(self.source_at == i) for i in range(len(self.quota))]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For global sample indices: (their source, their index among that source's samples)."""
        cycles, within = np.divmod(np.asarray(samples, dtype=np.int64), self.cycle)
        source = self.source_at[within]
        return source, cycles * self.quota[source] + self.rank_at[within]

    def counts(self, samples: int) -> np.ndarray:
        """How many of the first `samples` global samples each source gave."""
        cycles, within = divmod(samples, self.cycle)
        return np.array([cycles * q + int(np.searchsorted(p, within)) for q, p in zip(self.quota, self.places)],
                        dtype=np.int64)


def quotas(weights: Sequence[float], cycle: int) -> np.ndarray:
    """Samples per cycle for each weight: proportional, largest remainders, at least one each."""
    share = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * cycle
    quota = np.maximum(np.floor(share).astype(np.int64), 1)
    for i in np.argsort(-(share - np.floor(share)), kind="stable"):
        if quota.sum() >= cycle:
            break
        quota[i] += 1
    while quota.sum() > cycle:  # the minimum of one took samples from the largest
        quota[np.argmax(quota)] -= 1
    return quota
