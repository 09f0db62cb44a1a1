"""Checkpoints written in the background (checkpoint.async_save): the same bytes as a synchronous save, the state of
their own step while training goes on, never visible half-written, pruning that spares the latest complete one, a
stop that waits for the write, a kill in any phase of the write, and what the log and the history say. Through the
supervisor, with a write held in flight (debug.inject_write_stall_step) rather than caught by timing: a SIGTERM to the
supervisor waits for it and publishes it; a rank that fails a step later lets it end (an exception) or takes its
share with it (SIGKILL), and the log says which checkpoint is the latest."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_checkpoint import KEY, make_cfg, make_state, snapshot, train_once
from test_fault_matrix import run_supervisor, wait_for

from rank_scripts.harness import clean_env
from rank_support import (
    TINY,
    checkpoint_content,
    history,
    history_losses,
    merged,
    run_main,
    set_flags,
    tiny_config,
)
from trainer import durable, loop
from trainer.checkpoint import layout, store
from trainer.checkpoint.manager import Checkpointer
from trainer.errors import lost_a_peer
from trainer.metrics import get_logger
from trainer.model.distributed import DistContext, init_distributed, teardown
from trainer.progress import Progress, ProgressReporter

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


def test_a_rank_that_lost_a_peer_leaves_its_write_in_flight_at_once_and_says_training_goes_on_after_a_save(
        tmp_path: Path, ctx: DistContext, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank failing because a peer went away (`trainer.errors.lost_a_peer`) with a write in flight does not wait
    for it: the peer's share went with it, and with three ranks or more a writer whose collective pairs it with a live
    rank would wait the writer group's whole timeout (the supervisor's grace period ended it). It says the write was
    not published and which checkpoint is the latest. After a save the rank's record says it is training again, so a
    peer dying in the next step finds it waiting there, not saving."""
    cfg = make_cfg(tmp_path)
    cfg.checkpoint.async_save = True
    root = Path(cfg.checkpoint.dir)
    state = make_state(cfg)
    read, write = os.pipe()
    checkpoints = Checkpointer(cfg, ctx, state, SimpleNamespace(key=KEY), get_logger(),  # type: ignore[arg-type]
                               ProgressReporter(fd=write))
    train_once(state, 0)
    checkpoints.save(1)
    records = [Progress.decode(line) for line in os.read(read, 65536).splitlines()]
    assert [(r.event, r.phase) for r in records][-2:] == [("phase", "checkpoint"), ("phase", "training")]
    checkpoints.finish()

    gate = Gate(monkeypatch)
    train_once(state, 1)
    checkpoints.save(2)
    assert gate.reached.wait(120)
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:53151")
    assert lost_a_peer(RuntimeError("the step failed")) is False
    try:
        try:
            raise lost
        except RuntimeError as e:
            raise RuntimeError("the step failed") from e
    except RuntimeError as e:
        assert lost_a_peer(e)
    capsys.readouterr()
    opener = threading.Timer(30, gate.open.set)  # a settle that waited would see the write published then
    opener.start()
    checkpoints.settle(peer_lost=True)
    opener.cancel()
    said = capsys.readouterr().out
    assert "the rank lost a peer with step_000002 still being written; not waiting for it" in said
    assert f"step_000002 was not published (a peer went away during the write); the latest checkpoint is " \
           f"{layout.step_path(root, 1)}" in said
    assert checkpoints.in_flight is None
    gate.open.set()  # (the abandoned writer ends; a failing rank's process would end it)
    os.close(read), os.close(write)


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


# ---------------------------------------------------------------------------------------------------------------------
# A write held in flight, through the supervisor


def supervised(tmp_path: Path, cache_dir: Path, **sections: dict[str, Any]) -> list[str]:
    """`python -m supervisor` flags: the tiny run on 2 CPU ranks (DDP: each writes its share in the background)."""
    layer = merged(merged(TINY, {"data": {"cache_dir": str(cache_dir)},
                                 "checkpoint": {"dir": str(tmp_path / "ckpt"), "async_save": True, "keep": 5}}),
                   sections)
    return ["--debug", "--no-footer", "--nproc", "2", "--log-dir", str(tmp_path / "logs"), *set_flags(layer)]


def stalled(step: int, rank: int) -> str:
    return f"fault injection: the checkpoint write after step {step} stalls on rank {rank} until training waits for it"


def resumes_from(tmp_path: Path, cache_dir: Path) -> Path | None:
    """What `--resume auto` takes in the run's checkpoint folder."""
    return layout.find_resume(tiny_config(tmp_path, cache_dir, checkpoint={"resume": "auto"}))


def assert_complete(path: Path) -> None:
    """A published checkpoint that looks whole and whose every tensor reads back, every rank's share included."""
    assert layout.damage(path) is None
    content = checkpoint_content(path)
    assert content["meta"]["step"] == layout.step_of(path) and content["model"] and content["optimizer"]["state"]


def test_sigterm_to_the_supervisor_waits_for_the_write_in_flight_and_publishes_it(
        tmp_path: Path, token_cache_dir: Path) -> None:
    """SIGTERM to the supervisor (a user, Slurm's scancel) while step_000020's write is held in flight on rank 0: the
    ranks stop at a step boundary, and the stop's save first waits for that write (said in the log), which is
    published complete; then the stop's own checkpoint, which --resume auto takes. Nothing is lost."""
    flags = supervised(tmp_path, token_cache_dir, training={"max_steps": 200}, checkpoint={"interval": 20},
                       debug={"inject_write_stall_step": 19})

    def sigterm_once_stalled(proc: Any, log: Path) -> None:
        wait_for(re.compile(re.escape(stalled(19, 0))), log, proc, 120)
        proc.send_signal(signal.SIGTERM)

    run = run_supervisor(flags, tmp_path, "run.txt", clean_env(), sigterm_once_stalled)
    out = run.output
    assert run.code == 128 + signal.SIGTERM, out[-4000:]
    root, held = tmp_path / "ckpt", layout.step_path(tmp_path / "ckpt", 20)
    stop = re.search(r"^CPU0:INFO \| \[GPU 0\] stopping after step (\d+): a stop was requested", out, re.MULTILINE)
    assert stop, out[-4000:]
    waited = re.search(r"^CPU0:INFO \| checkpoint: waited \d+\.\d\d s for step_000020 to finish writing$", out,
                       re.MULTILINE)
    saved = re.search(rf"^CPU0:INFO \| checkpoint saved: {re.escape(str(held))} ", out, re.MULTILINE)
    assert waited and saved and stop.start() < min(waited.start(), saved.start()), out[-4000:]
    last = layout.step_path(root, int(stop[1]) + 1)
    assert layout.list_checkpoints(root) == [held, last]
    for path in (held, last):
        assert_complete(path)
    assert resumes_from(tmp_path, token_cache_dir) == last


@pytest.mark.parametrize("fault, code", [pytest.param("raise", 1, marks=pytest.mark.slow),
                                         ("sigkill", 128 + signal.SIGKILL)])
def test_a_rank_failing_with_a_write_in_flight_ends_it_or_abandons_it_and_says_which_is_latest(
        tmp_path: Path, token_cache_dir: Path, fault: str, code: int) -> None:
    """Rank 1 fails at step 4 while step_000004's write is in flight (held on rank 1 until the rank waits for it).
    An exception: the failing rank lets the write end before it leaves, rank 0's writer finishing its share
    meanwhile, so step_000004 is published and the log says it is the latest. SIGKILL: rank 1's share dies with it,
    rank 0 fails on the lost peer and leaves without waiting for its writer (`Checkpointer.settle`), saying
    step_000002 is the latest. Either way --resume auto takes what the log names, complete."""
    flags = supervised(tmp_path, token_cache_dir, checkpoint={"interval": 2},
                       debug={"inject_fault": fault, "inject_fault_step": 4, "inject_fault_rank": 1,
                              "inject_write_stall_step": 3})
    run = run_supervisor(flags, tmp_path, "run.txt", clean_env())
    out = run.output
    assert run.code == code, out[-4000:]
    assert f"fault injection: {fault} at step 4 on rank 1" in out
    root = tmp_path / "ckpt"
    held, before = layout.step_path(root, 4), layout.step_path(root, 2)
    if fault == "raise":  # (killed, rank 1 may die before its writer thread has even said that it stalls)
        assert stalled(3, 1) in out
        assert re.search(r"^CPU1:WARNING \| \[GPU 1\] checkpoint: the rank is failing with step_000004 still being "
                         r"written; waiting for it \(at most 120 s, system.dist_timeout_s\)$", out,
                         re.MULTILINE), out[-4000:]
        assert f"CPU1:WARNING | [GPU 1] checkpoint: {held} was published: it is the latest checkpoint" in out
        latest = held
    else:
        assert re.search(rf"^CPU0:WARNING \| \[GPU 0\] checkpoint: step_000004 was not published \(.+\); the latest "
                         rf"checkpoint is {re.escape(str(before))}$", out, re.MULTILINE), out[-4000:]
        assert not held.exists()  # (a `.tmp-` folder its writer had no time to remove is never taken: the next save's)
        latest = before
    assert layout.list_checkpoints(root)[-1] == latest == resumes_from(tmp_path, token_cache_dir)
    assert_complete(latest)


def test_the_stager_is_handed_tensors_alone_and_later_saves_reuse_its_buffers() -> None:
    """The stager lives for the run: every save after the first copies into the first one's host buffers. torch
    2.11's `DefaultStager` closed its stager after every stage, so there the second save (the first after the
    buffers are allocated at the start) failed with `KeyError: <class 'type'>`. The stager sees one flat dict of
    tensors; the containers come back whole around the copies."""
    from collections import OrderedDict, namedtuple

    from trainer.checkpoint.background import HostStager

    Pair = namedtuple("Pair", "first second")
    weight = torch.randn(4, 3)
    model_sd = OrderedDict([("w", weight), ("w_view", weight[1:])])
    model_sd._metadata = {"": {"version": 1}}  # what Module.state_dict attaches
    state = {"model": model_sd, "groups": [{"betas": (0.9, 0.95), "params": [0, 1]}],
             "rng": (3, tuple(range(5)), None), "pair": Pair(torch.ones(2), "x"), "shape": torch.Size([2, 3]),
             "cls": torch.float32, "kind": OrderedDict}
    stager = HostStager(torch.device("cpu"))
    seen: list[dict[str, Any]] = []
    original = stager.stager.stage
    stager.stager.stage = lambda flat, **kw: (seen.append(flat), original(flat, **kw))[1]
    try:
        first = stager.stage(state)
        buffer = first["model"]["w"].data_ptr()
        weight.add_(1.0)  # training goes on: the copy keeps the staged step until the next save
        assert not torch.equal(first["model"]["w"], weight)
        copy = stager.stage(state)
    finally:
        stager.close()
    assert len(seen) == 2 and all(isinstance(t, torch.Tensor) for t in seen[1].values()) and len(seen[1]) == 3
    assert copy["model"]["w"].data_ptr() == buffer != weight.data_ptr()  # the first save's buffer, refilled
    assert torch.equal(copy["model"]["w"], weight)
    assert type(copy["model"]) is OrderedDict and copy["model"]._metadata == {"": {"version": 1}}
    assert copy["model"]["w_view"].untyped_storage().data_ptr() == copy["model"]["w"].untyped_storage().data_ptr()
    assert copy["groups"] == [{"betas": (0.9, 0.95), "params": [0, 1]}] and copy["rng"] == (3, (0, 1, 2, 3, 4), None)
    assert type(copy["pair"]) is Pair and copy["pair"].second == "x" and torch.equal(copy["pair"].first, torch.ones(2))
    assert copy["shape"] == torch.Size([2, 3]) and type(copy["shape"]) is torch.Size
    assert copy["cls"] is torch.float32 and copy["kind"] is OrderedDict
