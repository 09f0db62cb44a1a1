"""The rank's checkpoints behind one narrow interface, as the training loop uses them: resume at the start, save at
a step (an interval, a stop, the end), a checkpoint where the NaN guard asks for one, the final model.

What a save writes and a load reads is `store`; names on disk and which checkpoint `--resume` means is `layout`. This
class holds what lies between them over a run: the step last saved (a stop right after an interval save writes
nothing again), a finished earlier run's checkpoints in the same folder (replaced by this run's first save), and
pruning to `checkpoint.keep`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.checkpoint import layout, store
from trainer.config import Config
from trainer.model.distributed import DistContext, broadcast_object
from trainer.progress import ProgressReporter

if TYPE_CHECKING:  # the type alone: the cache module imports tokenizers and numpy
    from trainer.data.cache import TokenCache


class Checkpointer:
    """Every rank holds one and calls each method together (saves and loads are collective when sharded)."""

    def __init__(self, cfg: Config, ctx: DistContext, state: store.TrainState, cache: TokenCache,
                 log: logging.Logger, progress: ProgressReporter,
                 before_publish: Callable[[int], None] = lambda step: None) -> None:
        """`before_publish(step)`: called between writing a checkpoint and publishing it, with the step it follows
        (the fault injector's `debug.inject_fault_during=checkpoint`)."""
        self.cfg, self.ctx, self.state, self.cache, self.log, self.progress = cfg, ctx, state, cache, log, progress
        self.before_publish = before_publish
        self.root = Path(cfg.checkpoint.dir)
        self.last_saved: int | None = None
        self.superseded: list[Path] = []  # a finished earlier run's checkpoints, removed at this run's first save
        # the final model's tokenizer, held from the start: the token cache may be removed while the run trains
        self.tokenizer_json = cache.tokenizer_path.read_text() if cfg.checkpoint.save_final and ctx.is_main else ""

    def meta(self, step: int) -> store.CheckpointMeta:
        return store.CheckpointMeta(
            step=step, format=self.state.format, cache_key=self.cache.key, world_size=self.ctx.world_size,
            data=store.data_position(self.cfg, self.ctx.world_size),
            model_shapes=store.shape_signature(self.state.model), config=self.cfg.to_dict())

    def resume(self) -> int:
        """Load the checkpoint `checkpoint.resume` means, if any; returns the step to run next (0 for a fresh start)."""
        passed_over: list[str] = []  # damaged checkpoints `--resume` passed over for the newest intact one
        path = layout.find_resume(self.cfg, passed_over) if self.ctx.is_main else None
        if not self.progress.supervised:  # a supervisor said so already, before any rank started
            for note in passed_over:
                self.log.warning(note)
        path = broadcast_object(path, self.ctx)  # one decision for every rank
        if path is None:
            if self.cfg.checkpoint.resume == "auto" and self.ctx.is_main:
                self.log.info(f"no checkpoint in {self.root}; starting from step 0")
            if self.ctx.is_main and (superseded := layout.earlier_run(self.cfg)):
                self.superseded = superseded
                self.log.info(f"{self.root} holds a finished earlier run (up to {superseded[-1].name}): this run "
                              f"starts from step 0, and its first checkpoint replaces those (to extend that run "
                              f"instead: --resume auto with a larger --max-steps)")
            return 0
        meta = store.load(path, self.state, self.ctx, self.cache.key)
        if path.resolve() == layout.step_path(self.root, meta.step).resolve():
            self.last_saved = meta.step  # already on disk where this run saves: no need to write it again
        if self.ctx.is_main:
            self.log.info(f"resumed from {path} at step {meta.step}")
            here = store.data_position(self.cfg, self.ctx.world_size)
            if store.sample_order(meta.data) != store.sample_order(here):
                self.log.warning(f"the data settings changed since {path} ({meta.data}); "
                                 f"batches will not continue the original order")
            elif meta.data != here:
                self.log.info(f"{path} was written by {meta.world_size} ranks × accumulation "
                              f"{meta.data['grad_accum']}, resumed on {self.ctx.world_size} × "
                              f"{self.cfg.training.grad_accum_nums}: the same global batch, the same batches")
        return meta.step

    def save(self, step: int) -> Path | None:
        """The checkpoint after `step` completed steps, unless it is on disk already; prunes to `checkpoint.keep`."""
        if self.last_saved == step:
            return None
        self.progress.phase("checkpoint")  # a large save may take minutes: the start-up allowance, not the step's
        path = store.save(layout.step_path(self.root, step), self.state, self.meta(step), self.ctx,
                          before_publish=lambda: self.before_publish(step - 1))
        if self.ctx.is_main:
            for old in self.superseded:
                if old.name != path.name:  # one of the same name was just replaced by this run's
                    store.remove(old)
            self.superseded = []
            store.prune(self.root, self.cfg.checkpoint.keep)
            self.log.info(f"checkpoint saved: {path}")
        self.last_saved = step
        return path

    def save_to(self, path: Path, step: int) -> None:
        """For the NaN guard: a resumable checkpoint at the path it names (every rank calls it together)."""
        store.save(path, self.state, self.meta(step), self.ctx)

    def save_final(self) -> None:
        """`final/`: the transformers model and the tokenizer, loadable with `from_pretrained`."""
        self.progress.phase("checkpoint")
        final = store.save_final(self.root / store.FINAL_DIR, self.state.model, self.ctx, self.tokenizer_json,
                                 self.cache.eos_id)
        if self.ctx.is_main:
            self.log.info(f"final model saved: {final} (AutoModelForCausalLM.from_pretrained)")
