"""The node's memory copy of the latest state (trainer.checkpoint.memory), in this process on a one-member group: a
snapshot restores the model, the optimizer, the schedule and the RNGs exactly; a copy that is damaged (a byte
changed, its header gone, cut short) or older than the disk's checkpoint is passed over for the disk, in one line;
a rank killed while it writes a snapshot leaves the one before whole; where there is none, nothing is said; `auto`
keeps the cost of a snapshot under 2 % of a step."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rank_support import tiny_config
from trainer.checkpoint import store
from trainer.checkpoint.layout import MEMORY_DIR_ENV, memory_file, memory_step
from trainer.checkpoint.memory import COST_SHARE, EARLY, EARLY_S, TIMED, MemoryCopy
from trainer.config import Config
from trainer.model.build import build_model
from trainer.model.distributed import DistContext, init_distributed, teardown
from trainer.model.optim import build_optimizer, build_scheduler

KEY = "cache-key"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def world(tmp_path: Path, token_cache_dir: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Config, DistContext]]:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPU_RANK"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "shm").mkdir()
    monkeypatch.setenv(MEMORY_DIR_ENV, str(tmp_path / "shm"))
    cfg = tiny_config(tmp_path, token_cache_dir, checkpoint={"memory_interval": 1})
    ctx = init_distributed(cfg)
    torch.set_num_threads(1)
    try:
        yield cfg, ctx
    finally:
        teardown()


def folder() -> Path:
    return Path(os.environ[MEMORY_DIR_ENV])


def trained(cfg: Config, seed: int, steps: int) -> store.TrainState:
    """A model, its AdamW and schedule after `steps` steps on random tokens."""
    torch.manual_seed(seed)
    model = build_model(cfg, 300, 0, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    state = store.TrainState(model, optimizer, build_scheduler(optimizer, cfg))
    for _ in range(steps):
        tokens = torch.randint(0, 300, (2, 9))
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state.scheduler.step()
    return state


def memory(cfg: Config, ctx: DistContext, state: store.TrainState) -> tuple[MemoryCopy, Lines]:
    log, lines = logging.getLogger(f"memory-test-{id(state)}"), Lines()
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    return MemoryCopy(cfg, ctx, state, KEY, log), lines


def meta(cfg: Config, state: store.TrainState, step: int) -> store.CheckpointMeta:
    return store.CheckpointMeta(step=step, format=state.format, cache_key=KEY, world_size=1,
                                data=store.data_position(cfg, 1), model_shapes=store.shape_signature(state.model),
                                config=cfg.to_dict())


def snapshot_of_three_steps(cfg: Config, ctx: DistContext) -> tuple[store.TrainState, torch.Tensor]:
    """A state three steps in, its snapshot taken: (the state, the torch RNG state the snapshot holds)."""
    state = trained(cfg, seed=1, steps=3)
    copy, _ = memory(cfg, ctx, state)
    rng = torch.get_rng_state()
    copy.snapshot(3, meta(cfg, state, 3))
    torch.rand(5)  # the generator moves on after the snapshot
    return state, rng


def test_a_snapshot_restores_the_state_exactly(world: tuple[Config, DistContext]) -> None:
    cfg, ctx = world
    source, rng = snapshot_of_three_steps(cfg, ctx)
    assert memory_step(folder(), 1) == 3  # what the supervisor reads
    target = trained(cfg, seed=2, steps=0)
    copy, lines = memory(cfg, ctx, target)
    restored = copy.restore(disk_step=None)
    assert restored is not None and restored.step == 3 and lines.lines == []
    for (name, a), (_, b) in zip(source.model.state_dict().items(), target.model.state_dict().items()):
        assert torch.equal(a, b), name
    for p, q in zip(source.model.parameters(), target.model.parameters()):
        for key, value in source.optimizer.state[p].items():
            assert torch.equal(value, target.optimizer.state[q][key]), key
    assert target.scheduler.state_dict() == source.scheduler.state_dict()
    assert [g["lr"] for g in target.optimizer.param_groups] == [g["lr"] for g in source.optimizer.param_groups]
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("damage, said", [
    ("byte", "has checksum"),
    ("header", "a header is missing (written once a snapshot is complete"),
    ("cut", "bytes, its header needs"),
])
def test_a_damaged_copy_is_passed_over_for_the_disk(world: tuple[Config, DistContext], damage: str, said: str) -> None:
    cfg, ctx = world
    snapshot_of_three_steps(cfg, ctx)
    data = memory_file(folder(), 0, 0, "bin")  # the first snapshot's copy
    if damage == "byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    elif damage == "header":
        memory_file(folder(), 0, 0, "json").unlink()
    else:
        data.write_bytes(data.read_bytes()[:1000])
    target = trained(cfg, seed=2, steps=0)
    before = [t.clone() for t in target.model.parameters()]
    copy, lines = memory(cfg, ctx, target)
    assert copy.restore(disk_step=None) is None
    [line] = lines.lines
    assert line.startswith(f"the memory copy in {folder()} is not used: ") and said in line, line
    assert line.endswith("; resuming from disk")
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters()))  # nothing loaded


def test_a_copy_older_than_the_disk_checkpoint_is_passed_over(world: tuple[Config, DistContext]) -> None:
    cfg, ctx = world
    snapshot_of_three_steps(cfg, ctx)
    copy, lines = memory(cfg, ctx, trained(cfg, seed=2, steps=0))
    assert copy.restore(disk_step=5) is None
    assert lines.lines == [f"the memory copy in {folder()} is not used: its newest whole copy, of step 3, is older "
                           f"than the checkpoint on disk (step 5); resuming from disk"]


def test_no_copy_is_no_line(world: tuple[Config, DistContext]) -> None:
    cfg, ctx = world
    copy, lines = memory(cfg, ctx, trained(cfg, seed=2, steps=0))
    assert copy.restore(disk_step=None) is None and lines.lines == []


def test_auto_keeps_a_snapshot_under_two_percent_of_a_step(world: tuple[Config, DistContext],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots timed 10 ms each, 100 ms apart (90 ms of step): every 6 steps keeps them under 2 %, decided once ten
    are timed: a millisecond snapshot is not decided on one timing, which a loaded machine can inflate tenfold."""
    cfg, ctx = world
    cfg.checkpoint.memory_interval = "auto"
    copy, lines = memory(cfg, ctx, trained(cfg, seed=1, steps=1))
    for i in range(TIMED + 1):
        assert copy.interval is None
        copy.decide(started=i * 0.1, seconds=0.01)
    assert copy.interval == 6 == -(-0.01 // (COST_SHARE * 0.09))
    assert lines.lines == ["memory snapshots every 6 steps: 10.0 ms each, 11.1% of a 90 ms step "
                           "(checkpoint.memory_interval=auto keeps it under 2%)"]


def test_auto_decides_after_one_timed_snapshot_that_costs_far_more(world: tuple[Config, DistContext]) -> None:
    """The first snapshot allocates (2 s), the second takes 0.5 s of a 5 s step (7 s after the first began), as a
    large state on a GPU would: every 5 steps, decided there, without ten more such snapshots at every step."""
    cfg, ctx = world
    cfg.checkpoint.memory_interval = "auto"
    copy, lines = memory(cfg, ctx, trained(cfg, seed=1, steps=1))
    copy.decide(started=0.0, seconds=2.0)
    copy.decide(started=7.0, seconds=0.5)
    assert copy.interval == 5 == -(-0.5 // (COST_SHARE * 5.0)) and 5 >= EARLY and 0.5 >= EARLY_S
    copy.decide(started=20.0, seconds=9.0)  # not timed any more
    assert copy.interval == 5 and len(copy.timed) == 2
    assert lines.lines == ["memory snapshots every 5 steps: 500.0 ms each, 10.0% of a 5000 ms step "
                           "(checkpoint.memory_interval=auto keeps it under 2%)"]


def test_auto_takes_the_slowest_rank_s_interval_but_decides_early_only_where_every_rank_would(
        world: tuple[Config, DistContext], monkeypatch: pytest.MonkeyPatch) -> None:
    """A second rank (its figures as the gather hands them) whose one timed snapshot asks 5 steps: not decided early,
    since this rank's took 10 ms (a loaded machine can make one look like that); once ten are timed, its 5 steps
    win, and the line says whose figures asked for them."""
    from trainer.checkpoint import memory as memory_module

    cfg, ctx = world
    cfg.checkpoint.memory_interval = "auto"
    monkeypatch.setattr(memory_module, "gather_objects", lambda mine, ctx: [mine, (5, 0.5)])
    copy, lines = memory(cfg, ctx, trained(cfg, seed=1, steps=1))
    for i in range(TIMED + 1):
        assert copy.interval is None
        copy.decide(started=i * 0.1, seconds=0.001)
    assert copy.interval == 5
    assert lines.lines == ["memory snapshots every 5 steps, as rank 1's asks: 1.0 ms each, 1.0% of a 99 ms step "
                           "(checkpoint.memory_interval=auto keeps it under 2%)"]


def test_a_rank_killed_during_a_snapshot_leaves_the_one_before(world: tuple[Config, DistContext]) -> None:
    """Snapshots of steps 3 and 4; the next overwrites step 3's copy and its rank dies half-way (no header, the tensors
    changed): the restore takes step 4, exactly."""
    cfg, ctx = world
    state = trained(cfg, seed=1, steps=3)
    copy, _ = memory(cfg, ctx, state)
    copy.snapshot(3, meta(cfg, state, 3))
    trained_further = trained(cfg, seed=1, steps=4)  # the same run one step on
    for source, target in zip(trained_further.model.parameters(), state.model.parameters()):
        target.data.copy_(source.data)
    copy.snapshot(4, meta(cfg, state, 4))
    memory_file(folder(), 0, 0, "json").unlink()
    data = memory_file(folder(), 0, 0, "bin")
    data.write_bytes(bytes(len(data.read_bytes())))
    target = trained(cfg, seed=2, steps=0)
    restored, lines = memory(cfg, ctx, target)
    assert restored.restore(disk_step=None).step == 4 and lines.lines == []
    assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(), target.model.parameters()))
