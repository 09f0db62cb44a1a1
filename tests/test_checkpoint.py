"""Checkpoints: exact round trips, atomicity under SIGKILL, retention, resume lookup, and refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rank_support import PYTHON, ROOT, base_env, kill_on_exit, tiny_config
from trainer import durable
from trainer.checkpoint import layout, store
from trainer.checkpoint.store import CheckpointMeta, TrainState
from trainer.config import Config
from trainer.errors import UserError
from trainer.model.build import build_model, shape_signature
from trainer.model.distributed import DistContext, init_distributed, teardown
from trainer.model.loss import full_loss
from trainer.model.optim import build_optimizer, build_scheduler

CPU = torch.device("cpu")
KEY = "0123456789abcdef0123456789abcdef"


def make_cfg(folder: Path, **model: object) -> Config:
    return tiny_config(folder, folder / "cache", model=dict(model), training={"max_steps": 20, "warmup_steps": 2})


def make_state(cfg: Config) -> TrainState:
    torch.manual_seed(0)
    model = build_model(cfg, 300, 0, CPU)
    optimizer = build_optimizer(model, cfg)
    return TrainState(model, optimizer, build_scheduler(optimizer, cfg))


def train_once(state: TrainState, seed: int) -> None:
    batch = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(seed))
    full_loss(state.model, batch).backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)


def make_meta(state: TrainState, step: int, key: str = KEY) -> CheckpointMeta:
    return CheckpointMeta(step=step, format=state.format, cache_key=key, world_size=1, data={},
                          model_shapes=shape_signature(state.model), config={})


def snapshot(state: TrainState) -> dict[str, torch.Tensor]:
    tensors = {f"model.{k}": v.clone() for k, v in state.model.state_dict().items()}
    for i, s in state.optimizer.state_dict()["state"].items():
        tensors.update({f"optim.{i}.{k}": v.clone() for k, v in s.items()})
    return tensors


@pytest.fixture
def ctx(tmp_path: Path, one_thread: None) -> Iterator[DistContext]:
    """A one-member gloo group in this process (what a single-process run uses)."""
    context = init_distributed(make_cfg(tmp_path))
    yield context
    teardown()


@pytest.mark.parametrize("name", ["step_000003", "nan_grad_step_3.pt"])
def test_round_trip_is_exact(tmp_path: Path, ctx: DistContext, name: str) -> None:
    cfg = make_cfg(tmp_path)
    state = make_state(cfg)
    for seed in range(3):
        train_once(state, seed)
    path = store.save(tmp_path / "ckpt" / name, state, make_meta(state, 3), ctx)
    assert path.is_file() == name.endswith(".pt")
    saved, lr, after_save = snapshot(state), state.scheduler.get_last_lr(), torch.rand(3)

    restored = make_state(cfg)  # a fresh process's view: new weights, empty optimizer
    meta = store.load(path, restored, ctx, KEY)
    assert meta.step == 3
    assert snapshot(restored).keys() == saved.keys()
    assert all(torch.equal(restored_value, saved[k]) for k, restored_value in snapshot(restored).items())
    assert restored.scheduler.get_last_lr() == lr and restored.scheduler.last_epoch == 3
    assert torch.equal(torch.rand(3), after_save)  # RNG state restored too
    train_once(state, 9)
    train_once(restored, 9)
    assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(), restored.model.parameters()))


def test_a_pt_checkpoint_has_its_record_beside_it_and_damage_is_named(tmp_path: Path, ctx: DistContext) -> None:
    """The NaN guard's one-file checkpoint records its size and checksum in nan_grad_step_<n>.pt.json: flipped
    bytes are found by the ranks' checksums, a file cut short before any rank starts, each naming the record."""
    state = make_state(make_cfg(tmp_path))
    path = store.save(tmp_path / "ckpt" / "nan_grad_step_3.pt", state, make_meta(state, 3), ctx)
    record = json.loads(layout.record_path(path).read_text())
    assert record == layout.file_record(path) and sorted(p.name for p in path.parent.iterdir()) == \
        ["nan_grad_step_3.pt", "nan_grad_step_3.pt.json"]
    checked = store.verify(path, ctx)
    assert (checked.problem, checked.files, checked.bytes) == (None, 1, record["bytes"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert layout.damage(path) is None  # the same size: the zip's structure is intact
    said = (f"{path} has checksum {layout.file_record(path)[layout.CHECKSUM]}, nan_grad_step_3.pt.json recorded "
            f"{record[layout.CHECKSUM]}")
    assert store.verify(path, ctx).problem == said and layout.checksum_damage(path) == said
    path.write_bytes(bytes(data[:-10]))
    assert layout.damage(path) in (f"{path} is not a torch.save archive, or one cut short (File is not a zip file)",
                                   f"{path} is {len(data) - 10:,} bytes, nan_grad_step_3.pt.json recorded "
                                   f"{len(data):,}")
    layout.record_path(path).write_text("{")
    path.write_bytes(bytes(data))
    assert layout.damage(path) == f"{layout.record_path(path)} is not a record of nan_grad_step_3.pt this version reads"


@pytest.mark.parametrize("name", ["step_000003", "nan_grad_step_3.pt"])
def test_a_checkpoint_from_before_split_saves_still_loads(tmp_path: Path, ctx: DistContext, name: str) -> None:
    """A checkpoint written before a full-format save could be split (see trainer.checkpoint.store) has no `split`
    in its meta and everything in state.pt: it looks whole and loads exactly. One whose meta says split but that has
    no finished dcp/ does not look whole."""
    cfg = make_cfg(tmp_path)
    state = make_state(cfg)
    train_once(state, 0)
    path = store.save(tmp_path / "ckpt" / name, state, make_meta(state, 3), ctx)
    payload_file = path if path.is_file() else path / store.STATE_FILE
    content = store.load_payload(payload_file)
    del content["meta"]["split"]
    torch.save(content, payload_file)
    if path.is_dir():
        meta = json.loads((path / layout.META_FILE).read_text())
        del meta["split"], meta["files"]  # written before both: no record of its files either
        (path / layout.META_FILE).write_text(json.dumps(meta))
    else:
        layout.record_path(path).unlink()
    assert layout.damage(path) is None
    restored = make_state(cfg)
    assert not store.load(path, restored, ctx, KEY).split
    saved = snapshot(state)
    assert all(torch.equal(value, saved[k]) for k, value in snapshot(restored).items())
    if path.is_dir():
        (path / layout.META_FILE).write_text(json.dumps({**meta, "split": True}))
        assert layout.damage(path) == f"{path / layout.DCP_DIR} has no .metadata (the save of its shards did not " \
                                      f"finish)"


def test_retention_and_resume_lookup(tmp_path: Path, ctx: DistContext) -> None:
    cfg = make_cfg(tmp_path)
    root = Path(cfg.checkpoint.dir)
    assert layout.find_resume(cfg) is None
    cfg.checkpoint.resume = "auto"
    assert layout.find_resume(cfg) is None  # nothing yet: a fresh start
    state = make_state(cfg)
    (root / ".tmp-step_000009").mkdir(parents=True)  # what a killed save leaves
    for step in (1, 2, 3):
        store.save(layout.step_path(root, step), state, make_meta(state, step), ctx)
        store.prune(root, keep=2)
    assert [p.name for p in layout.list_checkpoints(root)] == ["step_000002", "step_000003"]
    assert not list(root.glob(".tmp-*"))
    assert layout.find_resume(cfg) == root / "step_000003"
    cfg.checkpoint.resume = str(root)  # a folder of checkpoints: its latest
    assert layout.find_resume(cfg) == root / "step_000003"
    cfg.checkpoint.resume = str(root / "step_000002")
    assert layout.find_resume(cfg) == root / "step_000002"
    cfg.checkpoint.resume = str(tmp_path / "nowhere")
    with pytest.raises(UserError, match="nowhere: no such file or folder"):
        layout.find_resume(cfg)
    (tmp_path / "empty").mkdir()
    cfg.checkpoint.resume = str(tmp_path / "empty")
    with pytest.raises(UserError, match="empty: no checkpoint there"):
        layout.find_resume(cfg)


def test_a_damaged_checkpoint_is_passed_over_by_auto_and_refused_by_path(tmp_path: Path, ctx: DistContext) -> None:
    """What the atomic save cannot rule out (a disk fault, a copy cut short, a hand edit): `--resume auto` passes over
    a damaged latest checkpoint for the newest intact one and says so; a damaged one named by path is refused, naming
    the intact one beside it; one that is not a checkpoint at all is refused."""
    cfg = make_cfg(tmp_path)
    root = Path(cfg.checkpoint.dir)
    state = make_state(cfg)
    for step in (1, 2, 3):
        store.save(layout.step_path(root, step), state, make_meta(state, step), ctx)
    cut = layout.step_path(root, 3) / store.STATE_FILE
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    (layout.step_path(root, 2) / layout.META_FILE).write_text('{"step": 2, "form')
    cfg.checkpoint.resume = "auto"
    notes: list[str] = []
    assert layout.find_resume(cfg, notes) == layout.step_path(root, 1)
    assert [n.split(" (")[0] for n in notes] == [
        f"--resume: {cut} is not a torch.save archive, or one cut short",
        f"--resume: {layout.step_path(root, 2) / layout.META_FILE} is not readable JSON"]
    assert all(n.endswith(f"resuming from {root / 'step_000001'}, the newest intact checkpoint") for n in notes)
    cfg.checkpoint.resume = str(layout.step_path(root, 3))
    with pytest.raises(UserError) as refused:
        layout.find_resume(cfg)
    assert str(refused.value).startswith(f"--resume {cfg.checkpoint.resume} cannot be resumed: {cut} is not a "
                                         f"torch.save archive, or one cut short")
    assert str(refused.value).endswith(f"; the newest intact checkpoint beside it is {root / 'step_000001'}: "
                                       f"--resume {root / 'step_000001'}")
    (layout.step_path(root, 1) / store.STATE_FILE).write_bytes(b"")
    cfg.checkpoint.resume = "auto"
    with pytest.raises(UserError, match=f"every checkpoint in {root} is damaged \\(3; the latest: {cut} is not"):
        layout.find_resume(cfg)
    for name, content, problem in (("passwd", b"root:x:0:0:root:/root:/bin/bash\n", "is not a torch.save archive"),
                                   ("empty.pt", b"", "is empty")):
        (tmp_path / name).write_bytes(content)
        cfg.checkpoint.resume = str(tmp_path / name)
        with pytest.raises(UserError, match=f"cannot be resumed: {tmp_path / name} {problem}"):
            layout.find_resume(cfg)


def test_a_fresh_start_supersedes_a_finished_run_and_refuses_an_unfinished_one(tmp_path: Path,
                                                                               ctx: DistContext) -> None:
    """layout.earlier_run: what a run without --resume makes of the checkpoints already in its folder."""
    cfg = make_cfg(tmp_path)  # a 20-step run
    root = Path(cfg.checkpoint.dir)
    assert layout.earlier_run(cfg) == []
    state = make_state(cfg)

    def save(step: int) -> None:  # with the run's config in meta.json, as the trainer writes it
        store.save(layout.step_path(root, step), state,
                        replace(make_meta(state, step), config=cfg.to_dict()), ctx)

    save(3)
    with pytest.raises(UserError, match=r"holds an unfinished run \(up to step_000003 of 20 steps\); continue it with "
                                        r"--resume auto, or start a new run elsewhere with --set checkpoint.dir=DIR"):
        layout.earlier_run(cfg)
    cfg.checkpoint.resume = "auto"  # continuing it is what the user asked: nothing to supersede
    assert layout.earlier_run(cfg) == []
    cfg.checkpoint.resume = None
    save(20)
    assert layout.earlier_run(cfg) == [root / "step_000003", root / "step_000020"]
    (root / "step_000020" / layout.META_FILE).write_text("{")  # unreadable: the safe side
    with pytest.raises(UserError, match=r"holds an unfinished run \(up to step_000020 steps\)"):
        layout.earlier_run(cfg)


def test_a_folder_is_checked_writable_without_leaving_it_behind(tmp_path: Path) -> None:
    """durable.check_writable: what the supervisor and a rank by hand ask of checkpoint.dir and the log folder before
    any work; a run that cannot start must not leave the folders it checked."""
    durable.check_writable(tmp_path / "a" / "b", "the checkpoint folder", "fix it")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    durable.check_writable(tmp_path / "kept", "the checkpoint folder", "fix it")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []
    (tmp_path / "a-file").write_text("in the way")
    with pytest.raises(UserError, match=r"^the log folder .*a-file/logs is not writable \(Not a directory\); fix it$"):
        durable.check_writable(tmp_path / "a-file" / "logs", "the log folder", "fix it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "kept"]


def test_refuses_another_dataset_model_shape_or_format(tmp_path: Path, ctx: DistContext) -> None:
    cfg = make_cfg(tmp_path)
    state = make_state(cfg)
    path = store.save(tmp_path / "ckpt" / "step_000001", state, make_meta(state, 1), ctx)
    with pytest.raises(UserError, match=f"trained on dataset cache {KEY}, but this run uses other"):
        store.load(path, make_state(cfg), ctx, "other")
    wider = make_state(make_cfg(tmp_path, hidden_size=64))
    with pytest.raises(UserError, match=r"different model shape: model.embed_tokens.weight is \[300, 32\] there "
                                        r"and \[300, 64\] here"):
        store.load(path, wider, ctx, KEY)
    meta = json.loads((path / layout.META_FILE).read_text())
    (path / layout.META_FILE).write_text(json.dumps({**meta, "format": "sharded"}))
    with pytest.raises(UserError, match="training.strategy=fsdp"):
        store.load(path, make_state(cfg), ctx, KEY)


def test_meta_json_refuses_before_any_rank_builds_its_model(tmp_path: Path) -> None:
    """layout.check_meta, what the supervisor and a rank by hand ask before torch: other data, another
    shape and the other strategy's format are refused from meta.json alone; keys that do not change a shape, a vocabulary given as the tokenizer's
    own size, and a .pt file (its meta is among its tensors) are not."""
    cfg = make_cfg(tmp_path)
    path = tmp_path / "step_000001"
    path.mkdir()
    meta = {"cache_key": KEY, "format": layout.FULL, "config": cfg.to_dict()}
    (path / layout.META_FILE).write_text(json.dumps(meta))
    layout.check_meta(path, cfg, KEY, 300)
    with pytest.raises(UserError, match=f"trained on dataset cache {KEY}, but this run uses other"):
        layout.check_meta(path, cfg, "other", 300)
    wider = make_cfg(tmp_path, hidden_size=64, num_layers=2)
    with pytest.raises(UserError) as refused:
        layout.check_meta(path, wider, KEY, 300)
    assert str(refused.value) == (f"checkpoint {path} holds a different model shape: model.hidden_size is 32 there "
                                  f"and 64 here, model.num_layers is 1 there and 2 here; resume with the same model "
                                  f"settings, or start fresh without --resume")
    same_shape = make_cfg(tmp_path, init_std=0.05, rope_theta=500000.0, gradient_checkpointing="full",
                          vocab_size=300)
    layout.check_meta(path, same_shape, KEY, 300)
    with pytest.raises(UserError, match="a vocabulary of 300 there and 512 here"):
        layout.check_meta(path, make_cfg(tmp_path, vocab_size=512), KEY, 300)
    from_hub = make_cfg(tmp_path, name_or_path="someone/llama", hidden_size=64)
    with pytest.raises(UserError, match="shape: model.name_or_path is None there and someone/llama here; resume"):
        layout.check_meta(path, from_hub, KEY, 300)  # its shape is the hub's: hidden_size is not compared
    sharded = make_cfg(tmp_path)
    sharded.training.strategy = "fsdp"
    with pytest.raises(UserError, match="written in the full format; resume it with --set training.strategy=ddp"):
        layout.check_meta(path, sharded, KEY, 300)
    (tmp_path / "nan_grad_step_3.pt").write_bytes(b"not read")
    layout.check_meta(tmp_path / "nan_grad_step_3.pt", wider, "other", 300)


def save_then_stall(folder: str) -> None:
    """Child process: save step 1 completely, then stall inside the save of step 2 (before its rename) and wait
    for the parent's SIGKILL."""
    cfg = make_cfg(Path(folder))
    context = init_distributed(cfg)
    state = make_state(cfg)
    root = Path(cfg.checkpoint.dir)
    train_once(state, 0)
    store.save(layout.step_path(root, 1), state, make_meta(state, 1), context)
    train_once(state, 1)

    def stall(path: Path) -> None:
        (Path(folder) / "saving").write_text(str(path))
        time.sleep(120)

    durable.fsync_tree = stall  # publish() flushes before it renames: stall there
    store.save(layout.step_path(root, 2), state, make_meta(state, 2), context)


def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path, ctx: DistContext) -> None:
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_checkpoint as t; " \
           f"t.save_then_stall({str(tmp_path)!r})"
    child = subprocess.Popen([PYTHON, "-c", code], env=base_env(), stderr=subprocess.PIPE, text=True)
    with kill_on_exit(child):
        deadline = time.monotonic() + 90
        while not (tmp_path / "saving").exists():
            assert child.poll() is None, child.stderr.read() if child.stderr else ""
            assert time.monotonic() < deadline, "the child never reached the save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    root = tmp_path / "ckpt"
    assert (root / ".tmp-step_000002" / store.STATE_FILE).is_file()  # the interrupted save, never published
    assert not (root / "step_000002").exists()
    assert layout.latest_checkpoint(root) == root / "step_000001"
    cfg = make_cfg(tmp_path)
    expected = make_state(cfg)
    train_once(expected, 0)
    restored = make_state(cfg)
    assert store.load(root / "step_000001", restored, ctx, KEY).step == 1
    assert all(torch.equal(a, b) for a, b in zip(expected.model.parameters(), restored.model.parameters()))
    store.save(layout.step_path(root, 2), restored, make_meta(restored, 2), ctx)  # the next save cleans up
    assert not list(root.glob(".tmp-*")) and layout.latest_checkpoint(root) == root / "step_000002"
