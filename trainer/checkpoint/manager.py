"""The rank's checkpoints behind one narrow interface, as the training loop uses them: resume at the start, save at
a step (an interval, a stop, the end), a checkpoint where the NaN guard asks for one, the final model.

What a save writes and a load reads is `store`; names on disk and which checkpoint `--resume` means is `layout`;
the write in the background is `background`. This class holds what lies between them over a run: the checkpoint a
resume loads (its files verified first; a damaged one passed over for the newest intact one, rank 0 deciding for
every rank), the staging buffers of background saves (allocated before the first step), the step last
saved (a stop right after an interval save writes nothing again), the save still being written (at most one: the
next save, a stop, the end of the run and a failure wait for it), a finished earlier run's checkpoints in the same
folder (replaced by this run's first save), pruning to `checkpoint.keep` (after a save is published, so the latest
complete checkpoint is never removed for one still being written), and the time each save cost (`SaveRecord`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from trainer.checkpoint import layout, store
from trainer.checkpoint.background import BackgroundWrite, HostStager
from trainer.checkpoint.layout import FULL, SHARDED, human_bytes
from trainer.checkpoint.memory import MemoryCopy
from trainer.config import Config
from trainer.errors import CollectiveUserError, UserError
from trainer.model.distributed import DistContext, agree_any, broadcast_object
from trainer.progress import ProgressReporter

if TYPE_CHECKING:  # the type alone: the cache module imports tokenizers and numpy
    from trainer.data.training_data import TrainingData

STAGING_SHARE = 0.5  # checkpoint.async_save=auto stages only when the copy takes at most this share of free memory


@dataclass
class SaveRecord:
    """What one published checkpoint cost (rank 0's view; `training_history.json` keeps them)."""

    step: int
    path: str
    bytes: int  # the published folder's files, every rank's shards included
    blocked_s: float  # the training thread stopped: waiting for the previous save, staging (and writing, when not
    #                   in the background)
    write_s: float  # the write: shards, state.pt, the agreement between ranks, the rename
    waited_s: float  # of blocked_s, waiting for the previous save to finish writing
    background: bool

    def line(self) -> str:
        waited = f", {self.waited_s:.1f} s of it waiting for the previous save" if self.waited_s >= 0.05 else ""
        return (f"checkpoint saved: {self.path} ({human_bytes(self.bytes)}; training blocked {self.blocked_s:.2f} s"
                f"{waited}, written in {self.write_s:.2f} s{' in the background' if self.background else ''})")


def folder_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Checkpointer:
    """Every rank holds one and calls each method together (saves and loads are collective)."""

    def __init__(self, cfg: Config, ctx: DistContext, state: store.TrainState, cache: TrainingData,
                 log: logging.Logger, progress: ProgressReporter,
                 fault: Callable[[int, str], None] = lambda step, phase: None,
                 stall: Callable[[int, threading.Event], None] = lambda step, awaited: None,
                 loop_state: Callable[[], dict[str, Any]] = dict) -> None:
        """`fault(step, phase)`: called as a save reaches each phase (`staging`, `checkpoint`: written, `publishing`),
        with the step it follows (the fault injector's `debug.inject_fault_during`). `stall(step, awaited)`: called
        on the writer thread before a background write begins, with the event set once training waits for it (the
        fault injector's `debug.inject_write_stall_step`). `loop_state()`: what the loop keeps in each checkpoint's meta
        beside the tensors (`store.CheckpointMeta.loop`); `resumed` is the meta of the checkpoint a resume loaded."""
        self.cfg, self.ctx, self.state, self.cache, self.log, self.progress = cfg, ctx, state, cache, log, progress
        self.fault, self.stall, self.loop_state = fault, stall, loop_state
        self.resumed: store.CheckpointMeta | None = None
        self.root = Path(cfg.checkpoint.dir)
        self.last_saved: int | None = None
        # removed at this run's first save: a finished earlier run's checkpoints, or those after the step it resumed
        self.superseded: list[Path] = []
        self.background: bool | None = None  # checkpoint.async_save as decided at the first save
        self.stager: HostStager | None = None  # its host buffers, while saves are written in the background
        self.in_flight: BackgroundWrite | None = None
        self.saved: list[SaveRecord] = []  # appended by the writer as each save is published (rank 0)
        self.published: Callable[[SaveRecord], None] = lambda record: None  # then told (the history's journal)
        self.load_s: float | None = None  # how long the resume's load took
        self.memory = MemoryCopy(cfg, ctx, state, cache.key, log)  # the latest state in the node's shared memory
        # the final model's tokenizer, held from the start: the token cache may be removed while the run trains
        self.tokenizer_json = cache.tokenizer_path.read_text() if cfg.checkpoint.save_final and ctx.is_main else ""

    def meta(self, step: int, split: bool = False) -> store.CheckpointMeta:
        return store.CheckpointMeta(
            step=step, format=self.state.format, cache_key=self.cache.key, world_size=self.ctx.world_size,
            data=store.data_position(self.cfg, self.ctx.world_size),
            model_shapes=store.shape_signature(self.state.model), config=self.cfg.to_dict(), split=split,
            loop=self.loop_state())

    def splits(self, background: bool) -> bool:
        """Whether a save is split (`store.replicated_share`): a full-format one written in the background by several
        ranks, so that no rank stages and writes more than its share while the others train."""
        return background and self.state.format == FULL and self.ctx.world_size > 1

    def resume(self) -> int:
        """Load the checkpoint `checkpoint.resume` means, if any; returns the step to run next (0 for a fresh start)."""
        passed_over: list[str] = []  # damaged checkpoints `--resume` passed over for the newest intact one
        path = layout.find_resume(self.cfg, passed_over) if self.ctx.is_main else None
        if not self.progress.supervised:  # a supervisor said so already, before any rank started
            for note in passed_over:
                self.log.warning(note)
        path = broadcast_object(path, self.ctx)  # one decision for every rank
        started = time.perf_counter()
        if (meta := self.memory.restore(layout.step_of(path) if path is not None else None)) is not None:
            self.load_s = time.perf_counter() - started
            self.resumed = meta
            if self.ctx.is_main:
                self.log.info(f"resumed from the memory copy in {self.memory.folder} at step {meta.step} (checked and "
                              f"loaded in {self.load_s:.2f} s; on disk: {path or 'no checkpoint yet'})")
                self.say_data(f"the memory copy of step {meta.step}", meta)
            return meta.step
        if path is None:
            if self.cfg.checkpoint.resume == "auto" and self.ctx.is_main:
                self.log.info(f"no checkpoint in {self.root}; starting from step 0")
            if self.ctx.is_main and (superseded := layout.earlier_run(self.cfg)):
                self.superseded = superseded
                self.log.info(f"{self.root} holds a finished earlier run (up to {superseded[-1].name}): this run "
                              f"starts from step 0, and its first checkpoint replaces those (to extend that run "
                              f"instead: --resume auto with a larger --max-steps)")
            return 0
        path, meta = self.load_intact(path)
        self.resumed = meta
        if path.resolve() == layout.step_path(self.root, meta.step).resolve():
            self.last_saved = meta.step  # already on disk where this run saves: no need to write it again
        if self.ctx.is_main:
            self.log.info(f"resumed from {path} at step {meta.step} (loaded in {self.load_s:.1f} s)")
            self.say_data(str(path), meta)
            self.leave_later(meta.step)
        return meta.step

    def leave_later(self, step: int) -> None:
        """The checkpoints in checkpoint.dir after the resumed `step` (damaged ones passed over, or those of a
        trajectory resumed from before them) are superseded: this run's first save removes them, so that neither
        pruning, which keeps the newest, nor a later --resume auto takes them for this run's (rank 0)."""
        later = [p for p in layout.list_checkpoints(self.root) if (layout.step_of(p) or 0) > step]
        if later:
            self.superseded = later
            self.log.warning(f"{self.root} holds {len(later)} checkpoint{'s' * (len(later) > 1)} after step {step} "
                             f"({', '.join(p.name for p in later)}) that this run does not continue: its first "
                             f"checkpoint removes them (copy them elsewhere first to keep them)")

    def say_data(self, what: str, meta: store.CheckpointMeta) -> None:
        """Rank 0, after a resume: how the batches go on from `what`, written with `meta`'s data settings."""
        here = store.data_position(self.cfg, self.ctx.world_size)
        if store.sample_order(meta.data) != store.sample_order(here):
            self.log.warning(f"the data settings changed since {what} ({meta.data}); "
                             f"batches will not continue the original order")
        elif meta.data != here:
            self.log.info(f"{what} was written by {meta.world_size} ranks × accumulation "
                          f"{meta.data['grad_accum']}, resumed on {self.ctx.world_size} × "
                          f"{self.cfg.training.grad_accum_nums}: the same global batch, the same batches")

    def load_intact(self, path: Path) -> tuple[Path, store.CheckpointMeta]:
        """Verify the checkpoint `path`'s files, then load it (collective); a damaged one (its files differ from their
        record, or it does not load) is passed over for the newest intact checkpoint before it, which is verified in
        turn. Each one passed over is said once one loads, naming it; where none does, one UserError says so. Returns
        the checkpoint loaded and its meta."""
        known: dict[Path, str] = {}  # the checkpoints found damaged here, and why
        passed: list[str] = []  # rank 0: what was wrong with each checkpoint passed over here, newest first
        while True:
            # its structure (rank 0; a rollback's target was not checked before), then its checksums, then the load
            problem = broadcast_object(layout.damage(path) if self.ctx.is_main else None, self.ctx)
            if problem is None:
                checked = store.verify(path, self.ctx)
                problem = checked.problem
            if problem is None:
                self.say_verified(path, checked)
                started = time.perf_counter()
                try:
                    meta = store.load(path, self.state, self.ctx, self.cache.key)
                except store.Unreadable as e:
                    problem = str(e)
                else:
                    self.load_s = time.perf_counter() - started
                    self.memory.forget()  # the live state is the disk's now, not the trajectory the memory copy holds
                    for damaged in passed:
                        self.log.warning(layout.passed_over(damaged, path))
                    return path, meta
            known[path] = problem
            path = self.instead_of(path, known, passed)

    def say_verified(self, path: Path, checked: store.Verification) -> None:
        if not self.ctx.is_main:
            return
        if not checked.files:
            self.log.warning(f"{path} records no checksums of its files (a single .pt file, or a checkpoint written "
                             f"before checkpoints recorded them): loading it unverified")
            return
        rate = f"{human_bytes(checked.bytes / checked.seconds)}/s" if checked.seconds > 0 else "at once"
        self.log.info(f"checkpoint {path} verified: {checked.files} files, {human_bytes(checked.bytes)} read in "
                      f"{checked.seconds:.2f} s ({rate}, the ranks reading their shares at once)")

    def instead_of(self, damaged: Path, known: dict[Path, str], passed: list[str]) -> Path:
        """The checkpoint to try in place of `damaged` (rank 0 decides, every rank follows): the newest intact one in
        the same folder at or before its step, what was wrong with each passed over appended to `passed`. Where
        --resume named `damaged` itself, or no intact checkpoint is left, one UserError on every rank alike."""
        decision: Path | str = ""
        if self.ctx.is_main:
            try:
                decision = self.newest_intact_instead(damaged, known, passed)
            except UserError as e:
                decision = str(e)
        if self.ctx.is_main and isinstance(decision, str):  # before the others hear of it: the failure is rank 0's
            self.progress.failing()
        decision = broadcast_object(decision, self.ctx)
        if isinstance(decision, str):
            raise CollectiveUserError(decision)
        return decision

    def newest_intact_instead(self, damaged: Path, known: dict[Path, str], passed: list[str]) -> Path:
        """Rank 0's part of `instead_of`."""
        named = layout.names_one(self.cfg) and Path(str(self.cfg.checkpoint.resume)).resolve() == damaged.resolve()
        if named:
            raise layout.refusal(str(self.cfg.checkpoint.resume), damaged, known[damaged], known)
        # never one newer than `damaged`: a rollback's target precedes its spike, and those newer than what --resume
        # chose were passed over (and said) already
        intact, newer = layout.scan(damaged.parent, known, up_to=layout.step_of(damaged) or 0)
        if intact is None:  # each damaged one found on the way back named in the count, the latest first
            raise layout.all_damaged(damaged.parent, layout.scan(damaged.parent, known)[1] or newer)
        passed += [problem for _, problem in newer]
        return intact

    # -- saving ------------------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Before the first step (collective): decide how saves are written (`writes_in_background`), which in the
        background allocates the staging buffers now rather than at the first save."""
        self.writes_in_background()

    def save(self, step: int) -> Path | None:
        """The checkpoint after `step` completed steps, unless it is on disk already. Training blocks while the save
        before it finishes writing, if it has not, and while this one is staged; the write goes on in the background
        (checkpoint.async_save) and is published once every rank's files are written."""
        if self.last_saved == step:
            return None
        self.progress.phase("checkpoint")  # a large save may take minutes: the start-up allowance, not the step's
        started = time.perf_counter()
        waited = self.wait()
        background = self.writes_in_background()
        path = layout.step_path(self.root, step)

        def fault(phase: str) -> None:
            self.fault(step - 1, phase)

        staged = store.stage(path, self.state, self.meta(step, self.splits(background)), self.ctx,
                             copy=self.stager.stage if background else None, fault=fault)
        record = SaveRecord(step, str(path), 0, time.perf_counter() - started, 0.0, waited, background)
        if background:
            def job(awaited: threading.Event) -> None:
                self.stall(step - 1, awaited)
                self.write(staged, record, fault)

            self.in_flight = BackgroundWrite(path.name, job)
        else:
            self.write(staged, record, fault)
        self.last_saved = step
        # back in the steps: a record that still said "checkpoint" would tell the supervisor, should a peer die in
        # the next step, that this rank is saving rather than waiting in that step's collectives for the dead peer
        self.progress.phase("training")
        return path

    def write(self, staged: store.Staged, record: SaveRecord, fault: store.Fault) -> None:
        """Write, publish and prune (on the writer thread when in the background, over the writer group)."""
        started = time.perf_counter()
        store.write(staged, self.ctx, self.ctx.writer if record.background else None, fault)
        record.write_s = time.perf_counter() - started
        if not record.background:
            record.blocked_s += record.write_s
        if not self.ctx.is_main:
            return
        for old in self.superseded:
            if old.name != staged.path.name:  # one of the same name was just replaced by this run's
                store.remove(old)
        self.superseded = []
        store.prune(self.root, self.cfg.checkpoint.keep)
        record.bytes = folder_bytes(staged.path)
        self.saved.append(record)
        self.published(record)
        self.log.info(record.line())

    def writes_in_background(self) -> bool:
        """checkpoint.async_save, decided before the first step (`prepare`), alike on every rank (each rank's writer
        joins the same collectives): `auto` stages only where this host's copies (every local rank's shards, or its
        share of the replicated state) fit in half of the memory free now."""
        if self.background is not None:
            return self.background
        setting = self.cfg.checkpoint.async_save
        store.prime_optimizer(self.state)  # its state counted, and there to stage, before the first step
        held = store.tensor_bytes(self.state.model.state_dict()) + store.tensor_bytes(self.state.optimizer.state_dict())
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        need = held * local if self.state.format == SHARDED else held * local // self.ctx.world_size
        free = psutil.virtual_memory().available
        too_large = agree_any(setting == "auto" and need > free * STAGING_SHARE, self.ctx)
        self.background = setting is True or (setting == "auto" and not too_large)
        allocated_s = self.allocate_staging() if self.background else 0.0
        if self.ctx.is_main:
            if self.background:
                self.log.info(f"checkpoints are written in the background: each is first staged in host memory "
                              f"({human_bytes(need)} on this host, allocated in {allocated_s:.2f} s and kept for the "
                              f"run; checkpoint.async_save)")
            elif too_large:
                self.log.info(f"checkpoints are written synchronously: staging one in host memory would take "
                              f"{human_bytes(need)} of the {human_bytes(free)} free (checkpoint.async_save=auto)")
        return self.background

    def allocate_staging(self) -> float:
        """Make the stager and have it allocate its buffers by staging this rank's part of the state once; seconds
        taken. The stager keeps one buffer per tensor storage it has staged, reused at every later save, so the
        first save then blocks training no longer than the later ones: the allocation (pinned host memory on a
        GPU: seconds for a large state) is paid here, before the first step, with the optimizer's state already
        there (`store.prime_optimizer`)."""
        started = time.perf_counter()
        self.stager = HostStager(self.ctx.device)
        meta = self.meta(0, self.splits(True))
        self.stager.stage(store.weights_to_stage(self.state, meta, self.ctx))
        return time.perf_counter() - started

    def wait(self) -> float:
        """Wait for the save in flight, if any (collective: raises its failure on every rank alike); seconds waited,
        said in the log when it had not finished."""
        if self.in_flight is None:
            return 0.0
        in_flight, self.in_flight = self.in_flight, None
        still_writing = not in_flight.done()
        waited = in_flight.wait()
        if still_writing and self.ctx.is_main:
            self.log.info(f"checkpoint: waited {waited:.2f} s for {in_flight.name} to finish writing")
        return waited

    def settle(self, peer_lost: bool = False) -> None:
        """The rank is failing (an exception left the loop): a write still in flight may end first, for up to
        `system.dist_timeout_s` (the writer group's own timeout); the other ranks' writers go on meanwhile, so a
        failure right after an interval save does not lose it. Not when the rank failed because a peer went away
        (`peer_lost`): that peer's part of the write went with it (a write every rank had finished is published
        before any of them leaves), and the writers' next collective could wait the whole timeout for it. Says which
        checkpoint that leaves the latest, unless the write had already been published (and said so) before the
        failure."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        writing = not in_flight.done()
        if not writing and in_flight.error is None:
            return
        limit = 0.0 if peer_lost else self.cfg.system.dist_timeout_s
        who = f"[GPU {self.ctx.gpu_id}] checkpoint"
        if writing and peer_lost:
            self.log.warning(f"{who}: the rank lost a peer with {in_flight.name} still being written; not waiting "
                             f"for it (the peer's part of the write went with it)")
        elif writing:
            self.log.warning(f"{who}: the rank is failing with {in_flight.name} still being written; waiting for it "
                             f"(at most {limit:g} s, system.dist_timeout_s)")
        ended = in_flight.wait_at_most(limit)
        latest = layout.latest_checkpoint(self.root)
        # a write returns only once rank 0 has renamed it into place; rank 0 may also have published it before a
        # collective after the rename failed here
        if (ended and in_flight.error is None) or (latest is not None and latest.name == in_flight.name):
            self.log.warning(f"{who}: {self.root / in_flight.name} was published: it is the latest checkpoint")
            return
        why = ("a peer went away during the write" if peer_lost and in_flight.error is None else
               f"still being written after {limit:g} s" if in_flight.error is None else store.one_line(in_flight.error))
        self.log.warning(f"{who}: {in_flight.name} was not published ({why}); the latest checkpoint is "
                         f"{latest if latest is not None else 'none (a resume starts from step 0)'}")

    def snapshot(self, step: int) -> None:
        """After `step` completed steps: the node's memory copy, when `checkpoint.memory_interval` says one is due."""
        if self.memory.due(step):
            self.memory.snapshot(step, self.meta(step))

    def poll(self) -> None:
        """At a step boundary: raise this rank's own failure in the write in flight (see `background`)."""
        if self.in_flight is not None:
            self.in_flight.raise_own_failure()

    def finish(self) -> None:
        """The end of the run or a stop: wait for the write in flight (the rank's checkpoint phase again, since `save`
        said it trains on), then release the staging buffers."""
        if self.in_flight is not None and not self.in_flight.done():
            self.progress.phase("checkpoint")
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None
            self.background = None

    def save_to(self, path: Path, step: int) -> None:
        """For the NaN guard: a resumable checkpoint at the path it names, written now (every rank calls it)."""
        store.save(path, self.state, self.meta(step), self.ctx)

    def save_final(self) -> None:
        """`final/`: the transformers model and the tokenizer, loadable with `from_pretrained`."""
        self.progress.phase("checkpoint")
        final = store.save_final(self.root / store.FINAL_DIR, self.state.model, self.ctx, self.tokenizer_json,
                                 self.cache.eos_id)
        if self.ctx.is_main:
            self.log.info(f"final model saved: {final} (AutoModelForCausalLM.from_pretrained)")
