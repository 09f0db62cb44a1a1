"""Which documents of the corpus a step's batch holds: for each sample, where its window lies in the token cache and
the documents it overlaps (their offsets, and the first characters of each). The replay of a step (`trainer.replay`)
and a loss spike (`trainer.diagnosis.spikes`) say them, so that what the model was reading can be looked at.

A sample is `context_length + 1` tokens of one cache's flat token file (`tokens.bin`), from window ×
`context_length` on (`trainer.data.batches`); the cache's `doc_offsets.npy` holds each document's first token, so the
documents a window overlaps are a binary search away, and a document's first characters are its first tokens decoded
with the cache's own tokenizer. Nothing here is read unless asked for: a run that never replays nor spikes opens no
offsets and no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from trainer.data.batches import BatchSampler
from trainer.data.training_data import TrainingData

PREVIEW_TOKENS = 32  # decoded for a document's first characters
PREVIEW_CHARS = 60


@dataclass(frozen=True)
class Document:
    index: int  # its number in its cache (a row of doc_offsets.npy)
    start: int  # its tokens in the cache's tokens.bin: [start, end)
    end: int
    preview: str  # its first characters

    def describe(self) -> str:
        return f"document {self.index} (tokens {self.start:,}-{self.end:,}) {self.preview!r}"


@dataclass(frozen=True)
class Sample:
    """One sample of a step's global batch: who trains on it, and what it holds."""

    rank: int
    micro_step: int
    row: int  # within the micro-batch
    source: str  # a mixture's source, by its name ("" for a run on one cache)
    start: int  # the sample is tokens [start, start + context_length + 1) of that cache's tokens.bin
    length: int
    documents: list[Document]

    def line(self) -> str:
        source = f"source {self.source} " if self.source else ""
        return (f"rank {self.rank} micro-batch {self.micro_step} row {self.row}: {source}tokens "
                f"{self.start:,}-{self.start + self.length:,} | " + "; ".join(d.describe() for d in self.documents))


class DocumentIndex:
    """The documents of a run's training data, by token offset (one cache, or each source of a mixture)."""

    def __init__(self, data: TrainingData) -> None:
        self.data = data
        self.offsets = [np.asarray(part.cache.doc_offsets) for part in data.parts]
        self.tokenizer = Tokenizer.from_file(str(data.tokenizer_path))

    def step(self, sampler: BatchSampler, step: int, rank: int | None = None) -> list[Sample]:
        """The samples of `step`'s global batch (`rank`: that rank's share alone), in the order the ranks and their
        micro-steps read them."""
        per_rank = sampler.grad_accum * sampler.micro_batch_size
        first = step * sampler.global_batch
        samples = first + np.arange(sampler.global_batch, dtype=np.int64)
        if rank is not None:
            samples = samples[rank * per_rank:(rank + 1) * per_rank]
        sources, windows = sampler.sources_of(samples)
        length = sampler.context_length + 1
        out = []
        for sample, source, window in zip(samples.tolist(), sources.tolist(), windows.tolist()):
            at = sample - first
            start = window * sampler.context_length
            out.append(Sample(rank=at // per_rank, micro_step=at % per_rank // sampler.micro_batch_size,
                              row=at % sampler.micro_batch_size,
                              source=self.data.parts[source].name if self.data.mixture else "", start=start,
                              length=length, documents=self.overlapping(source, start, start + length)))
        return out

    def overlapping(self, source: int, start: int, end: int) -> list[Document]:
        """The documents of source `source` that hold some of tokens [start, end)."""
        offsets = self.offsets[source]
        first = max(0, int(np.searchsorted(offsets, start, side="right")) - 1)
        last = int(np.searchsorted(offsets, end, side="left"))  # documents first..last-1 begin before `end`
        tokens = self.data.parts[source].cache.train
        found = []
        for index in range(first, min(last, len(offsets) - 1)):
            begin, stop = int(offsets[index]), int(offsets[index + 1])
            ids = np.asarray(tokens[begin:min(stop, begin + PREVIEW_TOKENS)]).tolist()
            found.append(Document(index, begin, stop, self.tokenizer.decode(ids)[:PREVIEW_CHARS]))
        return found
