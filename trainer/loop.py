"""One rank's training run: set-up, the optimizer step, evaluation, logging, checkpoints, and the agreed stop.

Per optimizer step (the order the NaN guard relies on; `step` counts from 0, like the NaN report's "Step:"):

    faults.before_step(step); guard.start_step(step, batch)
    for each micro-batch (gradient sync only on the last), inside the SDPA backend context: the loss module's forward
        under autocast (trainer.model.loss: the model and the cross-entropy) → loss / grad_accum → backward
    grad_norm = clip_grad_norm_(...)                      the pre-clip total norm, still on the device
    found_inf = guard.check(local_loss, grad_norm)        one tiny collective, no host read
    guard.step_optimizer(...); scheduler.step(); zero_grad; guard.after_step(...)
    at log steps only: host reads for the log line, the averaged loss, tokens/s, MFU, guard.on_log lines (where a step
        was non-finite, its recompute: training.nan_recompute, trainer.diagnosis.recompute); the loss-spike detector's
        verdicts (also before an interval checkpoint), a rollback among them (training.spike_policy)
    every step: the stop flag all-reduced on the CPU control group, overlapped with the step (SIGTERM → checkpoint →
    exit 0 everywhere); a checkpoint written in the background that failed on this rank alone ends it here

A checkpoint named step_<n> holds the state after n completed steps; resuming from it runs step index n next.
Its save calls faults.during_checkpoint(n - 1, phase) at each phase (debug.inject_fault_during). Training blocks only
while it is staged; it is written in the background (checkpoint.async_save), and a stop, the end of the run or a
failure waits for the write in flight before the rank exits.

Length: one rank's run over the Trainer's state (set-up, the step, evaluation, the report, checkpoints, the stop),
which each part reads and the NaN guard and the checkpointer share; split up, every part would take most of it.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from trainer import compile_check
from trainer.checkpoint import layout, store
from trainer.checkpoint.manager import Checkpointer
from trainer.config import Config, check_world_size
from trainer.config.choices import compile_enabled
from trainer.config.sizes import flops_per_token, human, tokens_per_step
from trainer.data.batches import StepLoader, data_step
from trainer.data.cache import prepare
from trainer.data.documents import DocumentIndex
from trainer.data.training_data import TrainingData
from trainer.diagnosis import flight_recorder, oom_report
from trainer.diagnosis.faults import FaultInjector
from trainer.diagnosis.nan_guard import NanGuard
from trainer.diagnosis.nan_report import NonFiniteStep, shown_path
from trainer.diagnosis.nan_verdict import SuspectDevice, Verdict, record_gpu_fault
from trainer.diagnosis.recompute import KeptParameters
from trainer.diagnosis.spikes import Spike, SpikeDetector
from trainer.diagnosis.step_timer import StepTimer
from trainer.errors import CollectiveUserError, UserError, lost_a_peer
from trainer.metrics import (
    EtaClock,
    History,
    StepRecord,
    Throughput,
    get_logger,
    memory_part,
    mfu,
    peak_memory,
    step_line,
)
from trainer.model.build import (
    attention_backend,
    build_model,
    compile_layers,
    count_parameters,
    enable_gradient_checkpointing,
    use_maskless_causal_attention,
)
from trainer.model.distributed import (
    DistContext,
    StopRequest,
    StopVote,
    agree_any,
    all_reduce_mean,
    broadcast_object,
    gather_objects,
    gradient_sync,
    init_distributed,
    teardown,
    unwrap,
    wrap_model,
)
from trainer.model.estimate import GiB, model_shape
from trainer.model.loss import CausalLMLoss, choose_loss
from trainer.model.optim import build_optimizer, build_scheduler, resolve_precision
from trainer.progress import RENDEZVOUS_PHASE, ProgressReporter, device_label, gpu_id, restart_may_follow
from trainer.run_dir import agree_run_dir
from trainer.wandb_run import start_wandb

# ---------------------------------------------------------------------------------------------------------------------
# The trainer


@dataclass
class StepOutput:
    loss: torch.Tensor  # this rank's loss averaged over micro-batches (device)
    grad_norm: torch.Tensor  # pre-clip total norm (device)
    lr: float


class Trainer:
    """Builds everything one rank needs, then runs the steps. `run()` returns the process exit code."""

    def __init__(self, cfg: Config, ctx: DistContext, run_dir: Path, progress: ProgressReporter,
                 stop: StopRequest, cache: Path | None = None) -> None:
        self.cfg, self.ctx, self.run_dir, self.progress, self.stop = cfg, ctx, run_dir, progress, stop
        self.log = get_logger(cfg.logging.level)
        self.device = ctx.device
        self.total = cfg.training.max_steps
        self.replay_step = cfg.training.replay_step  # a replay (trainer.replay) stops after this step
        self.accum = cfg.training.grad_accum_nums
        self.completed = 0  # optimizer steps done (the step index to run next)
        self.history: History | None = None

        progress.phase("dataset")
        if cache is None:  # not prepared by the caller (trainer.rank_cli does, for runs by hand and under torchrun)
            cache = prepare(cfg, show_progress=False if not ctx.is_main else None).path
        self.data = TrainingData.open(cache)  # one cache, or a mixture's

        progress.phase("model")
        self.precision = resolve_precision(cfg, self.device)
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls left outside autocast
        torch.manual_seed(cfg.system.seed)  # same seed everywhere: identical initial weights on every rank
        random.seed(cfg.system.seed)
        module = build_model(cfg, self.data.vocab_size, self.data.eos_id, self.device)
        use_maskless_causal_attention(module)
        enable_gradient_checkpointing(module, cfg.model.gradient_checkpointing)
        module.train()
        self.faults = FaultInjector(cfg.debug, ctx.rank)
        self.faults.attach(module)  # before wrapping: the wrappers rename modules
        self.timer = StepTimer(self.device)
        self.compiled = compile_enabled(cfg, self.device.type == "cuda")
        if self.compiled:
            compile_layers(module)
        self.loss = choose_loss(cfg, module, self.device)
        self.attention, self.attention_context = attention_backend(cfg, self.device)
        # The root that forward and backward go through: DDP or FSDP2 around the loss module around the model.
        self.model = wrap_model(CausalLMLoss(module, self.loss.kind), cfg, ctx, self.precision.dtype)
        self.loss_module = unwrap(self.model)  # evaluation skips DDP (no gradients to synchronise)
        self.module = module  # the transformers model: checkpoints, the NaN guard, save_pretrained
        self.first_step: tuple[int, float] | None = None  # with torch.compile: (the first step, its compile trial's s)
        self.compile_reported = False
        self.parameters = count_parameters(self.module)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.module, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12) if self.precision.name == "fp16" else None
        t = cfg.training
        self.spikes = SpikeDetector(t.spike_threshold, t.spike_window) if t.spike_threshold > 0 else None
        self.checkpoints = Checkpointer(cfg, ctx, store.TrainState(self.module, self.optimizer, self.scheduler,
                                                                   self.scaler), self.data, self.log, progress,
                                        fault=self.faults.during_checkpoint, stall=self.faults.stall_write,
                                        loop_state=self.loop_state)
        # a replay: the NaN diagnostics on, the `auto` choices they would change left as the run made them
        diagnosed = cfg if self.replay_step is None else replace(
            cfg, debug=replace(cfg.debug, nan_localize=True, nan_dump=True))
        self.guard = NanGuard(self.module, diagnosed, rank=ctx.rank, world_size=ctx.world_size, gpu_id=ctx.gpu_id,
                              device=self.device, run_dir=run_dir, checkpoint_dir=self.checkpoints.root)
        self.kept = KeptParameters(self.params) if t.nan_recompute else None
        if self.kept is not None:
            self.guard.recheck = self.recheck

        self.sampler = self.data.sampler(cfg, ctx.world_size, ctx.rank)
        # read in this process (num_workers 0) or by worker processes from the first step fetched (the resume step)
        self.batches = StepLoader(self.sampler, self.total, t.num_workers, pin_memory=self.device.type == "cuda",
                                  seed=cfg.system.seed)
        self.val_samplers = self.data.val_samplers(cfg, ctx.world_size, ctx.rank) if t.eval_interval else {}
        self.tokens_per_step = tokens_per_step(cfg, ctx.world_size)
        self.flops_per_token = self.model_flops_per_token()
        self.device_name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                            else platform.processor() or platform.machine() or "cpu")

        progress.phase("resume")
        self.completed = self.checkpoints.resume()
        if (meta := self.checkpoints.resumed) is not None:
            self.resume_loop_state(meta)
        self.checkpoints.prepare()  # staging buffers for background saves allocated now, not in the first save

    # -- set-up helpers ----------------------------------------------------------------------------------------------

    def model_flops_per_token(self) -> int:
        """trainer.config's formula; for a model from a folder, applied to that model's real shape."""
        if not self.cfg.model.name_or_path:
            return flops_per_token(self.cfg)
        s = model_shape(self.cfg, self.data.vocab_size)
        shaped = replace(self.cfg, model=replace(
            self.cfg.model, hidden_size=s.hidden_size, num_layers=s.num_layers, num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads, ffn_hidden_size=s.ffn_hidden_size, vocab_size=s.vocab_size,
            tie_word_embeddings=s.tie_word_embeddings))
        return flops_per_token(shaped)

    def loop_state(self) -> dict[str, list[float]]:
        """What a checkpoint keeps of the loop beside the tensors: the spike detector's window."""
        return {"spike_window": self.spikes.state()} if self.spikes is not None else {}

    def resume_loop_state(self, meta: store.CheckpointMeta) -> None:
        """The batches the checkpoint's run skipped (its config's `training.skip_batches`, beside this run's own) and
        the spike detector's window, as they were when it was written."""
        t = self.cfg.training
        recorded = (meta.config.get("training") or {}).get("skip_batches") or {}
        t.skip_batches = {**recorded, **(t.skip_batches or {})} or None
        self.batches.end_step = data_step(self.total - 1, t.skip_batches) + 1
        if self.spikes is not None:
            self.spikes.restore(meta.loop.get("spike_window", []))

    def banner(self) -> None:
        labels = gather_objects(f"{device_label(self.device.type == 'cuda')} ({self.device_name})", self.ctx)
        if not self.ctx.is_main:
            return
        cfg, t, d = self.cfg, self.cfg.training, self.cfg.data
        lines = [
            f"run folder: {self.run_dir}",
            f"world size: {self.ctx.world_size} ({self.ctx.backend}) | devices: {', '.join(labels)}",
            f"precision: {self.precision.name} | strategy: {t.strategy} | grad accumulation: {self.accum}",
            f"compute: torch.compile {'each decoder layer' if self.compiled else 'off'} | loss {self.loss.kind}"
            f"{f' ({self.loss.note})' if self.loss.note else ''} | activation checkpointing "
            f"{cfg.model.gradient_checkpointing} | attention {self.attention}",
            f"batch: {t.batch_size} per GPU per micro-step, {t.batch_size * self.accum} per GPU per step, "
            f"global {t.batch_size * self.accum * self.ctx.world_size} sequences of {d.context_length} tokens | "
            f"tokens per step: {self.tokens_per_step:,}",
            f"parameters: {human(self.parameters)} ({self.parameters:,}) | FLOPs per token: "
            f"{human(self.flops_per_token)}",
            *self.data.banner(self.sampler, self.total),
        ]
        if injection := self.faults.describe():
            lines.append(injection)
        lines += cfg.notes
        for line in lines:
            self.log.info(line)

    # -- the step ----------------------------------------------------------------------------------------------------

    def fetch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batches of `step` ([accum, B, T+1]) on the host and on the device. On a GPU the host
        copy is pinned so the transfer is asynchronous: the CPU goes on queueing kernels meanwhile."""
        host = self.batches.get(data_step(step, self.cfg.training.skip_batches))
        if self.device.type != "cuda":
            return host, host
        host = host.pin_memory()  # a no-op for a batch the loader's workers delivered already pinned
        return host, host.to(self.device, non_blocking=True)

    def compile_trial(self, step: int) -> None:
        """Where torch.compile compiles, apart from any step (trainer.compile_check): the first micro-batch of `step`
        forward and backward without gradient synchronisation, its gradients dropped. Decides `self.compiled` for the
        run alike on every rank and times the compilation for the log."""
        self.progress.phase("compile")
        started = time.perf_counter()

        def trial() -> None:
            batch = torch.from_numpy(self.sampler.get(data_step(step, self.cfg.training.skip_batches), 0))
            batch = batch.to(self.device)
            try:
                with gradient_sync(self.model, enabled=False), self.attention_context():
                    with self.precision.autocast(self.device):
                        loss = self.model(batch)
                    loss.backward()
            finally:
                self.optimizer.zero_grad(set_to_none=True)

        self.compiled = compile_check.check(trial, self.cfg, self.ctx, self.module, self.log)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.first_step = (step, time.perf_counter() - started)

    def train_step(self, step: int) -> StepOutput:
        self.timer.start()
        self.faults.before_step(step, data_step(step, self.cfg.training.skip_batches))
        host, batches = self.fetch(step)
        self.guard.start_step(step, host.flatten(0, 1))
        local_loss, grad_norm = self.forward_backward(batches)
        found_inf = self.guard.check(local_loss, grad_norm)
        if self.kept is not None:
            self.kept.keep(found_inf, step)  # the parameters before a non-finite step, for its recompute
        lr = self.scheduler.get_last_lr()[0]
        self.guard.step_optimizer(self.optimizer, found_inf, scaler=self.scaler)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.completed = step + 1
        self.guard.after_step(step, local_loss, grad_norm, found_inf,
                              lambda path: self.checkpoints.save_to(path, self.completed))
        self.timer.end()
        return StepOutput(local_loss, grad_norm, lr)

    def forward_backward(self, batches: torch.Tensor, recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batches of a step forward and backward (gradients synchronised on the last one): the
        local loss averaged over them and the pre-clip total gradient norm, on the device. A `recompute` is not timed
        and not loss-scaled (the scaler's state belongs to the steps)."""
        scaler = self.scaler if not recompute else None
        loss_sum = torch.zeros((), device=self.device)
        for m in range(self.accum):
            with gradient_sync(self.model, enabled=m == self.accum - 1), self.attention_context():
                with self.precision.autocast(self.device):
                    loss = self.faults.scale_loss(self.model(batches[m]))
                if m == self.accum - 1 and not recompute:
                    self.timer.ready()
                scaled = loss / self.accum
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            loss_sum += loss.detach()
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # clip and check the true gradients
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.training.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        return loss_sum / self.accum, grad_norm

    def recheck(self, events: list[NonFiniteStep]) -> list[str]:
        """The NaN guard read non-finite `events` (every rank, at the same point): recompute the one whose parameters
        are held, from them and its batch, and judge it (`trainer.diagnosis.nan_verdict`); the lines to log. A rank
        whose local loss was non-finite judges its own; where only the gradient norm was, rank 0 judges the norm."""
        assert self.kept is not None
        held = self.kept.held_step()
        self.kept.release()
        event = next((e for e in events if e.step == held), None)
        lines = []
        if self.ctx.is_main and (others := [e.step for e in events if e is not event]):
            lines.append(f"WARNING | non-finite step{'s' * (len(others) > 1)} {', '.join(map(str, others))} not "
                         f"recomputed: one set of parameters is kept, the first non-finite step's since the last verdict")
        if event is None:
            return lines
        loss, grad_norm = self.recompute(event.step)
        if event.loss_ranks and self.ctx.rank not in event.loss_ranks or not event.loss_ranks and not self.ctx.is_main:
            return lines
        label = device_label(self.device.type == "cuda")
        verdict = Verdict(event.step, label, not math.isfinite(loss if event.loss_ranks else grad_norm), loss,
                          grad_norm, named=bool(event.loss_ranks))
        line = verdict.line(Path(shown_path(self.run_dir)))
        if verdict.reproduced or not verdict.named:
            return [*lines, f"WARNING | [GPU {self.ctx.gpu_id}] {line}"]
        if (gpu := gpu_id()) is not None:
            self.log.warning(f"[GPU {self.ctx.gpu_id}] {label} recorded as suspect in "
                             f"{shown_path(record_gpu_fault(self.run_dir, gpu, line))}")
        raise SuspectDevice(line)

    def recompute(self, step: int) -> tuple[float, float]:
        """Step `step` again from the held parameters and its own batch, with the same gradient synchronisation (a
        collective: every rank recomputes); the local loss and the gradient norm, read on the host."""
        assert self.kept is not None
        where = data_step(step, self.cfg.training.skip_batches)
        batches = torch.from_numpy(self.sampler.get_step(where)).to(self.device)
        before = self.faults.step, self.faults.data_step
        self.faults.step, self.faults.data_step = step, where  # an injected NaN fires again, a `corrupt` does not
        try:
            with self.kept.swapped():
                loss, grad_norm = self.forward_backward(batches, recompute=True)
            return float(loss.item()), float(grad_norm.item())
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.faults.step, self.faults.data_step = before

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Per source, the mean validation loss over eval_steps batches per rank, averaged over ranks (every rank
        takes part)."""
        self.progress.phase("evaluation")  # the start-up allowance: a first evaluation compiles the layers again
        self.module.eval()
        losses = {}
        for name, sampler in self.val_samplers.items():
            total = torch.zeros((), device=self.device)
            for i in range(self.cfg.training.eval_steps):
                host = sampler.get(i, 0)
                sampler.check(host)
                batch = torch.from_numpy(host).to(self.device, non_blocking=True)
                with self.precision.autocast(self.device):
                    total += self.loss_module(batch)
            losses[name] = float(all_reduce_mean(total / self.cfg.training.eval_steps, self.ctx).item())
        self.module.train()
        return losses

    # -- the run -----------------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.banner()
        if self.ctx.is_main:
            self.history = History(self.run_dir, {"run_dir": str(self.run_dir), "preset": self.cfg.preset,
                                                  "world_size": self.ctx.world_size, "cache_key": self.data.key,
                                                  "parameters": self.parameters,
                                                  "tokens_per_step": self.tokens_per_step},
                                   tensorboard=self.cfg.logging.tensorboard, plot=self.cfg.logging.plot,
                                   wandb_run=start_wandb(self.cfg, self.run_dir) if self.cfg.logging.wandb else None,
                                   checkpoints=self.checkpoints.saved, resume_load_s=self.checkpoints.load_s)
            self.history.continue_from(self.completed)
            self.checkpoints.published = self.history.published
        status = "failed"
        try:
            status = self.train()
            return 0
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except Exception as e:
            if not isinstance(e, UserError):  # (a bad input fails every rank alike: no rank is first)
                self.progress.failing()  # first: the supervisor learns which rank failed before this one waits
            # a write in flight may still be published (its record then in the history)
            self.checkpoints.settle(peer_lost=lost_a_peer(e))
            raise
        finally:
            try:
                self.batches.close()  # data-loading workers (if any) end with the run, whatever ended it
            finally:  # a worker found dead while closing must not cost the run its history
                if self.history is not None:
                    self.history.run_info["sources"] = self.data.history(self.sampler, self.completed)
                    # a failed group that a restart may follow does not draw the plot (a second of matplotlib
                    # before the supervisor can restart): the group that ends the run draws the whole curve
                    self.history.save(status, plot=status != "failed" or not restart_may_follow())
                    self.history.close()

    def train(self) -> str:
        """The step loop; returns "completed", "stopped" or (a replay, after its step) "replayed"."""
        cfg = self.cfg
        self.progress.phase("training")
        if self.completed >= self.total and self.ctx.is_main:
            self.log.info(f"nothing to train: the checkpoint is at step {self.completed} of {self.total}")
        if agree_any(self.stop.requested, self.ctx):  # SIGTERM during set-up: nothing trained, nothing to save
            self.log.info(f"[GPU {self.ctx.gpu_id}] stopping before the first step: a stop was requested (SIGTERM)")
            self.progress.stopped(self.completed, self.total, self.stop.signal)
            return "stopped"
        started = time.perf_counter()
        eta = EtaClock(self.completed, self.total, started)
        throughput = Throughput(self.tokens_per_step, self.completed, started)
        vote = StopVote(self.ctx)
        end = self.total if self.replay_step is None else self.replay_step + 1
        while (step := self.completed) < end:  # (a rollback moves `completed` back)
            if self.iteration(step, vote, eta, throughput):
                self.log.info(f"[GPU {self.ctx.gpu_id}] stopping after step {step}: a stop was requested (SIGTERM)")
                self.judge_losses()  # the window the checkpoint keeps, complete
                self.checkpoints.save(self.completed)
                self.checkpoints.finish()
                self.progress.stopped(self.completed, self.total, self.stop.signal)
                return "stopped"
        if self.replay_step is not None:
            self.say_documents(self.replay_step)
            self.progress.done(self.completed, self.total)
            return "replayed"
        self.checkpoints.save(self.completed)
        self.checkpoints.finish()
        if cfg.checkpoint.save_final:
            self.checkpoints.save_final()
        self.progress.done(self.completed, self.total)
        return "completed"

    def iteration(self, step: int, vote: StopVote, eta: EtaClock, throughput: Throughput) -> bool:
        """One turn of the loop: the step, evaluation, logging, an interval checkpoint, and the stop vote (cast at the
        start, read at the end). True when every rank agreed to stop now."""
        cfg = self.cfg
        if self.compiled and self.first_step is None:
            self.compile_trial(step)
        vote.cast(self.stop.requested)
        out = self.train_step(step)
        val_losses: dict[str, float] = {}
        last = self.completed == self.total
        if self.val_samplers and (self.completed % cfg.training.eval_interval == 0 or last):
            val_losses = self.evaluate()
        now = time.perf_counter()
        eta_s = eta.update(self.completed, now)
        logged = step % cfg.logging.log_interval == 0 or last or bool(val_losses) or step == self.replay_step
        if logged:
            self.report(step, out, val_losses, throughput.update(self.completed, now), eta_s)
        else:
            self.progress.step(self.completed, self.total, eta_s=eta_s, **self.step_times())
        saving = cfg.checkpoint.interval and self.completed % cfg.checkpoint.interval == 0 and not last
        rolled_back = (logged or saving) and self.judge_losses()  # before a save: the window it keeps, complete
        if saving and not rolled_back:
            self.checkpoints.save(self.completed)
        self.checkpoints.snapshot(self.completed)
        self.checkpoints.poll()
        return vote.result() and not last

    def judge_losses(self) -> bool:
        """The spike detector judges the steps' losses the NaN guard has read (it reads what it has not yet, on every
        rank alike); each spike is said, and with `training.spike_policy=rollback` the first one rolls the run back.
        True when it did."""
        if self.spikes is None:
            return False
        self.guard.drain()
        for step, loss in self.guard.take_losses():
            if (spike := self.spikes.observe(step, loss)) is not None and self.on_spike(spike):
                return True
        return False

    def on_spike(self, spike: Spike) -> bool:
        """Say `spike` with its batch's documents (rank 0: `spike_step_<n>.txt` in the run folder), roll back where the
        policy says so, record it in the history. True when the run went back."""
        t = self.cfg.training
        if self.ctx.is_main:
            samples = DocumentIndex(self.data).step(self.sampler, data_step(spike.step, t.skip_batches))
            path = self.run_dir / f"spike_step_{spike.step}.txt"
            path.write_text("".join(f"{sample.line()}\n" for sample in samples))
            first = samples[0].documents[0].describe() if samples and samples[0].documents else "none"
            self.log.warning(f"{spike.line(t.spike_threshold)}; its batch's {len(samples)} samples and their "
                             f"documents in {shown_path(path)} (the first: {first})")
        record: dict[str, object] = {"step": spike.step, "loss": spike.loss, "mean": spike.mean, "std": spike.std,
                                     "policy": t.spike_policy}
        if t.spike_policy == "rollback":
            record.update(self.roll_back(spike))
        if self.history is not None:
            self.history.spike(record)
        return "resumed_from" in record

    def roll_back(self, spike: Spike) -> dict[str, int]:
        """Back to the newest checkpoint at or before `spike` (rank 0 finds it, every rank loads it), skipping
        `training.spike_skip` batches around the spike from there on (recorded in `training.skip_batches`); the
        checkpoints after it, the history's steps from it and the steps the guard read belong to a trajectory the run
        left. What the history records of it; nothing where no checkpoint precedes the spike."""
        t = self.cfg.training
        self.checkpoints.wait()  # a save of the trajectory left behind, published or failed first
        root = self.checkpoints.root
        before = [p for p in layout.list_checkpoints(root) if (layout.step_of(p) or 0) <= spike.step]
        target: Path | None = broadcast_object(before[-1] if self.ctx.is_main and before else None, self.ctx)
        if target is None:
            if self.ctx.is_main:
                self.log.warning(f"no checkpoint at or before step {spike.step} in {root}: not rolled back")
            return {}
        # a damaged `target` is passed over for the newest intact checkpoint before it: the step is the one loaded
        target, meta = self.checkpoints.load_intact(target)
        back = meta.step
        skip_from = max(back, spike.step - t.spike_skip // 2)
        skips = dict(t.skip_batches or {})
        skips[str(skip_from)] = skips.get(str(skip_from), 0) + t.spike_skip
        t.skip_batches = skips
        if self.ctx.is_main:
            for later in layout.list_checkpoints(root):
                if (layout.step_of(later) or 0) > back:
                    store.remove(later)
        if self.spikes is not None:
            self.spikes.restore(meta.loop.get("spike_window", []))
        self.checkpoints.last_saved = back
        self.completed = back
        self.batches.end_step = data_step(self.total - 1, skips) + 1
        self.guard.forget()
        if self.kept is not None:
            self.kept.release()
        if self.history is not None:
            self.history.rewind(back)
        if self.ctx.is_main:
            self.log.warning(f"rolled back to {target} (step {back}), skipping {t.spike_skip} batches: from step "
                             f"{skip_from} on, each step trains on the batch {t.spike_skip} steps further on "
                             f"(training.skip_batches {json.dumps(skips)})")
        return {"resumed_from": back, "skip_from": skip_from, "skip_count": t.spike_skip}

    def say_documents(self, step: int) -> None:
        """What this rank's share of `step`'s batch holds: each sample's tokens in the cache and its documents."""
        where = data_step(step, self.cfg.training.skip_batches)
        samples = DocumentIndex(self.data).step(self.sampler, where, self.ctx.rank)
        moved = f" (the batch of step {where}: batches skipped before it)" if where != step else ""
        self.log.info(f"[GPU {self.ctx.gpu_id}] step {step}'s batch on this rank{moved}: {len(samples)} samples of "
                      f"{self.data.path}")
        for sample in samples:
            self.log.info(f"[GPU {self.ctx.gpu_id}] step {step} {sample.line()}")

    def step_times(self) -> dict[str, float | None]:
        ready_s, step_s = self.timer.take()
        return {"ready_s": ready_s, "step_s": step_s}

    def report(self, step: int, out: StepOutput, val_losses: dict[str, float], tok_s: float | None,
               eta_s: float) -> None:
        """A log step: the only place the loop reads device values on the host. A mixture's validation loss is its
        sources' weighted by the mixture's weights, each source's following it."""
        loss = float(out.loss.item())
        grad_norm = float(out.grad_norm.item())
        global_loss = float(all_reduce_mean(out.loss, self.ctx).item())
        line = step_line(self.ctx.gpu_id, step, self.total, loss, out.lr, grad_norm, eta_s)
        self.log.log(logging.INFO if math.isfinite(loss) else logging.WARNING, line)
        for text in self.guard.on_log(step):
            print(text, flush=True)
        self.progress.step(self.completed, self.total, loss=global_loss, tok_s=tok_s, eta_s=eta_s,
                           **self.step_times())
        if not self.ctx.is_main or self.history is None:
            return
        parts = [f"[all ranks] step {step}/{self.total}", f"mean loss {global_loss:.4f}"]
        val_loss = None
        if val_losses:
            weights = {name: self.data.val_weight(name) for name in val_losses}
            val_loss = sum(weights[n] * loss for n, loss in val_losses.items()) / sum(weights.values())
            parts.append(f"val loss {val_loss:.4f}")
            if self.data.mixture:
                parts.append("val loss by source " + ", ".join(f"{n} {v:.4f}" for n, v in val_losses.items()))
        for note in self.data.repeats(self.sampler, self.completed):
            self.log.info(note)
        if tok_s is not None:
            parts.append(f"{tok_s:,.0f} tokens/s")
            utilisation = mfu(tok_s, self.flops_per_token, self.ctx.world_size, self.device_name)
            if self.device.type == "cuda" and utilisation is not None:
                parts.append(f"MFU {utilisation:.1%}")
        if (memory := peak_memory(self.device)) is not None:
            parts.append(memory_part(*memory))
        self.log.info(" | ".join(parts))
        trial = self.first_step
        if self.compiled and trial is not None and step > trial[0] and tok_s and not self.compile_reported:
            first, seconds = trial
            extra = seconds - self.tokens_per_step / self.accum / tok_s  # a compiled micro-step's time
            self.log.info(f"torch.compile: the first forward and backward (step {first}) took {seconds:.1f} s, "
                          f"{extra:.1f} s more than a compiled one (the compilation); "
                          f"{compile_check.graph_cache()}")
            self.compile_reported = True
        self.history.add(StepRecord(step=step, loss=global_loss, lr=out.lr, grad_norm=grad_norm, tokens_per_s=tok_s,
                                    val_loss=val_loss, peak_mem_gib=memory[0] / GiB if memory else None))


def train(cfg: Config, run_dir: Path | None = None, progress: ProgressReporter | None = None,
          cache: Path | None = None) -> int:
    """Run one rank from a resolved config: join the group, train, leave the group (on every exit path). `cache`: the
    token cache's folder where the caller has prepared it already."""
    progress = progress or ProgressReporter()
    flight_recorder.start_from_environment()
    progress.phase(RENDEZVOUS_PHASE)
    with StopRequest().installed() as stop:
        ctx = init_distributed(cfg)
        trainer: Trainer | None = None
        try:
            check_world_size(cfg, ctx.world_size)  # the supervisor checked already; torchrun and runs by hand did not
            folder = agree_run_dir(cfg, ctx, run_dir)
            trainer = Trainer(cfg, ctx, folder, progress, stop, cache)
            return trainer.run()
        except CollectiveUserError:
            progress.failing()  # after rank 0's: the refusal is rank 0's, which says it (the others exit silently)
            raise
        except UserError:
            raise  # a bad input fails every rank alike: no rank is first
        except Exception as e:
            progress.failing()
            if not oom_report.is_out_of_memory(e):
                raise
            step = trainer.faults.step if trainer is not None else None
            report = oom_report.collect(e, cfg, device_label(ctx.device.type == "cuda"), ctx.rank, ctx.world_size,
                                        step)
            raise OutOfMemory(report.save(folder), step) from None
        finally:
            teardown()


class OutOfMemory(Exception):
    """A rank ran out of device memory; its report (`trainer.diagnosis.oom_report`) is at `path`."""

    def __init__(self, path: Path, step: int | None) -> None:
        super().__init__(f"out of memory {'before the first step' if step is None else f'at step {step}'}; "
                         f"figures and traceback in {path}")
        self.path = path
