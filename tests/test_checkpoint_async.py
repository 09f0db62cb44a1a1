"""Checkpoints written in the background (checkpoint.async_save): the same bytes as a synchronous save, the state of
their own step while training goes on, never visible half-written, pruning that spares the latest complete one, a
stop that waits for the write, a kill in any phase of the write, and what the log and the history say."""

from __future__ import annotations

import re
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_checkpoint import KEY, make_cfg, make_state, snapshot, train_once

from rank_support import TINY, history, history_losses, merged, run_main, set_flags, tiny_config
from trainer import durable, loop
from trainer.checkpoint import layout, store
from trainer.checkpoint.manager import Checkpointer
from trainer.metrics import get_logger
from trainer.model.distributed import DistContext, init_distributed, teardown
from trainer.progress import ProgressReporter

SAVED = re.compile(r"^INFO \| checkpoint saved: (?P<path>\S+) \(\d+(\.\d)? (B|kB|MB); training blocked "
                   r"(?P<blocked>\d+\.\d\d) s, written in (?P<written>\d+\.\d\d) s(?P<background> in the background)?\)$",
                   re.M)


def content(path: Path) -> dict[str, Any]:
    """A checkpoint's state.pt, without the moment it was written and the run's config (its folders differ)."""
    payload = store.load_payload(path / store.STATE_FILE)
    del payload["meta"]["saved_at"], payload["meta"]["config"]
    return payload


def same(a: Any, b: Any) -> bool:
    """Bit-identical nested state: tensors by value, everything else by equality."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_background_saves_are_bit_identical_to_synchronous_ones_and_say_what_they_cost(
        tmp_path: Path, token_cache_dir: Path, one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    runs = {}
    for mode in (True, False):
        cfg = tiny_config(tmp_path / str(mode), token_cache_dir, training={"max_steps": 6},
                          checkpoint={"interval": 2, "keep": 5, "async_save": mode})
        assert loop.train(cfg) == 0
        out = capsys.readouterr().out
        saves = list(SAVED.finditer(out))
        assert [Path(m["path"]).name for m in saves] == ["step_000002", "step_000004", "step_000006"]
        assert all(bool(m["background"]) == mode for m in saves)
        records = history(Path(cfg.logging.run_dir))["checkpoints"]
        assert [(r["step"], r["background"]) for r in records] == [(2, mode), (4, mode), (6, mode)]
        assert all(r["bytes"] > 0 and r["blocked_s"] >= 0 and r["write_s"] > 0 for r in records)
        if not mode:  # a synchronous save blocks training for its whole write
            assert all(r["blocked_s"] >= r["write_s"] for r in records)
        runs[mode] = Path(cfg.checkpoint.dir), history_losses(Path(cfg.logging.run_dir))
    (background, losses), (synchronous, _) = runs[True], runs[False]
    for step in (2, 4, 6):
        assert same(content(layout.step_path(background, step)), content(layout.step_path(synchronous, step))), step

    resumed = tiny_config(tmp_path / "resumed", token_cache_dir, training={"max_steps": 6},
                          checkpoint={"resume": str(layout.step_path(background, 2))})
    assert loop.train(resumed) == 0
    assert re.search(rf"resumed from {layout.step_path(background, 2)} at step 2 \(loaded in \d+\.\d s\)",
                     capsys.readouterr().out)
    got = history_losses(Path(resumed.logging.run_dir))
    assert got == {s: losses[s] for s in (2, 3, 4, 5)}  # bit-identical continuation on CPU
    assert history(Path(resumed.logging.run_dir))["run"]["resume_load_s"] >= 0


class Gate:
    """Holds every background write just before its rename (where `durable.publish` flushes) until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.reached = threading.Event()
        flush = durable.fsync_tree

        def held(path: Path) -> None:
            if threading.current_thread() is not threading.main_thread():
                self.reached.set()
                assert self.open.wait(120), "the gate was never opened"
            flush(path)

        monkeypatch.setattr(durable, "fsync_tree", held)


@pytest.fixture
def ctx(tmp_path: Path, one_thread: None) -> Any:
    context = init_distributed(make_cfg(tmp_path))
    yield context
    teardown()


def test_a_save_holds_its_own_step_while_training_goes_on_and_is_published_only_when_written(
        tmp_path: Path, ctx: DistContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged copy is the state at the save's step, whatever training does to the live tensors during the write;
    until the write ends the previous checkpoint is the latest and is not pruned (keep=1); `finish` (a stop, the end
    of the run) waits for it."""
    cfg = make_cfg(tmp_path)
    cfg.checkpoint.keep, cfg.checkpoint.async_save = 1, True
    root = Path(cfg.checkpoint.dir)
    state = make_state(cfg)
    cache = SimpleNamespace(key=KEY)
    checkpoints = Checkpointer(cfg, ctx, state, cache, get_logger(), ProgressReporter(fd=None))  # type: ignore[arg-type]
    train_once(state, 0)
    checkpoints.save(1)
    checkpoints.finish()
    assert layout.latest_checkpoint(root) == layout.step_path(root, 1)

    gate = Gate(monkeypatch)
    train_once(state, 1)
    at_step_2 = snapshot(state)
    checkpoints.save(2)
    assert gate.reached.wait(120)
    train_once(state, 2)  # training goes on while step 2 is written
    checkpoints.poll()  # nothing failed: a step boundary goes on
    assert (root / ".tmp-step_000002" / layout.META_FILE).is_file()  # written, not yet published
    assert layout.list_checkpoints(root) == [layout.step_path(root, 1)]  # the latest complete one, not pruned
    threading.Timer(0.2, gate.open.set).start()
    checkpoints.finish()
    assert layout.list_checkpoints(root) == [layout.step_path(root, 2)]
    restored = make_state(cfg)
    assert store.load(layout.step_path(root, 2), restored, ctx, KEY).step == 2
    assert same(snapshot(restored), at_step_2) and not same(snapshot(state), at_step_2)
    assert [(r.step, r.background) for r in checkpoints.saved] == [(1, True), (2, True)]


def rank_flags(tmp_path: Path, cache_dir: Path, **sections: dict[str, Any]) -> list[str]:
    layer = merged(merged(TINY, {"data": {"cache_dir": str(cache_dir)}, "training": {"max_steps": 6},
                                 "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 2, "async_save": True},
                                 "logging": {"run_dir": str(tmp_path / "run")}}), sections)
    return ["--debug", *set_flags(layer)]


@pytest.mark.parametrize("phase", [
    pytest.param("staging", marks=pytest.mark.slow),
    pytest.param("checkpoint", marks=pytest.mark.slow),
    "publishing",
])
def test_a_kill_in_any_phase_of_a_background_write_leaves_the_previous_checkpoint_to_resume(
        tmp_path: Path, token_cache_dir: Path, phase: str) -> None:
    """SIGKILL in the save of step_000004 (after step 3): in its staging on the training thread, or on the writer
    thread once its files are written, or once meta.json is written too, just before the rename. step_000002 stays
    the latest, intact, and --resume auto continues from it to the end."""
    fault = {"inject_fault": "sigkill", "inject_fault_step": 3, "inject_fault_during": phase}
    killed = run_main(rank_flags(tmp_path, token_cache_dir, debug=fault), cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert re.search(rf"fault injection: sigkill (while {phase}|during) the checkpoint after step 3 on rank 0",
                     killed.stderr), killed.stderr[-3000:]
    root = tmp_path / "ckpt"
    assert (root / ".tmp-step_000004").is_dir() and not layout.step_path(root, 4).exists()
    assert layout.find_resume(tiny_config(tmp_path, token_cache_dir, checkpoint={"resume": "auto"})) == \
        layout.step_path(root, 2)
    assert content(layout.step_path(root, 2))["meta"]["step"] == 2

    resumed = run_main([*rank_flags(tmp_path, token_cache_dir), "--resume", "auto"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {layout.step_path(root, 2)} at step 2" in resumed.stdout
    assert layout.latest_checkpoint(root) == layout.step_path(root, 6)
    assert not list(root.glob(f"{layout.TMP_PREFIX}*"))  # the next save cleared what the killed one left
