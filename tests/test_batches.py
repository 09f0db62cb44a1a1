"""BatchSampler: shapes, the label shift, disjoint and complete rank shards, exact resume, epoch wrap, pickling."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from trainer.data.batches import BatchSampler, WindowOrder
from trainer.errors import UserError


def samplers(tokens: np.ndarray, world_size: int, **kw: int) -> list[BatchSampler]:
    args = dict(context_length=8, micro_batch_size=2, grad_accum=3, seed=7) | kw
    return [BatchSampler(tokens, world_size=world_size, rank=r, **args) for r in range(world_size)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097])
def test_window_order_is_a_permutation(n: int) -> None:
    order = WindowOrder(n, seed=3, epoch=0)
    assert sorted(order(np.arange(n)).tolist()) == list(range(n))


def test_window_order_depends_on_seed_and_epoch() -> None:
    base = WindowOrder(1000, seed=1, epoch=0)(np.arange(1000))
    assert np.array_equal(base, WindowOrder(1000, seed=1, epoch=0)(np.arange(1000)))
    assert not np.array_equal(base, WindowOrder(1000, seed=2, epoch=0)(np.arange(1000)))
    assert not np.array_equal(base, WindowOrder(1000, seed=1, epoch=1)(np.arange(1000)))
    assert not np.array_equal(base, np.arange(1000))  # actually shuffled


def test_rows_are_windows_plus_the_next_token() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = BatchSampler(tokens, context_length=8, micro_batch_size=4, grad_accum=2, world_size=1, rank=0, seed=0)
    batch = sampler.get(3, 1)
    assert batch.shape == (4, 9) and batch.dtype == np.int64
    for row, window in zip(batch, sampler.windows(3, 1)):
        assert np.array_equal(row, tokens[window * 8: window * 8 + 9])
    inputs, labels = batch[:, :-1], batch[:, 1:]
    assert np.array_equal(inputs[:, 1:], labels[:, :-1])
    assert sampler.windows_per_epoch == (1000 - 1) // 8


def test_rank_shards_are_disjoint_and_complete() -> None:
    # 3 ranks x 3 micro-steps x 2 sequences = 18 windows per step; 180 windows = exactly 10 steps per epoch.
    tokens = np.arange(180 * 8 + 1, dtype=np.uint32)
    shards = samplers(tokens, world_size=3)
    assert shards[0].windows_per_epoch == 180 and shards[0].global_batch == 18
    per_rank = [set() for _ in shards]
    for step in range(10):
        for rank, sampler in enumerate(shards):
            for micro in range(3):
                per_rank[rank].update(sampler.windows(step, micro).tolist())
    assert all(not (a & b) for i, a in enumerate(per_rank) for b in per_rank[i + 1:])
    assert set().union(*per_rank) == set(range(180))


def test_global_batch_does_not_depend_on_how_it_is_split() -> None:
    """4 ranks x 3 micro-steps, 3 x 4 and 1 x 12 (x 2 sequences = 24 per step) read the same windows, and in the same
    order rank by rank, micro-step by micro-step: what a restart on fewer GPUs with the same global batch relies on."""
    tokens = np.arange(500 * 8 + 1, dtype=np.uint32)
    layouts = [samplers(tokens, world_size=ranks, grad_accum=24 // 2 // ranks) for ranks in (4, 3, 1)]
    for step in (0, 5, 62):  # step 62 straddles an epoch's end (500 windows)
        batches = [[w for s in ranks for m in range(s.grad_accum) for w in s.windows(step, m).tolist()]
                   for ranks in layouts]
        assert batches[0] == batches[1] == batches[2]
        assert len(batches[0]) == 24


def test_resume_is_exact() -> None:
    tokens = np.random.default_rng(0).integers(0, 500, 10_000).astype(np.uint16)
    first = BatchSampler(tokens, 16, 4, 2, world_size=2, rank=1, seed=11)
    expected = [first.get(step, micro) for step in range(40) for micro in range(2)]
    resumed = BatchSampler(tokens, 16, 4, 2, world_size=2, rank=1, seed=11)  # a fresh process resuming at step 25
    again = [resumed.get(step, micro) for step in range(25, 40) for micro in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(expected[50:], again))
    other_seed = BatchSampler(tokens, 16, 4, 2, world_size=2, rank=1, seed=12)
    assert not np.array_equal(other_seed.get(0, 0), first.get(0, 0))


def test_epochs_wrap_with_a_new_order() -> None:
    tokens = np.arange(60 * 8 + 1, dtype=np.uint32)  # 60 windows, 18 samples per step: steps straddle epochs
    shards = samplers(tokens, world_size=3)
    window_at = {}  # global sample position -> window, over 10 steps = 180 samples = 3 epochs
    for step in range(10):
        for sampler in shards:
            for micro in range(3):
                window_at.update(zip(sampler.positions(step, micro).tolist(), sampler.windows(step, micro).tolist()))
    assert sorted(window_at) == list(range(180))
    epochs = [[window_at[e * 60 + i] for i in range(60)] for e in range(3)]
    assert all(sorted(e) == list(range(60)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_reads_a_read_only_memmap_without_copying_it(tmp_path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(4096, dtype="<u2").tofile(path)
    tokens = np.memmap(path, dtype="<u2", mode="r")
    batch = BatchSampler(tokens, 32, 2, 1, 1, 0, seed=0).get(0, 0)
    assert batch.dtype == np.int64 and not tokens.flags.writeable


def test_get_step_stacks_the_micro_batches() -> None:
    sampler = BatchSampler(np.arange(5000, dtype=np.uint16), 16, 2, 3, world_size=2, rank=1, seed=4)
    step = sampler.get_step(9)
    assert step.shape == (3, 2, 17) and step.dtype == np.int64
    assert all(np.array_equal(step[m], sampler.get(9, m)) for m in range(3))


def test_pickles_a_memmap_by_its_file_and_anything_else_by_value(tmp_path) -> None:
    """What a DataLoader worker receives: the same batches; a whole memmap is mapped again rather than copied."""
    path = tmp_path / "tokens.bin"
    np.arange(50_000, dtype="<u2").tofile(path)
    mapped = np.memmap(path, dtype="<u2", mode="r")
    at_offset = np.memmap(path, dtype="<u2", mode="r", offset=2000, shape=(20_000,))
    cases = [(mapped, True), (at_offset, True), (mapped[100:], False), (np.array(mapped), False)]
    for tokens, by_file in cases:
        sampler = BatchSampler(tokens, 16, 2, 2, world_size=1, rank=0, seed=3)
        sampler.get(0, 0)  # fills the per-epoch order cache, which is not sent
        data = pickle.dumps(sampler)
        assert (len(data) < 2000) == by_file
        arrived = pickle.loads(data)
        assert isinstance(arrived.tokens, np.memmap) == by_file
        assert not by_file or not arrived.tokens.flags.writeable  # mapped again read-only
        assert all(np.array_equal(arrived.get_step(s), sampler.get_step(s)) for s in (0, 7, 300))


def test_bad_arguments() -> None:
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(UserError, match="fewer than one context window"):
        BatchSampler(tokens, 128, 1, 1, 1, 0, 0)
    with pytest.raises(UserError, match="outside a world"):
        BatchSampler(tokens, 8, 1, 1, 2, 2, 0)
    sampler = BatchSampler(tokens, 8, 1, 2, 1, 0, 0)
    with pytest.raises(UserError, match="out of range"):
        sampler.get(0, 2)
