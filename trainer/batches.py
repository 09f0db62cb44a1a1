"""Deterministic, rank-sharded training batches read straight from the token memmap.

The token stream is cut into non-overlapping windows of `context_length` tokens; a sample is a window plus the token
after it (for the label shift), so the inputs cover every token once per epoch. Windows are visited in a pseudo-random
order per epoch, a keyed permutation computed index by index (`WindowOrder`): no permutation array is ever
materialised, so a rank's private memory does not grow with the cache (an explicit permutation of 50 M windows would
cost 400 MB in every rank).

Positions. Optimizer step s consumes global samples [s·G, (s+1)·G) with G = world_size · grad_accum · micro_batch_size.
Inside a step, rank r owns the contiguous slice starting at r·grad_accum·B, and micro-step m the B samples at m·B in it.
Global sample p is window order_{p // W}(p mod W), W windows per epoch: epochs wrap with a fresh order. Everything is
a pure function of (seed, step, micro_step, rank), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import numpy as np

from trainer.errors import UserError

U64 = np.uint64


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash (the round function below)."""
    x = (x ^ (x >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> U64(27))) * U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


class WindowOrder:
    """A keyed pseudo-random permutation of range(n): a balanced Feistel network on the smallest even power of two
    that holds n, cycle-walked back into range (a value outside range(n) is permuted again until it lands inside).
    Bijective by construction whatever the round function, O(1) memory, vectorised over index arrays."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + bits % 2) // 2
        self.mask = U64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence([seed % 2**63, epoch]).generate_state(self.ROUNDS, dtype=np.uint64)

    def __call__(self, index: np.ndarray) -> np.ndarray:
        x = self.feistel(np.asarray(index, dtype=np.uint64))
        outside = x >= self.n
        while outside.any():
            x[outside] = self.feistel(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)

    def feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> U64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix(right ^ key) & self.mask)
        return (left << U64(self.half)) | right


class BatchSampler:
    """Micro-batches of int64 [micro_batch_size, context_length + 1]: inputs = [:, :-1], labels = [:, 1:]."""

    def __init__(self, tokens: np.ndarray, context_length: int, micro_batch_size: int, grad_accum: int,
                 world_size: int, rank: int, seed: int) -> None:
        for name, value in (("context_length", context_length), ("micro_batch_size", micro_batch_size),
                            ("grad_accum", grad_accum), ("world_size", world_size)):
            if value < 1:
                raise UserError(f"{name} must be positive, got {value}")
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside a world of {world_size}")
        self.tokens = tokens
        self.context_length = context_length
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.windows_per_epoch = (len(tokens) - 1) // context_length
        if self.windows_per_epoch < 1:
            raise UserError(f"{len(tokens):,} tokens are fewer than one context window ({context_length:,} + 1); "
                            f"use a larger corpus or a shorter data.context_length")
        self.global_batch = world_size * grad_accum * micro_batch_size
        self._span = np.arange(context_length + 1)
        self._orders: dict[int, WindowOrder] = {}

    @property
    def steps_per_epoch(self) -> float:
        return self.windows_per_epoch / self.global_batch

    def positions(self, step: int, micro_step: int) -> np.ndarray:
        """Global sample indices of this rank's micro-batch."""
        if step < 0 or not 0 <= micro_step < self.grad_accum:
            raise UserError(f"step {step} / micro-step {micro_step} out of range (grad_accum {self.grad_accum})")
        start = step * self.global_batch + (self.rank * self.grad_accum + micro_step) * self.micro_batch_size
        return start + np.arange(self.micro_batch_size, dtype=np.int64)

    def windows(self, step: int, micro_step: int) -> np.ndarray:
        """Window indices of this rank's micro-batch (a batch may straddle two epochs)."""
        positions = self.positions(step, micro_step)
        epochs, index = np.divmod(positions, self.windows_per_epoch)
        windows = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            windows[here] = self.order(int(epoch))(index[here])
        return windows

    def order(self, epoch: int) -> WindowOrder:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # keep it tiny
            self._orders[epoch] = WindowOrder(self.windows_per_epoch, self.seed, epoch)
        return self._orders[epoch]

    def get(self, step: int, micro_step: int) -> np.ndarray:
        starts = self.windows(step, micro_step) * self.context_length
        return np.asarray(self.tokens[starts[:, None] + self._span], dtype=np.int64)
