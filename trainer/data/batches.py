"""Deterministic training batches read straight from the token memmap: each step's global batch, split among ranks.

The token stream is cut into non-overlapping windows of `context_length` tokens; a sample is a window plus the token
after it (for the label shift), so the inputs cover every token once per epoch. Windows are visited in a pseudo-random
order per epoch, a keyed permutation computed index by index (`WindowOrder`): no permutation array is ever
materialised, so a rank's private memory does not grow with the cache (an explicit permutation of 50 M windows would
cost 400 MB in every rank).

Positions. Optimizer step s consumes global samples [s·G, (s+1)·G), G = world_size · grad_accum · micro_batch_size
(the global batch). Global sample p is window order_{p // W}(p mod W), W windows per epoch: epochs wrap with a fresh
order. So a step's windows, and their order, are a function of the seed, the step and G alone, never of how many ranks
share them: the ranks only split the step's G samples, rank r taking the contiguous slice at r·grad_accum·B and its
micro-step m the B samples at m·B in it (`positions`). Rank by rank, micro-step by micro-step, the slices are the
global batch in order; 4 ranks × accumulation 3 read the same 12 micro-batches as 3 ranks × 4, or one process × 12.
A resumed run continues exactly where it stopped, on another world size too when G stays (`supervisor.gpus.exclusion`).
Skipped batches (`training.skip_batches`, recorded by a loss spike's rollback): loop step s trains on the batch of
step `data_step(s)`, s moved on by every skip recorded at or before it, so the order stays a function of the config.

Reading ahead (`training.num_workers`). `StepLoader` hands the loop one step's micro-batches at a time. With 0 workers
it reads them in the calling thread; with N it runs a torch DataLoader over `StepBatches`, a map-style dataset whose
item i is step start + i, so the workers only move *when* a batch is read, never *which* batch a step gets.
"""

from __future__ import annotations

import atexit
import mmap
import multiprocessing
import multiprocessing.resource_tracker
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from trainer.data.cache import MappedFile
from trainer.data.mixture import Schedule
from trainer.errors import UserError

U64 = np.uint64


def data_step(step: int, skips: dict[str, int] | None) -> int:
    """The step whose batch loop step `step` trains on: `training.skip_batches` maps a loop step to the batches
    skipped from it on."""
    return step + sum(count for start, count in (skips or {}).items() if step >= int(start))


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
                 world_size: int, rank: int, seed: int, vocab_size: int | None = None, origin: str = "") -> None:
        for name, value in (("context_length", context_length), ("micro_batch_size", micro_batch_size),
                            ("grad_accum", grad_accum), ("world_size", world_size)):
            if value < 1:
                raise UserError(f"{name} must be positive, got {value}")
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside a world of {world_size}")
        self.tokens = tokens
        self.mapped = MappedFile.of(tokens)
        self.context_length = context_length
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.vocab_size = vocab_size  # bound checked by `check`; `origin`: the cache the tokens come from
        self.origin = origin
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
        return self.windows_of(self.positions(step, micro_step))

    def windows_of(self, samples: np.ndarray) -> np.ndarray:
        """The windows of samples of this stream, by index (epoch after epoch)."""
        epochs, index = np.divmod(samples, self.windows_per_epoch)
        windows = np.empty_like(samples)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            windows[here] = self.order(int(epoch))(index[here])
        return windows

    def sources_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each global sample: one cache's windows, all from source 0."""
        return np.zeros(len(samples), dtype=np.int64), self.windows_of(samples)

    def order(self, epoch: int) -> WindowOrder:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # keep it tiny
            self._orders[epoch] = WindowOrder(self.windows_per_epoch, self.seed, epoch)
        return self._orders[epoch]

    def get(self, step: int, micro_step: int) -> np.ndarray:
        return self.read(self.windows(step, micro_step))

    def read(self, windows: np.ndarray) -> np.ndarray:
        """The samples of these windows: int64 [len(windows), context_length + 1], from a file checked first."""
        self.check_files()
        starts = windows * self.context_length
        return np.asarray(self.tokens[starts[:, None] + self._span], dtype=np.int64)

    def check_files(self) -> None:
        """Refuse a token file changed since the run mapped it (`MappedFile`)."""
        if self.mapped is not None:
            self.mapped.check()

    def check(self, batch: np.ndarray) -> None:
        """Refuse ids beyond the vocabulary (a cache damaged after its build) before they index the embedding: one
        vectorised max per batch on the host, in the process that trains on it."""
        if self.vocab_size is not None and len(batch) and int(batch.max()) >= self.vocab_size:
            raise UserError(f"token cache {self.origin} holds id {int(batch.max())}, beyond the vocabulary of "
                            f"{self.vocab_size:,}: it is damaged; check it with prepare_dataset.py --verify and "
                            f"rebuild it with prepare_dataset.py --force")

    def get_step(self, step: int) -> np.ndarray:
        """All of this rank's micro-batches of `step`: int64 [grad_accum, micro_batch_size, context_length + 1]."""
        return np.stack([self.get(step, m) for m in range(self.grad_accum)])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a worker process: a file-backed memmap travels as (file, dtype, offset, length) and is mapped
        again on arrival. Pickled as is, a memmap would be copied whole into the message (gigabytes for a real
        cache); only an array held in memory, or a slice of a memmap (whose base is the parent array rather than the
        mapping, so its offset is not known), travels by value."""
        state = {k: v for k, v in self.__dict__.items() if k != "_orders"}
        tokens = self.tokens
        if isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap) and tokens.filename:
            state["tokens"] = ("memmap", tokens.filename, tokens.dtype.str, tokens.offset, tokens.shape)
        else:
            state["tokens"] = np.asarray(tokens)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tokens = state["tokens"]
        if isinstance(tokens, tuple):
            _, filename, dtype, offset, shape = tokens
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
        self.__dict__.update(state, _orders={})


class MixtureSampler(BatchSampler):
    """A weighted mixture's batches (`trainer.data.mixture`): the same positions as `BatchSampler` (so the same rank
    split, resume and restart rules), each global sample taken from the source the schedule assigns it, as that
    source's next sample. Each source is a stream of its own, in its own keyed window order per epoch."""

    def __init__(self, streams: Sequence[np.ndarray], weights: Sequence[float], context_length: int,
                 micro_batch_size: int, grad_accum: int, world_size: int, rank: int, seed: int,
                 vocab_size: int | None = None, origin: str = "") -> None:
        super().__init__(streams[0], context_length, micro_batch_size, grad_accum, world_size, rank, seed, vocab_size,
                         origin)
        self.schedule = Schedule(weights)
        # the first source keeps the run's seed; the others theirs, so two equal sources are not read in lockstep
        self.streams = [BatchSampler(tokens, context_length, 1, 1, 1, 0, (seed + i * STREAM_SEED_STEP) % 2**64)
                        for i, tokens in enumerate(streams)]

    def get(self, step: int, micro_step: int) -> np.ndarray:
        source, windows = self.sources_of(self.positions(step, micro_step))
        batch = np.empty((len(source), self.context_length + 1), dtype=np.int64)
        for i in np.unique(source):
            here = source == i
            batch[here] = self.streams[i].read(windows[here])
        return batch

    def sources_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window in that source's stream) of each global sample, as the schedule assigns them."""
        source, index = self.schedule.locate(samples)
        windows = np.empty_like(index)
        for i in np.unique(source):
            here = source == i
            windows[here] = self.streams[i].windows_of(index[here])
        return source, windows

    def check_files(self) -> None:
        for stream in self.streams:
            stream.check_files()

    def epochs(self, steps: int) -> list[int]:
        """Per source, how many times it was begun within the first `steps` steps (1: still in its first pass)."""
        counts = self.schedule.counts(steps * self.global_batch)
        return [-(-int(n) // s.windows_per_epoch) for n, s in zip(counts, self.streams)]

    def tokens_trained(self, steps: int) -> list[int]:
        """Per source, the tokens of the first `steps` steps' inputs that came from it."""
        return [int(n) * self.context_length for n in self.schedule.counts(steps * self.global_batch)]


STREAM_SEED_STEP = 0x9E3779B97F4A7C15  # the golden-ratio increment: well-spread seeds for the sources' orders


# ---------------------------------------------------------------------------------------------------------------------
# Reading ahead in worker processes


class StepBatches(Dataset):
    """Map-style view of one rank's training batches from `start_step`: item i is step start_step + i, as
    `BatchSampler.get_step` returns it (an int64 tensor [grad_accum, B, T + 1]). Whole steps rather than
    micro-batches, so each item reaches the loop in the shape it trains on and is pinned once, by the loader."""

    def __init__(self, sampler: BatchSampler, start_step: int, end_step: int) -> None:
        self.sampler = sampler
        self.start_step = start_step
        self.end_step = end_step

    def __len__(self) -> int:
        return max(0, self.end_step - self.start_step)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"item {index} of {len(self)} (steps {self.start_step}..{self.end_step - 1})")
        return torch.from_numpy(self.sampler.get_step(self.start_step + index))


class StreamIndices(Sampler[int]):
    """Indices 0..count-1 in order, until `stop()`: the stream's sampler. Stopping it lets `StepLoader.close` take the
    batches the workers were already given without handing them new ones."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.stopped = False

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        for index in range(self.count):
            if self.stopped:
                return
            yield index

    def stop(self) -> None:
        self.stopped = True


WORKER_START_METHOD = "spawn"
WORKER_BLOCKED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PREFETCH_STEPS = 2  # per worker


@contextmanager
def signals_blocked(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """Block `signals` in the calling thread for the block's duration; what arrives meanwhile is delivered on exit
    (or to another thread of the process), so nothing is lost. A process started inside inherits the blocked mask,
    through exec too, and keeps it: that is how the workers start immune to SIGINT and SIGTERM from their very
    first instruction, with no window before a handler could be installed."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class StepLoader:
    """The loop's source of batches: `get(step)` → this rank's int64 [grad_accum, B, T + 1] host tensor of `step`.

    `num_workers == 0`: read in the calling thread, exactly as `BatchSampler.get_step` computes it; no thread and no
    process is started.

    `num_workers > 0`: a DataLoader over `StepBatches`, started at the first step asked for (the resume step), each
    worker reading `PREFETCH_STEPS` steps ahead; results arrive in step order and, on a GPU, already pinned (the
    loader's pin thread), so the host-to-device copy stays asynchronous. A step asked for out of order restarts the
    stream at that step, so what `get` returns is a pure function of the step whatever the order of calls.

    Why "spawn". The workers start after the rank has joined its process groups: gloo's and NCCL's threads are
    running, CUDA is initialised, and NCCL may have registered host memory with the network card. A `fork` would
    copy all of that into each worker: a lock held by one of those threads at the instant of the fork stays held
    forever in the child, registered pages may turn copy-on-write under the card, and every descriptor of the rank
    (gloo's sockets, the supervisor's progress pipe) stays open in the workers. "spawn" starts each worker as a
    fresh interpreter that holds none of it, as the rank's own child: in its process group (which the supervisor
    kills), and watched by torch's per-worker watchdog, which ends a worker within seconds of its rank's death
    however the rank died. "forkserver" is as clean and starts a little faster (its server imports torch once),
    but its workers are the server's children and hold the descriptor the server watches for the rank's death:
    after a rank is killed outright, the server and its workers wait on each other forever. Measured by
    bench/bench_dataloader.py (2 workers, 2-core machine): first batch after 0.20 s (fork), 3.0 s (forkserver),
    3.8 s (spawn: the workers import torch); private memory 65, 163, 314 MB; after a SIGKILL of the reader, its
    processes are gone after 5.1 s, never, 6.3 s. The start-up is paid once per run, at its first step.

    When workers pay. Reading a step from a memory-mapped cache that sits in the page cache is cheap (about 1 ms
    for 128 KB, 2.5 ms for 1 MB on that machine), and taking a batch from a worker costs the rank about as much
    (shared memory, a descriptor passed over a socket); so workers help only where reads are slow (a cold cache on
    network storage) and cores are free. 0 stays the default.

    Signals. Workers start with SIGINT and SIGTERM blocked (`signals_blocked`): a Ctrl-C or a SIGTERM sent to
    the whole process group must reach the rank alone, which finishes its step, checkpoints and then stops its
    workers. A worker killed by such a signal would instead make torch raise in the rank at an arbitrary point.
    Because the workers ignore those signals, they must be stopped explicitly: `close()`, which the trainer calls on
    every exit path; an `atexit` hook covers any other user, running before multiprocessing's own exit hook, which
    would send them SIGTERM (ignored) and then wait for them forever.

    Closing mid-stream. A worker's results leave through its queue's feeder thread, which spends part of each send
    in torch's C++ code (moving the batch into shared memory) with the interpreter lock released. A worker told to
    stop while its feeder is still sending exits with that thread inside C++, and Python (up to 3.13) ends such a
    thread at exit with an unwind that C++ turns into an abort ("terminate called without an active exception");
    the rank then raises "DataLoader worker ... killed by signal: Aborted". So `close()` first stops handing out
    steps and takes the batches already given out (at most PREFETCH_STEPS per worker, read already or being read),
    and only then ends the workers, each with its feeder idle. Measured on the 2-core machine (2 workers, 0.5 MB
    steps, closed after 3 steps): without it, 5 of 80 worker exits aborted over 40 closes; with it, none of 120.
    """

    def __init__(self, sampler: BatchSampler, end_step: int, num_workers: int = 0, pin_memory: bool = False,
                 seed: int = 0, start_method: str = WORKER_START_METHOD) -> None:
        if num_workers < 0:
            raise UserError(f"training.num_workers must be 0 or more, got {num_workers}")
        self.sampler = sampler
        self.end_step = end_step
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.start_method = start_method  # only bench/bench_dataloader.py picks another, to compare them
        self.loader: DataLoader | None = None
        self.indices: StreamIndices | None = None
        self.iterator: _MultiProcessingDataLoaderIter | None = None
        self.next_step: int | None = None
        self.stream_end = 0  # the running stream's steps are [next_step, stream_end)

    def get(self, step: int) -> torch.Tensor:
        """This rank's batch of `step`, int64 [grad_accum, B, T + 1] on the host."""
        if self.num_workers == 0:
            batch = torch.from_numpy(self.sampler.get_step(step))
        else:
            if self.iterator is None or step != self.next_step or step >= self.stream_end:
                self.start(step)
            assert self.iterator is not None
            with self.workers_failing():
                batch = next(self.iterator)
            self.next_step = step + 1
        self.sampler.check(batch.numpy())  # a host tensor: numpy's max, no torch op, nothing read back from a device
        return batch

    @contextmanager
    def workers_failing(self) -> Iterator[None]:
        """A worker's failure caused by a token file changed under the run (`MappedFile`) is said as that change."""
        try:
            yield
        except Exception:
            self.sampler.check_files()
            raise

    def start(self, step: int) -> None:
        """(Re)start the workers at `step`; the stream ends at end_step (or serves `step` alone past it)."""
        self.close()
        self.stream_end = max(self.end_step, step + 1)
        self.indices = StreamIndices(self.stream_end - step)
        self.loader = DataLoader(
            StepBatches(self.sampler, step, self.stream_end), batch_size=None, sampler=self.indices,
            num_workers=self.num_workers, prefetch_factor=PREFETCH_STEPS, persistent_workers=True,
            pin_memory=self.pin_memory, multiprocessing_context=multiprocessing.get_context(self.start_method),
            # the workers' seeds come from this generator, not from the training's global torch RNG
            generator=torch.Generator().manual_seed(self.seed))
        atexit.register(self.close)
        # multiprocessing starts its resource tracker on first use and unblocks SIGINT and SIGTERM after doing so,
        # which would undo the mask below: start it first
        multiprocessing.resource_tracker.ensure_running()
        with signals_blocked(WORKER_BLOCKED_SIGNALS):
            self.iterator = iter(self.loader)  # type: ignore[assignment]  # starts the workers (+ the pin thread)
        self.next_step = step

    def close(self) -> None:
        """Take the batches in flight, then stop the workers and wait for them (idempotent; the class docstring says
        why in that order). The iterator's finaliser would stop them too, but only once the last reference goes, and
        a traceback in flight keeps one (its frames hold the iterator) until after the interpreter has started
        exiting; so the shutdown is called here, directly."""
        atexit.unregister(self.close)
        if self.iterator is not None and self.indices is not None:
            self.indices.stop()
            try:
                with self.workers_failing():
                    for _ in self.iterator:  # ends once every step given out has arrived
                        pass
            finally:
                self.iterator._shutdown_workers()  # end marker to each worker, join; the pin thread too
        self.iterator = None
        self.indices = None
        self.loader = None
        self.next_step = None

    def __enter__(self) -> "StepLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
