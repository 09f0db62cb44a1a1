"""Checkpoints verified, not trusted: each file's size and checksum recorded by the rank that wrote it and checked
before a resume loads it (sizes before any rank starts, checksums by the ranks); a damaged checkpoint is passed over
for the newest intact one in one line naming the file, or refused in one line where --resume named it, and a load that
fails all the same (a checkpoint written before files were recorded) is passed over alike on every rank. And the
staging buffers of background saves, allocated before the first step without changing it.

In one process where a whole run is not needed; through the supervisor on 2 CPU ranks for what the ranks must agree
on. There the run is trained once (`trained`, a DDP run saving in the background: each rank's share of the state in
`dcp/__<rank>_0.distcp`), and each test damages a copy of its checkpoints and resumes.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_checkpoint import KEY, make_cfg, make_meta, make_state, snapshot, train_once
from test_checkpoint_async import same, supervised
from test_fault_matrix import Outcome, run_supervisor

from rank_scripts.harness import clean_env
from trainer.checkpoint import layout, store
from trainer.checkpoint.background import HostStager
from trainer.checkpoint.manager import Checkpointer
from trainer.config import Config
from trainer.errors import UserError
from trainer.metrics import get_logger
from trainer.model.distributed import DistContext, init_distributed, teardown
from trainer.progress import ProgressReporter

CHECKSUM = r"[0-9a-f]{16}"
SHARD = f"{layout.DCP_DIR}/__0_0.distcp"
DCP_METADATA = f"{layout.DCP_DIR}/{layout.DCP_METADATA}"


@pytest.fixture
def ctx(tmp_path: Path, one_thread: None) -> Iterator[DistContext]:
    context = init_distributed(make_cfg(tmp_path))
    yield context
    teardown()


def overwrite(file: Path, offset: int = 8192, size: int = 4096) -> None:
    """4 KiB inside `file` overwritten in place: the same size, other bytes (a disk's silent fault)."""
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(b"\xa5" * size)


def cut(file: Path) -> None:
    """`truncate -s 50%`: a copy cut short."""
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])


def unrecorded(path: Path) -> None:
    """The checkpoint as one written before files were recorded: no `files` in its meta.json."""
    meta = json.loads((path / layout.META_FILE).read_text())
    del meta["files"]
    (path / layout.META_FILE).write_text(json.dumps(meta))


def split_saves(cfg: Config, state: store.TrainState, ctx: DistContext, steps: int) -> dict[int, dict[str, Any]]:
    """A checkpoint after each of `steps` trained steps, its model and optimizer in dcp/ (a split save, on one rank);
    the state each holds, by step."""
    held = {}
    for step in range(1, steps + 1):
        train_once(state, step)
        meta = replace(make_meta(state, step), split=True, data=store.data_position(cfg, ctx.world_size))
        store.save(layout.step_path(Path(cfg.checkpoint.dir), step), state, meta, ctx)
        held[step] = snapshot(state)
    return held


def test_each_file_is_recorded_and_a_wrong_size_is_found_before_any_rank_starts(tmp_path: Path,
                                                                                 ctx: DistContext) -> None:
    """Every file of the folder is in meta.json with its size and checksum; `layout.damage` (what the supervisor asks
    before any rank starts) finds a file cut short, missing, or a record it cannot read, and leaves bytes changed in
    place (the same size) to the ranks' checksums."""
    cfg = make_cfg(tmp_path)
    state = make_state(cfg)
    split_saves(cfg, state, ctx, 1)
    path = layout.step_path(Path(cfg.checkpoint.dir), 1)
    files = json.loads((path / layout.META_FILE).read_text())["files"]
    assert sorted(files) == [DCP_METADATA, SHARD, store.STATE_FILE]
    assert all(layout.file_record(path / name) == entry for name, entry in files.items())
    assert layout.damage(path) is None
    whole = store.save(tmp_path / "whole" / "step_000001", state, make_meta(state, 1), ctx)  # all in state.pt
    assert list(json.loads((whole / layout.META_FILE).read_text())["files"]) == [store.STATE_FILE]

    def damaged(name: str, act: Callable[[Path], None]) -> Path:
        copy = tmp_path / name / path.name
        shutil.copytree(path, copy)
        act(copy)
        return copy

    size = files[SHARD]["bytes"]
    copy = damaged("cut", lambda c: cut(c / SHARD))
    assert layout.damage(copy) == f"{copy / SHARD} is {size // 2:,} bytes, meta.json recorded {size:,}"
    copy = damaged("deleted", lambda c: (c / SHARD).unlink())
    assert layout.damage(copy) == f"{copy / SHARD} is missing (meta.json records {size:,} bytes)"
    copy = damaged("metadata-cut", lambda c: cut(c / DCP_METADATA))
    assert layout.damage(copy).startswith(f"{copy / DCP_METADATA} is ")
    copy = damaged("overwritten", lambda c: overwrite(c / SHARD))
    assert layout.damage(copy) is None
    assert re.fullmatch(rf"{re.escape(str(copy / SHARD))} has checksum {CHECKSUM}, meta.json recorded "
                        rf"{files[SHARD]['xxh3_64']}", layout.verify_files(copy, sorted(files), files))

    def outside(c: Path) -> None:
        meta = json.loads((c / layout.META_FILE).read_text())
        (c / layout.META_FILE).write_text(json.dumps({**meta, "files": {"../../etc/passwd": files[SHARD]}}))

    copy = damaged("outside", outside)
    assert layout.damage(copy) == f"{copy / layout.META_FILE} records its files in a form this version does not read"


def test_a_resume_passes_over_damaged_checkpoints_in_one_line_and_refuses_one_named(
        tmp_path: Path, ctx: DistContext, capsys: pytest.CaptureFixture[str]) -> None:
    """`Checkpointer.resume` on one rank: files copied from another checkpoint (the same sizes) are found by their
    checksums and passed over; a checkpoint without a record whose shard is cut short fails DCP's load and is passed
    over too; the one named by --resume is refused, naming the intact one beside it; every one damaged is one line."""
    cfg = make_cfg(tmp_path)
    root = Path(cfg.checkpoint.dir)
    held = split_saves(cfg, make_state(cfg), ctx, 3)
    step = {n: layout.step_path(root, n) for n in held}
    recorded = json.loads((step[3] / layout.META_FILE).read_text())["files"][SHARD]["xxh3_64"]

    def resume(spec: str) -> tuple[int, store.TrainState, str]:
        cfg.checkpoint.resume = spec
        state = make_state(cfg)
        checkpoints = Checkpointer(cfg, ctx, state, SimpleNamespace(key=KEY), get_logger(),  # type: ignore[arg-type]
                                   ProgressReporter(fd=None))
        resumed = checkpoints.resume()
        return resumed, state, capsys.readouterr().out

    shutil.copy(step[1] / SHARD, step[3] / SHARD)  # another checkpoint's shard: the same size, other bytes
    capsys.readouterr()
    resumed, state, out = resume("auto")
    assert resumed == 2 and same(snapshot(state), held[2])
    assert re.search(rf"^WARNING \| --resume: {re.escape(str(step[3] / SHARD))} has checksum {CHECKSUM}, meta.json "
                     rf"recorded {recorded}; resuming from {re.escape(str(step[2]))}, the newest intact checkpoint$",
                     out, re.M), out
    assert re.search(rf"^INFO \| checkpoint {re.escape(str(step[2]))} verified: 3 files, [\d.]+ kB read in ", out,
                     re.M), out

    with pytest.raises(UserError) as refused:
        resume(str(step[3]))
    assert re.fullmatch(rf"--resume {re.escape(str(step[3]))} cannot be resumed: {re.escape(str(step[3] / SHARD))} "
                        rf"has checksum {CHECKSUM}, meta.json recorded {recorded}; the newest intact checkpoint beside "
                        rf"it is {re.escape(str(step[2]))}: --resume {re.escape(str(step[2]))}", str(refused.value))

    unrecorded(step[2])
    cut(step[2] / SHARD)  # unseen without a record: DCP's load fails
    capsys.readouterr()
    resumed, state, out = resume("auto")
    assert resumed == 1 and same(snapshot(state), held[1])
    assert f"WARNING | {step[2]} records no checksums of its files" in out
    passed = re.findall(rf"^WARNING \| --resume: (.*); resuming from {re.escape(str(step[1]))}, the newest intact "
                        rf"checkpoint$", out, re.M)
    assert len(passed) == 2 and passed[0].startswith(f"{step[3] / SHARD} has checksum"), out
    assert passed[1].startswith(f"{step[2] / layout.DCP_DIR} cannot be read (RuntimeError: PytorchStreamReader failed "
                                f"reading zip archive"), out

    overwrite(step[1] / SHARD)
    with pytest.raises(UserError, match=rf"^every checkpoint in {re.escape(str(root))} is damaged \(3; the latest: "
                                        rf"{re.escape(str(step[3] / SHARD))} has checksum {CHECKSUM}, meta.json "
                                        rf"recorded {recorded}\); start fresh without --resume"):
        resume("auto")
    assert "resuming from" not in capsys.readouterr().out  # nothing was resumed: the one line alone


def test_a_hand_edited_meta_json_or_a_file_that_is_no_checkpoint_is_damage_and_later_ones_are_superseded(
        tmp_path: Path, ctx: DistContext, capsys: pytest.CaptureFixture[str]) -> None:
    """meta.json has no checksum of its own: another step written into it, `split` turned off or a key deleted is found
    (against the copy state.pt keeps, or by its structure) and passed over, never resumed under the wrong step; a
    torch.save file that is not a checkpoint named by --resume is one line. The checkpoints after the one resumed are
    removed by the run's first save, so that pruning (which keeps the newest) never removes that save for them."""
    cfg = make_cfg(tmp_path)
    root = Path(cfg.checkpoint.dir)
    held = split_saves(cfg, make_state(cfg), ctx, 4)
    step = {n: layout.step_path(root, n) for n in held}

    def edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
        meta = json.loads((path / layout.META_FILE).read_text())
        change(meta)
        (path / layout.META_FILE).write_text(json.dumps(meta, indent=1))

    def checkpointer(spec: str) -> tuple[Checkpointer, store.TrainState]:
        cfg.checkpoint.resume = spec
        state = make_state(cfg)
        return Checkpointer(cfg, ctx, state, SimpleNamespace(key=KEY), get_logger(),  # type: ignore[arg-type]
                            ProgressReporter(fd=None)), state

    edit(step[4], lambda meta: meta.update(step=1))
    edit(step[3], lambda meta: meta.update(split=False))
    edit(step[2], lambda meta: meta.pop("model_shapes"))
    capsys.readouterr()
    checkpoints, state = checkpointer("auto")
    assert checkpoints.resume() == 1 and same(snapshot(state), held[1])
    out = capsys.readouterr().out
    assert f"--resume: {step[2] / layout.META_FILE} lacks model_shapes; resuming from {step[1]}" in out, out
    for n, key in ((4, "step"), (3, "split")):
        assert (f"--resume: {step[n] / layout.META_FILE} differs from the copy state.pt keeps of it ({key}): it was "
                f"changed after the save; resuming from {step[1]}") in out, out
    assert (f"{root} holds 3 checkpoints after step 1 (step_000002, step_000003, step_000004) that this run does not "
            f"continue: its first checkpoint removes them") in out, out

    cfg.checkpoint.keep = 1
    checkpoints.save(2)
    checkpoints.wait()
    assert layout.list_checkpoints(root) == [step[2]]  # the others superseded, the new one kept
    assert layout.damage(step[2]) is None

    plain = tmp_path / "weights.pt"
    torch.save({"model": {}}, plain)
    with pytest.raises(UserError, match=rf"^--resume {re.escape(str(plain))} cannot be resumed: {re.escape(str(plain))} "
                                        rf"is a torch.save file but not a checkpoint \(it holds no checkpoint record\)"):
        checkpointer(str(plain))[0].resume()


def test_background_staging_is_allocated_before_the_first_step_without_changing_it(
        tmp_path: Path, ctx: DistContext, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The optimizer's state, made before its first step (`store.prime_optimizer`), is the one that step makes: the
    same weights and moments after it, bit for bit. With it there, `prepare` stages the state once at the start, and
    the first save copies into those buffers: none is allocated while training waits."""
    cfg = make_cfg(tmp_path)
    primed, plain = make_state(cfg), make_state(cfg)
    store.prime_optimizer(primed)
    assert primed.optimizer.state and not plain.optimizer.state
    for seed in (0, 1):
        train_once(primed, seed)
        train_once(plain, seed)
    assert same(snapshot(primed), snapshot(plain))

    staged: list[Any] = []
    stage = HostStager.stage
    monkeypatch.setattr(HostStager, "stage", lambda self, tree: staged.append(stage(self, tree)) or staged[-1])
    cfg.checkpoint.async_save = True
    state = make_state(cfg)
    checkpoints = Checkpointer(cfg, ctx, state, SimpleNamespace(key=KEY), get_logger(),  # type: ignore[arg-type]
                               ProgressReporter(fd=None))
    capsys.readouterr()
    checkpoints.prepare()
    assert re.search(r"each is first staged in host memory \([\d.]+ kB on this host, allocated in \d+\.\d\d s and "
                     r"kept for the run", capsys.readouterr().out)
    (allocated,) = staged

    def storages(tree: Any) -> set[int]:
        if isinstance(tree, torch.Tensor):
            return {tree.untyped_storage().data_ptr()}
        values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else []
        return set().union(*map(storages, values))

    train_once(state, 0)
    checkpoints.save(1)
    checkpoints.finish()
    first = staged[1]  # state.pt's content (one rank: the whole state there)
    weights = storages({"model": first["model"], "optimizer": first["optimizer"]})
    assert len(weights) == len(storages(allocated)) and weights <= storages(allocated)
    restored = make_state(cfg)
    assert store.load(layout.step_path(Path(cfg.checkpoint.dir), 1), restored, ctx, KEY).step == 1
    assert same(snapshot(restored), snapshot(state))


# ---------------------------------------------------------------------------------------------------------------------
# Through the supervisor, 2 CPU ranks

STEPS = 6  # checkpoints step_000002, step_000004, step_000006


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, token_cache_dir: Path) -> Path:
    """The checkpoints of one supervised run: DDP on 2 CPU ranks, saved in the background (each rank its share)."""
    folder = tmp_path_factory.mktemp("trained")
    run = run_supervisor(supervised(folder, token_cache_dir, training={"max_steps": STEPS}, checkpoint={"interval": 2}),
                         folder, "run.txt", clean_env())
    assert run.code == 0, run.output[-4000:]
    return folder / "ckpt"


def resumed(tmp_path: Path, cache_dir: Path, trained: Path, damage: Callable[[Path], None],
            resume: str = "auto") -> Outcome:
    """A copy of the trained checkpoints, damaged, then a supervised run with `--resume` to the end."""
    root = tmp_path / "ckpt"
    shutil.copytree(trained, root)
    damage(root)
    flags = supervised(tmp_path, cache_dir, training={"max_steps": STEPS}, checkpoint={"interval": 2})
    run = run_supervisor([*flags, "--resume", resume], tmp_path, "resume.txt", clean_env())
    assert "Traceback" not in run.output, run.output[-4000:]
    return run


def assert_resumed_from_step_4(run: Outcome, root: Path) -> None:
    """The run resumed from step_000004, trained to the end, and its last save replaced the damaged step_000006."""
    assert run.code == 0, run.output[-4000:]
    assert f"CPU0:INFO | resumed from {layout.step_path(root, 4)} at step 4" in run.output
    last = layout.step_path(root, STEPS)
    files = json.loads((last / layout.META_FILE).read_text())["files"]
    assert layout.verify_files(last, sorted(files), files) is None


def test_4_kib_overwritten_in_a_shard_is_found_and_passed_over(tmp_path: Path, token_cache_dir: Path,
                                                              trained: Path) -> None:
    run = resumed(tmp_path, token_cache_dir, trained, lambda root: overwrite(layout.step_path(root, 6) / SHARD))
    root = tmp_path / "ckpt"
    assert_resumed_from_step_4(run, root)
    said = re.findall(rf"^(\S+) \| --resume: {re.escape(str(layout.step_path(root, 6) / SHARD))} has checksum "
                      rf"{CHECKSUM}, meta.json recorded {CHECKSUM}; resuming from "
                      rf"{re.escape(str(layout.step_path(root, 4)))}, the newest intact checkpoint$", run.output, re.M)
    assert said == ["CPU0:WARNING"], run.output[-4000:]  # once, by rank 0


@pytest.mark.slow
def test_a_load_that_fails_is_passed_over_on_every_rank_alike(tmp_path: Path, token_cache_dir: Path,
                                                              trained: Path) -> None:
    """A checkpoint without a record (written before files were recorded) whose rank-1 shard is cut short: DCP's
    load fails, and both ranks go on from step_000004. In the slow tier: the default suite passes over a failed load
    in test_a_resume_passes_over_damaged_checkpoints_in_one_line_and_refuses_one_named."""
    def damage(root: Path) -> None:
        unrecorded(layout.step_path(root, 6))
        cut(layout.step_path(root, 6) / layout.DCP_DIR / "__1_0.distcp")

    run = resumed(tmp_path, token_cache_dir, trained, damage)
    root = tmp_path / "ckpt"
    assert_resumed_from_step_4(run, root)
    assert f"CPU0:WARNING | {layout.step_path(root, 6)} records no checksums of its files" in run.output
    assert f"CPU0:WARNING | --resume: {layout.step_path(root, 6) / layout.DCP_DIR} cannot be read (RuntimeError: " \
           f"PytorchStreamReader failed reading zip archive" in run.output, run.output[-4000:]


def test_a_damaged_checkpoint_named_by_resume_is_one_line_and_exit_2(tmp_path: Path, token_cache_dir: Path,
                                                                     trained: Path) -> None:
    run = resumed(tmp_path, token_cache_dir, trained, lambda root: overwrite(layout.step_path(root, 6) / SHARD),
                  resume=str(tmp_path / "ckpt" / "step_000006"))
    named, intact = (re.escape(str(layout.step_path(tmp_path / "ckpt", n))) for n in (6, 4))
    assert run.code == 2, run.output[-4000:]
    assert re.search(rf"^CPU0:error: --resume {named} cannot be resumed: {named}/{SHARD} has checksum {CHECKSUM}, "
                     rf"meta.json recorded {CHECKSUM}; the newest intact checkpoint beside it is {intact}: --resume "
                     rf"{intact}$", run.output, re.M), run.output[-4000:]
    assert "CPU1:error:" not in run.output  # decided by rank 0 for both: said once
    assert re.search(r"^supervisor: run failed after [\d.]+ s: CPU0 \(rank 0\) failed: exit 2$", run.output, re.M), \
        run.output[-4000:]


def copied_from_step_2(root: Path) -> None:
    for shard in (layout.step_path(root, 2) / layout.DCP_DIR).glob("*.distcp"):
        shutil.copy(shard, layout.step_path(root, 6) / layout.DCP_DIR / shard.name)


@pytest.mark.slow
@pytest.mark.parametrize("damage, said", [
    (copied_from_step_2, (rf"CPU0:WARNING \| --resume: STEP_6/dcp/__\d_0.distcp has checksum {CHECKSUM}, "
                          rf"meta.json recorded {CHECKSUM}")),
    (lambda root: cut(layout.step_path(root, 6) / SHARD),
     r"supervisor: --resume: STEP_6/dcp/__0_0.distcp is [\d,]+ bytes, meta.json recorded [\d,]+"),
    (lambda root: (layout.step_path(root, 6) / SHARD).unlink(),
     r"supervisor: --resume: STEP_6/dcp/__0_0.distcp is missing \(meta.json records [\d,]+ bytes\)"),
    (lambda root: cut(layout.step_path(root, 6) / DCP_METADATA),
     r"supervisor: --resume: STEP_6/dcp/.metadata is [\d,]+ bytes, meta.json recorded [\d,]+"),
], ids=["copied-from-step-2", "shard-cut-short", "shard-deleted", "metadata-cut-short"])
def test_each_damage_is_named_and_passed_over(tmp_path: Path, token_cache_dir: Path, trained: Path,
                                              damage: Callable[[Path], None], said: str) -> None:
    """The other damages of the latest checkpoint: an earlier one's shards copied over its own (found by the ranks'
    checksums), a shard cut short, deleted, or DCP's .metadata cut short (found by their sizes, said by the supervisor
    before any rank starts)."""
    run = resumed(tmp_path, token_cache_dir, trained, damage)
    root = tmp_path / "ckpt"
    assert_resumed_from_step_4(run, root)
    line = said.replace("STEP_6", re.escape(str(layout.step_path(root, 6))))
    assert len(re.findall(rf"^{line}; resuming from {re.escape(str(layout.step_path(root, 4)))}, the newest intact "
                          rf"checkpoint$", run.output, re.M)) == 1, run.output[-4000:]


@pytest.mark.slow
def test_every_checkpoint_damaged_is_one_line_and_exit_2(tmp_path: Path, token_cache_dir: Path,
                                                         trained: Path) -> None:
    def damage(root: Path) -> None:
        for path in layout.list_checkpoints(root):
            overwrite(path / SHARD)

    run = resumed(tmp_path, token_cache_dir, trained, damage)
    root = tmp_path / "ckpt"
    latest = re.escape(str(layout.step_path(root, 6) / SHARD))
    assert run.code == 2, run.output[-4000:]
    assert re.search(rf"^CPU0:error: every checkpoint in {re.escape(str(root))} is damaged \(3; the latest: {latest} "
                     rf"has checksum {CHECKSUM}, meta.json recorded {CHECKSUM}\); start fresh without --resume in "
                     rf"another checkpoint.dir, or restore them$", run.output, re.M), run.output[-4000:]
    assert "resuming from" not in run.output
